"""Tensor parallelism's processes over torch.distributed: rank 0 is the engine, ranks 1..N-1 workers.

Rank 0 holds the scheduler, block tables, prefix cache and sampling. Ranks 1..N-1 are worker processes (fresh
interpreters the engine starts, running engine/tp_worker.py) that own their model slice (sharding.py) and store and
loop on one message per step, broadcast by rank 0 (`broadcast_object_list`): the store operations queued since the
last step (a fork's block copies, scrubbed blocks), then the step's chunks (token ids, positions, block tables: what
build_batch needs), from which every rank builds the same batch and runs the same forward; no per-layer Python
round-trips. A step with evicting sequences is followed by a second message, their plans (engine/eviction.py): each
rank scores and compacts its own KV heads, scores that average over other ranks' query heads all-reduced.
Collectives run on gloo (CPU) or NCCL (CUDA), with a bounded timeout (KVCACHE_TP_TIMEOUT seconds, default 120): a
rank that dies makes the next step raise EngineDeadError instead of hanging, and a forward that fails midway on
rank 0 does too (the ranks' collectives would be out of step).
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from kvcache.parallel.errors import RankDiedError, checked
from kvcache.parallel.host import free_port, usable_cores

log = logging.getLogger("kvcache")
WORKER_MODULE = "kvcache.engine.tp_worker"  # what a worker process runs (python -m)
TIMEOUT_S = float(os.environ.get("KVCACHE_TP_TIMEOUT", "120"))  # a collective's bound, seconds


def threads_per_rank(size: int) -> int:
    """The cores each of `size` ranks on this machine takes."""
    return max(1, usable_cores() // size)


def init_group(rank: int, size: int, init_method: str, device_type: str) -> None:
    """Join the default process group as `rank` of `size` (gloo on CPU, NCCL on CUDA), with the bounded timeout."""
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=TIMEOUT_S))


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


def receive():
    """The next object rank 0 broadcasts (a worker's side of TensorParallel._send)."""
    box = [None]
    checked(dist.broadcast_object_list, box, 0)
    return box[0]


class TensorParallel:
    """Rank 0's handle on the group: starts the workers, sends each step, checks they live, stops them.

    Workers are fresh interpreters (`python -m kvcache.engine.tp_worker`), not multiprocessing children:
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
        self.size, self.device, self.threads = size, device, threads_per_rank(size)
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
                    [sys.executable, "-m", WORKER_MODULE, str(r), str(size), init_method,
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
                init_group(0, self.size, init_method, self.device.type)
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
            checked(dist.broadcast_object_list, [msg], 0)
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
                checked(dist.broadcast_object_list, [None], 0)
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
