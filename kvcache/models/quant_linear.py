"""Weight-only int8 linear layers for CPU decode (`--quantization int8`).

Decode on a CPU is bound by reading the weights: every step reads all of them for a handful of rows. Stored as int8
with one float32 scale per output channel (symmetric, amax / 127, as vLLM's and llm.int8's per-channel weight
quantization), they are a quarter of float32's bytes, and a C++ kernel (cpu_kernels.py, compiled on first use)
multiplies them straight from int8: each weight row is loaded once, widened to float32 in
registers and used for up to 8 activation rows. Measured here on a 576 x 3,072 layer streaming from memory:
0.065 ms per row against float32's 0.38 (1 row), 0.25 against 1.0 (8 rows); past about 32 rows float32's GEMM
is faster, so larger batches (prefill) dequantize the weight and use it.

Activations stay in the compute dtype (float32 by default): only the weights are rounded, once, as they load.
"""
from __future__ import annotations

import torch
from torch import nn

from kvcache.models import cpu_kernels

KERNEL_MAX_ROWS = 32  # up to this many rows the int8 kernel beats dequantizing + float32 GEMM on this CPU


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes and float32 scales of weight rows [n, K] (one per output channel: amax / 127, at least fp16's
    smallest normal so that an all-zero row stays 0), rounding half to even."""
    r = rows.float()
    scale = (r.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float16).tiny)
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
        kernel = cpu_kernels.load() if x.device.type == "cpu" else None
        if kernel is not None and x.shape[0] <= KERNEL_MAX_ROWS:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
            kernel.int8_linear(out, x.float().contiguous(), self.weight, self.scale)
        else:
            out = x.float() @ (self.weight.float() * self.scale[:, None]).t()
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
