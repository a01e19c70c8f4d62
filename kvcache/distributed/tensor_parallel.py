"""Tensor parallelism over torch.distributed (`--tensor-parallel-size N`): Megatron-style sharding of the Llama family.

Each of the N ranks holds a slice of every layer: q/k/v and gate/up column-parallel (its query heads, its KV heads,
its share of the intermediate size), o_proj and down row-parallel (the matching input columns; one all-reduce of
their partial outputs each), the embedding and the LM head vocabulary-parallel (a lookup masked to the rank's rows
and all-reduced; logits all-gathered). KV heads are split across ranks, or replicated (one per rank) when N exceeds
them, as `kvcache plan --tensor-parallel-size` assumes: each rank's paged store holds its heads' K/V only, so a
rank's KV bytes per token are the planner's per-GPU figure.

Rank 0 is the engine: scheduler, block tables, prefix cache, sampling. Ranks 1..N-1 are worker processes
(fresh interpreters the engine starts) that own their model slice and store and loop on one message per
step, broadcast by rank 0 (`broadcast_object_list`): the store operations queued since the last step (a fork's
block copies, scrubbed blocks), then the step's chunks (token ids, positions, block tables: what build_batch
needs), from which every rank builds the same batch and runs the same forward; no per-layer Python round-trips.
A step with evicting sequences is followed by a second message, their plans (engine/eviction.py): each rank
scores and compacts its own KV heads, scores that average over other ranks' query heads all-reduced.
Collectives run on gloo (CPU) or NCCL (CUDA), with a bounded timeout (KVCACHE_TP_TIMEOUT seconds, default 120): a
rank that dies makes the next step raise EngineDeadError instead of hanging, and a forward that fails midway on
rank 0 does too (the ranks' collectives would be out of step).
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import datetime
import logging
import os
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kvcache.distributed.host import free_port, usable_cores
from kvcache.models.weights import WeightSource
from kvcache.plan.kv_bytes import heads_per_gpu

log = logging.getLogger("kvcache")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
TIMEOUT_S = float(os.environ.get("KVCACHE_TP_TIMEOUT", "120"))


class RankDiedError(RuntimeError):
    """A tensor-parallel rank exited, or a collective failed or timed out."""


def check_tensor_parallel(cfg, size: int, device: torch.device) -> None:
    """ValueError, with the numbers, for a tensor-parallel size this model or machine cannot take (before loading)."""
    if size == 1:
        return
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {size}: tensor parallelism runs the {', '.join(ARCHITECTURES)} "
                         f"architectures, not {cfg.model_type}")
    heads_per_gpu(cfg.num_key_value_heads, size)  # the planner's refusal, word for word
    for name in ("num_attention_heads", "intermediate_size"):
        n = getattr(cfg, name)
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} must divide {name} ({n:,})")
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if size > have:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; torch sees {have}")
    else:
        have = usable_cores()
        if size > have:
            raise ValueError(f"tensor_parallel_size {size} needs a CPU core per rank; this process may use {have}")


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model with these global sizes."""

    rank: int
    size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def q_rows(self) -> range:
        n = self.heads // self.size * self.head_dim
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_rows(self) -> range:
        """This rank's KV heads' rows: its share, or the one head its queries use when KV heads are replicated."""
        local = heads_per_gpu(self.kv_heads, self.size)
        first = self.rank * local if self.kv_heads >= self.size else self.rank * self.kv_heads // self.size
        return range(first * self.head_dim, (first + local) * self.head_dim)

    @property
    def ffn_rows(self) -> range:
        n = self.intermediate // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab // self.size)

    @property
    def vocab_rows(self) -> range:
        """This rank's vocabulary rows (the last rank's may be short: its shard is padded with zero rows)."""
        n = self.vocab_per_rank
        return range(min(self.vocab, self.rank * n), min(self.vocab, (self.rank + 1) * n))


def shard_of(cfg, rank: int, size: int) -> Shard:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Shard(rank, size, cfg.num_attention_heads, cfg.num_key_value_heads, hd, cfg.intermediate_size,
                 cfg.vocab_size)


