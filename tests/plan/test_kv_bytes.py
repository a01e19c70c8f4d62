"""The KV byte formula: per attention kind and dtype, the issue's reference values, and how a budget divides."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.plan.kv_bytes import (KV_DTYPES, cache_capacity, heads_per_gpu, kv_bytes_per_token, kv_cache_bytes,
                                   kv_dtype, kv_formula, layer_bytes_per_token, residual_bytes_per_seq,
                                   sequence_blocks, state_bytes_per_seq)
from kvcache.plan.model_source import load_model_shape
from kvcache.plan.shape import ModelShape

GiB = 2**30
SMOLLM2 = ModelShape(num_layers=30, num_kv_heads=3, head_dim=64, num_attention_heads=9)


@pytest.mark.parametrize("dtype,want", [("float32", 46_080), ("bfloat16", 23_040), ("float16", 23_040),
                                        ("fp32", 46_080), ("bf16", 23_040)])
def test_smollm2_dtypes(dtype, want):
    assert kv_bytes_per_token(SMOLLM2, dtype) == want


def test_llama3_8b_is_128_kib_per_token():
    assert kv_bytes_per_token(load_model_shape("llama-3-8b"), "bfloat16") == 131_072


# ---- the reference values --------------------------------------------------------------

def test_llama3_70b_fp16_batch16_16k():
    # 2 x 80 layers x 8 KV heads x 128 x 2 bytes = 327,680 bytes/token; x 16 x 16,384 tokens = 80 GiB.
    # The issue quotes 68,719,476,736 (64 GiB), which would need 64 layers: it contradicts its own third
    # reference (128k tokens = 40 GiB), since 16 x 16,384 tokens is exactly twice 131,072.
    shape = load_model_shape("llama-3-70b")
    assert kv_cache_bytes(shape, "float16", 16, 16_384).total_bytes == 85_899_345_920 == 80 * GiB
    assert kv_cache_bytes(shape, "float16", 16, 16_384).total_bytes == 2 * kv_cache_bytes(
        shape, "bfloat16", 1, 131_072).total_bytes


def test_llama3_70b_bf16_128k_is_40_gib():
    assert kv_cache_bytes(load_model_shape("llama-3-70b"), "bfloat16", 1, 131_072).total_bytes == 40 * GiB


def test_80_layer_mha_d8192():
    # MHA, d_model 8192 (64 heads x 128): 2 x 80 x 8192 x 2 bytes = 2,621,440 bytes/token; x 16 x 4,096 = 160 GiB.
    # The 137,438,953,472 (128 GiB) again corresponds to 64 layers, not 80.
    shape = ModelShape(num_layers=80, num_kv_heads=64, head_dim=128, num_attention_heads=64)
    assert shape.attention_kind == "MHA"
    assert kv_cache_bytes(shape, "float16", 16, 4096).total_bytes == 171_798_691_840 == 160 * GiB


# ---- attention kinds ---------------------------------------------------------------------------

def test_gqa_and_mqa_use_kv_heads_not_query_heads():
    gqa = ModelShape(num_layers=4, num_kv_heads=2, head_dim=64, num_attention_heads=8)
    mqa = ModelShape(num_layers=4, num_kv_heads=1, head_dim=64, num_attention_heads=8)
    assert (gqa.attention_kind, mqa.attention_kind) == ("GQA", "MQA")
    assert kv_bytes_per_token(gqa, "float16") == 2 * 4 * 2 * 64 * 2
    assert kv_bytes_per_token(mqa, "float16") == 2 * 4 * 1 * 64 * 2


def test_mla_caches_one_latent_without_the_kv_pair():
    v3 = load_model_shape("deepseek-v3")
    assert v3.attention_kind == "MLA"
    assert kv_bytes_per_token(v3, "bfloat16") == 61 * (512 + 64) * 2 == 70_272
    lite = load_model_shape("deepseek-v2-lite")
    assert kv_bytes_per_token(lite, "bfloat16") == 27 * 576 * 2 == 31_104
    # tensor parallelism replicates the latent: every rank stores all of it
    assert kv_bytes_per_token(v3, "bfloat16", tensor_parallel_size=8) == 70_272


def test_gemma2_uses_stated_head_dim_and_caps_sliding_layers():
    g = load_model_shape("gemma-2-9b")
    assert g.head_dim == 256 and g.hidden_size // g.num_attention_heads == 224
    assert (g.count("sliding"), g.count("full"), g.sliding_window) == (21, 21, 4096)
    assert g.layer_kinds[:2] == ("sliding", "full")
    per_layer = 2 * 8 * 256 * 2
    assert kv_bytes_per_token(g, "bfloat16") == 42 * per_layer
    c = kv_cache_bytes(g, "bfloat16", 2, 8192)
    assert c.total_bytes == 2 * (21 * per_layer * 8192 + 21 * per_layer * 4096)
    # the paged pool's per-layer-group tables give back the sliding group's out-of-window blocks: what it holds is
    # the layer-by-layer count, and kvcache plan prints no separate paged line
    assert c.paged_bytes == c.total_bytes
    # below the window every layer holds every token
    assert kv_cache_bytes(g, "bfloat16", 1, 4096).total_bytes == 42 * per_layer * 4096


def test_mistral_every_layer_windowed():
    m = load_model_shape("mistral-7b-v0.1")
    assert set(m.layer_kinds) == {"sliding"}
    assert kv_cache_bytes(m, "bfloat16", 1, 32_768).total_bytes == 131_072 * 4096
    # kvcache's pool gives back out-of-window blocks of such a model: it holds the window too (and the planner
    # prints no separate paged line), as for Gemma-2 above
    assert kv_cache_bytes(m, "bfloat16", 3, 32_768).paged_bytes == 3 * 131_072 * 4096


def test_linear_attention_layers_cost_constant_state():
    q = load_model_shape("qwen3-next-80b-a3b")
    assert (q.count("full"), q.count("linear")) == (12, 36)
    assert kv_bytes_per_token(q, "bfloat16") == 12 * 2 * 2 * 256 * 2
    # Gated DeltaNet: 32 value heads x 128 x 128 recurrent + (2 x 16 x 128 + 32 x 128) x (4 - 1) conv, bf16
    per_layer = 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3
    assert state_bytes_per_seq(q) == 36 * per_layer * 2
    short, long = kv_cache_bytes(q, "bfloat16", 1, 10), kv_cache_bytes(q, "bfloat16", 1, 10_000)
    assert short.state_bytes == long.state_bytes == 36 * per_layer * 2


# ---- quantized storage -------------------------------------------------------------------------

def test_fp8_int8_add_one_fp16_scale_per_token_and_head():
    shape = load_model_shape("llama-3-8b")
    for d in ("fp8_e4m3", "fp8_e5m2", "fp8", "int8"):
        assert kv_bytes_per_token(shape, d) == 32 * 8 * 2 * (128 + 2) == 66_560


def test_kivi_int4_int2_layout():
    shape = load_model_shape("llama-3-8b")
    # keys: 128 values x 4 bits + (scale, zero) fp16 per channel per 64 tokens = 64 + 8; values: 64 + 2 groups x 4
    assert kv_bytes_per_token(shape, "int4") == 32 * 8 * ((64 + 8) + (64 + 8)) == 36_864
    assert kv_bytes_per_token(shape, "int2") == 32 * 8 * ((32 + 8) + (32 + 8)) == 20_480
    # at most 63 newest keys per sequence wait in fp16 for their group to fill
    assert residual_bytes_per_seq(shape, "int4") == 63 * 32 * 8 * 128 * 2
    assert residual_bytes_per_seq(shape, "int8") == 0
    c = kv_cache_bytes(shape, "int4", 3, 1000)
    assert c.total_bytes == 3 * 1000 * 36_864 + 3 * residual_bytes_per_seq(shape, "int4")


def test_int4_capacity_ratio_on_the_demo_shape():
    # The quantization issue's targets: 3.2x fp16 for int4, 1.9x for int8, scales and residual counted.
    # int4 takes 64-token blocks (a KIVI key group never straddles blocks); its 63-token fp16 key residual
    # (725,760 bytes) needs 1.75 blocks of 414,720 bytes and takes 2 whole ones, so 1k-token requests
    # reach 3.16x, while the tokens the pool holds reach 3.56x.
    fp16 = cache_capacity(SMOLLM2, "float16", GiB, 16, 1024)
    int4 = cache_capacity(SMOLLM2, "int4", GiB, 64, 1024)
    assert int4.seq_blocks == sequence_blocks(SMOLLM2, "int4", 64) == 2
    assert residual_bytes_per_seq(SMOLLM2, "int4") == 725_760 and int4.block_size * int4.bytes_per_token == 414_720
    assert int4.num_tokens / fp16.num_tokens == pytest.approx(3.556, abs=1e-3)
    assert int4.max_concurrency / fp16.max_concurrency == pytest.approx(3.161, abs=1e-3)
    assert cache_capacity(SMOLLM2, "int8", GiB, 16, 1024).max_concurrency / fp16.max_concurrency >= 1.9
    with pytest.raises(ValueError, match="multiple of 64"):
        cache_capacity(SMOLLM2, "int4", GiB, 16, 1024)


def test_kivi_rejects_head_dims_it_cannot_group():
    with pytest.raises(ValueError, match="head_dim 40"):
        kv_bytes_per_token(ModelShape(num_layers=1, num_kv_heads=1, head_dim=40), "int4")


def test_unknown_dtype_lists_the_supported_ones():
    with pytest.raises(ValueError) as e:
        kv_bytes_per_token(SMOLLM2, "int3")
    for name in ("int3", *KV_DTYPES, "fp8"):
        assert name in str(e.value)


@given(layers=st.integers(1, 128), kvh=st.integers(1, 64), hd=st.sampled_from([16, 32, 64, 80, 96, 128, 256]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16", "int8", "fp8_e5m2"]))
def test_formula_matches_textbook(layers, kvh, hd, dtype):
    shape = ModelShape(num_layers=layers, num_kv_heads=kvh, head_dim=hd)
    spec = kv_dtype(dtype)
    scale = 2 if spec.scales != "none" else 0
    assert kv_bytes_per_token(shape, dtype) == 2 * layers * kvh * (hd * spec.bits // 8 + scale)
    assert kv_formula(shape, dtype).endswith(f"= {kv_bytes_per_token(shape, dtype):,} bytes/token")


def test_formula_substitutes_the_numbers():
    assert kv_formula(SMOLLM2, "float32") == "30 full layers x 2 x 3 kv_heads x 64 head_dim x 4 bytes = 46,080 bytes/token"
    assert "(64 + 2 scale)" in kv_formula(SMOLLM2, "int8")


# ---- tensor parallelism and capacity -------------------------------------------------------------

def test_heads_split_then_replicate():
    assert [heads_per_gpu(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ValueError, match="8 KV heads"):
        heads_per_gpu(8, 3)
    shape = load_model_shape("llama-3-8b")
    assert layer_bytes_per_token(shape, "bfloat16", "full", 16) == 2 * 1 * 128 * 2


def test_budget_divides_into_blocks():
    c = cache_capacity(SMOLLM2, "float32", 2 * GiB, 16, 8192)
    assert c.num_blocks == 2 * GiB // (16 * 46_080) == 2912
    assert c.num_tokens == 2912 * 16 and c.total_bytes == 2912 * 16 * 46_080
    assert c.max_concurrency == pytest.approx(2912 / 512)


def test_budget_below_one_block():
    with pytest.raises(ValueError, match="smaller than one block"):
        cache_capacity(SMOLLM2, "float32", 1000, 16, 2048)


def test_bad_batch_or_length():
    with pytest.raises(ValueError, match="batch=0"):
        kv_cache_bytes(SMOLLM2, "float32", 0, 10)
    with pytest.raises(ValueError, match="seq_len=-1"):
        kv_cache_bytes(SMOLLM2, "float32", 1, -1)
