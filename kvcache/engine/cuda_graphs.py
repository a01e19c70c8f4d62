"""CUDA graphs of pure-decode steps (vLLM's piecewise-free "full graph" mode for decode): captured at start-up at a
ladder of batch sizes, replayed with the step's inputs copied into the buffers they were captured over.

A decode step of n sequences (one new token each, nothing else in the step) is padded to the smallest captured
size b >= n. Every input the model reads lives in static buffers of the largest size: token ids, positions,
context lengths, and per block-table group the slot of each new token and a [max size, W] block table, W the
blocks of a max_model_len sequence. Padding rows have token 0 at position 0, attend to one token, and write their
K/V into slot 0 of block 0, the null block that no sequence reads: they cost a little arithmetic and change no
sequence's KV. The model's logits for all b rows land in one static [max size, vocab] buffer; the step returns the
first n, copied.

Invariants a captured step relies on:
- the model's decode forward does no host-side work that depends on the data (no .item(), no .tolist(), no
  Python branch on a tensor's values) and reads its batch only through the static tensors: models whose forward
  does (DeepSeek's MoE counts tokens per expert on the host) set CUDA_GRAPHS = False and run eager;
- the attention kernel's launch shape depends only on the batch size and W, never on a step's lengths: the Triton
  decode kernel splits each sequence's own blocks among its split-K programs (triton_attention.paged_decode);
- the store's tensors are never reallocated after capture (they are not: the pool is fixed at start-up).

Steps that are not pure decodes (prefill chunks, speculative verification, eviction scoring, PyramidKV's per-layer
views, more rows than the largest size) run eager, as does everything with --enforce-eager. Graphs are captured
largest first into one memory pool, so the smaller ones reuse the largest one's activations (vLLM's order); the
static buffers and that pool are what the KV sizing sets aside (estimate_bytes). After capture, the smallest and
largest graphs are replayed on inputs other than the ones they were captured with and compared with eager
forwards of the same inputs: a graph that does not read its inputs is caught at start-up, and the engine runs eager
with a warning.

On a CPU there are no CUDA graphs; `Replay.EMULATE` (tests only) runs the same static-buffer machinery with the
forward re-run in place of a replay, which checks everything but the capture itself.
"""
from __future__ import annotations

import dataclasses
import enum
import gc
import logging
import time
from collections.abc import Callable

import torch

from kvcache.attention.metadata import DecodeGroup, ForwardBatch, SeqChunk
from kvcache.memory.device_tables import DeviceBlockTables, upload

log = logging.getLogger("kvcache")
GiB = 2**30


class Replay(enum.Enum):
    CUDA = "cuda"  # torch.cuda.CUDAGraph
    EMULATE = "emulate"  # the tests' stand-in on a CPU: the captured callable re-run on the static buffers


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, then every 8, up to the most decode rows one step can hold (max_num_seqs, and no
    more than max_num_batched_tokens), which is included."""
    top = min(max_num_seqs, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else sizes + [top]


def why_not(device: torch.device, backend: str, model, enforce_eager: bool) -> str | None:
    """Why decode steps will run eager on this engine, or None: they will be captured."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if backend != "triton":
        return (f"attention backend {backend}: the graphs are captured over the Triton kernels (the torch path's "
                "shapes follow each step's lengths)")
    if not getattr(model, "CUDA_GRAPHS", True):
        return f"{type(model).__name__}'s forward does host-side work per step ({model.CUDA_GRAPHS_WHY})"
    return None


@dataclasses.dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    bytes: int  # device memory the graphs and their buffers took (the driver's free memory before and after)

    def __str__(self) -> str:
        return (f"{len(self.sizes)} decode batch sizes ({self._ladder()}) in {self.seconds:.1f} s, "
                f"{self.bytes / 2**20:,.0f} MiB")

    def _ladder(self) -> str:
        s = self.sizes
        return ", ".join(map(str, s)) if len(s) <= 6 else f"{', '.join(map(str, s[:4]))}, ..., {s[-1]}"


