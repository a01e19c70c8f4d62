"""The interface every eviction policy implements, the per-sequence state it keeps, and shared scoring math.

Slots are a sequence's physical cache positions: after a compaction slot i holds the i-th surviving token,
whose key still carries the rotation of its original position (RoPE is applied before caching). A policy
sees this step's queries of its sequence (`observe`) and, when the engine compacts, returns which slots
survive in each layer and KV head (`select`). Scores come from the queries the engine ran, never from a
full attention matrix: at most (captured queries x cached tokens) per layer at a time.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# keys(layer, n) -> the first n cached keys of a layer, [n, kv_heads, head_dim] in the compute dtype
KeysFn = Callable[[int, int], torch.Tensor]


@dataclass(slots=True)
class EvictionState:
    """One sequence's eviction bookkeeping (tokens and slots are counted per layer and KV head)."""

    policy: EvictionPolicy
    budget: int  # tokens kept after a compaction
    prompt_len: int  # tokens prefilled before the first compaction (the whole recompute after a preemption)
    num_layers: int
    num_kv_heads: int
    generator: torch.Generator | None = None
    num_evicted: int = 0  # tokens dropped from the cache so far: a new token's slot is its position minus this
    scores: torch.Tensor | None = None  # [layers, kv_heads, slots] accumulated scores (h2o), compacted with the cache
    queries: list[list[torch.Tensor]] = field(default_factory=list)  # per layer: captured queries [r, H, D]
    query_slots: list[torch.Tensor] = field(default_factory=list)  # slots of those queries, one tensor per capture
    layer_start: list[int] | None = None  # first live slot per layer (block-aligned) when layers keep different counts
    pending: bool = False  # a compaction is due but waited for a free block

    def reset(self, prompt_len: int) -> None:
        """Forget everything: the sequence lost its cache (preemption) and will prefill `prompt_len` tokens."""
        self.prompt_len, self.num_evicted, self.scores, self.layer_start, self.pending = prompt_len, 0, None, None, False
        self.queries, self.query_slots = [], []


class EvictionPolicy:
    """Which cached tokens a sequence keeps. Subclasses name their paper."""

    name = ""
    decode = False  # also evicts while decoding (else once, when the prompt is in the cache)
    per_head = True  # KV heads may keep different tokens

    def cacheable_prefix(self, state: EvictionState) -> int:
        """Prompt tokens the sequence may take from the prefix cache: their queries are never run, so a policy
        that scores them needs them computed."""
        return state.prompt_len

    def capture(self, state: EvictionState, start: int, n: int, prompt_chunk: bool) -> range:
        """Offsets into a chunk of `n` tokens at slots [start, start + n) whose queries `observe` needs."""
        return range(0)

    def observe(self, state: EvictionState, queries: list[torch.Tensor], slots: torch.Tensor, keys: KeysFn,
                scale: float) -> None:
        """Take this step's captured queries ([r, H, D] per layer, at `slots`) into the sequence's scores."""

    def budgets(self, state: EvictionState, n: int) -> list[int]:
        """Tokens each layer keeps when `n` are cached (the same budget everywhere but for PyramidKV)."""
        return [state.budget] * state.num_layers

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        """Slots to keep of the `n` cached: counts[layer] per KV head, [kv_heads, counts[layer]] ascending."""
        raise NotImplementedError


def attention_probs(q: torch.Tensor, k: torch.Tensor, q_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of queries q [r, H, D] at slots `q_slots` over keys k [n, KVH, D] (causal), as
    fp32 [H, r, n]. GQA: query head h reads KV head h // (H / KVH)."""
    r, H, D = q.shape
    kvh = k.shape[1]
    # query heads grouped by their KV head, so the keys are not copied per query head
    logits = torch.einsum("rkgd,nkd->kgrn", q.float().view(r, kvh, H // kvh, D), k.float()).reshape(H, r, -1) * scale
    visible = torch.arange(k.shape[0], device=k.device)[None, :] <= q_slots[:, None]
    return logits.masked_fill_(~visible, float("-inf")).softmax(-1)


def group_mean(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[H, ...] per query head -> [KVH, ...]: the mean over each KV head's query heads (kvpress's GQA rule)."""
    return x.view(kv_heads, x.shape[0] // kv_heads, *x.shape[1:]).mean(1)


def top_slots(scores: torch.Tensor, k: int, keep_from: int | None = None) -> torch.Tensor:
    """The `k` highest-scoring slots of each row of scores [KVH, n], ascending; slots >= keep_from are
    always kept (they must number fewer than k)."""
    s = scores.float().clone()
    if keep_from is not None:
        s[:, keep_from:] = float("inf")
    return s.topk(k, dim=-1).indices.sort(dim=-1).values


def shared(slots: torch.Tensor, kv_heads: int, num_layers: int) -> list[torch.Tensor]:
    """One list of slots [n] used by every KV head of every layer."""
    return [slots.expand(kv_heads, -1)] * num_layers


def windowed_queries(state: EvictionState) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The captured queries per layer, concatenated, and their slots."""
    return [torch.cat(qs) for qs in state.queries], torch.cat(state.query_slots)


def keep_queries(state: EvictionState, queries: list[torch.Tensor], slots: torch.Tensor, append: bool) -> None:
    """Store this step's captured queries (appending to earlier ones, or replacing them)."""
    if not append or not state.queries:
        state.queries, state.query_slots = [[q] for q in queries], [slots]
    else:
        for qs, q in zip(state.queries, queries):
            qs.append(q)
        state.query_slots.append(slots)
