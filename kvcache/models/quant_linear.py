"""Quantized linear layers for CPU decode: weight-only int8 (`--quantization int8`) and 4-bit weights with int8
activations (`--quantization int4`).

Decode on a CPU is bound by reading the weights: every step reads all of them for a handful of rows. Stored as int8
with one float32 scale per output channel (symmetric, amax / 127, as vLLM's and llm.int8's per-channel weight
quantization), they are a quarter of float32's bytes, and a C++ kernel (csrc/linear/int8.cpp, built at install)
multiplies them straight from int8: each weight row is loaded once, widened to float32 in
registers and used for up to 8 activation rows. Up to KERNEL_MAX_ROWS rows that beat float32's GEMM on the machines
measured (docs/kernels.md); past it float32's GEMM is faster, so larger batches (prefill) dequantize the weight and
use it.

Activations stay in the compute dtype (float32 by default): only the weights are rounded, once, as they load.

int4 is GGUF's Q4_1 (what llama.cpp runs the demo model in): groups of 32 weights along the input, each with a
float16 scale d and minimum m, codes 0..15 (w = d * code + m). Re-quantizing a Q4_1 checkpoint's dequantized weights
gives back its own codes, so on such a checkpoint int4 costs nothing beyond the activations' rounding. Activations
are quantized on the fly to int8 per group of 32 (Q8_1) and the kernel multiplies codes by them with AVX512-VNNI's
u8 x s8 dot product (AVX2: vpmaddubsw + vpmaddwd, the same integer sums): a weight costs 0.625 bytes (float32: 4),
and a row's products are integer sums. The weights are stored for vertical dot products (16 output rows per
instruction, see pack_int4), so that one kernel serves every batch size, ahead of float32's product from one row to
prefill's hundreds on the machines measured (docs/kernels.md). Prefill and large decode batches run it too, and
compute what one row computes.
"""
from __future__ import annotations

import torch
from torch import nn

from kvcache.models import cpu_kernels

KERNEL_MAX_ROWS = 32  # up to this many rows the int8 kernel beat dequantizing + float32 GEMM (docs/kernels.md)


def _kernel(x: torch.Tensor):
    """The compiled kernels if int8_linear serves this call (a CPU batch of at most KERNEL_MAX_ROWS rows), else None.
    Decode calls this ~120 times a step: it is kept to a few attribute reads."""
    if x.shape[0] > KERNEL_MAX_ROWS or not x.is_cpu:
        return None
    return cpu_kernels.load()


def _as_f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()


DEQUANT_BLOCK_ELEMS = 1 << 22  # weights dequantized at a time by the float fallback (16 MiB of float32)


