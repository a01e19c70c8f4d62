"""A tensor-parallel worker rank (ranks 1..N-1): its model slice, its store, one forward per message from rank 0.

Started by parallel/group.py's TensorParallel as `python -m kvcache.engine.tp_worker RANK SIZE INIT SPEC_JSON`, or
by a launcher (torchrun) that starts every rank with the engine's command: there a rank > 0 serves here instead.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist

from kvcache.attention.backend import with_backend_write
from kvcache.engine.eviction import Evictor, WorkerEvictor
from kvcache.engine.model_runner import ModelRunner
from kvcache.models.loader import read_checkpoint
from kvcache.parallel.group import WorkerSpec, init_group, launched_rank, receive, threads_per_rank
from kvcache.parallel.sharding import build_shard, head_share
from kvcache.store.quantized_store import make_store


def worker_main(rank: int, size: int, init_method: str, spec: WorkerSpec) -> None:
    """A worker rank: build its model slice, then its store from rank 0's description, then one forward per message
    until told to stop (None). Any error ends the process: rank 0's next collective sees it."""
    torch.set_num_threads(threads_per_rank(size))
    local = int(os.environ.get("LOCAL_RANK", rank))  # the GPU of this rank on its node
    device = torch.device(f"cuda:{local}") if spec.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(rank, size, init_method, spec.device_type)
    model = build_shard(read_checkpoint(spec.model), rank, size, spec.max_model_len, device, getattr(torch, spec.dtype),
                        spec.quantization)
    store_args, backend, layer_group, windows = receive()
    store = with_backend_write(make_store(device=device, **store_args), backend)
    runner = ModelRunner(model, store, None, device, backend, layer_group, windows)
    evictor = WorkerEvictor(Evictor(store, None, len(model.layers), model.kv_layout[0], model.attention_scale, device,
                                    layer_group, head_share(model.tp.shard)))
    with torch.inference_mode():
        while (msg := receive()) is not None:
            ops, specs, logit_rows, evicting, group_tables = msg
            _apply(store, ops)
            runner.forward(specs, logit_rows, group_tables)
            if evicting:  # rank 0's eviction plans for this step, applied to this rank's heads
                ops, works, live = receive()
                _apply(store, ops)
                evictor.run(works, live, runner.captured)
    dist.destroy_process_group()


def _apply(store, ops: list[tuple[str, tuple]]) -> None:
    """Rank 0's store operations (MirroredStore's), in order, on this worker's store."""
    for name, args in ops:
        getattr(store, name)(*args)


def serve_as_launched_worker(model_path: str, size: int, max_model_len: int, device: torch.device,
                             dtype: torch.dtype, quantization: str) -> None:
    """Under torchrun, a process of rank > 0 does not run the command it was started with: it serves as a worker
    until rank 0 stops the group, then exits (SystemExit 0)."""
    rank = launched_rank(size)
    if not rank:
        return
    worker_main(rank, size, "env://", WorkerSpec.of(model_path, max_model_len, device, dtype, quantization))
    raise SystemExit(0)


if __name__ == "__main__":  # a worker rank: python -m kvcache.engine.tp_worker RANK SIZE INIT SPEC_JSON
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], WorkerSpec(**json.loads(sys.argv[4])))
    # out without the interpreter's teardown: a C++ thread of the process group's (gloo) still joinable when static
    # destructors ran aborted the exit now and then ("terminate called without an active exception", code -6)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
