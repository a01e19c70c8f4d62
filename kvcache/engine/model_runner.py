"""Turns a scheduled step into the batch tensors, runs the model, returns logits."""
from __future__ import annotations

import dataclasses

import torch

from kvcache.attention.metadata import ForwardBatch, KiviLayout, SeqChunk, build_batch
from kvcache.parallel.errors import RankDiedError
from kvcache.engine import prompt_logprobs
from kvcache.engine.eviction import seq_chunk
from kvcache.engine.sequence import Sequence
from kvcache.memory.device_tables import DeviceBlockTables
from kvcache.memory.kv_cache_manager import KVCacheManager
from kvcache.memory.layer_groups import GroupedKVCacheManager
from kvcache.models.llama import LlamaModel
from kvcache.store.kv_store import KVStore
from kvcache.store.quantized_store import QuantizedKVStore
from kvcache.store.state_store import StateBatch, StateSpan, StateStore


SMALL_STEP_ROWS = 4  # at most this many tokens in a step: decode of a few sequences, bound by the weights' reads


class ModelRunner:
    """Owns the model and the KV store; knows nothing of queues or requests."""

    def __init__(self, model: LlamaModel, store: KVStore | QuantizedKVStore,
                 kv: KVCacheManager | GroupedKVCacheManager | None, device: torch.device, backend: str = "torch",
                 layer_group: list[int] | None = None, windows: list[int | None] | None = None,
                 states: StateStore | None = None) -> None:
        """`layer_group` (with a GroupedKVCacheManager): each layer's group, whose tables it reads. A tensor-parallel
        worker has no manager (`kv` None): rank 0's chunks carry the tables, and with `layer_group` each group's
        (`windows`: each group's sliding window). `states`: the recurrent layers' state pool, whose slots the
        manager's StateSlots hand out."""
        self.model, self.store, self.kv, self.device = model, store, kv, device
        self.states = states
        grouped = isinstance(kv, GroupedKVCacheManager) or (kv is None and windows is not None)
        if grouped != (layer_group is not None):
            raise ValueError("per-layer-group tables need both a GroupedKVCacheManager and each layer's group")
        self.layer_group = layer_group
        self.windows = kv.windows if isinstance(kv, GroupedKVCacheManager) else windows
        self.backend = backend  # see attention/backend.py
        self.decode_kernel = backend in ("cpu", "triton")
        # CPU threads for steps of at most SMALL_STEP_ROWS tokens (None: every step uses all of torch's threads);
        # a server sets it from KVCACHE_SMALL_STEP_THREADS.
        self.small_step_threads: int | None = None
        self.all_threads = torch.get_num_threads()
        self.tables = DeviceBlockTables(device)  # the device copy of kv's block tables, updated by diffs
        self.group_tables = [DeviceBlockTables(device) for _ in self.windows] if grouped else []
        self.kivi = None
        self.captured: list[torch.Tensor] = []
        self.graphs = None  # engine/cuda_graphs.py's DecodeGraphs once captured: pure-decode steps replay them
        self.tp = None  # parallel/group.py's TensorParallel on rank 0: each forward is broadcast first
        if store.kivi_group:
            self.kivi = KiviLayout(store.kivi_group, store.num_kv_heads * store.head_dim, store.row_elems)

    def execute(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor, list[SeqChunk]]:
        """Run one step. Returns the sequences that reached their last token, their fp32 logits (1 + len(draft)
        rows each, in order: [n, vocab]), and
        the step's chunks (one per scheduled sequence; `self.captured` holds the queries eviction asked for)."""
        specs, sampled = [], []
        every_row: dict[int, bool] = {}  # chunks whose every row's logits prompt logprobs need -> whether last
        for seq, n in chunks:
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + n]
            if seq.draft:  # a speculating decode: its last token, then the proposal
                tokens = tokens + seq.draft[:n - len(tokens)]
            last = start + n == seq.num_tokens + len(seq.draft)
            slot = start - seq.num_evicted
            specs.append(seq_chunk(seq.seq_id, tokens, slot, self.kv.block_tables[seq.seq_id], last,
                                   self.kv.private_blocks.get(seq.seq_id, []), seq.eviction))
            if self.kv.snapshots is not None:
                specs[-1].state_saves = self._snapshot_points(seq, start, n)
            if seq.params.prompt_logprobs is not None and prompt_logprobs.want_every_row(seq, specs[-1]):
                every_row[len(specs) - 1] = last
            if last:
                if seq.draft:  # a speculating decode: every proposed token is verified, each row as a decode
                    specs[-1].num_logits, specs[-1].as_decodes = 1 + len(seq.draft), True
                sampled.append(seq)
        logits = self._forward(specs, evicting=any(seq.eviction for seq, _ in chunks))
        if every_row:
            logits = prompt_logprobs.take(chunks, specs, every_row, logits)
        return sampled, logits, specs

    def forward(self, specs: list[SeqChunk], logit_rows: range | None = None,
                group_tables: list[list[list[int]]] | None = None) -> torch.Tensor:
        """Run chunks whose blocks are allocated; fp32 logits of each chunk's last num_logits rows, in order, or of
        `logit_rows` (batch rows). A tensor-parallel worker runs rank 0's forwards so: it has no manager, the chunks
        carry the tables, and `group_tables` each group's (per group, per chunk)."""
        return self._forward(specs, logit_rows, group_tables=group_tables)

    def run_chunk(self, chunk: SeqChunk, logit_rows: range, evicting: bool = False) -> torch.Tensor:
        """Run one chunk of a sequence whose blocks are allocated; fp32 logits of `logit_rows` (chunk rows)
        (`evicting`: the sequence has an eviction policy, whose plans follow the forward under tensor parallelism)."""
        return self._forward([chunk], logit_rows, evicting)

    def _batch(self, specs: list[SeqChunk], kv: KVCacheManager | None, tables: DeviceBlockTables,
               windows: tuple[int | None, ...]) -> ForwardBatch:
        rows = tables.sync(kv, [c.seq_id for c in specs]) if kv is not None else None
        batch = build_batch(specs, self.store.block_size, windows, self.device, self.decode_kernel,
                            read_cache=not self.store.exact, kivi=self.kivi,
                            tables=tables.table if kv is not None else None, table_rows=rows)
        batch.backend = self.backend
        return batch

    def group_tables_of(self, specs: list[SeqChunk]) -> list[list[list[int]]]:
        """Each group's table of each chunk's sequence (what a tensor-parallel worker is sent)."""
        return [[m.block_tables[c.seq_id] for c in specs] for m in self.kv.groups]

    def _grouped_batch(self, specs: list[SeqChunk], group_tables: list[list[list[int]]] | None) -> ForwardBatch:
        """One batch per layer group, on that group's tables (the manager's, or `group_tables` without one); the
        first group's carries the others per layer."""
        batches = []
        for g, (w, tables) in enumerate(zip(self.windows, self.group_tables)):
            m = self.kv.groups[g] if self.kv is not None else None
            own = [dataclasses.replace(c, block_table=m.block_tables[c.seq_id] if m else group_tables[g][i])
                   for i, c in enumerate(specs)]
            batches.append(self._batch(own, m, tables, (w,)))
        batch = batches[0]
        for b in batches[1:]:  # every layer appends the queries eviction asked for to one list, in layer order
            b.captured_q = batch.captured_q
        batch.layer_batches = [batches[g] for g in self.layer_group]
        return batch

    def graph_tables(self) -> list[tuple]:
        """Per block-table group, (its manager, its device tables): what a captured decode step reads."""
        if self.layer_group is None:
            return [(self.kv, self.tables)]
        return list(zip(self.kv.groups, self.group_tables))

    def _forward(self, specs: list[SeqChunk], logit_rows: range | None = None, evicting: bool = False,
                 group_tables: list[list[list[int]]] | None = None) -> torch.Tensor:
        if self.tp is not None:  # rank 0 of a tensor-parallel group: every rank runs this forward
            self.tp.send_step(specs, logit_rows, evicting, self.group_tables_of(specs) if self.layer_group else None)
            try:
                return self._local_forward(specs, logit_rows)
            except RankDiedError:
                self.tp.name_the_dead()  # which rank, if one exited
                raise
            except Exception as e:  # the other ranks are inside (or past) collectives this rank will not join
                raise RankDiedError(f"a tensor-parallel forward failed midway on rank 0 ({type(e).__name__}: {e}); "
                                    "the ranks' collectives are out of step") from e
        return self._local_forward(specs, logit_rows, group_tables)

    def _local_forward(self, specs: list[SeqChunk], logit_rows: range | None,
                       group_tables: list[list[list[int]]] | None = None) -> torch.Tensor:
        if self.graphs is not None and logit_rows is None:
            logits = self.graphs.run(specs, self.graph_tables())
            if logits is not None:
                self.captured = []
                return logits
        if self.layer_group is not None:
            batch = self._grouped_batch(specs, group_tables)
        else:
            batch = self._batch(specs, self.kv, self.tables, self.model.windows)
        if self.small_step_threads is not None:  # every forward (steps, scoring chunks) sets its own thread count
            rows = batch.num_tokens
            torch.set_num_threads(self.small_step_threads if rows <= SMALL_STEP_ROWS else self.all_threads)
        if logit_rows is not None:
            batch.logits_indices = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        if self.states is not None:
            batch.states = self._state_batch(specs)
        self.captured = batch.captured_q  # per layer [rows, H, D], in chunk order (eviction scoring)
        # Denormal floats run many times slower on x86 CPUs; flush them to zero during the
        # forward only, since the setting is process-wide and other code may rely on them.
        flush = self.device.type == "cpu" and torch.set_flush_denormal(True)
        try:
            logits = self.model(batch, self.store)
        finally:
            if flush:
                torch.set_flush_denormal(False)
        return logits.float()

    def _snapshot_points(self, seq: Sequence, start: int, n: int) -> list[tuple[int, tuple]]:
        """(position, key) of the snapshot boundaries that tokens [start, start + n) of `seq` reach."""
        every = self.kv.snapshots.interval
        return [(b, self.kv.snapshot_key(seq.seq_id, seq.token_ids, seq.extra_key, b))
                for b in range(start - start % every + every, start + n + 1, every)]

    def _state_batch(self, specs: list[SeqChunk]) -> StateBatch:
        """Each chunk's state slot: decode rows (one token after the first) stepped together, other chunks scanned
        one by one, from zeros where they start the sequence; and where the states at boundaries are snapshotted.
        Copies (forks, snapshots a sequence starts from) reach the pool before any snapshot slot is reused."""
        slots, snapshots = self.kv.states, self.kv.snapshots
        self.states.copy(slots.take_copies())
        spans, rows, decode_slots, decode_saves, row = [], [], [], [], 0
        for c in specs:
            n, slot = len(c.token_ids), slots.slot_of[c.seq_id]
            saves = [(b, snapshots.reserve(key)) for b, key in c.state_saves]
            if n == 1 and c.start > 0:
                decode_saves += [(len(rows), dst) for _, dst in saves]
                rows.append(row)
                decode_slots.append(slot)
            else:
                spans.append(StateSpan(row, n, slot, c.start, saves))
            row += n
        long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return StateBatch(self.states, spans, long(rows), long(decode_slots), decode_saves)
