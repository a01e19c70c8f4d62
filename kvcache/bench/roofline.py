"""What the device could do at best, measured on it in the benchmark's dtype: its GEMM rate (for the compute a
workload needs) and its memory bandwidth (for the bytes it must read: the weights once per decode step and
every sequence's KV at every step). The slower of the two bounds is the roofline."""
from __future__ import annotations

import time

import torch

from kvcache.bench.workload import Workload


def _best_rate(op, work: float, seconds: float, device: torch.device) -> float:
    """Best `work` per second of `op()` over `seconds` of repeats (4 per timing; 1 where one call takes over 50 ms,
    at least one timing). A first call that takes `seconds` or more is the timing: a bfloat16 GEMM on a CPU without
    native bfloat16 runs at under 1 GFLOP/s, 3 s a call, and timing it again doubled the benchmark's start-up."""
    t = time.perf_counter()
    op()
    first = time.perf_counter() - t
    if first >= seconds and device.type != "cuda":
        return work / first
    reps = 4 if first < 0.05 else 1
    best, end = 0.0, time.perf_counter() + seconds
    while not best or time.perf_counter() < end:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(reps):
            op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, reps * work / (time.perf_counter() - t))
    return best


def measure_gemm_gflops(m: int | None = None, k: int | None = None, n: int | None = None, seconds: float = 1.0,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> float:
    """Best matmul rate (GFLOP/s) in `dtype` on `device` over `seconds` of repeated [m,k] x [k,n] products (default
    512 x 1536 x 1536 on a CPU, 8192 cubed on a GPU, where smaller products are bound by their launch); where the
    engine packs float32 weights (linear.py's Dense.pack), the best of torch.matmul, the engine's own linear layer (the C++
    kernels' panels) and oneDNN's linear on its packed layout."""
    device = torch.device(device)
    default = 8192 if device.type == "cuda" else None
    m, k, n = m or default or 512, k or default or 1536, n or default or 1536
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    best = _best_rate(lambda: torch.matmul(a, b, out=out), 2 * m * k * n, seconds, device)
    from kvcache.models.linear import Dense, pack_weight, packable, packed_linear
    if not packable(dtype, device):
        return best / 1e9
    dense = Dense(k, n, bias=False).to(dtype=dtype, device=device)
    with torch.no_grad():
        dense.weight.copy_(b)
    if dense.pack():  # faster than matmul here, so the bound is the best of them
        best = max(best, _best_rate(lambda: dense(a), 2 * m * k * n, seconds, device))
        if not dense.packed.is_mkldnn and torch.backends.mkldnn.is_available():
            packed = pack_weight(b.t().contiguous())
            best = max(best, _best_rate(lambda: packed_linear(a, packed), 2 * m * k * n, seconds, device))
    return best / 1e9


def measure_bandwidth_gbs(nbytes: int = 256 * 2**20, seconds: float = 0.5, device: str | torch.device = "cpu") -> float:
    """Best memory bandwidth (GB/s: bytes read plus bytes written) of copying `nbytes` on `device`."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2 * nbytes, seconds, device) / 1e9


def workload_bytes(work: Workload, weight_bytes: int, kv_bytes_per_token: int) -> float:
    """Bytes the workload must read at least: the weights once per decode step (the longest output takes that
    many steps, however well the others batch with it) and each sequence's KV cache at each of its steps."""
    kv = sum(out * len(prompt) + out * (out - 1) / 2 for prompt, out in zip(work.prompts, work.output_lens))
    return max(work.output_lens) * weight_bytes + kv * kv_bytes_per_token


def workload_flops(cfg, work: Workload) -> float:
    """FLOPs the workload needs at minimum: every token through every layer once, attention over its context, and
    the LM head only for tokens that are sampled; in the last layer a prompt token that samples nothing needs only
    its key and value (the engine skips the rest of that layer for it, as llama.cpp does)."""
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    h, kvh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    linear = d * (h + 2 * kvh) * hd + h * hd * d + 3 * d * inter  # weights touched per token per layer
    kv = d * 2 * kvh * hd  # the key and value projections' weights
    total = 0.0
    for prompt, out in zip(work.prompts, work.output_lens):
        tokens = len(prompt) + out - 1  # the last sampled token is never fed back
        ctx_sum = tokens * (tokens + 1) / 2  # each token attends to all before it and itself
        quiet = len(prompt) - 1  # prompt tokens before the last: nothing is sampled from them
        ctx_sampled = ctx_sum - quiet * (quiet + 1) / 2  # the sampled tokens' attention
        total += (layers - 1) * (2 * linear * tokens + 4 * h * hd * ctx_sum)
        total += 2 * linear * (tokens - quiet) + 2 * kv * quiet + 4 * h * hd * ctx_sampled  # the last layer
        total += out * 2 * d * cfg.vocab_size
    return total
