"""Runs each sequence's eviction policy after a forward and compacts its cache, freeing whole blocks.

A sequence with a policy prefills its whole prompt, then keeps `budget` tokens per layer and KV head:
the survivors are packed, in order, into the first slots of its block table and the emptied blocks go
back to the pool. Kept keys keep the rotation of their original positions (RoPE is applied before
caching), and new tokens continue at their true positions: slot = position - tokens evicted so far.
Policies that evict while decoding let the cache grow one block past the budget, then compact again,
so each compaction frees a block. Blocks shared through the prefix cache are never written: see
KVCacheManager.compact.

A step's eviction runs in two phases, so that tensor-parallel ranks can run it in lockstep: `plan` (rank 0 alone,
which owns the block tables) decides each sequence's compaction and takes it in the tables; `apply` (every rank,
on its own KV heads) takes the sequence's captured queries into its scores, selects the survivors and moves them.
Phase 2 runs the sequences in order, so a survivor is read from an old block before a later sequence's compaction
writes into that block (the manager may have handed it on in phase 1). Under tensor parallelism rank 0 broadcasts
the step's plans (EvictionWork) once, and each worker applies them to its copies of the sequences' states
(WorkerEvictor); scores that average over query heads held by other ranks are summed across ranks (HeadShare).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache.attention.metadata import SeqChunk
from kvcache.compress.policy import EvictionState, HeadShare
from kvcache.compress.registry import get_policy
from kvcache.compress.spec import EvictionSpec
from kvcache.memory.kv_cache_manager import KVCacheManager
from kvcache.parallel.errors import RankDiedError


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


@dataclass(slots=True)
class Compaction:
    """A compaction rank 0's tables have taken: n cached tokens down to `top` slots, layer l keeping slots
    [starts[l], top) (PyramidKV's dead leading blocks: starts > 0), and each table's (old, new) blocks."""

    n: int
    top: int
    starts: list[int]
    pairs: list[tuple[list[int], list[int]]]


@dataclass(slots=True)
class EvictionWork:
    """One sequence's eviction after a forward: its captured queries (`rows` of the step's, at cache slots
    `slots`) and each table's blocks as they ran, then its compaction if one is due; and what a worker needs to
    keep its copy of the state (`policy`, `budget`, `prompt_len`, `seed`, `epoch`)."""

    seq_id: int
    policy: str
    budget: int
    prompt_len: int
    seed: int
    epoch: int
    rows: range
    slots: range
    tables: list[list[int]]
    plan: Compaction | None = None


class Evictor:
    """Owns the eviction step of every sequence that has a policy (see the module docstring)."""

    def __init__(self, store, kv: KVCacheManager | None, num_layers: int, num_kv_heads: int, scale: float,
                 device: torch.device, layer_group: list[int] | None = None, share: HeadShare | None = None,
                 tp=None) -> None:
        """`layer_group`: each layer's table group, where `kv` keeps one table per group (layer_groups.py): then each
        layer's dead leading blocks (PyramidKV's smaller budgets) go back to the pool. `num_kv_heads`: the KV heads
        this process's store holds (`share`: which of the model's, under tensor parallelism; `tp`: rank 0's
        TensorParallel, to which each step's plans are sent)."""
        self.store, self.kv, self.scale, self.device = store, kv, scale, device
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.layer_group, self.share, self.tp = layer_group, share, tp
        self.stats = EvictionStats()

    def _tables(self, seq_id: int) -> list[list[int]]:
        """Each table of `seq_id` (one, or one per layer group)."""
        if self.layer_group is None:
            return [self.kv.block_tables[seq_id]]
        return self.kv.tables(seq_id)

    def _per_layer(self, tables: list[list[int]]) -> list[list[int]]:
        return tables * self.num_layers if self.layer_group is None else [tables[g] for g in self.layer_group]

    def new_state(self, spec: EvictionSpec, prompt_len: int, seed: int) -> EvictionState:
        """State for a sequence with a `prompt_len`-token prompt; ValueError if the budget cannot work."""
        return self.make_state(spec.policy, spec.tokens(prompt_len), prompt_len, seed)

    def make_state(self, policy: str, budget: int, prompt_len: int, seed: int) -> EvictionState:
        return EvictionState(get_policy(policy), budget, prompt_len, self.num_layers, self.num_kv_heads,
                             torch.Generator().manual_seed(seed), seed, self.share)

    def _keys(self, tables: list[list[int]]):
        """keys(layer, n): the first n cached keys of `layer`, read through its table in `tables` (one per layer)."""
        bs = self.store.block_size

        def keys(layer: int, n: int) -> torch.Tensor:
            blocks = torch.tensor(tables[layer][:-(-n // bs)], device=self.device)
            return self.store.gather(layer, blocks)[0].flatten(0, 1)[:n]
        return keys

    def after_forward(self, seq_id: int, state: EvictionState, chunk: SeqChunk, queries: list[torch.Tensor],
                      num_computed: int) -> None:
        """Both phases for one sequence (`queries`: its captured ones, [r, H, D] per layer; `num_computed`: its
        tokens computed, this chunk included)."""
        work = None
        try:
            work = self.plan(seq_id, state, chunk, num_computed, 0)
        finally:  # the workers wait for this step's plans, however planning went
            self.send([work] if work is not None else [], [seq_id])
        self.apply_in_step(work, state, queries)

    def apply_in_step(self, work: EvictionWork, state: EvictionState, queries: list[torch.Tensor]) -> None:
        """`apply`; under tensor parallelism a failure is the group's (RankDiedError): the other ranks applied the
        same plan, and may wait in its collectives."""
        if self.tp is None:
            return self.apply(work, state, queries)
        try:
            self.apply(work, state, queries)
        except Exception as e:
            raise RankDiedError(f"eviction failed on rank 0 ({type(e).__name__}: {e}); the ranks' collectives "
                                "are out of step") from e

    def plan(self, seq_id: int, state: EvictionState, chunk: SeqChunk, num_computed: int, row: int) -> EvictionWork:
        """Phase 1 (rank 0): what `apply` must do for `chunk` of `seq_id`, whose captured queries start at `row` of
        the step's; a compaction due is taken in the tables here."""
        tables = [list(t) for t in self._tables(seq_id)]
        slots = range(chunk.start + chunk.capture.start, chunk.start + chunk.capture.stop)
        work = EvictionWork(seq_id, state.policy.name, state.budget, state.prompt_len, state.seed, state.epoch,
                            range(row, row + len(slots)), slots, tables)
        work.plan = self._compaction(seq_id, state, num_computed)
        return work

    def send(self, works: list[EvictionWork], live: list[int]) -> None:
        """Under tensor parallelism, the step's plans to every worker (`live`: the sequences whose states they
        keep); they apply them as `apply` does here."""
        if self.tp is not None:
            self.tp.send_eviction(works, live)

    def _compaction(self, seq_id: int, state: EvictionState, num_computed: int) -> Compaction | None:
        """The compaction of `seq_id` if its policy is due, taken in the tables: when the prompt is in the cache,
        and (decode-time policies) each time the cache has grown a block past the budget. None if not due, or
        put off for want of a free block (`state.pending`)."""
        n = num_computed - state.num_evicted
        if num_computed < state.prompt_len or n <= state.budget:
            return None
        bs = self.store.block_size
        due = num_computed == state.prompt_len or state.pending or (state.policy.decode and n >= state.budget + bs)
        if not due:
            return None
        counts = state.policy.budgets(state, n)
        top = min(max(counts), n)
        starts = [(top - min(c, top)) // bs * bs for c in counts]  # dead leading slots, whole blocks only
        res = self.kv.compact(seq_id, top)
        if res is None:
            state.pending = True
            self.stats.deferred += 1
            return None
        pairs = [res] if self.layer_group is None else res  # (old, new) per table
        freed = sum(len(old) - len(new) for old, new in pairs)
        if self.layer_group is not None:  # a table's dead leading blocks hold nothing its layers read: give them back
            first: dict[int, int] = {}
            for layer, start in enumerate(starts):
                g = self.layer_group[layer]
                first[g] = min(first.get(g, start), start)
            for g, start in first.items():
                freed += len(self.kv.groups[g].release_leading(seq_id, start))
        self.stats.compactions += 1
        self.stats.evicted_tokens += n - top
        self.stats.freed_blocks += freed
        return Compaction(n, top, starts, [(list(o), list(w)) for o, w in pairs])

    def compact_now(self, seq_id: int, state: EvictionState, n: int, top: int) -> bool:
        """Compact `seq_id`'s `n` cached slots to the `top` its state's policy selects, now, between steps (the
        pressure ladder: engine/pressure.py; one table, one process). False, and nothing changed, where the table
        cannot take the fresh blocks the compaction needs."""
        res = self.kv.compact(seq_id, top, fixed_blocks=state.fixed // self.store.block_size)
        if res is None:
            return False
        old, new = list(res[0]), list(res[1])  # counted by the ladder (PressureStats), not in self.stats
        plan = Compaction(n, top, [0] * self.num_layers, [(old, new)])
        self.apply(EvictionWork(seq_id, state.policy.name, top, state.prompt_len, state.seed, state.epoch, range(0),
                                range(0), [old], plan), state, [])
        return True

    def apply(self, work: EvictionWork, state: EvictionState, queries: list[torch.Tensor]) -> None:
        """Phase 2 (every rank): observe the sequence's captured queries, then move its survivors."""
        if len(work.slots):
            slots = torch.arange(work.slots.start, work.slots.stop, device=self.device)
            state.policy.observe(state, queries, slots, self._keys(self._per_layer(work.tables)), self.scale)
        c = work.plan
        if c is None:
            return
        bs = self.store.block_size
        old = self._per_layer([o for o, _ in c.pairs])
        keep = state.policy.select(state, c.n, [c.top - s for s in c.starts], self._keys(old), self.scale)
        moved = [(torch.tensor(o, device=self.device), torch.tensor(w, device=self.device)) for o, w in c.pairs]
        per_layer = [0] * self.num_layers if self.layer_group is None else self.layer_group
        scores = torch.zeros_like(state.scores) if state.scores is not None else None  # h2o's, compacted alike
        for layer, idx in enumerate(keep):
            old_t, new_t = moved[per_layer[layer]]
            idx = idx.to(self.device)
            dst = torch.arange(c.starts[layer], c.top, device=self.device).expand_as(idx)
            self.store.move_slots(layer, old_t[idx // bs] * bs + idx % bs, new_t[dst // bs] * bs + dst % bs)
            if scores is not None:
                scores[layer, :, c.starts[layer]:c.top] = state.scores[layer].gather(1, idx.to(scores.device))
        state.scores = scores
        state.layer_start = c.starts if any(c.starts) else None
        state.num_evicted += c.n - c.top
        state.pending = False


@dataclass
class WorkerEvictor:
    """A tensor-parallel worker's side: its copies of the live sequences' states, kept by rank 0's plans."""

    evictor: Evictor
    states: dict[int, EvictionState] = field(default_factory=dict)

    def run(self, works: list[EvictionWork], live: list[int], captured: list[torch.Tensor]) -> None:
        for w in works:
            state = self.states.get(w.seq_id)
            if state is None or state.epoch != w.epoch:
                if state is None:
                    state = self.states[w.seq_id] = self.evictor.make_state(w.policy, w.budget, w.prompt_len, w.seed)
                else:
                    state.reset(w.prompt_len)
                state.epoch = w.epoch
            self.evictor.apply(w, state, [q[w.rows.start:w.rows.stop] for q in captured])
        keep = set(live)
        for seq_id in [s for s in self.states if s not in keep]:
            del self.states[seq_id]
