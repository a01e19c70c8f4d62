"""kvcache: an LLM inference engine built around its KV cache."""
from kvcache.engine.llm import LLM
from kvcache.engine.llm_engine import CompletionOutput, LLMEngine, RequestOutput
from kvcache.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
