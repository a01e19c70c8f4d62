"""The OpenAI-compatible HTTP API (FastAPI): completions, chat, streaming, tokenize, models, health, metrics.

Every error reaches the client as {"error": {"message", "type", "param", "code"}} with a 4xx/5xx
status and a message written for the client; tracebacks go to the log only, under the request id that
every response carries in its `x-request-id` header (and 5xx messages in their text). A client that
disconnects has its request aborted.

The app is assembled here from its parts: the shared state (state.py, on `app.state.server`), the middleware
(guard.py), the routers (routes/: info, tokens, generate) and the KV page (kv_page.py).
"""
from __future__ import annotations

from fastapi import FastAPI, Request

from kvcache.server import kv_page
from kvcache.server.engine_loop import EngineLoop
from kvcache.server.errors import error_response
from kvcache.server.guard import Guard
from kvcache.server.protocol import APIError
from kvcache.server.routes import generate, info, tokens
from kvcache.server.state import ServerState


def build_app(loop: EngineLoop, model_name: str, metrics, api_key: str | None = None,
              max_waiting_requests: int = 512, max_body_bytes: int = 4 * 2**20, kv_page_on: bool = True,
              kv_page_show_text: bool = False) -> FastAPI:
    """The FastAPI application over a running EngineLoop (with the KV page, server/kv_page.py, unless
    `kv_page_on` is False)."""
    app = FastAPI(title="kvcache", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = ServerState(loop, metrics, model_name, max_waiting_requests, max_body_bytes)
    expected_auth = f"Bearer {api_key}".encode() if api_key else None
    app.add_middleware(Guard, expected_auth=expected_auth, max_body_bytes=max_body_bytes,
                       draining=lambda: loop.draining)
    if kv_page_on:
        app.state.kv_hub = kv_page.add_routes(app, loop, metrics, api_key, kv_page_show_text)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    for routes in (info, tokens, generate):
        app.include_router(routes.router)
    return app


async def api_error(_: Request, exc: APIError):
    """An APIError a handler raised, in OpenAI's error shape."""
    return error_response(exc)


async def not_found(request: Request, _):
    """No route for the path: 404 in OpenAI's error shape."""
    return error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))


async def not_allowed(request: Request, _):
    """A route, but not for this method: 405 in OpenAI's error shape."""
    return error_response(APIError(405, f"method {request.method} not allowed on {request.url.path}"))
