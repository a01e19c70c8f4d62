"""What a request's fields become for the engine: the chat template's prompt, SamplingParams, the prompt logprobs
to keep, an echoed prompt's text; and which request field an engine error is about (the error's `param`)."""
from __future__ import annotations

import re

from kvcache.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvcache.server.protocol import APIError

_FIELDS = set(SamplingParams.__dataclass_fields__) | {"cache_salt", "prompt", "kv_eviction", "kv_budget"}


def prompt_top(req, echo: int | None = None) -> int | None:
    """The prompt logprobs the engine keeps: the larger of vLLM's `prompt_logprobs` (checked here, as the larger
    echo count could hide its bad value) and completions' echo (its `logprobs`), None for none."""
    k = req.prompt_logprobs
    if k is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available with stream: true (as in vLLM)", param="prompt_logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="prompt_logprobs")
    wanted = [x for x in (k, echo) if x is not None]
    return max(wanted) if wanted else None


def sampling_params(req, max_tokens, logprobs=None, prompt_logprobs=None) -> SamplingParams:
    """The request's SamplingParams; APIError 400 naming the field where a value is out of range."""
    try:
        return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=param_of(str(e))) from None


def param_of(message: str) -> str | None:
    """The request field an engine error names first ('temperature must be ...' -> 'temperature', 'the prompt is
    empty' -> 'prompt', 'request needs 19 KV blocks ...; ... lower max_tokens' -> 'max_tokens'), if any."""
    return next((w for w in re.findall(r"[a-z_]+", message.split(": ", 1)[0]) if w in _FIELDS), None)


def echo_text(tokenizer, ids: list) -> str:
    """A token-id prompt's text for echo; ids the tokenizer cannot decode are refused (400) with the engine's message
    later, so decode what can be."""
    try:
        return tokenizer.decode(ids)
    # an id out of range, or not an int: add_request refuses the prompt with its reason
    except Exception:  # noqa: BLE001
        return ""


def chat_prompt(tokenizer, messages, add_generation_prompt: bool) -> str:
    """The text a chat request's messages become through the model's chat template (tokenized without special
    tokens: the template writes them); APIError 400 where there is no template or it rejects the messages. The
    replicas' router keys requests by it too (router/kv_index.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    convo = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as e:  # noqa: BLE001 -- a template may raise anything (jinja errors, its own checks)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
