"""Shared fixtures: tiny random-weight checkpoints (built by tiny_models.py), and the real demo model
with its transformers oracle (loaded once per run)."""
from __future__ import annotations

import os

import pytest

from tiny_models import TINY_ARCHS, hf_model, make_tiny_model

# Tests pin their device: `auto` means the CPU for the whole suite (subprocesses included), where the oracles
# and the exact float32 comparisons run; tests marked cuda ask for device="cuda" themselves.
os.environ["KVCACHE_DEVICE"] = "cpu"


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda run only where torch sees a CUDA device (the GPU check); elsewhere they are skipped."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {a: make_tiny_model(str(root / a), a) for a in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def demo_path() -> str:
    from kvcache.models.loader import demo_model_path
    return demo_model_path()


@pytest.fixture(scope="session")
def demo_hf(demo_path):
    """transformers' own load of the demo GGUF: the oracle for the real model (about a minute)."""
    from transformers import AutoTokenizer
    d, name = os.path.split(demo_path)
    return hf_model(demo_path), AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.fixture(scope="session")
def demo_llm(demo_path):
    from kvcache import LLM
    return LLM(demo_path, kv_cache_memory="256MiB", max_model_len=2048)
