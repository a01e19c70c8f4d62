"""`kvcache bench attention`: decode attention alone, B sequences x L context tokens with a model's head shape.

Decode is bound by memory bandwidth: every step reads each sequence's whole K/V. So each backend's time per
call is turned into the bytes of K/V (and scales) it must read per second, and that into a fraction of the
device's bandwidth measured in the same run (a large copy, before and after the kernels: the higher of the two, as
a machine's bandwidth moves between minutes and a fraction of a low reading read over 100%). The portable torch
path is the baseline the kernels are compared with, as a ratio.
"""
from __future__ import annotations

import argparse
import itertools
import random
import time
from typing import TYPE_CHECKING

from kvcache.bench.report import write_json

if TYPE_CHECKING:  # torch loads when the benchmark runs: `kvcache plan` and `simulate` stay torch-free
    import torch

DEFAULTS = {"cuda": (64, 4096), "cpu": (16, 1024)}  # (sequences, context) sized for each device's memory
# Each call reads another layer of KV, as a model's decode step does, through enough layers that together they hold
# this much: the KV a call reads comes from memory, not from a cache that still holds the last call's (one layer of
# the demo's heads, 64 x 316 tokens of float32, fits a 32 MB L3 and read 29.6 GB/s there against 20 from DRAM).
COLD_BYTES, MAX_LAYERS = 512 * 2**20, 64


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-8b", help="preset name, config.json or model directory: the head "
                   "shape (default Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128)")
    p.add_argument("--batch", type=int, default=None, help="sequences (default 64 on CUDA, 16 on CPU)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens of context each (default 4096 on CUDA, 1024 on CPU)")
    p.add_argument("--kv-cache-dtype", default=None, help="KV storage format, comma-separated for several "
                   "(default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per block (default 16; 64 where a format is int4/int2, as the engine picks)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run; auto: CUDA where torch sees a GPU, else the CPU (default: %(default)s)")
    p.add_argument("--backends", default=None,
                   help="attention backends to time, comma-separated (default: triton,torch on CUDA; cpu,torch on CPU)")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="timing budget per backend and format, in seconds (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the results here (default: not written)")


