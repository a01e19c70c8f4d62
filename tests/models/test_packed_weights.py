"""float32 CPU weights packed (Dense.pack): in panels for the C++ kernels (the default) or in oneDNN's layout
(KVCACHE_PACKED_WEIGHTS=onednn), the model computes what it computes with MKL on the dense weights, holds each weight
once (a tied head keeps its dense copy for the embedding lookups, and counts both; panels count their padding), and
KVCACHE_PACKED_WEIGHTS=0 keeps the dense path."""
from __future__ import annotations

import pytest
import torch

from kvcache.models.linear import Dense
from kvcache.models.loader import build_model, read_checkpoint
from tiny_models import TINY_ARCHS


def _dense(model):
    return [m for m in model.modules() if isinstance(m, Dense)]


@pytest.mark.parametrize("how", ["1", "onednn"])
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_packed_weights_compute_what_the_dense_ones_do(tiny_model_dirs, arch, how, monkeypatch):
    from test_half_precision import kv_logits
    loaded = read_checkpoint(tiny_model_dirs[arch])
    monkeypatch.setenv("KVCACHE_PACKED_WEIGHTS", how)
    packed = build_model(loaded, 128)
    monkeypatch.setenv("KVCACHE_PACKED_WEIGHTS", "0")
    dense = build_model(loaded, 128)
    assert all(m.packed is None and m.weight is not None for m in _dense(dense))
    padding = 0
    for m in _dense(packed):
        if how == "onednn":
            assert m.packed is not None and m.packed.is_mkldnn
        else:  # [ceil(out / 32), in, 32], the last panel's missing channels zero
            panels = -(-m.out_features // 32)
            assert m.packed.shape == (panels, m.in_features, 32) and m.packed.dtype == torch.float32
            assert not m.packed[-1, :, m.out_features % 32 or 32:].any()
            padding += (panels * 32 - m.out_features) * m.in_features * 4
        assert (m.weight is not None) == (m is packed.lm_head and packed.tied)  # dropped, unless looked up
    extra = packed.lm_head.weight.numel() * 4 if packed.tied else 0
    assert packed.weight_bytes == dense.weight_bytes + extra + padding
    ids = list(range(3, 60))
    for chunk in (7, 64):  # decode-sized steps (the fused C++ calls) and one prefill (the op-by-op path)
        got, want = kv_logits(packed, ids, chunk), kv_logits(dense, ids, chunk)
        tol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        top2 = want.topk(2, -1).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tol  # greedy agrees wherever rounding cannot flip it
        assert clear.float().mean() > 0.8 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_pack_refuses_what_it_cannot_pack(monkeypatch):
    half = Dense(8, 16, bias=False).to(torch.bfloat16)
    assert not half.pack() and half.packed is None and half.weight is not None
    d = Dense(8, 16, bias=True)
    torch.nn.init.normal_(d.weight), torch.nn.init.normal_(d.bias)
    x = torch.randn(3, 8)
    want = d(x)
    assert d.pack() and not d.pack()  # once
    torch.testing.assert_close(d(x), want, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("KVCACHE_PACKED_WEIGHTS", "panels")
    with pytest.raises(ValueError, match="KVCACHE_PACKED_WEIGHTS='panels': use 1"):
        Dense(8, 16, bias=False).pack()


def test_the_plain_variant_keeps_onednn(cpu_isa):
    """Panels where a vector variant runs; with the plain C++ one (no AVX2: its panels run 60-80x slower than
    oneDNN's linear), oneDNN's layout, computing the same."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    d = Dense(64, 48, bias=True)
    torch.nn.init.normal_(d.weight), torch.nn.init.normal_(d.bias)
    x = torch.randn(5, 64)
    want = d(x)
    assert d.pack()
    assert d.packed.is_mkldnn == (cpu_isa == "scalar")
    torch.testing.assert_close(d(x), want, atol=1e-4, rtol=1e-5)
