"""The memory-pressure ladder (--kv-pressure-policy ladder): what the scheduler tries, cheapest quality cost first,
when a step's blocks do not fit, before it preempts a sequence.

1. Cached prefix blocks no sequence holds are reclaimed by every allocation already (the pool's free list).
2. Offload: with --preemption-mode swap, the sequence to preempt is swapped out to a tier, which costs it time
   (it waits, then its KV is loaded back) but no quality. A running sequence's blocks cannot go to a tier one by
   one, because every decode step reads all of them, so the ladder offloads whole sequences, and only while the
   tier has room (scheduler.py).
3. Evict: tokens of the longest running sequence that may degrade (not kv_pressure "exact", no eviction policy of
   its own, decoding, a single sample) are evicted and its cache compacted, freeing whole blocks. Its first
   SINK_TOKENS and last RECENT_TOKENS stay (compress/pressure.py), and the ladder never evicts more than
   --kv-pressure-max-evict of its tokens in all.
4. Preempt: as without the ladder.

A sequence the ladder compacted carries a PressureEviction state, so its new tokens keep their true positions (slot
+ tokens evicted). A preemption that recomputes it drops that state: recomputed from its tokens, it is exact again.
What each request went through is counted on its sequences and reported as RequestOutput.kv_degradation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvcache.compress.policy import EvictionState
from kvcache.compress.pressure import PressureEviction
from kvcache.memory.kv_cache_manager import blocks_for

# Each eviction frees at least this share of the sequence's blocks (or the blocks wanted, if more), so that the
# ladder does not compact the same sequence at every step
EVICT_SHARE = 0.25


@dataclass(slots=True)
class PressureStats:
    """Counters since start-up (Prometheus: server/metrics.py)."""

    evictions: int = 0  # compactions the ladder made
    evicted_tokens: int = 0  # cache slots they emptied (per sequence, every layer alike)
    freed_blocks: int = 0
    failed: int = 0  # compactions that could not take the fresh blocks they needed (the next rung ran)


class PressureLadder:
    """Rung 3 (evict), on the engine's store through its Evictor; the scheduler calls `evict`."""

    def __init__(self, evictor, kv, rule: str, max_evict: float) -> None:
        self.evictor, self.kv = evictor, kv
        self.policy = PressureEviction(rule)
        self.max_evict = max_evict
        self.stats = PressureStats()

    def eligible(self, seq) -> bool:
        """Whether the ladder may evict tokens of `seq` at all."""
        state = seq.eviction
        return (seq.params.kv_pressure != "exact" and seq.params.n == 1 and not seq.draft
                and (state is None or state.policy is self.policy)
                and seq.num_tokens - seq.num_computed_tokens == 1)  # decoding: its prompt is all cached

    def plan(self, seq, blocks: int) -> int:
        """Slots `seq` keeps if the ladder frees `blocks` of its blocks (or EVICT_SHARE of them, if more), within its
        bound; its slots if it can free none."""
        bs = self.kv.block_size
        n = seq.num_computed_tokens - seq.num_evicted
        have = blocks_for(n, bs)
        want = max(blocks, math.ceil(have * EVICT_SHARE))
        allowed = int(self.max_evict * seq.num_tokens) - seq.pressure_evicted  # tokens it may still lose
        floor = max(self.policy.kept_always(n, self.shared_slots(seq)), n - allowed)
        keep = max((have - want) * bs, floor)
        keep = -(-keep // bs) * bs if keep < n else n  # whole blocks: what it keeps fills them
        return min(keep, n) if blocks_for(keep, bs) < have else n

    def shared_slots(self, seq) -> int:
        """Slots in the leading blocks of `seq` that other holders share (a common prefix, a pin): kept in place."""
        refs, bs = self.kv.pool.ref_counts, self.kv.block_size
        table = self.kv.block_tables.get(seq.seq_id, [])
        n = next((i for i, b in enumerate(table) if refs[b] <= 1), len(table))
        return min(n * bs, seq.num_computed_tokens - seq.num_evicted)

    def evict(self, running: list, skip: set[int], blocks: int) -> bool:
        """Free at least one block by compacting the longest eligible sequence of `running` not in `skip` (those
        already scheduled this step); False if none could."""
        found = [s for s in running if s.seq_id not in skip and self.eligible(s)]
        for seq in sorted(found, key=lambda s: s.num_computed_tokens - s.num_evicted, reverse=True):
            keep = self.plan(seq, blocks)
            if keep < seq.num_computed_tokens - seq.num_evicted and self._compact(seq, keep):
                return True
        return False

    def _compact(self, seq, keep: int) -> bool:
        state = seq.eviction
        if state is None:
            ev = self.evictor
            state = EvictionState(self.policy, keep, seq.num_computed_tokens, ev.num_layers, ev.num_kv_heads,
                                  share=ev.share)
        n = seq.num_computed_tokens - state.num_evicted
        state.fixed = self.shared_slots(seq) // self.kv.block_size * self.kv.block_size  # whole blocks
        before = self.kv.num_free_blocks
        if not self.evictor.compact_now(seq.seq_id, state, n, keep):
            self.stats.failed += 1
            return False
        state.budget, state.prompt_len = keep, seq.num_computed_tokens  # no compaction due after the step
        seq.eviction = state
        seq.pressure_evicted += n - keep
        seq.pressure_evictions += 1
        self.stats.evictions += 1
        self.stats.evicted_tokens += n - keep
        self.stats.freed_blocks += self.kv.num_free_blocks - before
        return True

    @staticmethod
    def forget(seq) -> None:
        """`seq` is recomputed from its tokens (a preemption): the ladder's state goes, the counts stay."""
        if seq.eviction is not None and isinstance(seq.eviction.policy, PressureEviction):
            seq.eviction = None