def sharded_config(cfg, shard: Shard):
    """The config of one rank's model: its heads, KV heads, intermediate size and vocabulary rows."""
    local = copy.deepcopy(cfg)
    local.num_attention_heads = shard.heads // shard.size
    local.num_key_value_heads = heads_per_gpu(shard.kv_heads, shard.size)
    local.intermediate_size = shard.intermediate // shard.size
    local.head_dim = shard.head_dim
    local.vocab_size = shard.vocab_per_rank
    return local


class ShardedSource(WeightSource):
    """One rank's slice of a checkpoint, under the same Hugging Face names: column-parallel weights' rows,
    row-parallel weights' columns (their biases whole on rank 0 and zero elsewhere, so that the all-reduce adds them
    once), vocabulary rows of the embedding and LM head (zero rows past the vocabulary), the rest replicated."""

    def __init__(self, source: WeightSource, shard: Shard) -> None:
        self.source, self.shard = source, shard

    def names(self) -> list[str]:
        return self.source.names()

    def _rule(self, name: str) -> tuple[str, range | None]:
        """(kind, range): rows / cols / vocab / bias0 / whole."""
        s = self.shard
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return "rows", s.q_rows
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return "rows", s.kv_rows
        if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
            return "rows", s.ffn_rows
        if name.endswith("o_proj.weight"):
            return "cols", s.q_rows
        if name.endswith("down_proj.weight"):
            return "cols", s.ffn_rows
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            return "bias0", None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return "vocab", s.vocab_rows
        return "whole", None

    def shape(self, name: str) -> tuple[int, ...]:
        full = self.source.shape(name)
        kind, r = self._rule(name)
        if kind == "rows":
            return (len(r), *full[1:])
        if kind == "cols":
            return (full[0], len(r))
        if kind == "vocab":
            return (self.shard.vocab_per_rank, *full[1:])
        return full

    def row_bytes(self, name: str) -> int:
        return self.source.row_bytes(name)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        kind, r = self._rule(name)
        n = self.shape(name)[0] if self.shape(name) else 0
        stop = n if stop is None else stop
        if kind == "rows":
            if len(self.source.shape(name)) < 2:
                return self.source.read(name)[r.start + start:r.start + stop]
            return self.source.read(name, r.start + start, r.start + stop)
        if kind == "cols":
            return self.source.read(name, start, stop)[:, r.start:r.stop].contiguous()
        if kind == "bias0":
            b = self.source.read(name)
            return b if self.shard.rank == 0 else torch.zeros_like(b)
        if kind == "vocab":
            lo, hi = r.start + start, min(r.stop, r.start + stop)
            have = self.source.read(name, lo, hi) if hi > lo else None
            want = stop - start
            if have is not None and have.shape[0] == want:
                return have
            pad = torch.zeros(want - (0 if have is None else have.shape[0]), *self.source.shape(name)[1:],
                              dtype=torch.float32 if have is None else have.dtype)
            return pad if have is None else torch.cat([have, pad])
        return self.source.read(name, start, stop)

    def chunks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        kind, _ = self._rule(name)
        if kind == "whole":
            yield from self.source.chunks(name)  # a GGUF source un-permutes q/k whole: those are "rows", read whole
        elif kind == "rows" and name.endswith(("q_proj.weight", "k_proj.weight")):
            yield 0, self.read(name)
        else:
            yield from super().chunks(name)


