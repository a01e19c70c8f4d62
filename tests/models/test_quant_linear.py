"""Quantized linear layers: weight-only int8 (--quantization int8) and 4-bit weights with int8 activations
(--quantization int4). Each kernel against its exact reference (the dequantized weights; for int4 also the
activations as the kernel quantizes them) at every row count it serves and past it, the quantization itself, and the
whole model against its own dequantized float twin and against transformers (within the rounding)."""
from __future__ import annotations

import os

import pytest
import torch

from tiny_models import TINY_ARCHS, hf_model
from kvcache import LLM, SamplingParams
from kvcache.config import EngineConfig
from kvcache.models.linear import Dense
from kvcache.models.loader import build_model, read_checkpoint
from kvcache.models.cpu_kernels import has_int4, load
from kvcache.models.quant_linear import (KERNEL_MAX_ROWS, Int4Dense, Int8Dense, Q8Dense, fake_quantize_activations,
                                         pack_int4, pack_q8, quantize_activations, quantize_groups, quantize_q8,
                                         quantize_rows, unpack_int4, unpack_q8)


def test_the_kernels_are_built_and_have_int4():
    """The install built the C++ kernels (CI must): without them every int8 layer dequantizes per call and int4 is
    refused; every variant has the int4 and q8 kernels."""
    from kvcache import native
    if os.environ.get(native.OFF_ENV, "1") == "0":
        pytest.skip(f"{native.OFF_ENV}=0")
    assert load() is not None, native._state.reason
    assert has_int4()


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 13, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("k", [64, 100])  # 100: a tail after the kernel's 16-wide steps
def test_int8_dense_computes_its_dequantized_weights(rows, k):
    g = torch.Generator().manual_seed(rows)
    layer = Int8Dense(k, 48, bias=True)
    w = torch.randn(48, k, generator=g)
    with torch.no_grad():
        layer.load_rows(0, w[:20])  # in two chunks, as a checkpoint loads
        layer.load_rows(20, w[20:])
        layer.bias.copy_(torch.randn(48, generator=g))
    x = torch.randn(rows, k, generator=g, dtype=torch.float64).float()
    dequant = layer.weight.double() * layer.scale.double()[:, None]
    ref = (x.double() @ dequant.t() + layer.bias.double()).float()
    torch.testing.assert_close(layer(x), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(layer(x.bfloat16()).float(), ref, atol=0.15, rtol=0.02)  # bf16 in and out


def test_quantization_is_per_output_channel_and_bounded():
    w = torch.randn(10, 64) * torch.logspace(-3, 2, 10)[:, None]
    w[3] = 0
    codes, scale = quantize_rows(w)
    assert codes.dtype == torch.int8 and codes.abs().max() == 127
    assert torch.equal(scale, (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny))
    err = (codes.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()  # half a step per channel, at most
    assert not codes[3].any()


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_the_int8_model_is_its_dequantized_twin_and_close_to_transformers(tiny_model_dirs, arch, monkeypatch):
    path = tiny_model_dirs[arch]
    monkeypatch.setenv("KVCACHE_PACKED_WEIGHTS", "0")  # the twin's weights are overwritten below: keep them dense
    loaded = read_checkpoint(path)
    q = build_model(loaded, 128, quantization="int8")
    assert all(not isinstance(m, Dense) for m in q.modules()) and q.weight_bytes < 0.45 * build_model(
        loaded, 128).weight_bytes
    twin = build_model(loaded, 128)  # float32 with the int8 layers' dequantized weights, loaded the float way
    with torch.no_grad():
        for (name, mod), tmod in zip(q.named_modules(), twin.modules()):
            if isinstance(mod, Int8Dense):
                tmod.weight.copy_((mod.weight.float() * mod.scale[:, None]).t())
        if q.embed is None:  # tied: the lookups read the quantized head too
            twin.lm_head.weight.copy_((q.lm_head.weight.float() * q.lm_head.scale[:, None]).t())
    ids = list(range(3, 60))
    from test_half_precision import kv_logits  # the paged reference runner of the half-precision tests
    got, same = kv_logits(q, ids, 7), kv_logits(twin, ids, 7)
    torch.testing.assert_close(got, same, atol=1e-4, rtol=0)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    # int8's rounding (half a step of each channel's largest weight) through two layers of a random model
    assert (got - ref).abs().max().item() < 0.05 * ref.abs().max().item()
    if not _flat_logits(loaded.config):
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def _flat_logits(cfg) -> bool:
    """The tiny Gemmas' soft-capped logits are too flat (max ~0.6 over 320 ids) for top-1 agreement to measure a
    weight format's rounding; their logits' distance still does."""
    return cfg.model_type.startswith("gemma")


def test_the_engine_runs_int8_with_its_features(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]  # biases
    llm = LLM(path, quantization="int8", kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=24)
    info = llm.kv_cache_info()
    assert info["quantization"] == "int8" and info["weight_bytes"] < 0.45 * LLM(
        path, kv_cache_memory="4MiB", max_model_len=256).kv_cache_info()["weight_bytes"]
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == alone
    llm.engine.check_no_leaks()


def test_bad_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4 .*got 'q4_k'"):
        EngineConfig(model="/nonexistent", quantization="q4_k")


def test_int4_is_refused_for_a_model_whose_layers_it_cannot_pack(tiny_model_dirs):
    loaded = read_checkpoint(tiny_model_dirs["llama"])
    loaded.config.intermediate_size = 100  # not a multiple of the kernel's 64
    with pytest.raises(ValueError, match="int4 needs layer input sizes that are multiples of 64; this model has "
                                         "intermediate_size 100: use --quantization int8 or none"):
        build_model(loaded, 128, quantization="int4")


# ---- int4 ----

def _int4_layer(k: int, n: int, seed: int, bias: bool = True) -> tuple[Int4Dense, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    layer = Int4Dense(k, n, bias=bias)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w[1, :32] = 0.5  # a constant group: d = 0, codes 0, dequantized exactly
    with torch.no_grad():
        layer.load_rows(0, w[:n // 2])  # in two chunks, as a checkpoint loads
        layer.load_rows(n // 2, w[n // 2:])
        if bias:
            layer.bias.copy_(torch.randn(n, generator=g))
    return layer, w


def test_int4_quantization_is_q4_1_and_packs_losslessly():
    w = torch.randn(32, 128) * 3
    codes, d, m = quantize_groups(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) == 15 and int(codes.min()) == 0
    assert d.dtype == m.dtype == torch.float16 and d.shape == m.shape == (32, 4)
    deq = codes.float().reshape(32, 4, 32) * d.float()[..., None] + m.float()[..., None]
    assert ((deq.reshape(32, 128) - w).abs() <= d.float().repeat_interleave(32, 1) / 2 + 2e-3).all()
    packed = pack_int4(codes)
    assert packed.shape == (2, 128 // 8, 64) and torch.equal(unpack_int4(packed), codes)
    # the kernel's layout: block 1, inputs 8..15, row 3: byte 4 * 3 + i holds input 8 + i low and 12 + i high
    assert [int(b) for b in packed[1, 1, 12:16]] == [int(codes[19, 8 + i]) | int(codes[19, 12 + i]) << 4 for i in range(4)]
    again = quantize_groups(deq.reshape(32, 128))  # Q4_1 weights re-quantized give back their own codes
    assert torch.equal(again[0], codes) and torch.equal(again[1], d) and torch.equal(again[2], m)


def test_int4_rows_load_in_any_chunks():
    """A checkpoint's rows arrive in chunks that do not align with the 16-row blocks: the stored codes and scales are
    the same as loading them at once, and the padding rows past out_features stay zero."""
    w = torch.randn(37, 64)
    whole, parts = Int4Dense(64, 37, bias=False), Int4Dense(64, 37, bias=False)
    with torch.no_grad():
        whole.load_rows(0, w)
        for a, b in ((0, 5), (5, 21), (21, 37)):
            parts.load_rows(a, w[a:b])
    assert all(torch.equal(x, y) for x, y in zip(whole.codes(), parts.codes()))
    assert torch.equal(whole.qweight, parts.qweight) and torch.equal(whole.scale, parts.scale)
    codes, d, m = quantize_groups(w)
    assert torch.equal(whole.codes()[0], codes) and torch.equal(whole.codes()[1], d)
    assert not whole.qweight[2].reshape(-1, 16, 4)[:, 37 - 32:].any() and not whole.scale[2, :, 37 - 32:].any()


def test_int4_activations_round_per_group_of_32():
    x = torch.randn(3, 64)
    x[1, 32:] = 0  # an all-zero group
    q, scale = quantize_activations(x)
    assert q.abs().max() == 127 and not q[1, 32:].any() and scale[1, 1] == 0
    err = (q.reshape(3, 2, 32) * scale[..., None] - x.reshape(3, 2, 32)).abs()
    assert (err <= scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 5, 8, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1])
@pytest.mark.parametrize("k,n", [(64, 48), (576, 37), (1088, 20)])  # 37, 20: output rows not a multiple of 4;
def test_int4_kernel_computes_its_quantized_product(rows, k, n):  # 576, 1088: 18 and 34 groups (partial 16s)
    layer, w = _int4_layer(k, n, rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows), dtype=torch.float64).float()
    out = layer(x)
    wd = layer.dequantized().double()
    # the kernel (up to KERNEL_MAX_ROWS) and the float fallback past it: the same quantized activations
    q, scale = quantize_activations(x)
    xq = (q.reshape(rows, -1, 32).double() * scale.double()[..., None]).reshape(rows, k)
    ref = xq @ wd.t() + layer.bias.double()
    torch.testing.assert_close(out.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    exact = x.double() @ wd.t() + layer.bias.double()  # float activations: within int8's rounding of them
    assert (out.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    assert out.dtype == torch.float32 and out.shape == (rows, n)


def test_int4_without_the_kernel_matches_it(monkeypatch):
    layer, _ = _int4_layer(128, 16, 3)
    x = torch.randn(2, 128)
    with_kernel = layer(x)
    import kvcache.models.quant_linear as ql
    monkeypatch.setattr(ql, "_kernel", lambda x, fmt: None)  # a CPU without VNNI: dequantized float GEMM
    monkeypatch.setattr(ql, "DEQUANT_BLOCK_ELEMS", 128 * 5)  # and a layer dequantized 5 rows at a time
    torch.testing.assert_close(layer(x), with_kernel, atol=1e-5 * with_kernel.abs().max().item(), rtol=1e-5)


def test_int8_float_fallback_dequantizes_in_blocks(monkeypatch):
    import kvcache.models.quant_linear as ql
    layer = Int8Dense(64, 50, bias=False)
    with torch.no_grad():
        layer.load_rows(0, torch.randn(50, 64))
    x = torch.randn(KERNEL_MAX_ROWS + 3, 64)
    whole = layer(x)
    monkeypatch.setattr(ql, "DEQUANT_BLOCK_ELEMS", 64 * 7)  # 7 rows a block, the last one short
    torch.testing.assert_close(layer(x), whole)
    torch.testing.assert_close(whole, x @ layer.dequantized().t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_the_int4_model_is_its_dequantized_twin_and_near_transformers(tiny_model_dirs, arch, monkeypatch):
    path = tiny_model_dirs[arch]
    monkeypatch.setenv("KVCACHE_PACKED_WEIGHTS", "0")  # the twin's weights are overwritten below: keep them dense
    loaded = read_checkpoint(path)
    if any(v % 64 for v in (loaded.config.hidden_size, loaded.config.intermediate_size)):
        with pytest.raises(ValueError, match="multiples of 64"):
            build_model(loaded, 128, quantization="int4")
        return
    q = build_model(loaded, 128, quantization="int4")
    first = q.layers[0]
    head = Q8Dense if has_int4() else Int8Dense  # without the int4 kernel the head stays int8 per channel
    assert isinstance(getattr(first, "qkv", None) or first.qkv_a, Int4Dense) and isinstance(q.lm_head, head)
    twin = build_model(loaded, 128)
    with torch.no_grad():
        for mod, tmod in zip(q.modules(), twin.modules()):
            if isinstance(mod, (Int4Dense, Int8Dense)):  # the Q8_0 (or int8) head too
                tmod.weight.copy_(mod.dequantized().t())
    ids = list(range(3, 60))
    from test_half_precision import kv_logits
    got, same = kv_logits(q, ids, 7), kv_logits(twin, ids, 7)
    # the twin has the same weights; the kernel also rounds the activations (int8 per group of 32). Gemma norms each
    # sublayer's output before it joins the residual, which scales a small output's rounding up with it: twice the bound
    bound = 0.04 if loaded.config.model_type.startswith("gemma") else 0.02
    assert (got - same).abs().max().item() < bound * same.abs().max().item()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    assert (got - ref).abs().max().item() < 12.5 * bound * ref.abs().max().item()  # 4 bits of random weights
    if not _flat_logits(loaded.config):
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.6


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int4_kernel_keeps_a_non_finite_activation_non_finite(bad):
    layer, _ = _int4_layer(128, 8, 5)
    x = torch.randn(3, 128)
    x[1, 70] = bad  # the engine fails a request whose logits are not finite: the kernel must not round this away
    out = layer(x)
    assert not out[1].isfinite().any() and out[[0, 2]].isfinite().all()


def test_a_batch_invariant_int8_layer_gives_each_row_what_it_gives_it_alone():
    """Above KERNEL_MAX_ROWS the layer dequantizes and sums in another order (a row's result depends on the rows
    beside it); the LM head is batch invariant: the kernel, KERNEL_MAX_ROWS rows a call."""
    g = torch.Generator().manual_seed(3)
    layer = Int8Dense(128, 300, bias=True)
    with torch.no_grad():
        layer.load_rows(0, torch.randn(300, 128, generator=g))
        layer.bias.copy_(torch.randn(300, generator=g))
    x = torch.randn(3 * KERNEL_MAX_ROWS + 5, 128, generator=g)
    layer.batch_invariant = True
    whole = layer(x)
    for rows in (slice(0, 1), slice(40, 43), slice(len(x) - 2, len(x))):
        assert torch.equal(whole[rows], layer(x[rows]))
    layer.batch_invariant = False
    torch.testing.assert_close(layer(x), whole, atol=1e-4, rtol=1e-5)  # the same to rounding


def test_the_lm_head_is_batch_invariant(tiny_model_dirs):
    """A row's logits are bit for bit the same alone and among others, past the int8 kernel's row limit too (int8:
    per-channel int8, every row through its kernel; int4: the Q8_0 head)."""
    for q, head in (("int8", Int8Dense), ("int4", Q8Dense if has_int4() else Int8Dense)):
        model = build_model(read_checkpoint(tiny_model_dirs["llama"]), 64, quantization=q)
        assert isinstance(model.lm_head, head)
        x = torch.randn(KERNEL_MAX_ROWS + 5, model.config.hidden_size)
        whole = model.lm_head(x)
        for i in (0, 7, KERNEL_MAX_ROWS + 4):
            assert torch.equal(model.lm_head(x[i:i + 1]), whole[i:i + 1]), (q, i)


def test_q8_codes_are_gguf_q8_0_and_round_trip():
    """Q8Dense holds GGUF's Q8_0 (d = amax / 127 in float16, q = round(w / d)): re-quantizing its dequantized weights
    (what a Q8_0 tensor loads as) gives back the same codes and scales; packing is a permutation."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 128, generator=g)
    w[3, :32] = 0  # a zero group: d = 0, every code 128 (q = 0)
    codes, d, m = quantize_q8(w)
    assert codes.dtype == torch.uint8 and int(codes.min()) >= 1 and torch.equal(m, d * -128)
    assert (codes[3, :32] == 128).all() and d[3, 0] == 0
    deq = (codes.float().reshape(37, 4, 32) * d.float()[..., None] + m.float()[..., None]).reshape(37, 128)
    assert (deq - w).abs().max() <= d.float().max() / 2 + 1e-6
    again = quantize_q8(deq)
    assert torch.equal(again[0], codes) and torch.equal(again[1], d)
    padded = torch.cat([codes, torch.zeros(11, 128, dtype=torch.uint8)])
    assert torch.equal(unpack_q8(pack_q8(padded)), padded)


@pytest.mark.parametrize("n_out", [16, 37, 100])
def test_q8_kernel_is_its_reference_and_batch_invariant(n_out):
    """q8_linear computes x (int8 per group of 32, as int4's kernel rounds it) times the Q8_0 weight, every row
    bit for bit what it gets alone (the LM head's logits do not depend on the step's other rows); rows() are the
    dequantized weight's rows (a tied embedding's lookups)."""
    if not has_int4():
        pytest.skip("no int4/q8 kernel on this CPU (neither AVX512-VNNI nor AVX2 + FMA + F16C)")
    g = torch.Generator().manual_seed(n_out)
    layer = Q8Dense(192, n_out, bias=False)
    with torch.no_grad():
        layer.load_rows(0, torch.randn(n_out // 2, 192, generator=g))  # two loads: blocks repacked in place
        layer.load_rows(n_out // 2, torch.randn(n_out - n_out // 2, 192, generator=g))
    x = torch.randn(19, 192, generator=g)
    whole = layer(x)
    ref = fake_quantize_activations(x).double() @ layer.dequantized().double().t()
    torch.testing.assert_close(whole.double(), ref, atol=2e-5 * ref.abs().max().item(), rtol=1e-5)
    for rows in (1, 2, 5, 8, 9):
        assert torch.equal(layer(x[3:3 + rows]), whole[3:3 + rows])
    ids = torch.tensor([0, n_out - 1, 7, 7])
    assert torch.equal(layer.rows(ids), layer.dequantized()[ids])


def test_every_variant_gives_the_scalar_kernels_floats(isa_kernels):
    """The variants' int4 and q8 kernels (AVX512-VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, plain C++) give the
    very same floats, 4-bit and 8-bit codes, every tile size."""
    from kvcache import native
    reference = native.kernels("scalar")
    g = torch.Generator().manual_seed(4)
    for cls in (Int4Dense, Q8Dense):
        layer = cls(256, 40, bias=False)
        with torch.no_grad():
            layer.load_rows(0, torch.randn(40, 256, generator=g))
        for m in (1, 3, 4, 5, 8, 9, 17):
            x = torch.randn(m, 256, generator=g)
            a, b = torch.empty(m, 40), torch.empty(m, 40)
            getattr(isa_kernels, layer.KERNEL)(a, x, layer.qweight, layer.scale, layer.minimum)
            getattr(reference, layer.KERNEL)(b, x, layer.qweight, layer.scale, layer.minimum)
            assert torch.equal(a, b), f"{isa_kernels.isa}: {cls.__name__}, {m} rows"