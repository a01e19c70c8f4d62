"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, streaming, tokenize, models, health, metrics.

Every error reaches the client as {"error": {"message", "type", "param", "code"}} with a 4xx/5xx
status and a message written for the client; tracebacks go to the log only, under the request id that
every response carries in its `x-request-id` header (and 5xx messages in their text). A client that
disconnects has its request aborted.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvcache.engine.llm_engine import RequestOutput
from kvcache.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvcache.messages import describe
from kvcache.server import kv_page
from kvcache.server.engine_loop import EngineDeadError, EngineLoop
from kvcache.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs, joined, prompt_entries
from kvcache.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, validation_error)

log = logging.getLogger("kvcache.server")
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key
DISCONNECT_POLL_S = 0.5


def build_app(loop: EngineLoop, model_name: str, metrics, api_key: str | None = None,
              max_waiting_requests: int = 512, max_body_bytes: int = 4 * 2**20, kv_page_on: bool = True,
              kv_page_show_text: bool = False) -> FastAPI:
    """The FastAPI application over a running EngineLoop (with the KV page, server/kv_page.py, unless
    `kv_page_on` is False)."""
    app = FastAPI(title="kvcache", docs_url=None, redoc_url=None, openapi_url=None)
    engine = loop.engine
    tokenizer = engine.tokenizer
    texts = TokenTexts(tokenizer)
    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    app.add_middleware(Guard, expected_auth=expected_auth, max_body_bytes=max_body_bytes)
    if kv_page_on:
        app.state.kv_hub = kv_page.add_routes(app, loop, metrics, api_key, kv_page_show_text)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, _):
        return _error(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, _):
        return _error(APIError(405, f"method {request.method} not allowed on {request.url.path}"))

    async def parse(request: Request, model_cls):
        body = bytearray()
        async for part in request.stream():  # chunked bodies have no Content-Length: stop at the limit
            body += part
            if len(body) > max_body_bytes:
                raise APIError(413, f"request body is over the {max_body_bytes:,}-byte limit", code="body_too_large")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an int over 4,300 digits
            why = "an integer has too many digits" if "digits" in str(e) else "it nests too deeply" if isinstance(
                e, RecursionError) else "it is malformed"
            raise APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if getattr(req, "model", None) not in (None, model_name):
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return req

    def admit(n: int) -> None:
        """Refuse `n` more requests if the engine is down or the queue would pass its limit: 503 if it may
        succeed later, 400 if it never can."""
        if not loop.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_dead")
        if n > max_waiting_requests:
            raise APIError(400, f"the request has {n:,} prompts but this server queues at most "
                                f"{max_waiting_requests:,} (--max-waiting-requests); send fewer per request",
                           param="prompt", code="too_many_prompts")
        if loop.num_waiting + n > max_waiting_requests:
            raise APIError(503, f"{loop.num_waiting} requests are waiting and this one adds {n} (limit "
                                f"{max_waiting_requests}); retry later", type="server_overloaded",
                           code="too_many_waiting", headers={"Retry-After": "1"})

    async def encode(text: str, special: bool) -> list[int]:
        """Tokenize in a worker thread: a long prompt must not stall the event loop or the engine thread."""
        try:
            return await asyncio.to_thread(engine.tokenize, text, special)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    # ---- info endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if loop.alive:
            return Response(status_code=200)
        return _error(APIError(503, "the engine loop is not running", type="server_error", code="engine_dead"))

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "kvcache",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {model_name!r}", param="model",
                           code="model_not_found")
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = await encode(chat_prompt(tokenizer, req.messages, True), False)
        else:
            ids = await encode(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await parse(request, DetokenizeRequest)
        vocab = engine.model.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {describe(bad[:5])}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    # ---- generation --------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        for name, bad in (("suffix", req.suffix), ("best_of", req.best_of not in (None, req.n))):
            if bad:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        # echo: each choice's text starts with its prompt (token ids decoded), and its logprobs with the prompt's
        params = _params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs,
                         _prompt_top(req, req.logprobs if req.echo else None))
        prompts = req.prompts()
        admit(len(prompts))  # refuse early, before tokenizing; _generate checks again before queueing
        echo = [p if isinstance(p, str) else _decode(tokenizer, p) for p in prompts] if req.echo else None
        prompts = [await encode(p, True) if isinstance(p, str) else p for p in prompts]
        return await _generate(request, req, "cmpl", "text_completion", prompts, params, echo)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        if req.tools:
            raise APIError(400, "tools is not supported by this server", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                           param="top_logprobs")
        params = _params(req, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                         (req.top_logprobs or 0) if req.logprobs else None, _prompt_top(req))
        admit(1)
        prompt = await encode(chat_prompt(tokenizer, req.messages, req.add_generation_prompt), False)
        return await _generate(request, req, "chatcmpl", "chat.completion", [prompt], params)

    async def _generate(request: Request, req, prefix: str, kind: str, prompts: list[list[int]], params,
                        echo: list[str] | None = None):
        eviction = req.eviction(loop.engine.config.eviction)
        rid = f"{prefix}-{request.state.request_id}"
        out: asyncio.Queue = asyncio.Queue()
        ids = [f"{rid}-{i}" for i in range(len(prompts))]
        # No await between the queue-limit check and queueing every prompt: a burst cannot overshoot it.
        admit(len(prompts))
        try:
            accepted = [loop.enqueue(sub_id, p, params, True, req.cache_salt, out, eviction)[1]
                        for sub_id, p in zip(ids, prompts)]
        except EngineDeadError:
            raise _engine_dead(rid) from None
        errors = [r for r in await asyncio.gather(*accepted, return_exceptions=True) if r is not None]
        if errors:  # one bad prompt of several: none of them runs
            for sub_id in ids:
                loop.abort(sub_id)
            e = errors[0]
            if isinstance(e, EngineDeadError):
                raise _engine_dead(rid)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=_param_of(str(e)))
            raise e
        created = int(time.time())
        shape = LogprobShape(kind, texts, params.logprobs, dict(zip(ids, echo)) if echo else {},
                             req.prompt_logprobs)
        if req.stream:
            body = _stream(request, loop, out, ids, rid, kind, created, model_name, params, req.include_usage, shape)
            return StreamingResponse(body, media_type="text/event-stream")
        finals = await _collect(request, loop, out, ids, rid)
        return _response(finals, ids, rid, kind, created, model_name, params.n, shape)

    return app