class Collectives:
    """The model's side of tensor parallelism: the all-reduces after row-parallel layers and the embedding, the
    all-gather of the vocabulary-parallel logits."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        _checked(dist.all_reduce, x)
        return x

    def embed(self, weight_rows, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the vocabulary-parallel embedding: each rank looks up the ids in its range, the rest zero."""
        r = self.shard.vocab_rows
        local = ids - r.start
        mine = (local >= 0) & (local < len(r))
        x = weight_rows(local.clamp(0, max(0, len(r) - 1)))
        return self.all_reduce((x * mine[:, None].to(x.dtype)).contiguous())

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[T, vocab_per_rank] on each rank -> [T, vocab] (the padding past the vocabulary cut)."""
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        _checked(dist.all_gather, parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, :self.shard.vocab]


def head_share(shard: Shard):
    """The HeadShare (compress/policy.py) of rank `shard.rank`: which KV heads it holds, how many of each one's
    query heads, and the all-reduce that sums a score across ranks."""
    from kvcache.compress.policy import HeadShare
    kv = shard.kv_rows
    local = len(kv) // shard.head_dim
    q_local = shard.heads // shard.size // local
    return HeadShare(shard.kv_heads, shard.heads, kv.start // shard.head_dim, q_local,
                     lambda x: _checked(dist.all_reduce, x) or x)


def _checked(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as e:  # gloo/NCCL: a peer gone (connection closed) or the timeout
        raise RankDiedError(f"a tensor-parallel collective failed: {e}") from e


def parallelize(model, shard: Shard) -> None:
    """Make a model built from a ShardedSource run its rank's part: collectives after the row-parallel layers and
    around the vocabulary, and no fused C++ layer calls (they run o_proj and the MLP in one call, with no point to
    reduce between)."""
    comm = Collectives(shard)
    model.tp = comm
    model.decode_stack = None  # the native decode loop (llama.py) is the fused calls too
    for layer in model.layers:
        layer.tp = comm
        layer.fused = None


# ---- processes -----------------------------------------------------------------------------------------------


def _threads_per_rank(size: int) -> int:
    return max(1, usable_cores() // size)


def _init(rank: int, size: int, init_method: str, device_type: str) -> None:
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def build_shard(loaded, rank: int, size: int, max_model_len: int, device, dtype, quantization: str):
    """Rank `rank`'s model: built from its slice of the checkpoint, its collectives attached."""
    from kvcache.models.loader import LoadedModel, build_model
    shard = shard_of(loaded.config, rank, size)
    local = LoadedModel(sharded_config(loaded.config, shard), loaded.tokenizer,
                        ShardedSource(loaded.weights, shard), loaded.source)
    model = build_model(local, max_model_len, device, dtype, quantization)
    parallelize(model, shard)
    model.shard_config, model.config = model.config, loaded.config  # the engine reads the whole model's sizes
    return model


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its part (sent at spawn)."""

    model: str
    max_model_len: int
    device_type: str
    dtype: str
    quantization: str

    @classmethod
    def of(cls, model: str, max_model_len: int, device: torch.device, dtype: torch.dtype,
           quantization: str) -> WorkerSpec:
        return cls(model, max_model_len, device.type, str(dtype).removeprefix("torch."), quantization)


def worker_main(rank: int, size: int, init_method: str, spec: WorkerSpec) -> None:
    """A worker rank: build its model slice, then its store from rank 0's description, then one forward per message
    until told to stop (None). Any error ends the process: rank 0's next collective sees it."""
    from kvcache.attention.backend import with_backend_write
    from kvcache.engine.eviction import Evictor, WorkerEvictor
    from kvcache.engine.model_runner import ModelRunner
    from kvcache.models.loader import read_checkpoint
    from kvcache.store.quantized_store import make_store
    torch.set_num_threads(_threads_per_rank(size))
    local = int(os.environ.get("LOCAL_RANK", rank))  # the GPU of this rank on its node
    device = torch.device(f"cuda:{local}") if spec.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init(rank, size, init_method, spec.device_type)
    model = build_shard(read_checkpoint(spec.model), rank, size, spec.max_model_len, device, getattr(torch, spec.dtype),
                        spec.quantization)
    store_args, backend, layer_group, windows = _receive()
    store = with_backend_write(make_store(device=device, **store_args), backend)
    runner = ModelRunner(model, store, None, device, backend, layer_group, windows)
    evictor = WorkerEvictor(Evictor(store, None, len(model.layers), model.kv_layout[0], model.layers[0].scale, device,
                                    layer_group, head_share(model.tp.shard)))
    with torch.inference_mode():
        while (msg := _receive()) is not None:
            ops, specs, logit_rows, evicting, group_tables = msg
            _apply(store, ops)
            runner.forward(specs, logit_rows, group_tables)
            if evicting:  # rank 0's eviction plans for this step, applied to this rank's heads
                ops, works, live = _receive()
                _apply(store, ops)
                evictor.run(works, live, runner.captured)
    dist.destroy_process_group()


def _apply(store, ops: list[tuple[str, tuple]]) -> None:
    """Rank 0's store operations (MirroredStore's), in order, on this worker's store."""
    for name, args in ops:
        getattr(store, name)(*args)