class DecodeGraphs:
    """Captured decode forwards of `model` over `store`, one per size in `sizes`.

    `groups`: the block-table groups the model's layers read (one for a single table; with per-layer-group tables,
    one per group, and `layer_group` gives each layer's); `max_blocks`: W, the width of every captured table.
    """

    def __init__(self, model, store, sizes: list[int], max_blocks: int, device: torch.device,
                 num_groups: int = 1, layer_group: list[int] | None = None, backend: str = "triton",
                 replay: Replay = Replay.CUDA) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be distinct positive batch sizes in increasing order, got {sizes}")
        self.model, self.store, self.sizes, self.device = model, store, sizes, device
        self.replay_mode, self.backend, self.layer_group = replay, backend, layer_group
        self.width = max_blocks
        top = sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(top, **long)
        self.positions = torch.zeros(top, **long)
        self.lens = torch.ones(top, **long)
        self.rows = torch.arange(top, **long)
        self.slots = [torch.zeros(top, **long) for _ in range(num_groups)]
        self.tables = [torch.zeros(top, max_blocks, **long) for _ in range(num_groups)]
        # [top, vocab] in the compute dtype (the head's output), made here: not on the warm-up's side stream
        self.logits = torch.empty(top, model.lm_head.out_features, dtype=model.compute_dtype, device=device)
        self.graphs: dict[int, Callable[[], None]] = {}
        self.pool = None
        self.replays = 0  # steps served by a graph (tests, metrics)
        self.report: CaptureReport | None = None

    # ---- capture -------------------------------------------------------------------------------

    def _batch(self, b: int) -> ForwardBatch:
        """The batch of size b over views of the static buffers (what a graph of size b is captured with)."""
        rows = self.rows[:b]
        per_group = []
        for slots, table in zip(self.slots, self.tables):
            group = DecodeGroup(rows, table[:b], self.lens[:b], {})
            fb = ForwardBatch(self.ids[:b], self.positions[:b], slots[:b], rows, [group], [], decode_kernel=True)
            fb.backend = self.backend
            per_group.append(fb)
        batch = per_group[0]
        if self.layer_group is not None:
            batch.layer_batches = [per_group[g] for g in self.layer_group]
        return batch

    def _pad(self) -> None:
        """Every row as padding: token 0 at position 0, one token attended, K/V written to the null slot."""
        self.ids.zero_()
        self.positions.zero_()
        self.lens.fill_(1)
        for slots in self.slots:
            slots.zero_()

    def _step(self, b: int) -> Callable[[], None]:
        batch = self._batch(b)

        def step() -> None:
            self.logits[:b].copy_(self.model(batch, self.store))
        return step

    def _record(self, step: Callable[[], None]) -> Callable[[], None]:
        if self.replay_mode is Replay.EMULATE:
            return step
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        return graph.replay

    def _warm_up(self, step: Callable[[], None]) -> None:
        """Run `step` eagerly (compiling the kernels and setting up library handles before capture), on a side stream
        as torch's CUDA graph notes advise."""
        if self.replay_mode is Replay.EMULATE:
            step()
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, sizes: list[int] | None = None) -> CaptureReport:
        """Capture a graph per size (all of them by default), largest first into one pool."""
        free0 = self._free()
        t = time.perf_counter()
        with torch.inference_mode():
            for b in sorted(sizes or self.sizes, reverse=True):
                self._pad()
                step = self._step(b)
                self._warm_up(step)
                self.graphs[b] = self._record(step)
            self._sync()
        self.report = CaptureReport(sorted(self.graphs), time.perf_counter() - t, free0 - self._free())
        return self.report

    def check(self, num_blocks: int) -> str | None:
        """Replay the smallest and the largest graph on inputs other than the capture's (row i: token i + 1 at
        position 0 over a block of its own in each group, where the store has enough blocks) and compare with an
        eager forward of the same inputs. None if they agree, else what differed. Writes only blocks that no
        sequence holds yet (start-up)."""
        g = len(self.tables)
        for b in sorted({self.sizes[0], self.sizes[-1]}):
            if g * b + 1 > num_blocks:
                continue
            bs = self.store.block_size
            with torch.inference_mode():
                self._pad()
                n = torch.arange(1, b + 1, device=self.device)
                self.ids[:b] = n % self.logits.shape[1]
                for i, (slots, table) in enumerate(zip(self.slots, self.tables)):
                    slots[:b] = (n + i * b) * bs
                    table[:b, 0] = n + i * b
                self._step(b)()  # eager, over the same static buffers
                eager = self.logits[:b].clone()
                self.logits[:b] = float("nan")
                self.graphs[b]()
                self._sync()
                got = self.logits[:b]
                if not torch.allclose(got.float(), eager.float(), rtol=1e-3, atol=1e-3):
                    diff = (got.float() - eager.float()).abs().nan_to_num(float("inf")).max().item()
                    return f"the graph of batch size {b} gave logits {diff:.3g} away from an eager forward"
                for table in self.tables:
                    table[:b, 0] = 0
        self._pad()
        return None

    # ---- replay --------------------------------------------------------------------------------

    @staticmethod
    def eligible(specs: list[SeqChunk], width: int) -> bool:
        """Whether a step of `specs` is a pure decode a graph can run."""
        return all(len(c.token_ids) == 1 and c.start > 0 and c.needs_logits and c.num_logits == 1
                   and not c.as_decodes and not c.capture and c.layer_start is None and not c.private_blocks
                   and len(c.block_table) <= width for c in specs)

    def size_for(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n and s in self.graphs), None)

    def run(self, specs: list[SeqChunk], tables: list[tuple[object, DeviceBlockTables]]) -> torch.Tensor | None:
        """fp32 logits [len(specs), vocab] of a pure-decode step through the graph of the next size up; None (nothing
        done) if the step is not one. `tables`: per group, (its KVCacheManager, its DeviceBlockTables)."""
        n = len(specs)
        b = self.size_for(n) if specs else None
        if b is None or not self.eligible(specs, self.width):
            return None
        seq_ids = [c.seq_id for c in specs]
        bs = self.store.block_size
        pad = b - n
        rows, slots = [], []
        for kv, dev in tables:
            rows.append(dev.sync(kv, seq_ids) + [0] * pad)  # padding rows read row 0 (any row: they attend to slot 0)
            slots.append([kv.block_tables[s][c.start // bs] * bs + c.start % bs for s, c in zip(seq_ids, specs)]
                         + [0] * pad)
        host = [[c.token_ids[0] for c in specs] + [0] * pad, [c.start + c.pos_offset for c in specs] + [0] * pad,
                [c.start + 1 for c in specs] + [1] * pad]
        up = upload(host + slots + rows, self.device)
        self.ids[:b].copy_(up[0])
        self.positions[:b].copy_(up[1])
        self.lens[:b].copy_(up[2])
        g = len(tables)
        for i, ((_, dev), static, table) in enumerate(zip(tables, self.slots, self.tables)):
            static[:b].copy_(up[3 + i])
            w = min(self.width, dev.table.shape[1])
            table[:b, :w].copy_(dev.table.index_select(0, up[3 + g + i])[:, :w])
        self.graphs[b]()
        self.replays += 1
        return self.logits[:n].float() if self.logits.dtype != torch.float32 else self.logits[:n].clone()

    # ---- memory --------------------------------------------------------------------------------

    def _free(self) -> int:
        if self.replay_mode is Replay.EMULATE:
            return 0
        self._sync()
        return torch.cuda.mem_get_info(self.device)[0]

    def _sync(self) -> None:
        if self.replay_mode is Replay.CUDA:
            torch.cuda.synchronize(self.device)


def estimate_bytes(model, make_store: Callable[[], object], sizes: list[int], max_blocks: int,
                   device: torch.device, num_groups: int, layer_group: list[int] | None) -> int:
    """Device memory the graphs of `sizes` will take, measured before the KV cache is allocated: the largest size
    captured over a two-block stand-in store (its static buffers, its pool, which the smaller graphs reuse), the
    smallest captured next to it (what each further graph adds beyond the pool), the stand-in freed again."""
    graphs = DecodeGraphs(model, make_store(), sizes, max_blocks, device, num_groups, layer_group)
    free0 = graphs._free()
    graphs.capture([sizes[-1]])
    free1 = graphs._free()
    extra = 0
    if len(sizes) > 1:
        graphs.capture([sizes[0]])
        extra = max(0, free1 - graphs._free())
    first = free0 - free1
    del graphs
    gc.collect()  # the graphs, their pool and the stand-in store go before the KV cache is sized
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(0, first) + extra * (len(sizes) - 1)


class DecodeGraphPlan:
    """The engine's side of the graphs: whether decode steps will be captured (and why not), the estimate the KV
    sizing sets aside, the capture once the store exists, and what start-up logs and kv_cache_info() report."""

    def __init__(self, config, device: torch.device, backend: str, model, max_model_len: int, num_groups: int,
                 layer_group: list[int] | None) -> None:
        self.device, self.backend, self.model = device, backend, model
        self.num_groups, self.layer_group = num_groups, layer_group
        self.sizes = capture_sizes(config.max_num_seqs, config.max_num_batched_tokens)
        self.width = -(-max_model_len // config.block_size)
        self.off = why_not(device, backend, model, config.enforce_eager)  # None: captured
        if self.off is None and config.tensor_parallel_size > 1:
            self.off = "tensor parallelism (every step is broadcast to the other ranks first)"
        self.estimate = 0
        self.report: CaptureReport | None = None

    def estimator(self, probe_store: Callable[[], object]) -> Callable[[], int] | None:
        """What the KV sizing calls for the graphs' bytes (None where there are none to capture)."""
        if self.off is not None:
            return None

        def estimate() -> int:
            self.estimate = estimate_bytes(self.model, probe_store, self.sizes, self.width, self.device,
                                           self.num_groups, self.layer_group)
            return self.estimate
        return estimate

    def capture(self, store, num_blocks: int, replay: Replay = Replay.CUDA) -> DecodeGraphs | None:
        """The captured graphs over `store`, checked; None (logged) where steps run eager."""
        if self.off is not None and replay is Replay.CUDA:
            log.info("CUDA graphs: off (%s); decode steps run eager", self.off)
            return None
        graphs = DecodeGraphs(self.model, store, self.sizes, self.width, self.device, self.num_groups,
                              self.layer_group, self.backend, replay)
        try:
            self.report = graphs.capture()
            wrong = graphs.check(num_blocks)
        except Exception as e:  # noqa: BLE001 -- an op that cannot be captured, a kernel that fails to build: said, eager
            wrong = f"capture failed: {type(e).__name__}: {e}"
        if wrong:
            self.off, self.report = wrong, None
            log.warning("CUDA graphs: %s; decode steps run eager (--enforce-eager skips the capture)", wrong)
            del graphs
            if replay is Replay.CUDA:
                torch.cuda.empty_cache()
            return None
        self.off = None
        log.info("CUDA graphs: captured %s%s; steps of more rows, prefill chunks and speculative verification run "
                 "eager", self.report, f" (the KV sizing set aside {self.estimate / 2**20:,.0f} MiB)"
                 if self.estimate else "")
        return graphs

    def info(self) -> dict:
        r = self.report
        return {"captured": r is not None, "why_not": self.off, "sizes": r.sizes if r else [],
                "capture_seconds": round(r.seconds, 3) if r else None, "bytes": r.bytes if r else 0,
                "estimated_bytes": self.estimate}
