"""Weight-only int8 linear layers (--quantization int8): the kernel against the dequantized float reference at every
row count it serves and past it, the quantization itself, and the whole model against its own dequantized float
twin (exactly what it computes) and against transformers (within int8's rounding)."""
from __future__ import annotations

import pytest
import torch

from tiny_models import TINY_ARCHS, hf_model
from kvcache import LLM, SamplingParams
from kvcache.config import EngineConfig
from kvcache.models.llama import Dense
from kvcache.models.loader import build_model, read_checkpoint
from kvcache.models.cpu_kernels import load
from kvcache.models.quant_linear import KERNEL_MAX_ROWS, Int8Dense, quantize_rows


def test_the_kernel_compiles_here():
    assert load() is not None  # else every int8 layer falls back to dequantizing per call (still correct, slow)


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
    assert torch.equal(scale, (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float16).tiny))
    err = (codes.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()  # half a step per channel, at most
    assert not codes[3].any()


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_the_int8_model_is_its_dequantized_twin_and_close_to_transformers(tiny_model_dirs, arch):
    path = tiny_model_dirs[arch]
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
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


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
    with pytest.raises(ValueError, match="quantization must be none or int8"):
        EngineConfig(model="/nonexistent", quantization="int4")