def _store(shape, kv: str, compute: torch.dtype, batch: int, context: int, block_size: int, device, seed: int,
           layers: int = 1):
    """A store of `layers` layers, each holding `batch` sequences of `context` random tokens in shuffled blocks (the
    same in every layer); their tables. A KIVI store (int4, int2) is written as the engine writes a prompt: its keys
    quantized per channel over each complete group of tokens, so `context` must be a multiple of the group (no key
    waits in full precision)."""
    import torch

    from kvcache.attention.metadata import KiviLayout, SeqChunk, build_batch
    from kvcache.store.quantized_store import make_store
    per_seq = -(-context // block_size)
    store = make_store(layers, 1 + batch * per_seq, block_size, shape.num_kv_heads, shape.head_dim, kv, compute,
                       device)
    group = getattr(store, "kivi_group", 0)
    kivi = KiviLayout(group, shape.num_kv_heads * shape.head_dim, store.row_elems) if group else None
    order = list(range(1, 1 + batch * per_seq))
    random.Random(seed).shuffle(order)
    tables = torch.tensor(order, device=device).view(batch, per_seq)
    g = torch.Generator(device).manual_seed(seed)
    for b in range(batch):
        slots = (tables[b, :, None] * block_size + torch.arange(block_size, device=device)).flatten()[:context]
        k, v = (torch.randn(context, shape.num_kv_heads, shape.head_dim, generator=g, device=device, dtype=compute)
                for _ in range(2))
        plan = build_batch([SeqChunk([0] * context, 0, tables[b].tolist())], block_size, kivi=kivi).kivi \
            if kivi else None
        for layer in range(layers):
            store.write(layer, slots, k, v, plan)
    return store, tables


def _time(fn, seconds: float, device: torch.device) -> float:
    """Best seconds per call of fn() over about `seconds` (at least 3 calls after one warm-up)."""
    import torch
    fn()
    best, calls, end = float("inf"), 0, time.perf_counter() + seconds
    while calls < 3 or time.perf_counter() < end:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best, calls = min(best, time.perf_counter() - t), calls + 1
    return best


def _decode_call(backend: str, store, layers: int, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 scale: float):
    """One decode-attention call of `backend` over the whole batch, as the engine makes it per layer: each call on
    the next of the store's `layers` layers."""
    turn = itertools.cycle(range(layers))
    call = _layer_call(backend, store, q, tables, lens, scale)
    return lambda: call(next(turn))


def _layer_call(backend: str, store, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float):
    """f(layer): `backend`'s decode attention over the batch at that layer."""
    import torch

    from kvcache.attention import cpu_kernel
    from kvcache.attention.metadata import SeqChunk, build_batch
    from kvcache.attention.paged import Workspace, paged_attention
    out = torch.empty_like(q)
    if backend == "triton":
        from kvcache.attention import triton_attention
        return lambda i: triton_attention.paged_decode(out, q, store, i, tables, lens, scale, None)
    if backend == "cpu":
        if not hasattr(store, "raw"):  # float32, float16 or bfloat16 blocks
            return lambda i: cpu_kernel.paged_decode(out, q, store.k[i], store.v[i], tables, lens, scale, None)
        # KIVI: every key is in a complete group (_store), so no position reads a full-precision key
        full = (torch.zeros(1, store.num_kv_heads, q.shape[2]), torch.zeros(q.shape[0], 1, dtype=torch.long), lens) \
            if store.kivi_group else None
        return lambda i: cpu_kernel.paged_decode_quant(out, q, store, i, tables, lens, scale, None, full)
    n = int(lens[0])
    chunks = [SeqChunk([0], n - 1, tables[b].tolist()) for b in range(q.shape[0])]
    batch = build_batch(chunks, store.block_size, (None,), q.device, read_cache=not store.exact)
    ws = Workspace()
    new_kv = torch.zeros(q.shape[0], store.num_kv_heads if hasattr(store, "num_kv_heads") else store.k[0].shape[2],
                         q.shape[2], dtype=q.dtype, device=q.device)  # this step's K/V: already in the store
    return lambda i: paged_attention(q, new_kv, new_kv, store, i, batch, scale, None, ws)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.attention.backend import resolve_backend
    from kvcache.bench.roofline import measure_bandwidth_gbs
    from kvcache.plan.kv_bytes import default_block_size, kv_dtype, layer_bytes_per_token
    from kvcache.plan.model_source import load_model_shape
    shape = load_model_shape(args.model)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    batch, context = args.batch or DEFAULTS[device.type][0], args.context or DEFAULTS[device.type][1]
    if batch < 1 or context < 1:
        raise ValueError(f"--batch and --context must be positive, got {batch} and {context}")
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    formats = (args.kv_cache_dtype or str(compute).removeprefix("torch.")).split(",")
    block_size = args.block_size or max(map(default_block_size, formats))  # one for all rows
    for spec in map(kv_dtype, formats):  # before anything is measured
        if spec.scales == "kivi" and context % spec.group:
            raise ValueError(f"--context {context}: {spec.name} quantizes keys in groups of {spec.group} tokens; give "
                             f"a multiple of {spec.group} (e.g. {context + spec.group - context % spec.group})")
    backends = (args.backends or ("triton,torch" if device.type == "cuda" else "cpu,torch")).split(",")
    bandwidth = measure_bandwidth_gbs(device=device)
    H, D = shape.num_attention_heads, shape.head_dim
    rows = []
    for kv in formats:
        kv = kv_dtype(kv).name
        nbytes = batch * context * layer_bytes_per_token(shape, kv, "full")
        layers = min(MAX_LAYERS, -(-COLD_BYTES // nbytes))
        store, tables = _store(shape, kv, compute, batch, context, block_size, device, seed=0, layers=layers)
        q = torch.randn(batch, H, D, device=device, dtype=compute)
        lens = torch.full((batch,), context, device=device)
        times = {}
        for backend in backends:
            resolve_backend(backend, device, compute, kv, block_size)  # refuses what cannot run here
            times[backend] = _time(_decode_call(backend, store, layers, q, tables, lens, D ** -0.5), args.seconds,
                                   device)
        base = times.get("torch")
        for backend, t in times.items():
            gbs = nbytes / t / 1e9
            rows.append({"kv_cache_dtype": kv, "backend": backend, "layers": layers, "time_ms": t * 1e3,
                         "gbytes_read": nbytes / 1e9,
                         "achieved_gbs": gbs,
                         "speedup_vs_torch": base / t if base else None})
        del store
    bandwidths = [bandwidth, measure_bandwidth_gbs(device=device)]
    bandwidth = max(bandwidths)
    for r in rows:
        r["bandwidth_fraction"] = r["achieved_gbs"] / bandwidth
    result = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "model": shape.name, "heads": H, "kv_heads": shape.num_kv_heads, "head_dim": D,
              "batch": batch, "context": context, "block_size": block_size,
              "compute_dtype": str(compute).removeprefix("torch."), "bandwidth_gbs": bandwidth,
              "bandwidth_gbs_before_after": bandwidths, "results": rows}
    _print(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _print(r: dict) -> None:
    print(f"\ndecode attention: {r['batch']} sequences x {r['context']:,} tokens, {r['heads']} heads / {r['kv_heads']} KV "
          f"heads x {r['head_dim']} ({r['model']}), block {r['block_size']}, {r['compute_dtype']} compute on "
          f"{r['device']}; measured bandwidth {r['bandwidth_gbs']:.1f} GB/s (the higher of "
          f"{' and '.join(f'{b:.1f}' for b in r['bandwidth_gbs_before_after'])}, before and after)")
    head = f"{'KV format':<11}{'backend':<9}{'ms/call':>9}{'GB read':>9}{'GB/s':>9}{'of bandwidth':>14}{'vs torch':>10}"
    print(head)
    print("-" * len(head))
    for x in r["results"]:
        ratio = f"{x['speedup_vs_torch']:.2f}x" if x["speedup_vs_torch"] else "-"
        print(f"{x['kv_cache_dtype']:<11}{x['backend']:<9}{x['time_ms']:>9.3f}{x['gbytes_read']:>9.3f}"
              f"{x['achieved_gbs']:>9.1f}{x['bandwidth_fraction']:>13.0%}{ratio:>10}")
