"""The C++ CPU kernels (csrc/), in every instruction-set variant this CPU runs (avx512, avx2, scalar: the
isa_kernels fixture; the others are skipped with the reason): the kernels compute what the reference computes at
the sizes that exercise their vector steps and tails (argmax_finite, the sampler's greedy ids and finiteness;
int8_linear, int4_linear and panel_linear, batch invariant: a row gets what it gets alone, whichever tile it lands
in), and every variant gives the scalar one's very floats where the kernels promise it (panel_linear, int4)."""
from __future__ import annotations

import pytest
import torch

from kvcache.models import cpu_kernels


@pytest.fixture
def kernels(isa_kernels):
    return isa_kernels


def scalar():
    from kvcache import native
    return native.kernels("scalar")


def atens_isa() -> str:
    """The variant whose vector loops ATen's own CPU kernels run on this machine (its dispatch: AVX512, AVX2)."""
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability(), "scalar")


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
    assert kernels.has_int4()  # every variant has it
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


def test_int4_linear_over_several_row_chunks_is_each_rows_own_result(kernels):
    """A prefill's rows go in chunks of about 96 KiB of int8 activations (88 rows at 1,088 inputs), every chunk
    against all of a thread's weight blocks: 203 rows (two chunks and one of 27, whose tail is 3 rows) get the
    VNNI kernel's floats, each row what it gets alone."""
    from kvcache.models.quant_linear import Int4Dense
    g = torch.Generator().manual_seed(7)
    k, n = 1088, 40
    layer = Int4Dense(k, n, bias=False)
    with torch.no_grad():
        layer.load_rows(0, torch.randn(n, k, generator=g))
    x = torch.randn(203, k, generator=g)
    whole = torch.empty(203, n)
    kernels.int4_linear(whole, x, layer.qweight, layer.scale, layer.minimum)
    assert torch.equal(whole, _vnni_reference(layer, x))
    for r in (0, 87, 88, 175, 176, 202):  # the chunks' edges
        alone = torch.empty(1, n)
        kernels.int4_linear(alone, x[r:r + 1].contiguous(), layer.qweight, layer.scale, layer.minimum)
        assert torch.equal(alone, whole[r:r + 1]), r


@pytest.mark.parametrize("k", [1, 5, 63, 64, 65, 576])  # chunks of 64 inputs and their tails
@pytest.mark.parametrize("n", [1, 16, 17, 32, 33, 70])  # whole, half and partial panels
def test_panel_linear_is_its_reference_and_batch_invariant(kernels, k, n):
    g = torch.Generator().manual_seed(k * 100 + n)
    w = torch.randn(n, k, generator=g)
    panels = cpu_kernels.pack_panels(w, kernels)
    assert panels.shape == (-(-n // 32), k, 32)
    x = torch.randn(29, k, generator=g)
    whole = torch.empty(29, n)
    kernels.panel_linear(whole, x, panels)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(whole.double(), ref, atol=1e-6 * (k ** 0.5) * ref.abs().max().item(), rtol=0)
    for rows in (1, 2, 5, 6, 7, 8, 9, 13, 25):  # every tile shape (8 rows with AVX-512, 6 with AVX2), and more
        for start in (0, 29 - rows):
            part = torch.empty(rows, n)
            kernels.panel_linear(part, x[start:start + rows].contiguous(), panels)
            assert torch.equal(part, whole[start:start + rows]), (rows, start)


def test_panel_linear_refuses_mismatched_shapes(kernels):
    panels = cpu_kernels.pack_panels(torch.randn(40, 8), kernels)  # 2 panels: 33..64 outputs
    x = torch.randn(3, 8)
    for out, xs in ((torch.empty(3, 32), x), (torch.empty(3, 65), x), (torch.empty(4, 40), x),
                    (torch.empty(3, 40), torch.randn(3, 9)), (torch.empty(3, 40), torch.randn(8, 3).t())):
        with pytest.raises(RuntimeError, match="panel_linear: (out|x)"):
            kernels.panel_linear(out, xs, panels)


def test_panel_linear_gives_the_same_floats_on_every_instruction_set(kernels):
    other = scalar()
    g = torch.Generator().manual_seed(7)
    for n, k in ((70, 130), (32, 64), (5, 3)):
        w = torch.randn(n, k, generator=g)
        panels = cpu_kernels.pack_panels(w, kernels)
        assert torch.equal(cpu_kernels.pack_panels(w, other), panels)
        for m in (1, 6, 7, 13, 29):
            x = torch.randn(m, k, generator=g)
            a, b = torch.empty(m, n), torch.empty(m, n)
            kernels.panel_linear(a, x, panels)
            other.panel_linear(b, x, panels)
            assert torch.equal(a, b), (kernels.isa, n, k, m)


def test_pack_panels_zeroes_the_padding_and_refuses_a_wrong_output(kernels):
    w = torch.randn(40, 8)
    out = torch.full((2, 8, 32), float("nan"))  # the padding outputs 40..63 are written, not assumed zero
    kernels.pack_panels(w, out)
    assert torch.equal(out, cpu_kernels.pack_panels(w, kernels))
    assert torch.equal(out[1, :, 8:], torch.zeros(8, 24))
    assert torch.equal(out.transpose(1, 2).reshape(64, 8)[:40], w)
    view = w.t().contiguous().t()  # [40, 8] with strides (1, 40): a Dense's [in, out] weight, transposed
    assert torch.equal(cpu_kernels.pack_panels(view, kernels), out)
    for bad in (torch.empty(1, 8, 32), torch.empty(2, 9, 32), torch.empty(2, 8, 16), torch.empty(2, 32, 8).transpose(1, 2),
                torch.empty(2, 8, 32, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="pack_panels: out must be"):
            kernels.pack_panels(w, bad)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 1536), (40, 1536), (3, 48), (5, 24), (2, 17), (1, 1)])
