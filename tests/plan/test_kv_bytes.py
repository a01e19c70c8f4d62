"""The KV byte formula and how a budget divides into blocks and tokens."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.plan.kv_bytes import DTYPE_BYTES, AttentionShape, cache_capacity, kv_bytes_per_token, kv_formula

SMOLLM2 = AttentionShape(num_layers=30, num_kv_heads=3, head_dim=64)


def test_smollm2_fp32():
    assert kv_bytes_per_token(SMOLLM2, "float32") == 46_080


@pytest.mark.parametrize("dtype,want", [("float32", 46_080), ("bfloat16", 23_040), ("float16", 23_040)])
def test_smollm2_dtypes(dtype, want):
    assert kv_bytes_per_token(SMOLLM2, dtype) == want


def test_llama3_8b():
    # 32 layers, 8 kv heads (GQA), head_dim 128, bf16: the well-known 128 KiB per token
    assert kv_bytes_per_token(AttentionShape(32, 8, 128), "bfloat16") == 131_072


def test_mqa_and_sliding_window_shape():
    assert kv_bytes_per_token(AttentionShape(2, 1, 16), "float32") == 2 * 2 * 1 * 16 * 4
    # a paged store keeps every token, so the per-token cost does not depend on the window
    assert kv_bytes_per_token(AttentionShape(2, 2, 16, sliding_window=24), "float32") == 2 * 2 * 2 * 16 * 4


@given(layers=st.integers(1, 128), kvh=st.integers(1, 64), hd=st.sampled_from([16, 32, 64, 80, 96, 128, 256]),
       dtype=st.sampled_from(sorted(DTYPE_BYTES)))
def test_formula(layers, kvh, hd, dtype):
    per = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    assert kv_bytes_per_token(AttentionShape(layers, kvh, hd), dtype) == 2 * layers * kvh * hd * per


def test_unknown_dtype():
    with pytest.raises(ValueError) as e:
        kv_bytes_per_token(SMOLLM2, "int3")
    msg = str(e.value)
    assert "int3" in msg
    for d in ("float32", "bfloat16", "float16"):
        assert d in msg
    with pytest.raises(ValueError, match="fp32"):
        cache_capacity(SMOLLM2, "fp32", 1 << 30, 16, 2048)


def test_kv_formula_unknown_dtype_is_the_same_value_error():
    with pytest.raises(ValueError, match="int3"):
        kv_formula(SMOLLM2, "int3")


def test_kv_formula_text():
    s = kv_formula(SMOLLM2, "float32")
    assert s == "2 x 30 layers x 3 kv_heads x 64 head_dim x 4 bytes = 46,080 bytes/token"


def test_cache_capacity_smollm2_256mib():
    budget = 256 * 1024 * 1024
    cap = cache_capacity(SMOLLM2, "float32", budget, block_size=16, max_model_len=2048)
    block_bytes = 46_080 * 16  # 737,280
    assert cap.bytes_per_token == 46_080
    assert cap.block_size == 16
    assert cap.num_blocks == 364  # 268,435,456 // 737,280
    assert cap.num_blocks == budget // block_bytes
    assert cap.num_tokens == 364 * 16 == 5_824
    assert cap.total_bytes == 364 * block_bytes == 268_369_920
    assert cap.total_bytes <= budget
    assert cap.max_model_len == 2048
    assert cap.max_concurrency == pytest.approx(364 / 128)


def test_cache_capacity_partial_request_rounds_up_blocks():
    shape = AttentionShape(1, 1, 2)  # 16 bytes/token fp32
    cap = cache_capacity(shape, "float32", budget_bytes=16 * 4 * 10 + 63, block_size=4, max_model_len=9)
    assert cap.num_blocks == 10  # the leftover 63 bytes do not make a block
    assert cap.num_tokens == 40
    assert cap.max_concurrency == pytest.approx(10 / 3)  # 9 tokens need 3 blocks of 4


def test_cache_capacity_exactly_one_block():
    per = kv_bytes_per_token(SMOLLM2, "float32")
    cap = cache_capacity(SMOLLM2, "float32", per * 16, 16, 16)
    assert cap.num_blocks == 1 and cap.num_tokens == 16 and cap.max_concurrency == 1.0


def test_budget_too_small_names_the_numbers():
    with pytest.raises(ValueError) as e:
        cache_capacity(SMOLLM2, "float32", budget_bytes=737_279, block_size=16, max_model_len=2048)
    msg = str(e.value)
    assert "737,279" in msg  # the budget
    assert "737,280" in msg  # one block
    assert "46,080" in msg  # one token
    assert "16" in msg  # tokens per block


@given(budget=st.integers(0, 10**9), bs=st.sampled_from([1, 2, 4, 8, 16, 32]), mml=st.integers(1, 10_000))
def test_capacity_never_exceeds_budget(budget, bs, mml):
    per = kv_bytes_per_token(SMOLLM2, "bfloat16")
    if budget < per * bs:
        with pytest.raises(ValueError):
            cache_capacity(SMOLLM2, "bfloat16", budget, bs, mml)
        return
    cap = cache_capacity(SMOLLM2, "bfloat16", budget, bs, mml)
    assert cap.total_bytes <= budget < cap.total_bytes + per * bs
    assert cap.num_tokens == cap.num_blocks * bs
    assert cap.total_bytes == cap.num_tokens * per
