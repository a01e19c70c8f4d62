"""The KV budget: one pure function shared with `kvcache plan`, the CPU default taken after the weights and
stated term by term, shares of memory, refusal when a computed budget cannot hold one max_model_len request,
and the CUDA profile (run by the GPU check)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from kvcache import LLM
from kvcache.config import EngineConfig
from kvcache.engine import sizing
from kvcache.plan.capacity import device_budget, plan_device
from kvcache.plan.model_source import load_model_shape

GiB = 2**30


def test_device_budget_is_every_term_subtracted():
    b = device_budget(80 * GiB, 0.9, 16 * GiB, 3 * GiB, GiB)
    assert b.budget == int(80 * GiB * 0.9) - 20 * GiB
    assert b.terms() == "0.9 x 80.00 GiB - 16.00 GiB weights - 3.00 GiB activations - 1.00 GiB outside torch"


@pytest.mark.parametrize("args, words", [
    ((80 * GiB, 0.9, 70 * GiB, 3 * GiB, 0), "nothing is left for the KV cache"),
    ((80 * GiB, 0.3, 16 * GiB, 3 * GiB, 8 * GiB), "raise --gpu-memory-utilization"),
    ((80 * GiB, 1.5, GiB, GiB, 0), "in \\(0, 1\\]"),
])
def test_device_budget_refuses_with_the_terms(args, words):
    with pytest.raises(ValueError, match=words):
        device_budget(*args)


def test_the_planner_and_the_engine_share_the_sizing():
    """kvcache plan's budget for given memory, weights and activations is device_budget's."""
    shape = load_model_shape("llama-3-8b")
    p = plan_device(shape, "bfloat16", memory_per_gpu=80 * GiB, activation_bytes=3 * GiB, seq_len=8192)
    assert p.kv_budget == device_budget(80 * GiB, 0.9, p.weight_bytes, 3 * GiB).budget


def test_the_cpu_budget_is_taken_after_the_weights_and_logged(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="kvcache"):
        llm = LLM(tiny_llama, max_model_len=64)
    info = llm.kv_cache_info()
    assert info["device"] == "cpu" and info["compute_dtype"] == "float32"
    # every tensor the weights are held in: the parameters and the oneDNN-packed linear weights (Dense.pack)
    model = llm.engine.model
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    assert packed and info["weight_bytes"] == 4 * (sum(p.numel() for p in model.parameters())
                                                   + sum(t.numel() for t in packed))
    assert "the CPU default of 2 GiB, at most half of the" in info["kv_cache_budget"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "of float32 on cpu; attention backend cpu" in line and "KV budget" in line and "RAM available after" in line
    assert info["total_bytes"] <= sizing.CPU_DEFAULT_KV_BYTES


def test_a_share_is_of_the_ram_available_on_cpu(tiny_llama, monkeypatch):
    monkeypatch.setattr(sizing.psutil, "virtual_memory", lambda: SimpleNamespace(available=400 * 2**20))
    llm = LLM(tiny_llama, kv_cache_memory="1%", max_model_len=64)
    info = llm.kv_cache_info()
    assert "--kv-cache-memory 1% of the RAM available after the weights (0.39 GiB)" in info["kv_cache_budget"]
    per_block = info["block_size"] * info["bytes_per_token"]
    assert info["num_blocks"] == 4 * 2**20 // per_block


def test_a_computed_budget_that_cannot_hold_one_request_refuses_to_start(tiny_llama, monkeypatch):
    monkeypatch.setattr(sizing.psutil, "virtual_memory", lambda: SimpleNamespace(available=200_000))
    with pytest.raises(ValueError, match="fewer than the 32 of one request of max_model_len 512: lower "
                                         "--max-model-len, or give --kv-cache-memory"):
        LLM(tiny_llama)
    # given explicitly, a small cache is the user's choice: requests that cannot fit are refused one by one
    assert LLM(tiny_llama, kv_cache_memory=100_000).kv_cache_info()["num_blocks"] < 32


@pytest.mark.parametrize("value", ["fp64", "int8", "float"])
def test_bad_dtypes_are_refused_before_loading(value):
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16 \\(aliases fp32, bf16, "
                                         "fp16, half\\)"):
        EngineConfig(model="/nonexistent", dtype=value)


@pytest.mark.parametrize("alias, name", [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"),
                                         ("half", "float16")])
def test_dtype_aliases(alias, name):
    assert EngineConfig(dtype=alias).dtype == name


def test_slow_half_precision_is_named_only_where_the_cpu_lacks_the_units(monkeypatch):
    monkeypatch.setattr(sizing, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert "avx512_bf16" in sizing.slow_half_precision(torch.device("cpu"), torch.bfloat16)
    assert sizing.slow_half_precision(torch.device("cpu"), torch.float32) is None
    monkeypatch.setattr(sizing, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert sizing.slow_half_precision(torch.device("cpu"), torch.bfloat16) is None
    assert "avx512_fp16" in sizing.slow_half_precision(torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_profile_step_runs_at_the_limits(tiny_llama, dtype):
    """The step the CUDA budget is profiled with, run on the CPU: the full token budget through every layer, and
    max_num_seqs rows through the head and the sampler (on the CPU no allocator keeps a peak to report)."""
    llm = LLM(tiny_llama, dtype=dtype, kv_cache_memory="1MiB", max_model_len=64, max_num_batched_tokens=300,
              max_num_seqs=40)
    assert sizing.profile_forward(llm.engine.model, llm.engine.config, torch.device("cpu")) is None


@pytest.mark.cuda
@pytest.mark.gpu_memory
def test_cuda_budget_is_profiled_and_stated(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.5, max_model_len=256)
    info = llm.kv_cache_info()
    assert info["device"].startswith("cuda") and info["compute_dtype"] == "bfloat16"
    assert " = 0.5 x " in info["kv_cache_budget"] and "activations profiled at 2,048 tokens" in info["kv_cache_budget"]
    total = torch.cuda.mem_get_info()[1]
    assert 0 < info["total_bytes"] <= 0.5 * total - info["weight_bytes"]


def test_the_torch_attention_path_reserves_what_it_gathers(tiny_llama):
    """Decode rows gathered into padded buffers (bounded by the pool) and a cached-prefix chunk's scores: what the
    portable path needs beside the profile step, so that a full cache does not run the device out of memory."""
    llm = LLM(tiny_llama, kv_cache_memory="1MiB", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    shape, config = llm.engine.shape, llm.engine.config
    per_token_gathered = shape.num_kv_heads * shape.head_dim * 2
    scores = 2 * shape.num_attention_heads * 32 * 64
    assert sizing.portable_attention_bytes(config, shape, 64, 2, 10**6) == (4 * 64 * per_token_gathered + scores) * 2
    assert sizing.portable_attention_bytes(config, shape, 64, 2, 100) == (100 * per_token_gathered + scores) * 2