def _blocked_matmul(x: torch.Tensor, n: int, dequantize) -> torch.Tensor:
    """x [M, K] float32 times the dequantized weight [n, K]^T (`dequantize(rows)`: output rows `rows` in float32),
    a block of output rows at a time: the float copy a large layer (an LM head) needs is bounded by
    DEQUANT_BLOCK_ELEMS, not the whole matrix."""
    k = x.shape[1]
    step = max(1, DEQUANT_BLOCK_ELEMS // k)
    if step >= n:
        return x @ dequantize(slice(0, n)).t()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for s in range(0, n, step):
        rows = slice(s, min(n, s + step))
        torch.matmul(x, dequantize(rows).t(), out=out[:, rows])
    return out


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes and float32 scales of weight rows [n, K] (one per output channel: amax / 127, at least float32's
    smallest normal so that an all-zero row stays 0), rounding half to even."""
    r = rows.float()
    scale = (r.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (r / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


class Int8Dense(nn.Module):
    """y = x W^T scale + b with W int8 [out, in] and float32 scale [out]: a weight-only quantized Dense.

    Above KERNEL_MAX_ROWS rows it dequantizes and runs a float32 GEMM, which sums in another order: a row's result
    then depends on how many rows share the call. With `batch_invariant` (the LM head: its rows are the step's
    logits rows, a few per sequence) every row goes through the kernel, KERNEL_MAX_ROWS rows a call, so that a
    sequence's logits are the same whatever else is in the step (speculative verification adds rows)."""

    batch_invariant = False

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(n_out, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _kernel(x) if not self.batch_invariant else cpu_kernels.load() if x.is_cpu else None
        if kernel is not None:
            out = torch.empty(x.shape[0], self.out_features)
            xf = _as_f32(x)
            for s in range(0, x.shape[0], KERNEL_MAX_ROWS):
                kernel.int8_linear(out[s:s + KERNEL_MAX_ROWS], xf[s:s + KERNEL_MAX_ROWS], self.weight, self.scale)
        else:
            out = _blocked_matmul(x.float(), self.out_features,
                                  lambda rows: self.weight[rows].float() * self.scale[rows, None])
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
INT4_UNIT = 64  # input sizes must be multiples of this (two groups: the activation quantizer's unit)
INT4_ROWS = 16  # output rows per block of the kernel's layout (one AVX-512 register of int32 sums)


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


def exact_codes(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
    """Codes [N, K] (uint8), scales and minima [N, K/32] (float32) and their bits (4 or 8) that give the float32
    weights w [N, K] back bit for bit as scale * code + minimum (the product of a float16 scale and a code is exact,
    the sum rounds once: how GGUF dequantizes Q4_1, Q4_0 and Q8_0): a layer whose weights were dequantized from
    such a grid. 4 bits where quantize_groups finds the grid, else Q8_0's 8 (quantize_q8), else None (a float
    checkpoint's weights, K not a multiple of 32, a row range cut through a group). Checked `rows` rows at a time,
    so that the check holds a few of those rows' floats, not copies of the matrix; the first 64 rows first, so that a
    float checkpoint's layer is told apart in a small fraction of the matrix."""
    n, k = w.shape
    if w.dtype != torch.float32 or k % GROUP or n == 0:
        return None
    starts = [0] + list(range(min(n, 64), n, rows))
    for quantize, bits in ((quantize_groups, 4), (quantize_q8, 8)):
        parts = []
        for r0, r1 in zip(starts, starts[1:] + [n]):
            block = w[r0:r1]
            codes, d, m = quantize(block)
            d, m = d.float(), m.float()
            back = d.repeat_interleave(GROUP, 1) * codes.float() + m.repeat_interleave(GROUP, 1)
            if not torch.equal(back.view(torch.int32), block.contiguous().view(torch.int32)):
                break
            parts.append((codes, d, m))
        else:
            return torch.cat([c for c, _, _ in parts]), torch.cat([d for _, d, _ in parts]), \
                torch.cat([m for _, _, m in parts]), bits
    return None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, K] (n % 16 == 0, K % 8 == 0) -> [n/16, K/8, 64] bytes in the kernel's layout: per block of 16 rows
    and 8 inputs one 64-byte line, whose byte 4r + i holds row r's input 8o + i in the low nibble and 8o + 4 + i in
    the high one (cpu_kernels.int4_linear)."""
    n, k = codes.shape
    c = codes.reshape(n // INT4_ROWS, INT4_ROWS, k // 8, 2, 4)  # [block, row, octet, half, i]
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n // INT4_ROWS, k // 8, 64)


def quantize_q8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 of weight rows [n, K] in Q8Dense's terms: per group of 32, d = amax / 127 (float16) and
    q = round(w / d) in -127..127, stored as code = q + 128 (uint8) with minimum m = -128 d (exact in float16), so
    that w = d * code + m as for the 4-bit codes. Re-quantizing a Q8_0 tensor's dequantized weights gives back its
    own d and q."""
    n, k = rows.shape
    g = rows.float().reshape(n, k // GROUP, GROUP)
    d = (g.abs().amax(-1) / 127).half()
    df = d.float()[..., None]
    q = torch.where(df > 0, g / torch.where(df > 0, df, 1), 0).round_().clamp_(-127, 127)
    return (q + 128).to(torch.uint8).reshape(n, k), d, d * -128


def pack_q8(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, K] (n % 16 == 0, K % 4 == 0) -> [n/16, K/4, 64] bytes: per block of 16 rows and 4 inputs one 64-byte
    line, whose byte 4r + i is row r's input 4o + i (cpu_kernels.q8_linear)."""
    n, k = codes.shape
    return codes.reshape(n // INT4_ROWS, INT4_ROWS, k // 4, 4).permute(0, 2, 1, 3).reshape(n // INT4_ROWS, k // 4, 64)


def unpack_q8(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_q8: codes [blocks x 16, K]."""
    nb, quads, _ = packed.shape
    return packed.reshape(nb, quads, INT4_ROWS, 4).permute(0, 2, 1, 3).reshape(nb * INT4_ROWS, quads * 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: codes [blocks x 16, K]."""
    nb, octets, _ = packed.shape
    v = packed.reshape(nb, octets, INT4_ROWS, 4).permute(0, 2, 1, 3)  # [block, row, octet, i]
    return torch.stack((v & 0x0F, v >> 4), dim=3).reshape(nb * INT4_ROWS, octets * 8)


def _by_row(blocked: torch.Tensor) -> torch.Tensor:
    """A [blocks, G, 16] scale tensor as a [blocks x 16, G] view-like index target: rows in order."""
    return blocked.permute(0, 2, 1)


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
    """y = x W^T + b with W in 4-bit groups (Q4_1) in the kernel's layout (pack_int4): qweight [ceil(out/16), in/8,
    64] uint8, scale and minimum [ceil(out/16), in/32, 16] float16 (rows past `out` are zero). Needs in % 64 == 0
    (refused at construction otherwise)."""

    BITS = 4
    KERNEL = "int4_linear"
    pack, unpack, quantize = staticmethod(pack_int4), staticmethod(unpack_int4), staticmethod(quantize_groups)

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        if n_in % INT4_UNIT:
            raise ValueError(f"int{self.BITS} layers need input sizes that are multiples of {INT4_UNIT}; this layer "
                             f"has {n_in}")
        self.in_features, self.out_features = n_in, n_out
        nb = -(-n_out // INT4_ROWS)
        self.qweight = nn.Parameter(torch.zeros(nb, n_in * self.BITS // 32, 64, dtype=torch.uint8),
                                    requires_grad=False)
        self.scale = nn.Parameter(torch.zeros(nb, n_in // GROUP, INT4_ROWS, dtype=torch.float16), requires_grad=False)
        self.minimum = nn.Parameter(torch.zeros(nb, n_in // GROUP, INT4_ROWS, dtype=torch.float16),
                                    requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [out, in] uint8, scales, minima [out, in/32] float16) in the plain row layout."""
        n = self.out_features
        return (self.unpack(self.qweight)[:n], _by_row(self.scale).reshape(-1, self.in_features // GROUP)[:n],
                _by_row(self.minimum).reshape(-1, self.in_features // GROUP)[:n])

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes stand for."""
        return self._dequantize(slice(0, self.out_features))

    def _dequantize(self, rows: slice) -> torch.Tensor:
        b0, b1 = rows.start // INT4_ROWS, -(-rows.stop // INT4_ROWS)
        lo, hi = rows.start - b0 * INT4_ROWS, rows.stop - b0 * INT4_ROWS
        k = self.in_features
        codes = self.unpack(self.qweight[b0:b1])[lo:hi].float().reshape(-1, k // GROUP, GROUP)
        d = _by_row(self.scale[b0:b1]).reshape(-1, k // GROUP)[lo:hi].float()
        m = _by_row(self.minimum[b0:b1]).reshape(-1, k // GROUP)[lo:hi].float()
        return (codes * d[..., None] + m[..., None]).reshape(-1, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = cpu_kernels.load() if x.is_cpu and cpu_kernels.has_int4() else None
        if k is not None:  # every batch size: the kernel is as fast as float32's GEMM from one row to thousands
            out = torch.empty(x.shape[0], self.out_features)
            getattr(k, self.KERNEL)(out, _as_f32(x), self.qweight, self.scale, self.minimum)
        else:  # no native kernels (a build without them, or a CPU that is not x86): float32 GEMM on the dequantized
            # weight, with the activations rounded as the kernel rounds them, so that both compute the same thing
            out = _blocked_matmul(fake_quantize_activations(x), self.out_features, self._dequantize)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def load_rows(self, start: int, rows: torch.Tensor) -> None:
        """Quantize Hugging Face weight rows [n, in] (output channels start .. start + n) into place: the blocks they
        touch are unpacked, given the new rows and packed again."""
        codes, d, m = self.quantize(rows)
        end = start + rows.shape[0]
        b0, b1 = start // INT4_ROWS, -(-end // INT4_ROWS)
        block = self.unpack(self.qweight[b0:b1])
        block[start - b0 * INT4_ROWS:end - b0 * INT4_ROWS] = codes
        self.qweight[b0:b1] = self.pack(block)
        ids = torch.arange(start, end)
        _by_row(self.scale)[ids // INT4_ROWS, ids % INT4_ROWS] = d
        _by_row(self.minimum)[ids // INT4_ROWS, ids % INT4_ROWS] = m


class Q8Dense(Int4Dense):
    """y = x W^T + b with W in GGUF's Q8_0 (8-bit codes per group of 32 with a float16 scale; quantize_q8) in the
    blocked layout of pack_q8, multiplied by the int4 kernel's machinery (cpu_kernels.q8_linear: int8 activations,
    VNNI's u8 x s8 dot products), so that it scales with the rows as Int4Dense does: a few rows cost little more
    than one, where Int8Dense's float32-activation kernel costs more per extra row (docs/kernels.md). It is the
    LM head (and tied embedding) under --quantization int4, as llama.cpp's Q4_1 GGUFs keep it in Q8_0."""

    BITS = 8
    KERNEL = "q8_linear"
    pack, unpack, quantize = staticmethod(pack_q8), staticmethod(unpack_q8), staticmethod(quantize_q8)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized weight rows `ids` [len(ids), in] in float32 (a tied embedding's lookups)."""
        k, blocks, r = self.in_features, ids // INT4_ROWS, ids % INT4_ROWS
        lines = self.qweight.index_select(0, blocks).view(ids.numel(), k // 4, INT4_ROWS, 4)
        codes = lines[torch.arange(ids.numel()), :, r].reshape(-1, k // GROUP, GROUP).float()
        d = self.scale.index_select(0, blocks)[torch.arange(ids.numel()), :, r].float()
        m = self.minimum.index_select(0, blocks)[torch.arange(ids.numel()), :, r].float()
        return (codes * d[..., None] + m[..., None]).reshape(-1, k)
