"""DeepSeek-V2/V3 beyond transformers parity (test_hf_parity.py and the engine suites cover that): the latent cache
holds the planner's bytes, the absorbed and expanded forms agree, what the tiny configs exercise matters, and bad
configurations and unsupported combinations are refused with the field named."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcache import LLM, SamplingParams
from kvcache.models.deepseek import MoE
from kvcache.models.loader import ModelLoadError, build_model, read_checkpoint
from kvcache.plan.kv_bytes import kv_bytes_per_token, mha_equivalent_bytes_per_token
from kvcache.plan.model_source import load_model_shape
from test_half_precision import kv_logits
from tiny_models import hf_model

ARCHS = ["deepseek_v2", "deepseek_v3"]
IDS = list(range(3, 60))


@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_holds_one_latent_per_token_and_layer(tiny_model_dirs, arch, kv):
    """The pool's bytes per token are the planner's: (kv_lora_rank + qk_rope_head_dim) values per layer, one fp16
    scale per token for the quantized formats, no K/V pair, no heads."""
    path = tiny_model_dirs[arch]
    llm = LLM(path, kv_cache_dtype=kv, kv_cache_memory="1MiB", max_model_len=256)
    eng = llm.engine
    cfg = eng.model.config
    values = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    per_value = {"float32": 4, "bfloat16": 2}.get(kv, 1)
    want = cfg.num_hidden_layers * (values * per_value + (2 if per_value == 1 else 0))
    slots = eng.store.num_blocks * eng.kv.block_size
    assert eng.store.nbytes == want * slots
    shape = load_model_shape(path)
    assert kv_bytes_per_token(shape, kv) == eng.capacity.bytes_per_token == want
    # 4 heads' keys (32) and values (16) against the latent's 48 values: 4x the values (scales aside)
    assert mha_equivalent_bytes_per_token(shape, kv) >= 3.5 * want
    out = llm.generate([IDS], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    eng.check_no_leaks()


@pytest.mark.parametrize("arch", ARCHS)
def test_absorbed_attention_equals_the_expanded_form(tiny_model_dirs, arch):
    """Decode steps and chunks over a cached prefix read only latents (absorbed); expanding every row instead gives
    the same logits to float32 rounding, and the fresh prefill (expanded either way) is identical."""
    model = build_model(read_checkpoint(tiny_model_dirs[arch]), 128)
    absorbed = [kv_logits(model, IDS, c) for c in (len(IDS), 7, 1)]
    for layer in model.layers:
        layer.expanded = True
    expanded = [kv_logits(model, IDS, c) for c in (len(IDS), 7, 1)]
    assert torch.equal(absorbed[0], expanded[0])
    for a, e in zip(absorbed[1:], expanded[1:]):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=0)


def _logits_with(model, change) -> torch.Tensor:
    saved = {}
    change(model, saved)
    try:
        return kv_logits(model, IDS, 7)
    finally:
        for (obj, name), value in saved.items():
            setattr(obj, name, value)


def _set(saved, obj, name, value):
    saved[obj, name] = getattr(obj, name)
    setattr(obj, name, value)


MUTATIONS = {
    # each is something the tiny configs must exercise, or parity with transformers would not show it wrong
    "interleaved RoPE pairs": lambda m, s: [_set(s, layer, "interleaved", False) for layer in m.layers],
    "YaRN's softmax scale": lambda m, s: [_set(s, layer, "scale", (16 + 16) ** -0.5) for layer in m.layers],
    "the expert score bias": lambda m, s: [_set(s, moe, "score_bias", torch.nn.Parameter(moe.score_bias * 0))
                                           for moe in m._moe()],
    "expert groups": lambda m, s: [_set(s, moe, "grouped", False) for moe in m._moe()],
    "normalised weights": lambda m, s: [_set(s, moe, "normalize", False) for moe in m._moe()],
    "the shared experts": lambda m, s: [_set(s, moe, "shared", None) for moe in m._moe()],
}


@pytest.mark.parametrize("what", list(MUTATIONS))
def test_what_the_v3_config_exercises_changes_the_output(tiny_model_dirs, what):
    path = tiny_model_dirs["deepseek_v3"]
    model = build_model(read_checkpoint(path), 128)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(kv_logits(model, IDS, 7), ref, atol=1e-4, rtol=0)
    assert (_logits_with(model, MUTATIONS[what]) - ref).abs().max().item() > 1e-3


def test_v2_routing_is_limited_to_the_best_groups(tiny_model_dirs):
    model = build_model(read_checkpoint(tiny_model_dirs["deepseek_v2"]), 128)
    moe = model._moe()[0]
    h = torch.randn(64, model.config.hidden_size)
    _, ids = moe.route(h)
    groups = ids // (len(moe.experts) // moe.num_groups)
    assert all(len(set(row)) <= moe.topk_group for row in groups.tolist())
    moe.grouped = False
    _, free = moe.route(h)
    assert not torch.equal(ids.sort(-1).values, free.sort(-1).values)  # the limit changes some token's choice


def _edited_copy(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim must be even"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds n_routed_experts 8"),
    ({"n_group": 3}, "n_group 3 must divide n_routed_experts 8"),
    ({"q_lora_rank": -1}, "q_lora_rank must be a positive integer"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "quantized"),
])
def test_inconsistent_configs_are_refused_naming_the_field(tiny_model_dirs, tmp_path, changes, message):
    path = _edited_copy(tiny_model_dirs["deepseek_v3"], str(tmp_path / "m"), **changes)
    with pytest.raises(ModelLoadError, match=message):
        read_checkpoint(path)


def test_multi_token_prediction_layers_are_left_unread(tiny_model_dirs, tmp_path):
    """V3 checkpoints carry their MTP module as a layer past the last (model.layers.61.* of 61): not run, not an
    error; any other tensor the model does not read still is."""
    path = str(tmp_path / "mtp")
    shutil.copytree(tiny_model_dirs["deepseek_v3"], path)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, f, metadata={"format": "pt"})
    build_model(read_checkpoint(path), 64)
    tensors["model.layers.1.mlp.experts.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(KeyError, match="does not use"):
        build_model(read_checkpoint(path), 64)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_dtype="int4"), "an MLA latent is both at once: use fp8 or int8"),
    (dict(kv_eviction="h2o", kv_budget=64), "not supported on MLA models"),
])
def test_unsupported_combinations_are_refused_before_loading(tiny_model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dirs["deepseek_v2"], kv_cache_memory="1MiB", **kwargs)


def test_the_router_stays_float32_in_half_precision(tiny_model_dirs):
    model = build_model(read_checkpoint(tiny_model_dirs["deepseek_v3"]), 64, dtype=torch.bfloat16)
    moe = model._moe()[0]
    assert isinstance(moe, MoE) and moe.gate.dtype == moe.score_bias.dtype == torch.float32
    assert model.layers[0].kv_b.dtype == torch.bfloat16
