"""The memory-pressure ladder's token selection (engine/pressure.py): which of a running sequence's cached tokens
survive when the pool runs dry. No queries are kept for a sequence the ladder picks, so the rules read the keys
alone, and both keep the attention sinks and the recent window.

- knorm: the tokens with the smallest key L2 norm per KV head survive. A. Devoto, Y. Zhao, S. Scardapane,
  P. Minervini, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
  (arXiv:2406.11430): keys with a low norm draw high attention. kvpress's KnormPress scores the same way.
- streaming: the oldest tokens after the sinks go (StreamingLLM's selection, compress/streaming.py).

Leading blocks the sequence shares with others (a common system prompt, a pinned prefix) are kept whole and in
place (EvictionState.fixed): a compaction never writes a shared block, so evicting from them would take a fresh
block for each, which a full pool does not have.
"""
from __future__ import annotations

import torch

from kvcache.compress.policy import EvictionPolicy, EvictionState, KeysFn, shared, top_slots
from kvcache.compress.spec import SINK_TOKENS

RECENT_TOKENS = 64  # the newest tokens the ladder never evicts (with the SINK_TOKENS first ones)


class PressureEviction(EvictionPolicy):
    """Evicts only when the ladder says so (`decode` False and the state's prompt_len set to the tokens computed at
    that moment: the engine's after-step eviction never finds a compaction due)."""

    name = "pressure"
    decode = False

    def __init__(self, rule: str) -> None:
        if rule not in ("knorm", "streaming"):
            raise ValueError(f"kv_pressure_evict must be knorm or streaming; got {rule!r}")
        self.rule = rule
        self.per_head = rule == "knorm"

    @staticmethod
    def kept_always(n: int, fixed: int = 0) -> int:
        """Slots of `n` that no rule evicts: the sinks (or the `fixed` leading slots, in blocks shared with other
        sequences, if more) and the recent window."""
        return min(n, max(SINK_TOKENS, fixed) + RECENT_TOKENS)

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        keep, head = counts[0], max(SINK_TOKENS, state.fixed)
        if keep < self.kept_always(n, state.fixed):
            raise ValueError(f"the ladder keeps at least the {head} leading and {RECENT_TOKENS} recent tokens; "
                             f"asked to keep {keep} of {n}")
        if self.rule == "streaming":
            slots = torch.cat([torch.arange(head), torch.arange(n - (keep - head), n)])
            return shared(slots, state.num_kv_heads, state.num_layers)
        out = []
        for layer in range(state.num_layers):
            score = -keys(layer, n).float().norm(dim=-1).t()  # [kv_heads, n]: low norm first
            score[:, :head] = float("inf")
            out.append(top_slots(score, keep, keep_from=n - RECENT_TOKENS))
        return out
