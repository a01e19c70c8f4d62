"""kvcache: an LLM inference engine built around its KV cache."""
from __future__ import annotations

import importlib

# Loaded on first use so that torch-free parts (`kvcache plan`, `kvcache simulate`) start fast.
_EXPORTS = {
    "LLM": "kvcache.engine.llm",
    "LLMEngine": "kvcache.engine.llm_engine",
    "RequestOutput": "kvcache.engine.llm_engine",
    "CompletionOutput": "kvcache.engine.llm_engine",
    "RequestFailedError": "kvcache.engine.outputs",
    "SamplingParams": "kvcache.engine.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
