"""Tiny random-weight checkpoints built with transformers' own config classes, and transformers as the
oracle (its model and greedy generation). Imported by tests and by conftest.py's fixtures."""
from __future__ import annotations

import os

import torch
from kvcache.models.random_checkpoint import save_random_checkpoint
from transformers import (AutoConfig, AutoModelForCausalLM, BambaConfig, DeepseekV2Config, DeepseekV3Config, Gemma2Config,
                          Gemma3TextConfig, LlamaConfig, Mamba2Config, MistralConfig, Qwen2Config, Qwen3Config,
                          Qwen3NextConfig)

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (config class, overrides). Together they cover GQA, MQA, MHA, biases, q/k norm,
# sliding window, tied embeddings, explicit head_dim and Llama 3 RoPE scaling.
TINY_ARCHS = {
    "llama": (LlamaConfig, {}),
    "llama-mqa-tied": (LlamaConfig, {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama3-rope": (LlamaConfig, {"num_key_value_heads": 4, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral-swa": (MistralConfig, {"sliding_window": 24}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),
    # layer 0 full attention, layer 1 a window of 24 (max_window_layers: the first layers stay full)
    "qwen2-swa": (Qwen2Config, {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
    # local (window 24) then global layers, attention scores soft-capped low enough to matter, (1 + w) norms
    "gemma2": (Gemma2Config, {"head_dim": 32, "query_pre_attn_scalar": 1, "sliding_window": 24,
                              "attn_logit_softcapping": 1.0, "final_logit_softcapping": 8.0}),
    # a local layer (window 24, its own RoPE base) then a global one; q/k norms, (1 + w) norms, GELU, scaled and
    # tied embeddings, a query scale that is not head_dim's, soft-capped logits
    "gemma3": (Gemma3TextConfig, {"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 24,
                                  "layer_types": ["sliding_attention", "full_attention"],
                                  "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                      "full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                  "final_logit_softcapping": 8.0}),
    # MLA (latent 32 + rope 16), a dense first layer then MoE: DeepSeek-V2-Lite's shape (no q compression),
    # softmax routing limited to the best of 4 expert groups (by its best expert: with 2 groups of the top 2
    # experts the limit would never bind), two shared experts
    "deepseek_v2": (DeepseekV2Config, {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
                                       "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                                       "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 1,
                                       "topk_method": "group_limited_greedy", "n_shared_experts": 2,
                                       "moe_intermediate_size": 64, "first_k_dense_replace": 1,
                                       "routed_scaling_factor": 1.5}),
    # V3: q compression, sigmoid routing with the score bias over groups, normalised weights, YaRN RoPE whose
    # mscale_all_dim scales the softmax
    "deepseek_v3": (DeepseekV3Config, {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 64,
                                       "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
                                       "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                                       "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
                                       "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                                                        "beta_fast": 32, "beta_slow": 1}}),
}


# State-space and hybrid models (their own tests: many features are refused on them). Mixers of 8 heads x 16 in 2
# groups, a state of 16, a conv of 4 and scan blocks of 16 tokens, so that prompts span several blocks.
MAMBA = dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4, chunk_size=16, expand=2)
TINY_HYBRIDS = {
    "mamba2": (Mamba2Config, {**{k: v for k, v in COMMON.items() if "heads" not in k and k != "intermediate_size"},
                              "layer_norm_epsilon": 1e-5, **MAMBA}),
    # mixer, attention (half of each head rotated), mixer; each followed by a gated MLP
    "bamba": (BambaConfig, {**COMMON, "num_hidden_layers": 3, "attn_layer_indices": [1],
                            **{"mamba_" + {"num_heads": "n_heads", "head_dim": "d_head", "state_size": "d_state",
                                           "conv_kernel": "d_conv", "n_groups": "n_groups", "chunk_size": "chunk_size",
                                           "expand": "expand"}[k]: v for k, v in MAMBA.items()}}),
    # Gated DeltaNet (2 key heads serving 4 value heads) in layers 0-2, gated attention (a quarter of each head
    # rotated) in layer 3; MoE of 4 experts (top 2, a gated shared expert) everywhere but layer 1's dense MLP
    "qwen3_next": (Qwen3NextConfig, {**COMMON, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
                                     "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                                     "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32, "mlp_only_layers": [1]}),
}


def make_tiny_model(directory: str, arch: str, seed: int = 0) -> str:
    """Save a random-weight `arch` model (safetensors + config.json + tokenizer) in `directory`."""
    cls, overrides = TINY_ARCHS[arch] if arch in TINY_ARCHS else TINY_HYBRIDS[arch]
    return save_random_checkpoint(directory, cls(**{**COMMON, **overrides} if arch in TINY_ARCHS else overrides), seed)


def hf_load(path: str, dtype: torch.dtype, **kwargs):
    """transformers' model of a tiny directory in `dtype`. Soft-capped attention (Gemma-2) asks for the eager
    implementation: SDPA cannot cap the scores and drops the cap, and transformers 5.17 picks SDPA for Gemma-2 by
    default (5.25 picks eager), which made the oracle another model."""
    if getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None):
        kwargs.setdefault("attn_implementation", "eager")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)


def hf_model(path: str):
    """transformers' model for a tiny directory or a GGUF file, fp32, eval mode."""
    if os.path.isfile(path):
        d, name = os.path.split(path)
        return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return hf_load(path, torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt: exactly `n` tokens, EOS disabled."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=n,
                             max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == n
    return tokens


OVERFLOW_TOKEN = 7


def make_fp16_overflow_model(src: str, directory: str) -> str:
    """A copy of the tiny model at `src` whose float16 activations overflow on OVERFLOW_TOKEN only: its embedding
    is float16's largest value and the first MLP's output is scaled up, so the residual sum passes 65,504 and
    turns inf, then NaN. In float32 nothing overflows; other tokens are unaffected."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, directory)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    tensors["model.embed_tokens.weight"][OVERFLOW_TOKEN] = torch.finfo(torch.float16).max
    tensors["model.layers.0.mlp.down_proj.weight"] *= 10_000
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
