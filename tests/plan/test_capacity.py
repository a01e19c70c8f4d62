"""Capacity planning: device memory -> KV budget -> blocks, tokens, concurrency; and the engine agrees."""
from __future__ import annotations

import pytest

from kvcache.plan.capacity import RUNTIME_RESERVE, activation_reserve, pipeline_stages, plan_device, weight_dtype
from kvcache.plan.kv_bytes import kv_bytes_per_token
from kvcache.plan.model_source import load_model_shape
from kvcache.plan.presets import GPU_PRESETS

GiB = 2**30


def test_budget_arithmetic_on_one_h100():
    shape = load_model_shape("llama-3-8b")
    p = plan_device(shape, "bfloat16", memory_per_gpu=GPU_PRESETS["h100-80gb"], seq_len=8192, batch=4)
    assert p.weight_dtype == "bfloat16" and p.weight_bytes == 8_030_261_248 * 2
    assert p.activation_bytes == activation_reserve(shape, "bfloat16", 1) > RUNTIME_RESERVE
    assert p.kv_budget == int(GPU_PRESETS["h100-80gb"] * 0.9) - p.weight_bytes - p.activation_bytes
    c = p.capacity
    assert c.num_blocks == p.kv_budget // (16 * 131_072)
    assert c.num_tokens == 16 * c.num_blocks
    assert c.max_concurrency == pytest.approx(c.num_blocks / 512)
    assert p.max_seq_len_for_batch == (c.num_blocks // 4) * 16
    assert p.kv_cache_bytes == c.num_blocks * 16 * 131_072


def test_tensor_parallel_splits_weights_and_kv_heads():
    shape = load_model_shape("llama-3-70b")
    two = plan_device(shape, "bfloat16", memory_per_gpu=GPU_PRESETS["h200"], num_gpus=2, seq_len=8192)
    four = plan_device(shape, "bfloat16", memory_per_gpu=GPU_PRESETS["h200"], num_gpus=4, seq_len=8192)
    assert four.tensor_parallel_size == 4 and four.weight_bytes == two.weight_bytes // 2
    assert four.capacity.bytes_per_token == two.capacity.bytes_per_token // 2 == 80 * 2 * 2 * 128 * 2
    assert four.capacity.num_tokens > 2 * two.capacity.num_tokens  # more memory per GPU left for KV, too
    assert four.kv_cache_bytes == 4 * four.capacity.total_bytes
    with pytest.raises(ValueError, match="weights"):  # 141 GB of bf16 weights do not fit one H200
        plan_device(shape, "bfloat16", memory_per_gpu=GPU_PRESETS["h200"], seq_len=8192)


def test_pipeline_parallel_splits_layers():
    shape = load_model_shape("llama-3-70b")
    stages = pipeline_stages(shape, 3)
    assert [s.num_layers for s in stages] == [27, 27, 26]
    p = plan_device(shape, "bfloat16", memory_per_gpu=GPU_PRESETS["a100-80gb"], num_gpus=6, tensor_parallel_size=2,
                    seq_len=8192)
    assert p.pipeline_parallel_size == 3
    assert p.capacity.bytes_per_token == 27 * 2 * 4 * 128 * 2  # the fullest stage, 4 KV heads per GPU


def test_float32_checkpoints_are_served_in_bfloat16_by_default():
    assert weight_dtype("auto", load_model_shape("gemma-2-9b")) == "bfloat16"
    assert weight_dtype("fp8", load_model_shape("gemma-2-9b")) == "fp8"
    with pytest.raises(ValueError, match="int3"):
        weight_dtype("int3", load_model_shape("gemma-2-9b"))


def test_weights_that_do_not_fit():
    with pytest.raises(ValueError, match="weights"):
        plan_device(load_model_shape("llama-3-70b"), "bfloat16", memory_per_gpu=GPU_PRESETS["a100-80gb"], seq_len=8192)
    p = plan_device(load_model_shape("llama-3-70b"), "bfloat16", memory_per_gpu=GPU_PRESETS["a100-80gb"],
                    weights="int4", seq_len=8192)
    assert p.weight_bytes == 70_553_706_496 // 2


def test_hybrid_model_needs_a_parameter_count():
    import dataclasses
    shape = load_model_shape("qwen3-next-80b-a3b")
    p = plan_device(shape, "bfloat16", memory_per_gpu=GPU_PRESETS["h200"], num_gpus=2, seq_len=65536)
    assert p.capacity.seq_blocks > 0  # the Gated DeltaNet state of each request comes out of the pool
    with pytest.raises(ValueError, match="--num-parameters"):
        plan_device(dataclasses.replace(shape, num_parameters=None), "bfloat16",
                    memory_per_gpu=GPU_PRESETS["h200"], seq_len=1024)


def test_bad_deployments():
    shape = load_model_shape("llama-3-8b")
    with pytest.raises(ValueError, match="multiple of tensor_parallel_size"):
        plan_device(shape, "bfloat16", memory_per_gpu=GiB, num_gpus=3, tensor_parallel_size=2, seq_len=10)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan_device(shape, "bfloat16", memory_per_gpu=GiB, gpu_memory_utilization=1.5, seq_len=10)
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        plan_device(shape, "bfloat16", seq_len=10)


def test_engine_sizes_its_pool_as_the_planner_says(tiny_llama):
    """The engine's start-up numbers and kv_cache_info() equal the planner's for the same model, dtype, budget."""
    from kvcache.engine.llm import LLM
    llm = LLM(tiny_llama, kv_cache_memory="3MiB", block_size=16, max_model_len=512)
    info = llm.kv_cache_info()
    plan = plan_device(load_model_shape(tiny_llama), "float32", kv_cache_memory=3 * 2**20, seq_len=512)
    c = plan.capacity
    assert info["bytes_per_token"] == c.bytes_per_token == kv_bytes_per_token(load_model_shape(tiny_llama), "float32")
    assert (info["num_blocks"], info["num_tokens"], info["total_bytes"]) == (c.num_blocks, c.num_tokens, c.total_bytes)
    assert info["max_concurrency"] == pytest.approx(c.max_concurrency)


@pytest.mark.demo
def test_demo_engine_matches_planner(demo_llm, demo_path):
    info = demo_llm.kv_cache_info()
    budget = info["num_blocks"] * info["block_size"] * info["bytes_per_token"]
    plan = plan_device(load_model_shape(demo_path), "float32", kv_cache_memory=budget,
                       block_size=info["block_size"], seq_len=info["max_model_len"])
    assert plan.capacity.bytes_per_token == info["bytes_per_token"] == 46_080
    assert plan.capacity.num_blocks == info["num_blocks"]
    assert plan.capacity.max_concurrency == pytest.approx(info["max_concurrency"])
