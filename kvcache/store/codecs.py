"""Quantized KV storage codecs: how fp8, int8, int4 and int2 values and their scales are stored.

The layouts are the ones `plan/kv_bytes.py` counts, byte for byte (a test holds them equal):
- fp8_e4m3, fp8_e5m2: one fp16 scale per token and KV head (amax / the format's largest value),
  values stored as float8.
- int8: one fp16 scale per token and KV head, symmetric (amax / 127), codes in [-127, 127].
- int4, int2: KIVI (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
  Cache"). Asymmetric: each group has an fp16 scale (max - min) / (2^bits - 1) and an fp16 zero
  point (its min); codes packed two (int4) or four (int2) to a byte along the channels. Keys are
  grouped per channel along the token axis (`quantize_per_channel`, KIVI's finding that key
  outliers sit in fixed channels); values per token along the channels (`quantize_per_token`).

Scales and zero points are rounded to fp16 before the codes are computed, so the codes are exact
for the scales stored and the error bound is the format's own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BITS = {"fp8_e4m3": 8, "fp8_e5m2": 8, "int8": 8, "int4": 4, "int2": 2}


@dataclass(frozen=True, slots=True)
class Quantized:
    """A quantized tensor: codes (float8, int8, or packed uint8), fp16 scales, fp16 zero points (int4/int2)."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits along the last dim -> bytes holding 8 // bits codes each, first code in the low bits."""
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ValueError(f"the last dimension ({codes.shape[-1]}) must be a multiple of {per} to pack {bits}-bit codes")
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per)
    out = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= grouped[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: uint8 codes, 8 // bits per byte."""
    per = 8 // bits
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _asymmetric(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, fp16 scale and fp16 zero of `x` reduced over `dim` (kept as size 1)."""
    levels = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = lo.to(torch.float16)
    # The scale must cover [zero, hi] after zero is rounded to fp16; never 0 (a constant group).
    scale = ((hi - zero.float()) / levels).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
    codes = ((x - zero.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


def quantize_per_token(x: torch.Tensor, dtype: str, group: int = 64) -> Quantized:
    """Quantize the last dimension of `x` ([..., head_dim]): one scale per token and head (fp8, int8), or per
    `group` channels (int4, int2)."""
    x = x.float()
    if dtype in FP8:
        amax = x.abs().amax(-1, keepdim=True)
        scale = (amax / torch.finfo(FP8[dtype]).max).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
        return Quantized((x / scale.float()).to(FP8[dtype]), scale)
    if dtype == "int8":
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float16).tiny).to(torch.float16)
        return Quantized((x / scale.float()).round_().clamp_(-127, 127).to(torch.int8), scale)
    bits = _int_bits(dtype)
    d = x.shape[-1]
    g = min(group, d)
    if d % g:
        raise ValueError(f"head_dim {d} is not a multiple of the {g}-channel group")
    codes, scale, zero = _asymmetric(x.reshape(*x.shape[:-1], d // g, g), bits, -1)
    return Quantized(pack(codes.reshape(x.shape), bits), scale.squeeze(-1), zero.squeeze(-1))


def dequantize_per_token(q: Quantized, dtype: str, group: int = 64) -> torch.Tensor:
    """The float32 values `quantize_per_token` stored."""
    if dtype in FP8 or dtype == "int8":
        return q.data.float() * q.scale.float()
    codes = unpack(q.data, _int_bits(dtype)).float()
    d = codes.shape[-1]
    g = min(group, d)
    grouped = codes.reshape(*codes.shape[:-1], d // g, g)
    return (grouped * q.scale.float()[..., None] + q.zero.float()[..., None]).reshape(codes.shape)


def quantize_per_channel(x: torch.Tensor, dtype: str) -> Quantized:
    """KIVI keys: `x` is one group of tokens ([tokens, ..., head_dim]); one scale and zero per channel over
    the group's tokens (shape [..., head_dim]); codes packed along head_dim."""
    codes, scale, zero = _asymmetric(x.float(), _int_bits(dtype), 0)
    return Quantized(pack(codes, _int_bits(dtype)), scale.squeeze(0), zero.squeeze(0))


def dequantize_per_channel(q: Quantized, dtype: str) -> torch.Tensor:
    """The float32 values `quantize_per_channel` stored ([tokens, ..., head_dim])."""
    return unpack(q.data, _int_bits(dtype)).float() * q.scale.float() + q.zero.float()


def _int_bits(dtype: str) -> int:
    if dtype not in ("int4", "int2"):
        raise ValueError(f"{dtype!r} is not a packed integer format (int4, int2)")
    return BITS[dtype]
