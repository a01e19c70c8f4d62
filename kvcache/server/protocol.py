"""Request bodies of the OpenAI-compatible API (pydantic), their mapping to SamplingParams, and error bodies.

Fields follow OpenAI's completions and chat APIs plus vLLM's extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, cache_salt, prompt_logprobs). Unknown fields are
ignored, as vLLM does; fields whose meaning this server cannot honour are refused.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvcache.compress.spec import EvictionSpec, parse_budget
from kvcache.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error returned to the client as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Unknown fields are ignored (as vLLM does); NaN and infinities are refused in every number field.
_LENIENT = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _LENIENT

    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = _LENIENT

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """An explicit null in a field that has a default means that default (OpenAI's schema makes n, stream,
        the penalties, echo and logprobs nullable, and vLLM and OpenAI answer such requests); a required field
        (prompt, messages) that is null is still refused."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict | None = None
    response_format: dict | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and the k most likely (not with stream)
    # kvcache's: this request's token eviction, overriding the server's --kv-eviction / --kv-budget
    kv_eviction: str | None = None
    kv_budget: int | float | str | None = None
    # whether the pressure ladder may evict this request's tokens ("degrade") or never ("exact")
    kv_pressure: str = "degrade"
    # the prefix-cache blocks it leaves behind: {"priority": 0..100, "ttl_s": seconds} (SamplingParams.kv_retention)
    kv_retention: dict | None = None

    def eviction(self, default: EvictionSpec) -> EvictionSpec | None:
        """The request's eviction (None: the server's); APIError naming the field if it is bad."""
        if self.kv_eviction is None and self.kv_budget is None:
            return None
        try:
            policy = self.kv_eviction or default.policy
            if self.kv_budget is not None:
                budget = parse_budget(self.kv_budget)
            else:  # the server's budget goes with the server's policy, or with another one the request names
                budget = default.budget if policy != "none" else None
            return EvictionSpec(policy, budget)
        except ValueError as e:
            param = "kv_eviction" if str(e).startswith("kv_eviction") else "kv_budget"
            raise APIError(400, str(e), param=param) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters (`logprobs`, `prompt_logprobs`: top entries per token, None for none); raises
        ValueError naming the field that is out of range."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":  # JSON modes need guided decoding, which this server does not do: not silently ignored
            raise APIError(400, f"response_format {kind!r} is not supported by this server (only 'text')",
                           param="response_format")
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, max_tokens=max_tokens,
            min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, kv_pressure=self.kv_pressure,
            kv_retention=self.kv_retention)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. A prompt is text or token ids; a list of them makes one choice set per prompt."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        return list(p)


class ContentPart(BaseModel):
    model_config = _LENIENT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _LENIENT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages (the chat template applied)."""

    model_config = _LENIENT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _LENIENT

    model: str | None = None
    tokens: list[int]


def validation_error(exc) -> APIError:
    """A pydantic ValidationError (or FastAPI's RequestValidationError) as one OpenAI-style 400."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    # A union's errors are located under the member that was tried ("kv_budget.int"): name the field only.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_member(p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    msg = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def _union_member(part: object) -> bool:
    """Whether a pydantic error location part names a union member ('int', 'list[int]', 'function-after[...]')."""
    return isinstance(part, str) and (part in ("int", "float", "str", "bool", "none") or "[" in part)