def test_silu_mul_is_atens_silu_then_mul(kernels, rows, inter):
    """The fused MLP's SiLU(gate) * up gives ATen's very floats where the variant is the one ATen dispatches to on
    this CPU (its loop's vector part: rows of 1,536, and the 32 of 48; its scalar tail: 24, 17, 1 and the last 16
    of 48), extremes included; other variants (the scalar one, or AVX2 on an AVX-512 CPU) within an ulp or two."""
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    gu = torch.randn(rows, 2 * inter, generator=g) * 8
    extremes = torch.tensor([0.0, -0.0, 88.7, -88.7, 1e-30, -104.0, 30.0, -30.0])[:inter]
    gu[0, :len(extremes)] = extremes
    act = torch.full((rows, inter), float("nan"))
    kernels.silu_mul(act, gu)
    ref = torch.nn.functional.silu(gu[:, :inter]).mul_(gu[:, inter:])
    if kernels.isa == atens_isa():
        assert torch.equal(act, ref)
    torch.testing.assert_close(act, ref, rtol=4e-7, atol=1e-30)
    strided = torch.empty(inter, rows).t()  # [rows, inter], not contiguous where both exceed 1
    bad = [(torch.empty(rows, inter + 1), gu), (act, gu[:, 1:]), (act, gu.double()), (act[0], gu)]
    for bad_act, bad_gu in bad + ([(strided, gu)] if not strided.is_contiguous() else []):
        with pytest.raises(RuntimeError, match="silu_mul: gu"):
            kernels.silu_mul(bad_act, bad_gu)


def test_silu_mul_on_every_instruction_set(kernels):
    """The vector variants' Sleef exp (8 or 16 lanes) gives ATen's floats where both loops take a row's values in
    vectors (the first 1,536 of 1,552 here: ATen's AVX-512 loop takes 32 at a time, its AVX2 loop 16); elsewhere,
    and in the scalar variant (glibc's expf, as ATen's default build), within an ulp or two."""
    g = torch.Generator().manual_seed(5)
    gu = torch.randn(9, 2 * 1552, generator=g) * 8  # 1,552 = 48 x 32 + 16: vector part and tail
    act = torch.empty(9, 1552)
    kernels.silu_mul(act, gu)
    ref = torch.nn.functional.silu(gu[:, :1552]).mul_(gu[:, 1552:])
    if kernels.isa != "scalar" and atens_isa() != "scalar":
        assert torch.equal(act[:, :1536], ref[:, :1536])
    torch.testing.assert_close(act, ref, rtol=4e-7, atol=1e-30)


def _gate_up_then_silu(kernels, x: torch.Tensor, panels: torch.Tensor, inter: int) -> torch.Tensor:
    gu = torch.empty(x.shape[0], 2 * inter)
    kernels.panel_linear(gu, x, panels)
    act = torch.empty(x.shape[0], inter)
    kernels.silu_mul(act, gu)
    return act


def test_gate_up_silu_is_the_product_then_silu_mul(kernels):
    """The fused MLP's gate/up product with SiLU x up in its epilogue (pairs of panels, no [M, 2I] tensor) gives the
    floats of panel_linear then silu_mul, on every instruction set: at row counts that end in each row block size,
    in several passes over the rows (K = 1,536: 40 rows a pass), and at no rows."""
    k = kernels
    g = torch.Generator().manual_seed(11)
    for inter, kin in ((1536, 576), (32, 8), (96, 1536)):
        panels = cpu_kernels.pack_panels(torch.randn(2 * inter, kin, generator=g), k)
        for m in (0, 1, 6, 7, 13, 29, 85):
            x = torch.randn(m, kin, generator=g)
            act = torch.full((m, inter), float("nan"))
            k.gate_up_silu(act, x, panels)
            assert torch.equal(act, _gate_up_then_silu(k, x, panels, inter)), (k.isa, inter, kin, m)


def test_gate_up_silu_refuses_what_it_cannot_pair(kernels):
    x = torch.randn(3, 8)
    panels = cpu_kernels.pack_panels(torch.randn(128, 8), kernels)  # 4 panels: I = 64
    kernels.gate_up_silu(torch.empty(3, 64), x, panels)
    odd = cpu_kernels.pack_panels(torch.randn(80, 8), kernels)  # I = 40: gate and up panels do not pair
    for act, xs, wp in ((torch.empty(3, 32), x, panels), (torch.empty(4, 64), x, panels), (torch.empty(3, 40), x, odd),
                        (torch.empty(64, 3).t(), x, panels), (torch.empty(3, 64, dtype=torch.float64), x, panels)):
        with pytest.raises(RuntimeError, match="gate_up_silu: act"):
            kernels.gate_up_silu(act, xs, wp)
    with pytest.raises(RuntimeError, match="gate_up_silu: x"):
        kernels.gate_up_silu(torch.empty(3, 64), torch.randn(3, 9), panels)