class Guard:
    """Plain ASGI middleware (so that handlers still see client disconnects): a request id for every request
    (`request.state.request_id`, echoed in the `x-request-id` header), the API key on every path but
    OPEN_PATHS, the body-size limit by Content-Length (bodies without one are checked when read), and the
    last word on any error a handler did not turn into an APIError: logged with its traceback and the request
    id, answered with a plain 500 that keeps the connection usable (Starlette's own handler for Exception
    re-raises to the server, which then drops the connection)."""

    def __init__(self, app, expected_auth: bytes | None, max_body_bytes: int) -> None:
        self.app, self.expected_auth, self.max_body_bytes = app, expected_auth, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        error = self._refusal(scope)
        try:
            if error is not None:
                await _error(error)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception as e:
            log.error("request %s: unhandled error in %s %s", request_id, scope["method"], scope["path"], exc_info=e)
            if not started:  # else the response is under way: it ends where it is
                await _error(APIError(500, f"internal server error (request id {request_id})", type="server_error",
                                      code="internal_error"))(scope, receive, send_with_id)

    def _refusal(self, scope) -> APIError | None:
        """A declared body over the limit (413, checked first: the KV page's login form is open) or a missing or wrong
        API key (401), else None."""
        headers = dict(scope["headers"])
        path = scope["path"]
        length = headers.get(b"content-length", b"")
        if length.isdigit() and len(length) < 20 and int(length) > self.max_body_bytes:
            return APIError(413, f"request body of {int(length):,} bytes is over the {self.max_body_bytes:,}-byte "
                                 "limit", code="body_too_large")
        if self.expected_auth and path not in OPEN_PATHS:
            ok = hmac.compare_digest(headers.get(b"authorization", b""), self.expected_auth)
            if not ok and (path == "/kv" or path.startswith("/kv/")):  # the KV page: its cookie will do too
                ok = kv_page.cookie_ok(headers, self.expected_auth.decode().removeprefix("Bearer "))
                if not ok and path in kv_page.PAGE_PATHS:  # the page answers with its login form
                    return None
            if not ok:
                return APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                type="authentication_error", code="invalid_api_key")
            scope["state"]["authorized"] = True
        return None


def _prompt_top(req, echo: int | None = None) -> int | None:
    """The prompt logprobs the engine keeps: the larger of vLLM's `prompt_logprobs` (checked here, as the larger
    echo count could hide its bad value) and completions' echo (its `logprobs`), None for none."""
    k = req.prompt_logprobs
    if k is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available with stream: true (as in vLLM)", param="prompt_logprobs")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {k}", param="prompt_logprobs")
    wanted = [x for x in (k, echo) if x is not None]
    return max(wanted) if wanted else None


