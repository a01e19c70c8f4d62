"""Quantized KV codecs: packing round trips, each format's error bound, and bytes equal to the planner's count."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.plan.kv_bytes import layer_bytes_per_token
from kvcache.plan.shape import ModelShape
from kvcache.store.codecs import (FP8, dequantize_per_channel, dequantize_per_token, pack, quantize_per_channel,
                                  quantize_per_token, unpack)

FP16_EPS = 2.0 ** -11  # relative rounding of an fp16 zero point


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([2, 4]), rows=st.integers(1, 5), groups=st.integers(1, 8), seed=st.integers(0, 10**6))
def test_pack_unpack_round_trip(bits, rows, groups, seed):
    per = 8 // bits
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, groups * per), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, groups)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_puts_the_first_code_in_the_low_bits():
    assert pack(torch.tensor([[1, 2]], dtype=torch.uint8), 4).item() == 0x21
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).item() == 0b00111001
    with pytest.raises(ValueError, match="multiple of 2"):
        pack(torch.zeros(1, 3, dtype=torch.uint8), 4)


def _kv(seed: int, shape=(64, 3, 64), outliers: bool = True) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if outliers:  # KIVI's observation: a few key channels carry large values
        x[..., 5] *= 20
    return x


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_per_token_formats_stay_within_their_bound(dtype):
    x = _kv(0)
    q = quantize_per_token(x, dtype)
    assert q.scale.dtype == torch.float16 and q.scale.shape == (64, 3, 1) and q.zero is None
    err = (dequantize_per_token(q, dtype) - x).abs()
    scale = q.scale.float()
    if dtype == "int8":
        assert q.data.dtype == torch.int8 and int(q.data.abs().max()) <= 127
        assert bool((err <= scale / 2 + 1e-6).all())
    else:
        finfo = torch.finfo(FP8[dtype])
        mantissa = {"fp8_e4m3": 3, "fp8_e5m2": 2}[dtype]
        bound = x.abs() * 2.0 ** -(mantissa + 1) + finfo.smallest_normal * 2.0 ** -mantissa * scale
        assert q.data.dtype == FP8[dtype] and bool((err <= bound * 1.0001 + 1e-7).all())


@pytest.mark.parametrize("dtype, bits", [("int4", 4), ("int2", 2)])
def test_kivi_formats_stay_within_half_a_step(dtype, bits):
    x = _kv(1)
    values = quantize_per_token(x, dtype)
    assert values.data.shape == (64, 3, 64 * bits // 8) and values.scale.shape == (64, 3, 1)
    err = (dequantize_per_token(values, dtype) - x).abs()
    assert bool((err <= values.scale.float() / 2 + values.zero.float().abs() * FP16_EPS + 1e-6).all())
    keys = quantize_per_channel(x, dtype)
    assert keys.scale.shape == (3, 64) and keys.zero.shape == (3, 64)
    err = (dequantize_per_channel(keys, dtype) - x).abs()
    assert bool((err <= keys.scale.float() / 2 + keys.zero.float().abs() * FP16_EPS + 1e-6).all())


def test_per_channel_keys_beat_per_token_keys_on_outlier_channels():
    """Why KIVI groups keys by channel: an outlier channel inflates every per-token scale."""
    x = _kv(2)
    per_channel = (dequantize_per_channel(quantize_per_channel(x, "int4"), "int4") - x).pow(2).mean()
    per_token = (dequantize_per_token(quantize_per_token(x, "int4"), "int4") - x).pow(2).mean()
    assert per_channel < per_token / 2


def test_constant_groups_come_back_exactly():
    """Asymmetric groups hold a constant in their zero point; all-zero rows stay zero in every format."""
    x = torch.full((64, 2, 64), 0.75)
    for dtype in ("int4", "int2"):
        assert torch.equal(dequantize_per_token(quantize_per_token(x, dtype), dtype), x)
    assert torch.equal(dequantize_per_channel(quantize_per_channel(x, "int2"), "int2"), x)
    zeros = torch.zeros(4, 2, 64)
    for dtype in ("int8", "fp8_e4m3", "fp8_e5m2", "int4"):
        assert torch.equal(dequantize_per_token(quantize_per_token(zeros, dtype), dtype), zeros)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"])
def test_stored_bytes_equal_the_planners_count(dtype, head_dim):
    """A 64-token group of K and V in one layer takes exactly what plan/kv_bytes.py charges per token."""
    heads, tokens = 3, 64
    k, v = _kv(3, (tokens, heads, head_dim)), _kv(4, (tokens, heads, head_dim))
    keys = quantize_per_channel(k, dtype) if dtype in ("int4", "int2") else quantize_per_token(k, dtype)
    values = quantize_per_token(v, dtype)
    shape = ModelShape(num_layers=1, num_kv_heads=heads, head_dim=head_dim)
    assert keys.nbytes + values.nbytes == tokens * layer_bytes_per_token(shape, dtype, "full")


def test_bad_formats_and_shapes():
    with pytest.raises(ValueError, match="not a packed integer format"):
        quantize_per_channel(torch.zeros(4, 8), "int8")
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_per_token(torch.zeros(2, 96), "int4")
