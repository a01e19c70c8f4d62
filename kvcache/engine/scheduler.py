"""Continuous batching: which sequences run this step, with how many tokens each.

Every step: running sequences first (decodes, then unfinished prefill chunks), then
waiting ones, all within `max_num_batched_tokens` and `max_num_seqs`. A waiting sequence
starts after the longest prefix the cache already holds. Waiting ones go first come, first
served (`fcfs`), or longest cached prefix first (`lpm`, SGLang's policy; FCFS above
LPM_MAX_QUEUE waiting), which also holds back a prompt whose next block another prompt
admitted in the same step is computing, so that it can share it one step later. When the
pool runs dry the most recently admitted sequence is preempted: its blocks are freed
(cached ones stay findable) and it waits at the head of the queue to be recomputed, or, with
`preemption_mode` swap, to have its blocks' contents loaded back from the offload tier that
kept them (recomputed after all if the tier had no room). No tensors here: the offloader moves
the bytes.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache.config import EngineConfig
from kvcache.engine.pressure import PressureLadder
from kvcache.engine.sequence import Sequence, SequenceStatus
from kvcache.memory.kv_cache_manager import KVCacheManager, blocks_for

# Blocks kept free when admitting new work, so that running sequences can grow for a
# while without preempting what was just admitted (vLLM's watermark is 1%).
WATERMARK_FRACTION = 0.01
# Above this many waiting requests `lpm` falls back to FCFS: matching every prompt each step costs too much.
LPM_MAX_QUEUE = 128


@dataclass(slots=True)
class Swapped:
    """A preempted sequence whose blocks' contents the offloader keeps (swap)."""

    computed: int  # its num_computed_tokens when it was preempted
    table_blocks: int  # leading blocks of its table swapped out (those holding its cache slots); then its private ones
    compacted: bool  # eviction had compacted it: its blocks no longer match its tokens


@dataclass(slots=True)
class _Admission:
    """What admitting a waiting sequence this step takes (Scheduler._plan_admission)."""

    prefix: list[int]  # the pool's cached blocks of its prompt
    loaded: list[bytes]  # blocks after them that the offload tiers hold (loaded before the forward)
    cached: int  # tokens it starts with computed
    slots: int  # cache slots those take (fewer than `cached` after eviction)
    n: int  # tokens it computes this step
    need: int  # fresh blocks
    swapped: Swapped | None  # where it was swapped out
    first_new: int | None  # lpm: the hash of its first uncached block


