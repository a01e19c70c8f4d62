"""The C++ CPU kernels (cpu_kernels.py) on whatever instruction set this CPU has (AVX-512, AVX2 + FMA, or neither):
the module builds, and the kernels with one implementation per instruction set compute what the reference computes
at the sizes that exercise their vector steps and tails: argmax_finite (the sampler's greedy ids and finiteness) and
int8_linear (batch invariant: a row gets what it gets alone, whichever tile it lands in)."""
from __future__ import annotations

import pytest
import torch

from kvcache.models import cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    assert k is not None  # AVX2-only CPUs build it too (int4 aside: has_int4 says whether that kernel is in)
    return k


VOCABS = [1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 100, 3000]


@pytest.mark.parametrize("vocab", VOCABS)
def test_argmax_finite_is_torch_argmax_and_isfinite(kernels, vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.cat([torch.randn(6, vocab, generator=g), torch.randint(0, 3, (6, vocab), generator=g).float(),
                   torch.full((2, vocab), -float("inf")), torch.full((1, vocab), 7.0)])
    x[-2, vocab // 2] = 1.0  # one finite value among -inf, wherever it falls (lanes or tail)
    ids, finite = kernels.argmax_finite(x)
    assert ids.tolist() == x.argmax(-1).tolist()  # the first maximum among ties (the integer rows have many)
    assert finite.tolist() == torch.isfinite(x).all(-1).tolist()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_argmax_finite_names_every_non_finite_position(kernels, vocab, value):
    x = torch.randn(vocab, vocab)
    x[torch.arange(vocab), torch.arange(vocab)] = value  # row r: position r, in a lane or in the tail
    ids, finite = kernels.argmax_finite(x)
    assert not finite.any()
    assert ((ids >= 0) & (ids < vocab)).all()
    if value == -float("inf") and vocab > 1:  # still a real maximum elsewhere
        assert ids.tolist() == x.argmax(-1).tolist()


@pytest.mark.parametrize("k", [5, 8, 12, 16, 64, 100, 576])  # tails after 8- and 16-wide steps
@pytest.mark.parametrize("n", [1, 2, 7, 48])  # channel pairs and a lone one
def test_int8_linear_is_its_reference_and_batch_invariant(kernels, k, n):
    g = torch.Generator().manual_seed(k * 100 + n)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) + 0.01
    x = torch.randn(21, k, generator=g)
    whole = torch.empty(21, n)
    kernels.int8_linear(whole, x, w, scale)
    ref = (x.double() @ w.double().t() * scale.double()).float()
    torch.testing.assert_close(whole, ref, atol=2e-5 * k, rtol=2e-5)
    for rows in (1, 2, 3, 4, 5, 8, 9, 13):  # every tile shape, and rows beside others in each
        for start in (0, 21 - rows):
            part = torch.empty(rows, n)
            kernels.int8_linear(part, x[start:start + rows].contiguous(), w, scale)
            assert torch.equal(part, whole[start:start + rows]), (rows, start)


def _vnni_reference(layer, x: torch.Tensor) -> torch.Tensor:
    """What the VNNI int4 kernel computes, step by step in float32: per output, its groups in order,
    acc = fma(sum(code * qa), d * da, acc) then fma(m, da * sum(qa), acc) (an fma as float64 rounded to float32)."""
    from kvcache.models.quant_linear import GROUP, quantize_activations
    q, da = quantize_activations(x)
    rows, k = x.shape
    g = k // GROUP
    codes, d, m = layer.codes()
    sums = (codes.double().reshape(1, -1, g, GROUP) * q.double().reshape(rows, 1, g, GROUP)).sum(-1)  # exact
    sa = da * q.reshape(rows, g, GROUP).sum(-1)
    acc = torch.zeros(rows, codes.shape[0])
    for i in range(g):
        acc = (sums[..., i] * (d.float()[None, :, i] * da[:, None, i]).double() + acc.double()).float()
        acc = (m.float()[None, :, i].double() * sa[:, None, i].double() + acc.double()).float()
    return acc


@pytest.mark.parametrize("k,n", [(64, 48), (64, 5), (576, 37), (1088, 20)])  # partial blocks and halves of 8
def test_int4_linear_is_the_vnni_kernels_float_result_and_batch_invariant(kernels, k, n):
    if not kernels.has_int4():
        pytest.skip("no int4 kernel on this CPU (neither AVX512-VNNI nor AVX2 + FMA + F16C)")
    from kvcache.models.quant_linear import Int4Dense
    g = torch.Generator().manual_seed(k + n)
    layer = Int4Dense(k, n, bias=False)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w[1, :32] = 0.5  # a constant group: d = 0
    with torch.no_grad():
        layer.load_rows(0, w)
    x = torch.randn(13, k, generator=g)
    x[3, 40:72] = 0  # an all-zero group of activations
    whole = torch.empty(13, n)
    kernels.int4_linear(whole, x, layer.qweight, layer.scale, layer.minimum)
    assert torch.equal(whole, _vnni_reference(layer, x))  # AVX2's integer sums are VNNI's, and so is the float math
    for rows in (1, 2, 3, 4, 5, 8, 9):  # every tile of either kernel
        for start in (0, 13 - rows):
            part = torch.empty(rows, n)
            kernels.int4_linear(part, x[start:start + rows].contiguous(), layer.qweight, layer.scale, layer.minimum)
            assert torch.equal(part, whole[start:start + rows]), (rows, start)
