"""Model shapes from transformers' own config classes, presets, GGUF metadata and safetensors headers.

The oracle for parameter counts is the transformers model itself (numel of its weights)."""
from __future__ import annotations

import json

import pytest
import transformers as T

from kvcache.plan.kv_bytes import kv_bytes_per_token
from kvcache.plan.model_source import load_model_shape
from kvcache.plan.presets import MODEL_PRESETS
from kvcache.plan.shape import ConfigError, estimate_parameters, shape_from_config

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
             intermediate_size=128)
MLA = dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=16, vocab_size=100, intermediate_size=128, moe_intermediate_size=32,
           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
           topk_group=1)

# name -> (config, model class): dense, tied, biased, q/k-normed, MoE, Gemma norms, MLA with and without q LoRA
PARAM_CASES = {
    "llama": (T.LlamaConfig(**SMALL), T.LlamaForCausalLM),
    "llama-mqa-tied": (T.LlamaConfig(**{**SMALL, "num_key_value_heads": 1}, tie_word_embeddings=True),
                       T.LlamaForCausalLM),
    "qwen2": (T.Qwen2Config(**SMALL), T.Qwen2ForCausalLM),
    "qwen3": (T.Qwen3Config(**SMALL, head_dim=32), T.Qwen3ForCausalLM),
    "mixtral": (T.MixtralConfig(**SMALL, num_local_experts=4), T.MixtralForCausalLM),
    "gemma2": (T.Gemma2Config(**SMALL, head_dim=32), T.Gemma2ForCausalLM),
    "deepseek-v2": (T.DeepseekV2Config(**MLA, q_lora_rank=None), T.DeepseekV2ForCausalLM),
    "deepseek-v3": (T.DeepseekV3Config(**MLA, q_lora_rank=24), T.DeepseekV3ForCausalLM),
}


@pytest.mark.parametrize("name", PARAM_CASES)
def test_parameter_estimate_equals_transformers(name):
    cfg, cls = PARAM_CASES[name]
    model = cls(cfg)
    # DeepSeek-V3's router bias is a buffer in transformers but a weight in the checkpoint
    want = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for k, b in model.named_buffers() if "e_score_correction_bias" in k)
    assert shape_from_config(cfg.to_dict()).num_parameters == want


@pytest.mark.parametrize("name", [n for n in MODEL_PRESETS if n not in ("qwen3-next-80b-a3b", "gpt-3-175b")])
def test_presets_agree_with_their_published_parameter_counts(name):
    _, published, cfg = MODEL_PRESETS[name]
    assert estimate_parameters(cfg, load_model_shape(name)) == published


def test_gpt3_estimate_is_close():
    _, published, cfg = MODEL_PRESETS["gpt-3-175b"]
    assert estimate_parameters(cfg, load_model_shape("gpt-3-175b")) == pytest.approx(published, rel=0.01)


def test_layer_kinds_from_transformers_configs():
    g2 = shape_from_config(T.Gemma2Config(**{**SMALL, "num_hidden_layers": 6}, head_dim=32, sliding_window=16).to_dict())
    assert g2.layer_kinds == ("sliding", "full") * 3 and g2.sliding_window == 16 and g2.head_dim == 32
    g3 = shape_from_config(T.Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 12}, head_dim=32,
                                              sliding_window=16).to_dict())
    assert [i for i, k in enumerate(g3.layer_kinds) if k == "full"] == [5, 11]
    mistral = shape_from_config(T.MistralConfig(**SMALL, sliding_window=24).to_dict())
    assert mistral.layer_kinds == ("sliding", "sliding") and mistral.sliding_window == 24
    qwen_sw = shape_from_config(T.Qwen2Config(**{**SMALL, "num_hidden_layers": 4}, sliding_window=24,
                                              use_sliding_window=True, max_window_layers=2).to_dict())
    assert qwen_sw.layer_kinds == ("full", "full", "sliding", "sliding")
    qwen_off = shape_from_config(T.Qwen2Config(**SMALL, sliding_window=24, use_sliding_window=False).to_dict())
    assert set(qwen_off.layer_kinds) == {"full"} and qwen_off.sliding_window is None
    mla = shape_from_config(T.DeepseekV3Config(**MLA, q_lora_rank=24).to_dict())
    assert mla.attention_kind == "MLA" and kv_bytes_per_token(mla, "float16") == 3 * (32 + 8) * 2


