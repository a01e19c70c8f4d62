"""The memory-pressure ladder's token selection (engine/pressure.py): which of a running sequence's cached tokens
survive when the pool runs dry. No queries are kept for a sequence the ladder picks, so the rules read the keys
alone, and both keep the attention sinks and the recent window.

- knorm: the tokens with the smallest key L2 norm per KV head survive. A. Devoto, Y. Zhao, S. Scardapane,
  P. Minervini, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
  (arXiv:2406.11430): keys with a low norm draw high attention. kvpress's KnormPress scores the same way.
- streaming: the oldest tokens after the sinks go (StreamingLLM's selection, compress/streaming.py).
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
    def kept_always(n: int) -> int:
        """Slots of `n` that no rule evicts: the sinks and the recent window."""
        return min(n, SINK_TOKENS + RECENT_TOKENS)

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        keep = counts[0]
        if keep < self.kept_always(n):
            raise ValueError(f"the ladder keeps at least the {SINK_TOKENS} sinks and {RECENT_TOKENS} recent tokens; "
                             f"asked to keep {keep} of {n}")
        if self.rule == "streaming":
            slots = torch.cat([torch.arange(SINK_TOKENS), torch.arange(n - (keep - SINK_TOKENS), n)])
            return shared(slots, state.num_kv_heads, state.num_layers)
        out = []
        for layer in range(state.num_layers):
            score = -keys(layer, n).float().norm(dim=-1).t()  # [kv_heads, n]: low norm first
            score[:, :SINK_TOKENS] = float("inf")
            out.append(top_slots(score, keep, keep_from=n - RECENT_TOKENS))
        return out