def _params(req, max_tokens, logprobs=None, prompt_logprobs=None):
    try:
        return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), param=_param_of(str(e))) from None


_FIELDS = set(SamplingParams.__dataclass_fields__) | {"cache_salt", "prompt", "kv_eviction", "kv_budget"}


def _param_of(message: str) -> str | None:
    """The request field an engine error names first ('temperature must be ...' -> 'temperature', 'the prompt is
    empty' -> 'prompt', 'request needs 19 KV blocks ...; ... lower max_tokens' -> 'max_tokens'), if any."""
    return next((w for w in re.findall(r"[a-z_]+", message.split(": ", 1)[0]) if w in _FIELDS), None)


def _decode(tokenizer, ids: list) -> str:
    """A token-id prompt's text for echo; ids the tokenizer cannot decode are refused (400) with the engine's message
    later, so decode what can be."""
    try:
        return tokenizer.decode(ids)
    except Exception:  # an id out of range, or not an int: add_request refuses the prompt with its reason
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
    except Exception as e:  # a template may raise anything (jinja errors, its own checks)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _engine_dead(rid: str) -> APIError:
    return APIError(503, f"the engine has stopped and this server is shutting down; retry once it is back "
                         f"(request id {rid})", type="server_error", code="engine_dead")


def _engine_failed(rid: str, error: str) -> APIError:
    """A request the engine failed (RequestOutput.error): the server's fault, not the client's."""
    return APIError(500, f"{error} (request id {rid}; the server log has the details)", type="server_error",
                    code="engine_error")


