"""POST /v1/completions and /v1/chat/completions: each request's checks, its prompts tokenized, and its
sub-requests (one per prompt) queued together on the engine loop, answered whole or streamed."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kvcache.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvcache.server.engine_loop import EngineDeadError, EngineRequestError
from kvcache.server.errors import engine_dead, engine_failed
from kvcache.server.outputs import LogprobShape, collect, response_body
from kvcache.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from kvcache.server.request_params import (
    chat_prompt,
    echo_text,
    param_of,
    prompt_top,
    sampling_params,
)
from kvcache.server.state import ServerState, server_state
from kvcache.server.streaming import EventStream

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    """OpenAI's completions: one sub-request per prompt, `n` choices each."""
    state = server_state(request)
    req = await state.parse(request, CompletionRequest)
    for name, bad in (("suffix", req.suffix), ("best_of", req.best_of not in (None, req.n))):
        if bad:
            raise APIError(400, f"{name} is not supported by this server", param=name)
    # echo: each choice's text starts with its prompt (token ids decoded), and its logprobs with the prompt's
    params = sampling_params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs,
                             prompt_top(req, req.logprobs if req.echo else None))
    prompts = req.prompts()
    state.admit(len(prompts))  # refuse early, before tokenizing; generate checks again before queueing
    echo = [p if isinstance(p, str) else echo_text(state.tokenizer, p) for p in prompts] if req.echo else None
    prompts = [await state.encode(p, True) if isinstance(p, str) else p for p in prompts]
    return await generate(state, request, req, "cmpl", "text_completion", prompts, params, echo)


@router.post("/v1/chat/completions")
async def chat(request: Request):
    """OpenAI's chat completions: the messages through the model's chat template, `n` choices."""
    state = server_state(request)
    req = await state.parse(request, ChatCompletionRequest)
    if req.tools:
        raise APIError(400, "tools is not supported by this server", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                       param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, prompt_top(req))
    state.admit(1)
    prompt = await state.encode(chat_prompt(state.tokenizer, req.messages, req.add_generation_prompt), False)
    return await generate(state, request, req, "chatcmpl", "chat.completion", [prompt], params)


async def generate(state: ServerState, request: Request, req, prefix: str, kind: str, prompts: list[list[int]],
                   params: SamplingParams, echo: list[str] | None = None):
    """Queue one sub-request per prompt (all or none of them), then answer with their outputs: whole, or streamed
    as server-sent events."""
    rid = f"{prefix}-{request.state.request_id}"
    out: asyncio.Queue = asyncio.Queue()
    ids = [f"{rid}-{i}" for i in range(len(prompts))]
    await _enqueue(state, req, rid, ids, prompts, params, out)
    created = int(time.time())
    shape = LogprobShape(kind == "chat.completion", state.texts, params.logprobs,
                         dict(zip(ids, echo)) if echo else {}, req.prompt_logprobs)
    if req.stream:
        body = EventStream(state.loop, out, ids, rid, kind, created, state.model_name, params, req.include_usage,
                           shape)
        return StreamingResponse(body.events(), media_type="text/event-stream")
    finals = await collect(request, state.loop, out, ids, rid)
    return response_body(finals, ids, rid, kind, created, state.model_name, params.n, shape)


async def _enqueue(state: ServerState, req, rid: str, ids: list[str], prompts: list[list[int]],
                   params: SamplingParams, out: asyncio.Queue) -> None:
    """Queue every prompt, its outputs to `out`; if the engine refuses one, abort them all and raise its error."""
    loop = state.loop
    eviction = req.eviction(loop.engine.config.eviction)
    # No await between the queue-limit check and queueing every prompt: a burst cannot overshoot it.
    state.admit(len(prompts))
    try:
        accepted = [loop.enqueue(sub_id, p, params, True, req.cache_salt, out, eviction)[1]
                    for sub_id, p in zip(ids, prompts)]
    except EngineDeadError as e:
        raise engine_dead(rid, e) from None
    errors = [r for r in await asyncio.gather(*accepted, return_exceptions=True) if r is not None]
    if errors:  # one bad prompt of several: none of them runs
        for sub_id in ids:
            loop.abort(sub_id)
        e = errors[0]
        if isinstance(e, EngineDeadError):
            raise engine_dead(rid, e)
        if isinstance(e, ValueError):
            raise APIError(400, str(e), param=param_of(str(e)))
        if isinstance(e, EngineRequestError):
            raise engine_failed(rid, str(e))
        raise e
