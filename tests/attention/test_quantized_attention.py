"""Attention over quantized blocks: equal to attention over their dequantized values, and, under KIVI,
to a dense reference of the scheme (earlier key groups quantized, the query's own group in fp16),
however the tokens are split into prefill chunks and decode steps."""
from __future__ import annotations

import pytest
import torch

from kvcache.attention import cpu_kernel
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


def _run(q, k, v, dtype, splits, block_size, window=None, kernel=False):
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
        batch = build_batch([chunk], block_size, (window,), read_cache=True, kivi=layout, decode_kernel=kernel)
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


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])
@pytest.mark.parametrize("dtype", ["int4", "int2"])
def test_kivi_residual_keys_by_token_or_by_element(dtype, kernel, monkeypatch):
    """The plan addresses residual keys by whole tokens where no token straddles two private blocks (this layout),
    else by fp16 element: both give the dense reference's answers."""
    from kvcache.attention import metadata
    assert QuantizedKVStore(1, 4, 64, KVH, D, dtype).row_elems % (KVH * D) == 0  # no token straddles here
    splits = [37, 1, 1, 50] + [1] * 61
    q, k, v = _data(sum(splits), seed=5)
    outs = {}
    for unit in ("token", "element"):
        if unit == "element":
            init = metadata._KiviBuilder.__init__

            def by_element(self, *a):
                init(self, *a)
                self.unit = 1
            monkeypatch.setattr(metadata._KiviBuilder, "__init__", by_element)
        outs[unit] = _run(q, k, v, dtype, splits, 64, kernel=kernel)
        torch.testing.assert_close(outs[unit], _reference(q, k, v, dtype), atol=1e-4, rtol=1e-4)
    assert torch.equal(outs["token"], outs["element"])


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"])
@pytest.mark.parametrize("splits", [[150], [64, 86], [37, 1, 1, 50, 61], [70, 1, 100]])
def test_prefill_chunks_over_quantized_blocks_take_the_cpu_kernel(cpu_isa, dtype, splits, monkeypatch):
    """A prefill chunk over a quantized store reads its context dequantized: with a plain causal mask (int8, fp8), or
    (KIVI) the fp16 keys of each query's own group after the dequantized groups before it, one group of queries at a
    time. At a head size the C++ causal kernel takes (a multiple of 32) every query row of such a chunk is attended
    there, not through SDPA and a mask, with the dense reference's answers."""
    monkeypatch.setitem(globals(), "D", 32)
    calls = []
    real = cpu_kernel.prefill_attention
    monkeypatch.setattr(cpu_kernel, "prefill_attention", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    q, k, v = _data(sum(splits), seed=4)
    kivi = dtype in ("int4", "int2")
    out = _run(q, k, v, dtype, splits, 64 if kivi else 16)
    assert sum(calls) == sum(n for n in splits if n > 1)  # every query row of a chunk of more than one token
    if kivi:  # one call per 64-token group a chunk's queries fall in
        starts = [sum(splits[:i]) for i in range(len(splits))]
        assert len(calls) == sum(len(range(s - s % 64, s + n, 64)) for s, n in zip(starts, splits) if n > 1)
    torch.testing.assert_close(out, _reference(q, k, v, dtype), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "cpu-kernel"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_sliding_window_over_quantized_blocks(dtype, kernel):
    q, k, v = _data(140, seed=1)
    bs = 64 if dtype == "int4" else 16
    out = _run(q, k, v, dtype, [50, 1, 1, 88] if not kernel else [50] + [1] * 90, bs, window=40, kernel=kernel)
    torch.testing.assert_close(out, _reference(q, k, v, dtype, window=40), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"])
@pytest.mark.parametrize("splits", [[1] * 150, [37] + [1] * 100, [64] + [1] * 70])
def test_cpu_kernel_decodes_quantized_blocks(cpu_isa, dtype, splits):
    """The C++ decode kernel dequantizes each token as it reads it: the same answers as the dense reference."""
    q, k, v = _data(sum(splits), seed=2)
    bs = 64 if dtype in ("int4", "int2") else 16
    out = _run(q, k, v, dtype, splits, bs, kernel=True)
    torch.testing.assert_close(out, _reference(q, k, v, dtype), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2", "int4", "int2"])
@pytest.mark.parametrize("head_dim", [24, 48, 64, 128])
def test_cpu_kernel_decodes_other_head_sizes(cpu_isa, dtype, head_dim, monkeypatch):
    """The kernel decodes a head 16 codes at a time where its size is a multiple of 16 (48: KIVI's value groups of
    48 too), one at a time otherwise (24): both give the dense reference's answers; so do the head sizes it is
    compiled for (64, 128: the weighted sum's two passes on AVX2)."""
    monkeypatch.setitem(globals(), "D", head_dim)  # _data, _run and _reference read the module's head size
    q, k, v = _data(100, seed=3)
    bs = 64 if dtype in ("int4", "int2") else 16
    out = _run(q, k, v, dtype, [37] + [1] * 63, bs, kernel=True)
    torch.testing.assert_close(out, _reference(q, k, v, dtype), atol=1e-4, rtol=1e-4)


def test_cpu_kernel_decodes_a_batch_of_quantized_sequences(cpu_isa):
    """Several sequences of different lengths and group phases in one kernel call (padded full-key rows)."""
    dtype, bs = "int4", 64
    lens = [70, 130, 5, 64, 191]
    data = [_data(n, seed=10 + i) for i, n in enumerate(lens)]
    nb = [-(-n // bs) for n in lens]
    store = QuantizedKVStore(1, 1 + sum(nb) + 4 * len(lens), bs, KVH, D, dtype)
    layout = KiviLayout(store.kivi_group, KVH * D, store.row_elems)
    at = 1
    tables, privates = [], []
    for n in nb:
        tables.append(list(range(at, at + n)))
        at += n
    for _ in lens:
        privates.append(list(range(at, at + 2)))
        at += 2
    # prefill all but the last token of each, then one batched decode step
    pre = [SeqChunk([0] * (n - 1), 0, t, True, p) for n, t, p in zip(lens, tables, privates) if n > 1]
    kpre = torch.cat([k[:n - 1] for (q, k, v), n in zip(data, lens) if n > 1])
    vpre = torch.cat([v[:n - 1] for (q, k, v), n in zip(data, lens) if n > 1])
    batch = build_batch(pre, bs, read_cache=True, kivi=layout)
    store.write(0, batch.slot_mapping, kpre, vpre, batch.kivi)
    dec = [SeqChunk([0], n - 1, t, True, p) for n, t, p in zip(lens, tables, privates)]
    outs = {}
    for kernel in (False, True):
        batch = build_batch(dec, bs, read_cache=True, kivi=layout, decode_kernel=kernel)
        kk = torch.cat([k[n - 1:n] for (q, k, v), n in zip(data, lens)])
        vv = torch.cat([v[n - 1:n] for (q, k, v), n in zip(data, lens)])
        qq = torch.cat([q[n - 1:n] for (q, k, v), n in zip(data, lens)])
        src = store.write(0, batch.slot_mapping, kk, vv, batch.kivi)
        outs[kernel] = paged_attention(qq, kk, vv, store, 0, batch, D ** -0.5, None, Workspace(), src)
    ref = torch.stack([_reference(q, k, v, dtype)[-1] for q, k, v in data])
    torch.testing.assert_close(outs[False], ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[True], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cpu_kernel_decodes_fp8_arithmetically_as_its_table_does(cpu_isa, dtype):
    """The kernel decodes fp8 bytes with integer and float arithmetic (vectorizable), not the store's 256-entry table:
    with every finite byte value in the blocks, the output is bit for bit the table's, with denormals flushed as the
    engine runs (the subnormal fp8 codes must not pass through a float32 denormal); a non-finite byte makes the row
    non-finite under both, as the table's NaN/inf would."""
    for flush in (True, False):
        torch.set_flush_denormal(flush)
        try:
            _fp8_codes_against_table(dtype)
        finally:
            torch.set_flush_denormal(False)


def _fp8_codes_against_table(dtype):
    bs, nb, g = 16, 6, torch.Generator().manual_seed(9)
    store = QuantizedKVStore(1, nb + 1, bs, KVH, D, dtype)
    L = nb * bs
    kv = torch.randn(2, L, KVH, D, generator=g)
    slots = torch.arange(bs, (nb + 1) * bs)
    store.write(0, slots, kv[0], kv[1])
    finite = torch.isfinite(store.lut).nonzero().flatten().to(torch.uint8)
    ko, vo = store.offsets[0], store.offsets[1]
    n = bs * KVH * D
    raw = store.raw[0]
    for off in (ko, vo):  # every finite byte value appears among the codes
        codes = finite[torch.randint(0, finite.numel(), (nb + 1, n), generator=g)]
        codes[1, :finite.numel()] = finite
        raw[:, off:off + n] = codes
    q = torch.randn(3, H, D, generator=g)
    table = torch.arange(1, nb + 1).repeat(3, 1)
    lens = torch.tensor([L, 37, 1])
    outs = []
    for code in (None, 0):
        out = torch.empty_like(q)
        cpu_kernel.paged_decode_quant(out, q, store, 0, table, lens, D ** -0.5, None, None, code=code)
        outs.append(out)
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[0], outs[1])
    bad = (~torch.isfinite(store.lut)).nonzero().flatten()
    for b in bad.tolist():
        raw[1, ko + 5] = b  # token 0, head 0, channel 5 of the first block
        for code in (None, 0):
            out = torch.empty_like(q)
            cpu_kernel.paged_decode_quant(out, q, store, 0, table, lens, D ** -0.5, None, None, code=code)
            assert not torch.isfinite(out[:2, :H // KVH]).all(), (b, code)
