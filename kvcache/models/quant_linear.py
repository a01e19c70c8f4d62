"""Quantized linear layers for CPU decode: weight-only int8 (`--quantization int8`) and 4-bit weights with int8
activations (`--quantization int4`).

Decode on a CPU is bound by reading the weights: every step reads all of them for a handful of rows. Stored as int8
with one float32 scale per output channel (symmetric, amax / 127, as vLLM's and llm.int8's per-channel weight
quantization), they are a quarter of float32's bytes, and a C++ kernel (cpu_kernels.py, compiled on first use)
multiplies them straight from int8: each weight row is loaded once, widened to float32 in
registers and used for up to 8 activation rows. Measured here on a 576 x 3,072 layer streaming from memory:
0.065 ms per row against float32's 0.38 (1 row), 0.25 against 1.0 (8 rows); past about 32 rows float32's GEMM
is faster, so larger batches (prefill) dequantize the weight and use it.

Activations stay in the compute dtype (float32 by default): only the weights are rounded, once, as they load.

int4 is GGUF's Q4_1 (what llama.cpp runs the demo model in): groups of 32 weights along the input, each with a
float16 scale d and minimum m, codes 0..15 (w = d * code + m). Re-quantizing a Q4_1 checkpoint's dequantized weights
gives back its own codes, so on such a checkpoint int4 costs nothing beyond the activations' rounding. Activations
are quantized on the fly to int8 per group of 32 (Q8_1) and the kernel multiplies codes by them with AVX512-VNNI's
u8 x s8 dot product: a weight costs 0.625 bytes (float32: 4), and a row's products are integer sums.
"""
from __future__ import annotations

import torch
from torch import nn

from kvcache.models import cpu_kernels

KERNEL_MAX_ROWS = 32  # up to this many rows the int8 kernel beats dequantizing + float32 GEMM on this CPU


def _kernel(x: torch.Tensor, fmt: str):
    """The compiled kernels if they serve this call (a CPU batch of at most KERNEL_MAX_ROWS rows; int4 needs VNNI),
    else None. Decode calls this ~120 times a step: it is kept to a few attribute reads."""
    if x.shape[0] > KERNEL_MAX_ROWS or not x.is_cpu:
        return None
    k = cpu_kernels.load()
    return k if k is not None and (fmt == "int8" or cpu_kernels.has_int4()) else None


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


DEQUANT_BLOCK_ELEMS = 1 << 22  # weights dequantized at a time by the float fallback (16 MiB of float32)


