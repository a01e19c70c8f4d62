"""What every route of the API shares (ServerState, kept on `app.state.server`; a handler gets it with
`server_state(request)`): the engine loop, its metrics, the served model's name and the request limits, and the
steps every request takes through them: its body read and parsed, its prompts admitted to the queue and tokenized."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvcache.server.engine_loop import EngineLoop
from kvcache.server.errors import RETRY_AFTER_S, shutting_down
from kvcache.server.logprobs import TokenTexts
from kvcache.server.protocol import APIError, validation_error

if TYPE_CHECKING:
    from kvcache.server.metrics import ServerMetrics


@dataclass
class ServerState:
    """The engine loop the API runs on, and the limits it holds requests to."""

    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    max_waiting_requests: int = 512
    max_body_bytes: int = 4 * 2**20
    texts: TokenTexts = field(init=False)  # each token's text, decoded once for every request's logprobs

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.loop.engine.tokenizer)

    @property
    def engine(self):
        return self.loop.engine

    @property
    def tokenizer(self):
        return self.loop.engine.tokenizer

    async def parse(self, request: Request, model_cls: type[BaseModel]):
        """The request's body as `model_cls`; APIError for a body over the limit, bad JSON, a field the model refuses
        or another model's name."""
        data = _json_object(await self._read_body(request))
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if getattr(req, "model", None) not in (None, self.model_name):
            raise self.no_such_model(req.model)
        return req

    async def _read_body(self, request: Request) -> bytearray:
        body = bytearray()
        async for part in request.stream():  # chunked bodies have no Content-Length: stop at the limit
            body += part
            if len(body) > self.max_body_bytes:
                raise APIError(413, f"request body is over the {self.max_body_bytes:,}-byte limit",
                               code="body_too_large")
        return body

    def no_such_model(self, model: str) -> APIError:
        return APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                        param="model", code="model_not_found")

    def admit(self, n: int) -> None:
        """Refuse `n` more requests if the engine is down or the queue would pass its limit: 503 if it may
        succeed later, 400 if it never can."""
        limit = self.max_waiting_requests
        if self.loop.draining:
            raise shutting_down("the server is shutting down and takes no new requests; retry on another instance")
        if not self.loop.alive:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_dead")
        if n > limit:
            raise APIError(400, f"the request has {n:,} prompts but this server queues at most "
                                f"{limit:,} (--max-waiting-requests); send fewer per request",
                           param="prompt", code="too_many_prompts")
        if self.loop.num_waiting + n > limit:
            raise APIError(503, f"{self.loop.num_waiting} requests are waiting and this one adds {n} (limit "
                                f"{limit}); retry later", type="server_overloaded",
                           code="too_many_waiting", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def encode(self, text: str, special: bool) -> list[int]:
        """Tokenize in a worker thread: a long prompt must not stall the event loop or the engine thread."""
        try:
            return await asyncio.to_thread(self.engine.tokenize, text, special)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None

    def model_card(self) -> dict:
        """The served model as /v1/models lists it."""
        return {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "kvcache",
                "max_model_len": self.engine.max_model_len}


def server_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request`."""
    return request.app.state.server


def _json_object(body: bytes) -> dict:
    """The body's JSON, which must be an object; APIError 400 saying why not."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an int over 4,300 digits
        why = "an integer has too many digits" if "digits" in str(e) else "it nests too deeply" if isinstance(
            e, RecursionError) else "it is malformed"
        raise APIError(400, f"the request body is not valid JSON: {why}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data