_SKIP, _STOP = object(), object()  # _plan_admission: not this sequence this step; no more admissions this step


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class Scheduler:
    """Admits, batches and preempts sequences over one KVCacheManager."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, offload=None) -> None:
        self.config = config
        self.kv = kv
        self.offload = offload  # an offload.Offloader: prefix lookups continue in its tiers
        # Blocks to fill before this step's forward, taken by the engine: (pool blocks, what the offloader found
        # for them: tier payloads, or a swapped sequence's rows), opaque here.
        self.loads: list[tuple[list[int], object]] = []
        self._found: dict[int, tuple[int, list[bytes]]] = {}  # seq -> (first block, payloads) found, not yet admitted
        self.swap = config.preemption_mode == "swap" and offload is not None and offload.swap_tier is not None
        self._swapped: dict[int, Swapped] = {}  # seq_id -> what it swapped out, while it waits
        self._logit_rows: int | None = None  # this step's prompt-logprob rows left (schedule sets it)
        self.num_swapped_out = 0  # preemptions that swapped the sequence out
        self.num_swapped_in = 0  # of those, resumed from the swapped contents
        self.num_swap_fallbacks = 0  # swap preemptions recomputed instead (the tier had no room, or a read failed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.watermark = max(1, int(WATERMARK_FRACTION * kv.pool.num_usable))
        self.num_preemptions = 0
        self.pressure = None  # an engine.pressure.PressureLadder under --kv-pressure-policy ladder (set by the engine)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in place (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str, release: Callable[[int], object] | None = None) -> None:
        """Remove `seq` from the queues and return its blocks (through `release` if given, else kv.free after its
        retention)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._found.pop(seq.seq_id, None)
        if self._swapped.pop(seq.seq_id, None) is not None:
            self.offload.swap_discard(seq.seq_id)
        if release is None:
            self._free(seq)
        else:
            release(seq.seq_id)

    def _free(self, seq: Sequence) -> None:
        """Return `seq`'s blocks, its cached ones first given the retention its request asked for (kv_retention),
        whether it finished or is preempted (they may serve it again when it resumes)."""
        retention = seq.params.kv_retention
        if retention is not None:
            self.kv.retain(seq.seq_id, retention["priority"], retention["ttl_s"])
        self.kv.free(seq.seq_id)

    def _offloaded(self, seq: Sequence, start: int) -> list[bytes]:
        """Payloads of the blocks after the pool's `start` cached ones that the offload tiers hold (remembered
        while the sequence waits, so a queue head is not read again every step)."""
        bs = self.kv.block_size
        limit = seq.num_tokens - 1 if seq.max_cached_prefix is None else \
            max(0, min(seq.num_tokens - 1, seq.max_cached_prefix))
        stop = limit // bs
        if start >= stop:
            return []
        found = self._found.get(seq.seq_id)
        if found is None or found[0] != start:
            hashes = self.kv.block_hashes(seq.seq_id, seq.token_ids, seq.extra_key)
            found = self._found[seq.seq_id] = (start, self.offload.lookup(hashes, seq.token_ids, bs, start, stop))
        return found[1]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft = []
        if self.swap and seq.seq_id not in self._swapped and not self._swap_out(seq):
            self.num_swap_fallbacks += 1
        self._free(seq)
        if seq.seq_id not in self._swapped:
            self._restart(seq)
        seq.num_computed_tokens = 0  # while it waits; a swapped one gets its count back on resuming
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _restart(seq: Sequence) -> None:
        """Make `seq` start over: recomputed from its tokens."""
        seq.num_computed_tokens = 0
        PressureLadder.forget(seq)  # recomputed, it is exact again
        if seq.eviction:  # recomputed from scratch: every token so far is its prompt now
            seq.eviction.reset(seq.num_tokens)

    def _swap_out(self, seq: Sequence) -> bool:
        """Have the offloader keep the contents of `seq`'s blocks (those of its cache slots, then its private ones);
        False if it has none to keep or the tier has no room."""
        slots = seq.num_computed_tokens - seq.num_evicted
        if slots <= 0:
            return False
        n = blocks_for(slots, self.kv.block_size)
        blocks = self.kv.block_tables[seq.seq_id][:n] + self.kv.private_blocks.get(seq.seq_id, [])
        if not self.offload.swap_out(seq.seq_id, blocks):
            return False
        self._swapped[seq.seq_id] = Swapped(seq.num_computed_tokens, n, self.kv.is_compacted(seq.seq_id))
        self.num_swapped_out += 1
        seq.num_swapped_out += 1
        return True

    def _relieve(self, seq: Sequence, tokens: int, scheduled: dict[int, int]) -> bool:
        """The pressure ladder's rungs before a preemption (engine/pressure.py), for `seq`'s allocation of `tokens`
        cache slots that failed: True if one freed blocks (try again), False if the victim is to be preempted. With
        swap, the victim is swapped out first (no quality lost; its preemption follows); where the tier has no room,
        tokens of the longest sequence not yet scheduled this step are evicted."""
        if self.pressure is None:
            return False
        if self.swap and self._swap_out(self.running[-1]):
            return False
        need = self.kv.blocks_needed(seq.seq_id, tokens)
        return self.pressure.evict(self.running, set(scheduled), max(1, need - self.kv.num_free_blocks))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[int, int] = {}
        # Rows whose logits prompt logprobs add to the step's: at most max_num_seqs, the LM head rows start-up sized
        # the activations for (with chunked prefill; without it a prompt goes whole)
        self._logit_rows = self.config.max_num_seqs if self.config.enable_chunked_prefill else None
        # Decodes before unfinished prefills, each group in admission order.
        order = sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            pending = seq.num_tokens - seq.num_computed_tokens
            if seq.draft:  # a speculating decode: its last token and as much of its proposal as the budget takes
                seq.draft = seq.draft[:max(0, budget - pending)]
            n = self._logit_cap(seq, min(pending + len(seq.draft), budget))
            if n == 0:
                continue  # its prompt's logits wait for the next step
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens - seq.num_evicted + n):
                if seq.draft:  # a proposal never preempts anyone: drop it first
                    n -= len(seq.draft)
                    seq.draft = []
                    continue
                if self._relieve(seq, seq.num_computed_tokens - seq.num_evicted + n, scheduled):
                    continue
                victim = self.running[-1]
                budget += scheduled.pop(victim.seq_id, 0)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled[seq.seq_id] = n
                budget -= n
                self._take_logit_rows(seq, n)
        if not out.preempted or not scheduled:  # after preempting everything, restart from the queue
            budget = self._admit(scheduled, budget)
        by_id = {s.seq_id: s for s in self.running}
        out.chunks = [(by_id[i], n) for i, n in scheduled.items()]
        return out

    def _logit_cap(self, seq: Sequence, n: int) -> int:
        """`n` tokens, or fewer for a sequence whose prompt rows all go through the LM head (prompt logprobs) when
        the step's rows for them are spent."""
        return n if self._logit_rows is None or not seq.wants_prompt_logits else min(n, self._logit_rows)

    def _take_logit_rows(self, seq: Sequence, n: int) -> None:
        if self._logit_rows is not None and seq.wants_prompt_logits:
            self._logit_rows -= n

    def _admit(self, scheduled: dict[int, int], budget: int) -> int:
        """Admit waiting sequences, FCFS or longest prefix match first (lpm), while the token budget, max_num_seqs
        and the free blocks allow; each one's tokens this step go in `scheduled`. Returns the budget left."""
        lpm = (self.config.scheduling_policy == "lpm" and self.kv.prefix_caching is not None
               and len(self.waiting) <= LPM_MAX_QUEUE)
        order = list(self.waiting)
        if lpm:  # stable: FCFS among equals
            hits = {s.seq_id: len(self.kv.find_prefix(s.seq_id, s.token_ids, s.extra_key, s.max_cached_prefix))
                    for s in order}
            order.sort(key=lambda s: -hits[s.seq_id])
        computing: set[int] = set()  # lpm: hashes of the first uncached block of each prompt admitted now
        for seq in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            plan = self._plan_admission(seq, budget, lpm, computing)
            if plan is _STOP:
                break
            if plan is _SKIP or not self._take(seq, plan):
                continue
            scheduled[seq.seq_id] = plan.n
            budget -= plan.n
            self._take_logit_rows(seq, plan.n)
            if plan.first_new is not None:
                computing.add(plan.first_new)
        return budget

    def _plan_admission(self, seq: Sequence, budget: int, lpm: bool, computing: set[int]):
        """What admitting `seq` now takes (an _Admission), or _SKIP (not this step: lpm shares its first new block
        with a prompt admitted now) or _STOP (no room: nothing after it in the queue is admitted either)."""
        bs = self.kv.block_size
        # Looked up again right before allocating: an admission earlier in this step may have evicted blocks of
        # the prefix found while sorting.
        swapped = self._swapped.get(seq.seq_id)
        if swapped is not None and swapped.compacted:
            prefix = []  # its blocks hold what eviction kept, not its tokens' blocks
        else:
            prefix = self.kv.find_prefix(seq.seq_id, seq.token_ids, seq.extra_key, seq.max_cached_prefix)
        first_new = None
        if lpm and swapped is None and len(prefix) < (seq.num_tokens - 1) // bs:  # a block it could take
            first_new = self.kv.block_hashes(seq.seq_id, seq.token_ids, seq.extra_key)[len(prefix)]
            if first_new in computing:
                return _SKIP  # share it next step instead of computing it twice now
        if swapped is not None:  # resumes where it was, or past it if the pool caches more of its prompt
            loaded, cached = [], max(swapped.computed, len(prefix) * bs)
        else:
            loaded = self._offloaded(seq, len(prefix)) if self.offload else []
            cached = (len(prefix) + len(loaded)) * bs
        slots = cached - seq.num_evicted  # a swapped sequence keeps what eviction left
        remaining = seq.num_tokens - cached
        n = self._logit_cap(seq, min(remaining, budget))
        if n == 0 or (n < remaining and not self.config.enable_chunked_prefill):
            return _STOP
        # Gate: keep a reserve for running sequences to grow into, so admitting this one does not force a
        # preemption a few steps later.
        need = self.kv.blocks_needed(seq.seq_id, slots + n, prefix)
        reserve = self.watermark + len(self.running)  # one fresh block each
        if (self.running and need + reserve > self.kv.num_free_blocks) or need > self.kv.num_free_blocks:
            return _STOP
        return _Admission(prefix, loaded, cached, slots, n, need, swapped, first_new)

    def _take(self, seq: Sequence, plan: _Admission) -> bool:
        """Allocate `seq`'s blocks as planned, queue its loads from a tier, and move it to running; False where a
        swapped sequence's tier could not hand its KV back (it is recomputed from the next step instead)."""
        swapped, prefix = plan.swapped, plan.prefix
        if swapped is not None:
            del self._swapped[seq.seq_id]
            skip = min(len(prefix), swapped.table_blocks)
            rows = self.offload.swap_in(seq.seq_id, skip)
            if rows is None:
                self.num_swap_fallbacks += 1
                self._restart(seq)
                return False
        if not self.kv.allocate(seq.seq_id, plan.slots + plan.n, prefix):  # cannot happen: planned just before
            raise RuntimeError(f"allocating {plan.need} KV blocks failed with {self.kv.num_free_blocks} free")
        if swapped is not None:
            table = self.kv.block_tables[seq.seq_id]
            self.loads.append((table[skip:swapped.table_blocks] + self.kv.private_blocks.get(seq.seq_id, []), rows))
            if swapped.compacted:
                self.kv.mark_compacted(seq.seq_id)
            self.num_swapped_in += 1
        elif plan.loaded:  # fresh blocks after the pool's prefix, filled from the tiers before the forward
            self.loads.append((self.kv.block_tables[seq.seq_id][len(prefix):len(prefix) + len(plan.loaded)],
                               plan.loaded))
            # Findable at once (their content is final before any forward reads them): a prompt admitted after
            # this one in the same step shares them instead of loading them again.
            self.kv.cache_blocks(seq.seq_id, seq.token_ids, plan.cached, seq.extra_key)
        self._found.pop(seq.seq_id, None)
        self.waiting.remove(seq)
        if not seq.prefix_counted and seq.index == 0:  # once per request, at admission (vLLM's counting)
            seq.prefix_counted = True
            seq.num_cached_tokens = plan.cached
            self.kv.record_lookup(seq.num_tokens, plan.cached)
        seq.num_computed_tokens = plan.cached
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True