def _blocked_matmul(x: torch.Tensor, weight: torch.Tensor, dequantize) -> torch.Tensor:
    """x [M, K] float32 times the dequantized weight [N, K]^T, a block of output rows at a time: the float copy a
    large layer (an LM head) needs is bounded by DEQUANT_BLOCK_ELEMS, not the whole matrix."""
    n, k = weight.shape[0], x.shape[1]
    step = max(1, DEQUANT_BLOCK_ELEMS // k)
    if step >= n:
        return x @ dequantize(weight, slice(None)).t()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for s in range(0, n, step):
        rows = slice(s, min(n, s + step))
        torch.matmul(x, dequantize(weight[rows], rows).t(), out=out[:, rows])
    return out


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes and float32 scales of weight rows [n, K] (one per output channel: amax / 127, at least float32's
    smallest normal so that an all-zero row stays 0), rounding half to even."""
    r = rows.float()
    scale = (r.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (r / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


class Int8Dense(nn.Module):
    """y = x W^T scale + b with W int8 [out, in] and float32 scale [out]: a weight-only quantized Dense."""

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(n_out, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _kernel(x, "int8")
        if kernel is not None:
            out = torch.empty(x.shape[0], self.out_features)
            kernel.int8_linear(out, _as_f32(x), self.weight, self.scale)
        else:
            out = _blocked_matmul(x.float(), self.weight, lambda w, rows: w.float() * self.scale[rows, None])
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def load_rows(self, start: int, rows: torch.Tensor) -> None:
        """Quantize Hugging Face weight rows [n, in] (output channels start .. start + n) into place."""
        codes, scale = quantize_rows(rows)
        self.weight[start:start + rows.shape[0]].copy_(codes)
        self.scale[start:start + rows.shape[0]].copy_(scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows `ids` [len(ids), in] in float32 (a tied embedding's lookups)."""
        return self.weight.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for."""
        return self.weight.float() * self.scale[:, None]


GROUP = 32  # int4 weights per (scale, minimum) pair along the input dimension, as GGUF's Q4_0/Q4_1
INT4_UNIT = 64  # the kernel's packing unit: 32 bytes holding two groups (input sizes must be multiples of it)


def quantize_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes [n, K] (uint8 0..15), scales and minima [n, K/32] (float16) of weight rows [n, K]:
    per group m = min, d = (max - min) / 15, code = round((w - m) / d) with the float16-rounded d and m (so that
    dequantizing gives the nearest grid point of what is stored). A constant group has d = 0 and codes 0."""
    n, k = rows.shape
    g = rows.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d, m = ((hi - lo) / 15).half(), lo.half()
    df = d.float()[..., None]
    codes = torch.where(df > 0, (g - m.float()[..., None]) / torch.where(df > 0, df, 1), 0)
    return codes.round_().clamp_(0, 15).to(torch.uint8).reshape(n, k), d, m


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, K] (K % 64 == 0) -> [n, K/2] bytes in the kernel's order: byte j of each 32-byte unit holds element j
    of its 64 in the low nibble and element j + 32 in the high one."""
    n, k = codes.shape
    u = codes.reshape(n, k // INT4_UNIT, 2, INT4_UNIT // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: codes [n, K]."""
    n, half = packed.shape
    u = packed.reshape(n, half // (INT4_UNIT // 2), 1, INT4_UNIT // 2)
    return torch.cat((u & 0x0F, u >> 4), dim=2).reshape(n, 2 * half)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel multiplies: x [M, K] as int8 codes per group of 32 (symmetric, amax / 127, half to even) and
    their scales [M, K/32] (the reference for tests and for CPUs without the kernel)."""
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0)
    q = (g * inv[..., None]).round_().clamp_(-127, 127)
    return q.reshape(m, k), amax / 127


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] in float32 as the int4 kernel sees it: rounded to int8 per group of 32 and scaled back."""
    q, scale = quantize_activations(x)
    m, k = x.shape
    return (q.reshape(m, k // GROUP, GROUP) * scale[..., None]).reshape(m, k)


class Int4Dense(nn.Module):
    """y = x W^T + b with W in 4-bit groups (Q4_1): qweight [out, in/2] uint8 (pack_int4's order), scale and minimum
    [out, in/32] float16. Needs in % 64 == 0 (refused at construction otherwise)."""

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        if n_in % INT4_UNIT:
            raise ValueError(f"int4 needs input sizes that are multiples of {INT4_UNIT}; this layer has {n_in}")
        self.in_features, self.out_features = n_in, n_out
        self.qweight = nn.Parameter(torch.empty(n_out, n_in // 2, dtype=torch.uint8), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(n_out, n_in // GROUP, dtype=torch.float16), requires_grad=False)
        self.minimum = nn.Parameter(torch.empty(n_out, n_in // GROUP, dtype=torch.float16), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for."""
        return self._dequantize(self.qweight, slice(None))

    def _dequantize(self, packed: torch.Tensor, rows: slice) -> torch.Tensor:
        n, k = packed.shape[0], self.in_features
        codes = unpack_int4(packed).float().reshape(n, k // GROUP, GROUP)
        return (codes * self.scale[rows].float()[..., None] + self.minimum[rows].float()[..., None]).reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _kernel(x, "int4")
        if kernel is not None:
            out = torch.empty(x.shape[0], self.out_features)
            kernel.int4_linear(out, _as_f32(x), self.qweight, self.scale, self.minimum)
        else:  # prefill-sized batches (and CPUs without VNNI): float32 GEMM on the dequantized weight, with the
            # activations rounded as the kernel rounds them, so that every batch size computes the same thing
            out = _blocked_matmul(fake_quantize_activations(x), self.qweight, lambda q, rows: self._dequantize(q, rows))
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def load_rows(self, start: int, rows: torch.Tensor) -> None:
        """Quantize Hugging Face weight rows [n, in] (output channels start .. start + n) into place."""
        codes, d, m = quantize_groups(rows)
        end = start + rows.shape[0]
        self.qweight[start:end].copy_(pack_int4(codes))
        self.scale[start:end].copy_(d)
        self.minimum[start:end].copy_(m)