async def _collect(request: Request, loop: EngineLoop, out: asyncio.Queue, ids: list[str],
                   rid: str) -> dict[str, RequestOutput]:
    """Wait for every sub-request's final output; abort all if the client disconnects or the engine fails one."""
    finals: dict[str, RequestOutput] = {}
    open_ids = set(ids)
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while open_ids:
        # Outputs arrive every step, so look for a disconnect on a clock, not only when the queue is quiet.
        if time.monotonic() >= next_check:
            if await request.is_disconnected():
                for sub_id in open_ids:
                    loop.abort(sub_id)
                raise APIError(499, "client disconnected")
            next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            item = await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            continue
        if isinstance(item, BaseException):
            raise _engine_dead(rid)
        if isinstance(item, tuple):
            open_ids.discard(item[0])
        elif item.error is not None:
            for sub_id in open_ids:
                loop.abort(sub_id)
            raise _engine_failed(rid, item.error)
        elif item.finished:
            finals[item.request_id] = item
    return finals


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class LogprobShape:
    """A request's logprobs in its endpoint's shape (server/logprobs.py), or None where it asked for none."""

    def __init__(self, kind: str, texts: TokenTexts, top: int | None, echo: dict[str, str],
                 prompt_top: int | None = None) -> None:
        self.chat, self.texts, self.top = kind == "chat.completion", texts, top
        self.echo = echo  # completions with echo: sub-request id -> its prompt's text
        self.prompt_top = prompt_top  # vLLM's prompt_logprobs, the k asked for

    def prompt(self, o: RequestOutput) -> tuple[dict | None, int]:
        """An echoed prompt's logprobs (completions shape) and the text offset after it."""
        if self.top is None:
            return None, 0
        return completion_logprobs(self.texts, o.prompt_token_ids, o.prompt_logprobs, self.top, 0)

    def prompt_logprobs(self, o: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` of a prompt (server/logprobs.py), or None where the request asked for none."""
        if self.prompt_top is None:
            return None
        return prompt_entries(self.texts, o.prompt_token_ids, o.prompt_logprobs, o.prompt_logprob_ranks,
                              self.prompt_top)

    def of(self, c, start: int = 0, offset: int = 0) -> tuple[dict | None, int]:
        """The logprobs of choice `c`'s tokens from `start` on (a completion's text offsets from `offset`), and the
        offset after them."""
        if self.top is None:
            return None, offset
        ids, lps = c.token_ids[start:], c.logprobs[start:len(c.token_ids)]
        if self.chat:
            return chat_logprobs(self.texts, ids, lps, self.top), offset
        return completion_logprobs(self.texts, ids, lps, self.top, offset)


def _response(finals: dict[str, RequestOutput], ids: list[str], rid: str, kind: str, created: int, model: str,
              n: int, shape: LogprobShape) -> dict:
    choices = []
    for i, sub_id in enumerate(ids):
        o = finals[sub_id]
        # a prompt's parts once, for all n of its choices
        head, offset = shape.prompt(o) if sub_id in shape.echo else (None, 0)
        prompt_lps = shape.prompt_logprobs(o) if kind != "chat.completion" else None  # vLLM's: on each choice
        for c in o.outputs:
            choice = {"index": i * n + c.index, "finish_reason": c.finish_reason}
            if kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": c.text}
                choice["logprobs"] = shape.of(c)[0]
            elif sub_id in shape.echo:  # the prompt first, text and logprobs
                choice["text"] = shape.echo[sub_id] + c.text
                choice["logprobs"] = joined(head, shape.of(c, 0, offset)[0]) if head is not None else None
            else:
                choice["text"] = c.text
                choice["logprobs"] = shape.of(c)[0]
            if c.stop_reason is not None:
                choice["stop_reason"] = c.stop_reason
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            choices.append(choice)
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
            "usage": _usage([finals[i] for i in ids])}
    if kind == "chat.completion" and shape.prompt_top is not None:  # vLLM's: the response's one prompt
        body["prompt_logprobs"] = shape.prompt_logprobs(finals[ids[0]])
    return body


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _stream(request: Request, loop: EngineLoop, out: asyncio.Queue, ids: list[str], rid: str, kind: str,
                  created: int, model: str, params, include_usage: bool, shape: LogprobShape) -> AsyncIterator[str]:
    """Server-sent events: text deltas per choice, a finish_reason per choice, usage if asked, then [DONE].

    Text that may be the start of a stop string, or an unfinished UTF-8 character, is held back
    until the next tokens settle it. With logprobs, a chunk carries those of the tokens that arrived since the
    last chunk of its choice (its text may still be held back): the chunks' logprobs together are the choice's.
    """
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    holdback = max((len(s) for s in params.stop), default=1) - 1
    sent: dict[tuple[str, int], int] = {}  # (sub-request, choice) -> characters sent
    lp_sent: dict[tuple[str, int], tuple[int, int]] = {}  # -> (tokens whose logprobs went out, their text offset)
    ended: set[tuple[str, int]] = set()  # choices whose finish chunk went out
    finals: dict[str, RequestOutput] = {}
    open_ids = set(ids)
    index_of = {sub_id: i for i, sub_id in enumerate(ids)}

    def chunk(index: int, text: str | None, finish: str | None, role: bool = False, logprobs=None) -> str:
        if chunk_kind == "text_completion":
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        else:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({"id": rid, "object": chunk_kind, "created": created, "model": model, "choices": [choice]})

    try:
        if chunk_kind != "text_completion":
            for sub_id in ids:
                for j in range(params.n):
                    yield chunk(index_of[sub_id] * params.n + j, None, None, role=True)
        while open_ids:
            item = await out.get()
            if isinstance(item, tuple):
                open_ids.discard(item[0])
                continue
            if isinstance(item, BaseException) or item.error is not None:  # vLLM's way: an error event, then [DONE]
                error = _engine_dead(rid) if isinstance(item, BaseException) else _engine_failed(rid, item.error)
                yield _sse(error.body())
                yield "data: [DONE]\n\n"
                return
            for c in item.outputs:
                key = (item.request_id, c.index)
                if key in ended:
                    continue
                if item.request_id in shape.echo and key not in lp_sent:  # the prompt first, with its logprobs
                    head, offset = shape.prompt(item)
                    lp_sent[key] = (0, offset)
                    yield chunk(index_of[item.request_id] * params.n + c.index, shape.echo[item.request_id], None,
                                logprobs=head)
                done = c.finish_reason is not None
                start = sent.get(key, 0)
                end = len(c.text) if done else max(start, len(c.text) - holdback)
                while not done and end > start and c.text[end - 1] == "\ufffd":
                    end -= 1
                index = index_of[item.request_id] * params.n + c.index

                def new_logprobs():
                    tokens, offset = lp_sent.get(key, (0, 0))
                    if tokens == len(c.token_ids):
                        return None
                    lps, offset = shape.of(c, tokens, offset)
                    lp_sent[key] = (len(c.token_ids), offset)
                    return lps
                if end > start:
                    sent[key] = end
                    yield chunk(index, c.text[start:end], None, logprobs=new_logprobs())
                if done:
                    ended.add(key)
                    yield chunk(index, None, c.finish_reason, logprobs=new_logprobs())
            if item.finished:
                finals[item.request_id] = item
        if include_usage:
            yield _sse({"id": rid, "object": chunk_kind, "created": created, "model": model, "choices": [],
                        "usage": _usage([finals[i] for i in ids if i in finals])})
        yield "data: [DONE]\n\n"
    finally:
        for sub_id in open_ids:  # the client went away (or the engine failed): free their blocks
            loop.abort(sub_id)
