"""The API's ASGI middleware (Guard): request ids, the API key, the body-size limit, and the last word on errors."""
from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Callable

from kvcache.server import kv_page
from kvcache.server.errors import error_response, shutting_down
from kvcache.server.protocol import APIError

log = logging.getLogger("kvcache.server")
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key


class Guard:
    """Plain ASGI middleware (so that handlers still see client disconnects): a request id for every request
    (`request.state.request_id`, echoed in the `x-request-id` header), the API key on every path but
    OPEN_PATHS, the body-size limit by Content-Length (bodies without one are checked when read), and the
    last word on any error a handler did not turn into an APIError: logged with its traceback and the request
    id, answered with a plain 500 that keeps the connection usable (Starlette's own handler for Exception
    re-raises to the server, which then drops the connection)."""

    def __init__(self, app, expected_auth: bytes | None, max_body_bytes: int,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.app, self.expected_auth, self.max_body_bytes = app, expected_auth, max_body_bytes
        self.draining = draining  # a draining server (server/drain.py) refuses every request but OPEN_PATHS

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
                await error_response(error)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception as e:
            log.error("request %s: unhandled error in %s %s", request_id, scope["method"], scope["path"], exc_info=e)
            if not started:  # else the response is under way: it ends where it is
                await error_response(APIError(500, f"internal server error (request id {request_id})",
                                              type="server_error", code="internal_error"))(scope, receive, send_with_id)

    def _refusal(self, scope) -> APIError | None:
        """503 while the server drains (but on OPEN_PATHS), a declared body over the limit (413, checked first: the KV page's login form is open) or a missing or wrong
        API key (401), else None."""
        headers = dict(scope["headers"])
        path = scope["path"]
        if path not in OPEN_PATHS and self.draining():
            return shutting_down("the server is shutting down and takes no new requests; retry on another instance")
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
