"""What the machine could do at best: measured fp32 GEMM rate and the workload's FLOPs."""
from __future__ import annotations

import time

import torch

from kvcache.bench.workload import Workload


def measure_gemm_gflops(m: int = 512, k: int = 1536, n: int = 1536, seconds: float = 1.0,
                        dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    """Best fp32 matmul rate (GFLOP/s) over `seconds` of repeated [m,k] x [k,n] products."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b, out=out)
        if device != "cpu":
            torch.cuda.synchronize()
        best = max(best, 4 * 2 * m * k * n / (time.perf_counter() - t))
    return best / 1e9


def workload_flops(cfg, work: Workload) -> float:
    """FLOPs the workload needs at minimum: every token through every layer once, attention over its
    context, and the LM head only for tokens that are sampled."""
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    h, kvh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    linear = d * (h + 2 * kvh) * hd + h * hd * d + 3 * d * inter  # weights touched per token per layer
    total = 0.0
    for prompt, out in zip(work.prompts, work.output_lens):
        tokens = len(prompt) + out - 1  # the last sampled token is never fed back
        ctx_sum = tokens * (tokens + 1) / 2  # each token attends to all before it and itself
        total += layers * (2 * linear * tokens + 4 * h * hd * ctx_sum)
        total += out * 2 * d * cfg.vocab_size
    return total