def test_hybrid_linear_layers():
    nxt = shape_from_config(T.Qwen3NextConfig(**{**SMALL, "num_hidden_layers": 8}, head_dim=16, linear_num_key_heads=2,
                                              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                              linear_conv_kernel_dim=4, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2).to_dict())
    assert nxt.layer_kinds == ("linear",) * 3 + ("full",) + ("linear",) * 3 + ("full",)
    assert nxt.linear_state_values == 4 * 8 * 8 + (2 * 2 * 8 + 4 * 8) * 3
    jamba = shape_from_config(T.JambaConfig(**{**SMALL, "num_hidden_layers": 8}, attn_layer_period=4, attn_layer_offset=2,
                                            mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, num_experts=2).to_dict())
    assert [i for i, k in enumerate(jamba.layer_kinds) if k == "full"] == [2, 6]
    assert jamba.linear_state_values == 128 * 4 + 128 * 3  # d_inner = 2 x 64: SSM state + conv state
    assert jamba.num_parameters is None  # not estimated for hybrid models: the planner asks for it


def test_gguf_demo_model(demo_path):
    s = load_model_shape(demo_path)
    preset = load_model_shape("smollm2-135m")
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.num_attention_heads) == (30, 3, 64, 9)
    assert s.num_parameters == 134_515_008 == preset.num_parameters  # exact, from the GGUF tensor list
    assert kv_bytes_per_token(s, "bfloat16") == kv_bytes_per_token(preset, "bfloat16") == 23_040
    assert s.max_position_embeddings == 8192 and s.vocab_size == 49_152


def test_safetensors_directory_counts_parameters_exactly(tiny_model_dirs):
    from safetensors.torch import load_file
    for arch in ("llama", "qwen3", "mistral-swa"):
        d = tiny_model_dirs[arch]
        s = load_model_shape(d)
        assert s.num_parameters == sum(t.numel() for t in load_file(f"{d}/model.safetensors").values())
    assert load_model_shape(tiny_model_dirs["mistral-swa"]).sliding_window == 24


def test_config_missing_a_field_names_it(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_model_shape(str(p))
    p.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 8}))
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        load_model_shape(str(p))


@pytest.mark.parametrize("cfg,match", [
    ({**SMALL, "num_key_value_heads": 3}, "divisor"),
    ({**SMALL, "hidden_size": 66}, "not a multiple"),
    ({**SMALL, "layer_types": ["full_attention"]}, "1 entries for 2 layers"),
    ({**SMALL, "layer_types": ["full_attention", "warp_attention"]}, "warp_attention"),
    ({**SMALL, "layer_types": ["full_attention", "linear_attention"]}, "linear_num_value_heads"),
    ({**SMALL, "num_hidden_layers": 0}, "positive integer"),
])
def test_contradictory_configs(cfg, match):
    with pytest.raises(ConfigError, match=match):
        shape_from_config(cfg)


def test_unknown_preset_suggests_close_names():
    with pytest.raises(ConfigError) as e:
        load_model_shape("llama-3-7b")
    assert "llama-3-8b" in str(e.value) and "llama-3-70b" in str(e.value)


def test_not_gguf_and_not_json(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_model_shape(str(fake))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        load_model_shape(str(truncated))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ConfigError, match="not a readable JSON"):
        load_model_shape(str(text))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON list"):
        load_model_shape(str(tmp_path / "list.json"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_shape(str(tmp_path / "empty_dir"))
