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


@dataclass(frozen=True, slots=True)
class HeadShare:
    """The heads a tensor-parallel rank holds of a model's (parallel/sharding.py): the state's
    num_kv_heads KV heads from `first` on, of kv_heads, with q_local of each one's query heads, and `reduce`, an
    in-place sum of a tensor across the ranks. A score that averages over query heads on other ranks too (a KV head replicated on
    several ranks, each with some of its query heads; TOVA's mean over a layer's heads) is summed across ranks
    before it is divided, so every rank holding a KV head ranks its tokens alike, as one process would."""

    kv_heads: int
    q_heads: int
    first: int
    q_local: int  # this rank's query heads per KV head it holds
    reduce: Callable[[torch.Tensor], torch.Tensor]

    @property
    def split(self) -> bool:
        """Each KV head's query heads all on the rank that holds it: its per-head scores need no other rank."""
        return self.q_local * self.kv_heads == self.q_heads


@dataclass(slots=True)
class EvictionState:
    """One sequence's eviction bookkeeping (tokens and slots are counted per layer and KV head)."""

    policy: EvictionPolicy
    budget: int  # tokens kept after a compaction
    prompt_len: int  # tokens prefilled before the first compaction (the whole recompute after a preemption)
    num_layers: int
    num_kv_heads: int
    generator: torch.Generator | None = None
    seed: int = 0  # the generator's (a tensor-parallel worker seeds its copy of the state alike)
    share: HeadShare | None = None  # tensor parallelism: the heads this rank's store holds (None: all of them)
    num_evicted: int = 0  # tokens dropped from the cache so far: a new token's slot is its position minus this
    scores: torch.Tensor | None = None  # [layers, kv_heads, slots] accumulated scores (h2o), compacted with the cache
    queries: list[list[torch.Tensor]] = field(default_factory=list)  # per layer: captured queries [r, H, D]
    query_slots: list[torch.Tensor] = field(default_factory=list)  # slots of those queries, one tensor per capture
    layer_start: list[int] | None = None  # first live slot per layer (block-aligned) when layers keep different counts
    fixed: int = 0  # leading slots a compaction keeps in place (the pressure ladder: blocks shared with others)
    pending: bool = False  # a compaction is due but waited for a free block
    epoch: int = 0  # resets so far (a tensor-parallel worker resets its copy when it sees a new one)

    def reset(self, prompt_len: int) -> None:
        """Forget everything: the sequence lost its cache (preemption) and will prefill `prompt_len` tokens."""
        self.epoch += 1
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


def group_mean(x: torch.Tensor, state: EvictionState) -> torch.Tensor:
    """[H, ...] per query head -> [KVH, ...]: the mean over each KV head's query heads (kvpress's GQA rule); under
    tensor parallelism over its query heads on every rank."""
    kvh, share = state.num_kv_heads, state.share
    grouped = x.view(kvh, x.shape[0] // kvh, *x.shape[1:])
    if share is None or share.split:
        return grouped.mean(1)
    whole = x.new_zeros(share.kv_heads, *x.shape[1:])
    whole[share.first:share.first + kvh] = grouped.sum(1)
    return share.reduce(whole)[share.first:share.first + kvh] / (share.q_heads // share.kv_heads)


def head_mean(x: torch.Tensor, state: EvictionState) -> torch.Tensor:
    """[H, ...] per query head -> [...]: the mean over all the layer's query heads (every rank's)."""
    if state.share is None:
        return x.mean(0)
    return state.share.reduce(x.sum(0)) / state.share.q_heads


def all_heads(scores: torch.Tensor, state: EvictionState) -> torch.Tensor:
    """[..., kv_heads, n] drawn for every KV head of the model -> this rank's heads' rows (dim -2)."""
    if state.share is None:
        return scores
    return scores[..., state.share.first:state.share.first + state.num_kv_heads, :]


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