def launched_rank(size: int) -> int | None:
    """This process's rank where a launcher started every rank (torchrun: RANK and WORLD_SIZE in the environment),
    else None (the engine starts its workers itself). ValueError if the launcher's world is not `size`."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size {size} but the launcher started {world} processes (WORLD_SIZE): "
                         "start as many processes as ranks")
    return int(os.environ["RANK"])


def serve_as_launched_worker(model_path: str, size: int, max_model_len: int, device: torch.device,
                             dtype: torch.dtype, quantization: str) -> None:
    """Under torchrun, a process of rank > 0 does not run the command it was started with: it serves as a worker
    until rank 0 stops the group, then exits (SystemExit 0)."""
    rank = launched_rank(size)
    if not rank:
        return
    worker_main(rank, size, "env://", WorkerSpec.of(model_path, max_model_len, device, dtype, quantization))
    raise SystemExit(0)


def _receive():
    box = [None]
    _checked(dist.broadcast_object_list, box, 0)
    return box[0]


class TensorParallel:
    """Rank 0's handle on the group: starts the workers, sends each step, checks they live, stops them.

    Workers are fresh interpreters (`python -m kvcache.distributed.tensor_parallel`), not multiprocessing children:
    a spawned child would re-run the caller's main script (a script without an `if __name__ == "__main__"` guard
    would start engines recursively), and a forked one would inherit this process's OpenMP and CUDA state. Each
    worker's output goes to a log file named at start-up; the last lines of a worker that died are in the error."""

    _open: list[TensorParallel] = []  # groups not closed yet (at most one: torch.distributed has one default group);
    # held here so that one dropped without close() is still closed at exit, its workers told to stop

    def __init__(self, model_path: str, size: int, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 quantization: str) -> None:
        if TensorParallel._open:
            raise ValueError("a tensor-parallel engine is already running in this process (close it first, "
                             "LLM.engine.close(): torch.distributed has one process group per process)")
        self.size, self.device, self.threads = size, device, _threads_per_rank(size)
        self.closed = False
        self.pending: list[tuple[str, tuple]] = []  # store operations the workers have yet to apply
        self.procs, self.logs = [], []
        self.log_dir: str | None = None  # the workers' logs; removed at a clean close, kept where a rank failed
        if launched_rank(size) == 0:  # torchrun started every rank (on this node or others): join them
            self._join("env://")
            TensorParallel._open.append(self)
            log.info("tensor parallelism: %d ranks (%s) started by the launcher (MASTER_ADDR %s)", size,
                     "NCCL" if device.type == "cuda" else "gloo", os.environ.get("MASTER_ADDR", "?"))
            return
        init_method = f"tcp://127.0.0.1:{free_port()}"
        spec = WorkerSpec.of(model_path, max_model_len, device, dtype, quantization)
        self.log_dir = tempfile.mkdtemp(prefix="kvcache-tp-")
        self.logs = [os.path.join(self.log_dir, f"rank{r}.log") for r in range(1, size)]
        for r, path in enumerate(self.logs, 1):
            with open(path, "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvcache.distributed.tensor_parallel", str(r), str(size), init_method,
                     json.dumps(dataclasses.asdict(spec))], stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        torch.set_num_threads(self.threads)
        self._join(init_method)
        TensorParallel._open.append(self)
        log.info("tensor parallelism: %d ranks (%s), %d threads each; ranks 1-%d are processes %s (logs in %s)",
                 size, "NCCL" if device.type == "cuda" else "gloo", self.threads, size - 1,
                 ", ".join(str(p.pid) for p in self.procs), self.log_dir)

    def _join(self, init_method: str) -> None:
        """Rank 0's rendezvous, watching the workers: one that exits first fails start-up with its log's end."""
        box: list[BaseException | None] = []

        def init() -> None:
            try:
                _init(0, self.size, init_method, self.device.type)
                box.append(None)
            except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
                box.append(e)
        t = threading.Thread(target=init, name="kvcache-tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.2)
            try:
                self.check_alive()
            except RankDiedError:
                self._kill()
                raise
        if box[0] is not None:
            self._kill()
            raise RankDiedError(f"tensor-parallel start-up failed: {box[0]}") from box[0]

    def send_store(self, store_args: dict, backend: str, layer_group: list[int] | None,
                   windows: list[int | None] | None) -> None:
        """Tell the workers how to build their stores (rank 0 sized the pool) and, with per-layer-group tables,
        each layer's group and each group's window."""
        self._send((store_args, backend, layer_group, windows))

    def send_step(self, specs, logit_rows, evicting: bool = False, group_tables=None) -> None:
        """Broadcast one forward (and the store operations queued before it); `evicting`: eviction's plans follow
        it (send_eviction), once the forward has run; `group_tables`: each layer group's tables of the chunks."""
        self._send((self.pending, specs, logit_rows, evicting, group_tables))
        self.pending = []

    def send_eviction(self, works, live: list[int]) -> None:
        """Broadcast a step's eviction plans (engine/eviction.py's EvictionWork), the sequences whose eviction
        states the workers keep, and the store operations queued since the forward (a request failed in between
        scrubbed its blocks, which a compaction of this step may take as fresh ones: zeroed first, as on rank 0)."""
        self._send((self.pending, works, live))
        self.pending = []

    def queue(self, name: str, *args) -> None:
        self.pending.append((name, args))

    def check_alive(self) -> None:
        for r, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                raise RankDiedError(f"tensor-parallel rank {r} (process {p.pid}) exited with code {p.returncode}; "
                                    f"the end of its log ({self.logs[r - 1]}):\n{_tail(self.logs[r - 1])}")

    def _send(self, msg) -> None:
        if self.closed:
            raise RankDiedError("the tensor-parallel group is closed")
        self.check_alive()
        try:
            _checked(dist.broadcast_object_list, [msg], 0)
        except RankDiedError:
            self.name_the_dead()
            raise

    def name_the_dead(self, wait_s: float = 2.0) -> None:
        """After a failed collective: RankDiedError naming the worker that exited (waiting a little for its exit to
        be seen), if one did."""
        end = time.monotonic() + wait_s
        while time.monotonic() < end and all(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        self.check_alive()

    def close(self) -> None:
        """Stop the workers (a None message), wait for them, and leave the process group."""
        if self.closed:
            return
        self.closed = True
        if self in TensorParallel._open:
            TensorParallel._open.remove(self)
        try:
            if all(p.poll() is None for p in self.procs):
                _checked(dist.broadcast_object_list, [None], 0)
        except RankDiedError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        self._remove_logs()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _remove_logs(self) -> None:
        """Delete the workers' log folder once every worker exited with 0; a failed one's log (named in its error)
        stays, and its place is logged."""
        if self.log_dir is None:
            return
        if all(p.returncode == 0 for p in self.procs):
            shutil.rmtree(self.log_dir, ignore_errors=True)
        else:
            log.warning("tensor-parallel workers' logs kept in %s (exit codes %s)", self.log_dir,
                        [p.returncode for p in self.procs])

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


@atexit.register
def _close_at_exit() -> None:
    for tp in list(TensorParallel._open):
        tp.close()


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip() or "(empty)"
    except OSError as e:
        return f"(unreadable: {e})"


class MirroredStore:
    """Rank 0's store as the engine sees it under tensor parallelism: the operations that change blocks outside a
    forward (copy-on-write for forks, scrubbing) are applied here and queued for every worker's store."""

    MIRRORED = ("copy_blocks", "zero_blocks")

    def __init__(self, store, tp: TensorParallel) -> None:
        self._store, self._tp = store, tp

    def __getattr__(self, name: str):
        attr = getattr(self._store, name)
        if name in self.MIRRORED:
            def mirrored(*args):
                out = attr(*args)
                self._tp.queue(name, *args)
                return out
            return mirrored
        return attr


if __name__ == "__main__":  # a worker rank: python -m kvcache.distributed.tensor_parallel RANK SIZE INIT SPEC_JSON
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], WorkerSpec(**json.loads(sys.argv[4])))
    # out without the interpreter's teardown: a C++ thread of the process group's (gloo) still joinable when static
    # destructors ran aborted the exit now and then ("terminate called without an active exception", code -6)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
