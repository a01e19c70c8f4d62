"""The offline API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence as Seq

from tqdm import tqdm

from kvcache.config import EngineConfig
from kvcache.engine.llm_engine import LLMEngine, RequestOutput
from kvcache.engine.outputs import RequestFailedError
from kvcache.engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict
Message = dict[str, str]


class LLM:
    """Load a model once, then generate for many prompts with continuous batching.

    `model` is a Hugging Face directory or a GGUF file (None: the SmolLM2-135M demo
    model). Other keyword arguments are EngineConfig fields (block_size, max_num_seqs,
    max_num_batched_tokens, max_model_len, kv_cache_memory, ...).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_info(self) -> dict:
        """The KV cache's size (blocks, tokens, bytes per token, total bytes) and current usage."""
        return self.engine.kv_cache_info()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or a dict with "prompt" or "prompt_token_ids" and
        optionally "cache_salt"); outputs in prompt order. Raises RequestFailedError, once all are done, if the
        engine failed any (its `outputs` has them all)."""
        if isinstance(prompts, str) or isinstance(prompts, dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self._as_prompt(p) for p in prompts], sampling_params, use_tqdm, True,
                         [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts])

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate the assistant's reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, **(chat_template_kwargs or {})) for c in convs]
        return self._run(prompts, sampling_params, use_tqdm, False)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, **kwargs) -> str:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if not messages:
            raise ValueError("messages is empty")
        return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)

    @staticmethod
    def _as_prompt(p: Prompt) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return p["prompt"]
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
        if isinstance(p, (str, list)):
            return p
        raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(p).__name__}")

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many. Raises RuntimeError while requests run."""
        return self.engine.reset_prefix_cache()

    def _run(self, prompts: list[str | list[int]], params, use_tqdm: bool, add_special_tokens: bool,
             salts: list[str | None] | None = None) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        engine = self.engine
        ids = []
        try:
            for p, sp, salt in zip(prompts, params, salts or [None] * len(prompts)):
                rid = str(next(self._ids))
                engine.add_request(rid, p, sp, add_special_tokens=add_special_tokens, cache_salt=salt)
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt leaves no half-submitted batch behind
                engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        t0, n_in, n_out = time.perf_counter(), 0, 0
        try:
            for outs in engine.steps():
                for out in outs:
                    if out.finished:
                        done[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        dt = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"input: {n_in / dt:.1f} toks/s, output: {n_out / dt:.1f} toks/s")
                        bar.update(1)
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        outputs = [done[rid] for rid in ids]
        if any(o.error for o in outputs):
            raise RequestFailedError(outputs)
        return outputs
