"""Attention over quantized blocks: equal to attention over their dequantized values, and, under KIVI,
to a dense reference of the scheme (earlier key groups quantized, the query's own group in fp16),
however the tokens are split into prefill chunks and decode steps."""
from __future__ import annotations

import pytest
import torch

from kvcache.attention.metadata import KiviLayout, SeqChunk, build_batch
from kvcache.attention.paged import Workspace, paged_attention
from kvcache.store.codecs import (dequantize_per_channel, dequantize_per_token, quantize_per_channel,
                                  quantize_per_token)
from kvcache.store.quantized_store import QuantizedKVStore

H, KVH, D = 4, 2, 16


def _reference(q, k, v, dtype, window=None, group=64):
    """Dense attention of queries at positions 0..L-1 with the stored format's view of k, v."""
    L = k.shape[0]
    if dtype in ("int4", "int2"):
        k16 = k.half().float()
        kq = k16.clone()
        for g0 in range(0, L - L % group, group):
            kq[g0:g0 + group] = dequantize_per_channel(quantize_per_channel(k16[g0:g0 + group], dtype), dtype)
        vq = dequantize_per_token(quantize_per_token(v, dtype, group), dtype, group)
    else:
        kq = dequantize_per_token(quantize_per_token(k, dtype), dtype)
        vq = dequantize_per_token(quantize_per_token(v, dtype), dtype)
        k16 = kq
    out = []
    for p in range(L):
        js = torch.arange(p + 1)
        if window is not None:
            js = js[p - js < window]
        same = js // group == p // group
        keys = torch.where(same[:, None, None], k16[js], kq[js]) if dtype in ("int4", "int2") else kq[js]
        kk = keys.repeat_interleave(H // KVH, 1)  # [n, H, D]
        vv = vq[js].repeat_interleave(H // KVH, 1)
        s = torch.einsum("hd,nhd->hn", q[p], kk) * D ** -0.5
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
    return torch.stack(out)


def _run(q, k, v, dtype, splits, block_size, window=None):
    """Feed one sequence through the store in chunks of `splits` tokens (1 = decode steps)."""
    L = k.shape[0]
    nb = -(-L // block_size)
    table = list(range(3, 3 + nb))[::-1]  # any order
    store = QuantizedKVStore(1, 3 + nb + 4, block_size, KVH, D, dtype)
    private = [3 + nb, 3 + nb + 2, 3 + nb + 1, 3 + nb + 3]  # scattered private blocks
    layout = KiviLayout(store.kivi_group, KVH * D, store.row_elems) if store.kivi_group else None
    outs, start = [], 0
    for n in splits:
        chunk = SeqChunk([0] * n, start, table, True, private)
        batch = build_batch([chunk], block_size, (window,), read_cache=True, kivi=layout)
        kk, vv = k[start:start + n], v[start:start + n]
        src = store.write(0, batch.slot_mapping, kk, vv, batch.kivi)
        outs.append(paged_attention(q[start:start + n], kk, vv, store, 0, batch, D ** -0.5, window, Workspace(), src))
        start += n
    return torch.cat(outs)


def _data(L, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, KVH, D, generator=g)
    k[..., 3] *= 10  # an outlier channel
    return torch.randn(L, H, D, generator=g), k, torch.randn(L, KVH, D, generator=g)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"])
@pytest.mark.parametrize("splits", [[150], [64, 86], [37, 1, 1, 50, 61], [70] + [1] * 80, [1] * 150])
def test_chunked_attention_matches_the_dense_reference(dtype, splits):
    q, k, v = _data(sum(splits))
    bs = 64 if dtype in ("int4", "int2") else 16
    out = _run(q, k, v, dtype, splits, bs)
    torch.testing.assert_close(out, _reference(q, k, v, dtype), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_sliding_window_over_quantized_blocks(dtype):
    q, k, v = _data(140, seed=1)
    bs = 64 if dtype == "int4" else 16
    out = _run(q, k, v, dtype, [50, 1, 1, 88], bs, window=40)
    torch.testing.assert_close(out, _reference(q, k, v, dtype, window=40), atol=1e-4, rtol=1e-4)
