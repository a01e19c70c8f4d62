"""Runs each sequence's eviction policy after a forward and compacts its cache, freeing whole blocks.

A sequence with a policy prefills its whole prompt, then keeps `budget` tokens per layer and KV head:
the survivors are packed, in order, into the first slots of its block table and the emptied blocks go
back to the pool. Kept keys keep the rotation of their original positions (RoPE is applied before
caching), and new tokens continue at their true positions: slot = position - tokens evicted so far.
Policies that evict while decoding let the cache grow one block past the budget, then compact again,
so each compaction frees a block. Blocks shared through the prefix cache are never written: see
KVCacheManager.compact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.attention.metadata import SeqChunk
from kvcache.compress.policy import EvictionState
from kvcache.compress.registry import get_policy
from kvcache.compress.spec import EvictionSpec
from kvcache.memory.kv_cache_manager import KVCacheManager


@dataclass(slots=True)
class EvictionStats:
    """Counters since start-up."""

    evicted_tokens: int = 0  # cache slots emptied by compactions (per sequence, layer 0's count for PyramidKV)
    freed_blocks: int = 0  # blocks compactions returned to the pool (net of fresh blocks they took)
    compactions: int = 0
    deferred: int = 0  # compactions put off for want of a free block to write survivors into


def seq_chunk(seq_id: int, token_ids: list[int], start: int, table: list[int], needs_logits: bool,
              private: list[int], state: EvictionState | None) -> SeqChunk:
    """A SeqChunk of sequence `seq_id` at cache slots [start, start + len) carrying the eviction fields of `state`."""
    if state is None:
        return SeqChunk(token_ids, start, table, needs_logits, private, seq_id=seq_id)
    prompt_chunk = start + state.num_evicted < state.prompt_len
    capture = state.policy.capture(state, start, len(token_ids), prompt_chunk)
    return SeqChunk(token_ids, start, table, needs_logits, private, state.num_evicted, capture, state.layer_start,
                    seq_id)


class Evictor:
    """Owns the eviction step of every sequence that has a policy (see the module docstring)."""

    def __init__(self, store, kv: KVCacheManager, num_layers: int, num_kv_heads: int, scale: float,
                 device: torch.device, layer_group: list[int] | None = None) -> None:
        """`layer_group`: each layer's table group, where `kv` keeps one table per group (layer_groups.py): then each
        layer's dead leading blocks (PyramidKV's smaller budgets) go back to the pool."""
        self.store, self.kv, self.scale, self.device = store, kv, scale, device
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.layer_group = layer_group
        self.stats = EvictionStats()

    def _tables(self, seq_id: int) -> list[list[int]]:
        """Each layer's block table of `seq_id`."""
        if self.layer_group is None:
            return [self.kv.block_tables[seq_id]] * self.num_layers
        tables = self.kv.tables(seq_id)
        return [tables[g] for g in self.layer_group]

    def new_state(self, spec: EvictionSpec, prompt_len: int, seed: int) -> EvictionState:
        """State for a sequence with a `prompt_len`-token prompt; ValueError if the budget cannot work."""
        budget = spec.tokens(prompt_len)
        return EvictionState(get_policy(spec.policy), budget, prompt_len, self.num_layers, self.num_kv_heads,
                             torch.Generator().manual_seed(seed))

    def _keys(self, tables: list[list[int]]):
        """keys(layer, n): the first n cached keys of `layer`, read through its table in `tables` (one per layer)."""
        bs = self.store.block_size

        def keys(layer: int, n: int) -> torch.Tensor:
            blocks = torch.tensor(tables[layer][:-(-n // bs)], device=self.device)
            return self.store.gather(layer, blocks)[0].flatten(0, 1)[:n]
        return keys

    def after_forward(self, seq_id: int, state: EvictionState, chunk: SeqChunk, queries: list[torch.Tensor],
                      num_computed: int) -> None:
        """Give the policy the queries captured for `chunk` ([r, H, D] per layer), then compact the cache if due
        (`num_computed`: the sequence's tokens computed, this chunk included)."""
        if chunk.capture:
            slots = torch.arange(chunk.start + chunk.capture.start, chunk.start + chunk.capture.stop,
                                 device=self.device)
            state.policy.observe(state, queries, slots, self._keys(self._tables(seq_id)), self.scale)
        self._maybe_compact(seq_id, state, num_computed)

    def _maybe_compact(self, seq_id: int, state: EvictionState, num_computed: int) -> None:
        """Compact the cache of `seq_id` if its policy is due: when the prompt is in the cache, and (decode-time
        policies) each time the cache has grown a block past the budget."""
        n = num_computed - state.num_evicted
        if num_computed < state.prompt_len or n <= state.budget:
            return
        bs = self.store.block_size
        due = num_computed == state.prompt_len or state.pending or (state.policy.decode and n >= state.budget + bs)
        if not due:
            return
        counts = state.policy.budgets(state, n)
        top = min(max(counts), n)
        starts = [(top - min(c, top)) // bs * bs for c in counts]  # dead leading slots, whole blocks only
        res = self.kv.compact(seq_id, top)
        if res is None:
            state.pending = True
            self.stats.deferred += 1
            return
        pairs = [res] if self.layer_group is None else res  # (old, new) per table
        per_layer = [0] * self.num_layers if self.layer_group is None else self.layer_group
        keep = state.policy.select(state, n, [top - s for s in starts], self._keys([pairs[t][0] for t in per_layer]),
                                   self.scale)
        moved = [(torch.tensor(old, device=self.device), torch.tensor(new, device=self.device)) for old, new in pairs]
        scores = torch.zeros_like(state.scores) if state.scores is not None else None  # h2o's, compacted alike
        for layer, idx in enumerate(keep):
            old_t, new_t = moved[per_layer[layer]]
            idx = idx.to(self.device)
            dst = torch.arange(starts[layer], top, device=self.device).expand_as(idx)
            self.store.move_slots(layer, old_t[idx // bs] * bs + idx % bs, new_t[dst // bs] * bs + dst % bs)
            if scores is not None:
                scores[layer, :, starts[layer]:top] = state.scores[layer].gather(1, idx.to(scores.device))
        freed = sum(len(old) - len(new) for old, new in pairs)
        if self.layer_group is not None:  # a table's dead leading blocks hold nothing its layers read: give them back
            first: dict[int, int] = {}
            for layer, start in enumerate(starts):
                g = self.layer_group[layer]
                first[g] = min(first.get(g, start), start)
            for g, start in first.items():
                freed += len(self.kv.groups[g].release_leading(seq_id, start))
        state.scores = scores
        state.layer_start = starts if any(starts) else None
        state.num_evicted += n - top
        state.pending = False
        self.stats.compactions += 1
        self.stats.evicted_tokens += n - top
        self.stats.freed_blocks += freed
