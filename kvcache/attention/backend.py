"""Which attention implementation runs, chosen once at start-up (`--attention-backend`); the model never asks.

- `torch`: the portable path (decode rows gathered into padded groups, SDPA with masks). Runs anywhere.
- `cpu`: the C++ decode kernel walking block tables (cpu_kernel.py): CPU, float32 compute, a float32, float16,
  bfloat16 or quantized store; prefill stays on SDPA (or, for soft-capped scores, computes them out).
- `triton`: the Triton kernels (triton_attention.py): CUDA, full-precision or fp8/int8 stores, block size >= 16
  (tl.dot's smallest tile); decode, prefill over a cached prefix and the quantizing KV write.
- `auto`: triton on CUDA, cpu on the CPU, where they can run; else torch (the start-up log says which and why).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from kvcache import native
from kvcache.plan.kv_bytes import KVDtype, kv_dtype

BACKENDS = ("auto", "triton", "torch", "cpu")


def _why_not_triton(device: torch.device, kv: KVDtype, block_size: int) -> str | None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter: tests on CPU tensors
        return "it runs on CUDA devices only (use --attention-backend cpu or torch here)"
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton, or use --attention-backend torch)"
    if kv.scales == "kivi":
        return f"it does not read {kv.name} (KIVI) blocks (use an fp8 or int8 cache, or --attention-backend torch)"
    if block_size < 16:
        return f"its prefill tiles need --block-size 16 or more, got {block_size} (or use --attention-backend torch)"
    return None


def _why_not_cpu(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return "it runs on the CPU only (use --attention-backend triton or torch on CUDA)"
    if dtype != torch.float32:
        return f"it computes in float32 only, not {str(dtype).removeprefix('torch.')} (use --attention-backend torch)"
    try:
        native.require()
    except native.KernelsUnavailable as e:
        return f"{e} (or use --attention-backend torch)"
    return None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str,
                    block_size: int) -> tuple[str, str]:
    """(backend, why) for `name` on this device, compute dtype, KV format and block size; ValueError naming what to
    use instead if a backend asked for by name cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    kv = kv_dtype(kv_cache_dtype)
    checks = {"triton": lambda: _why_not_triton(device, kv, block_size),
              "cpu": lambda: _why_not_cpu(device, dtype), "torch": lambda: None}
    if name != "auto":
        why = checks[name]()
        if why:
            raise ValueError(f"attention_backend {name} cannot run here: {why}")
        return name, "asked for"
    preferred = "triton" if device.type == "cuda" else "cpu"
    why = checks[preferred]()
    return ("torch", f"auto: not {preferred}, as {why}") if why else (preferred, f"auto on {device.type}")


def with_backend_write(store, backend: str):
    """`store` writing its K/V the backend's way: on triton a per-token fp8/int8 store quantizes and scatters in one
    kernel (triton_attention.write_quantized); otherwise as it is."""
    if backend == "triton" and hasattr(store, "raw"):
        from kvcache.attention.triton_attention import write_quantized
        store.fused_write = write_quantized
    return store
