"""--attention-backend: what auto picks on each device, and what a backend asked for by name refuses, with what to
use instead, before anything runs."""
from __future__ import annotations

import pytest
import torch

from kvcache import LLM
from kvcache.attention.backend import resolve_backend
from kvcache.config import EngineConfig

CPU = torch.device("cpu")


def test_auto_takes_the_cpu_kernel_where_it_runs_and_torch_elsewhere(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", CPU, torch.float32, "float32", 16)[0] == "cpu"
    assert resolve_backend("auto", CPU, torch.float32, "int4", 64)[0] == "cpu"
    assert resolve_backend("auto", CPU, torch.float32, "float16", 16)[0] == "cpu"  # widened as the kernel reads
    name, why = resolve_backend("auto", CPU, torch.bfloat16, "bfloat16", 16)
    assert name == "torch" and "float32 only" in why


@pytest.mark.parametrize("name, device, dtype, kv, block, words", [
    ("triton", CPU, torch.float32, "float32", 16, "CUDA devices only"),
    ("cpu", CPU, torch.bfloat16, "bfloat16", 16, "float32 only"),
    ("cpu", torch.device("cuda"), torch.float32, "float32", 16, "CPU only"),
    ("flash", CPU, torch.float32, "float32", 16, "one of auto, triton, torch, cpu"),
])
def test_a_backend_that_cannot_run_is_refused_with_the_alternative(monkeypatch, name, device, dtype, kv, block, words):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=words):
        resolve_backend(name, device, dtype, kv, block)


def test_triton_refuses_what_it_cannot_read(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check
    with pytest.raises(ValueError, match="does not read int4 .*fp8 or int8 cache"):
        resolve_backend("triton", CPU, torch.float32, "int4", 64)
    with pytest.raises(ValueError, match="--block-size 16 or more"):
        resolve_backend("triton", CPU, torch.float32, "float32", 8)


def test_the_choice_is_in_the_config_the_log_and_kv_cache_info(tiny_llama, caplog):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")
    with caplog.at_level("INFO", logger="kvcache"):
        llm = LLM(tiny_llama, attention_backend="torch", kv_cache_memory="1MiB", max_model_len=64)
    assert llm.kv_cache_info()["attention_backend"] == "torch"
    assert any("attention backend torch (asked for)" in r.getMessage() for r in caplog.records)
