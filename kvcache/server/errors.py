"""The API's error responses: an APIError as the JSON body OpenAI's clients read, and the errors a request meets
when the engine stops or fails it (5xx: the server's fault, not the client's)."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from kvcache.server.engine_loop import ServerShuttingDown
from kvcache.server.protocol import APIError

RETRY_AFTER_S = 1  # what a 503 for a shutdown or a full queue tells clients to wait: another instance can serve them


def error_response(exc: APIError) -> JSONResponse:
    """`exc` as {"error": {"message", "type", "param", "code"}} with its status and headers."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def engine_dead(rid: str, error: BaseException | None = None) -> APIError:
    """A request the engine could not run because it has stopped (503: the server is shutting down), or, where
    `error` is a drain's ServerShuttingDown, because the server is shutting down on a signal."""
    if isinstance(error, ServerShuttingDown):
        return shutting_down(f"{error}; retry on another instance (request id {rid})")
    return APIError(503, f"the engine has stopped and this server is shutting down; retry once it is back "
                         f"(request id {rid})", type="server_error", code="engine_dead")


def engine_failed(rid: str, error: str) -> APIError:
    """A request the engine failed (RequestOutput.error): the server's fault, not the client's."""
    return APIError(500, f"{error} (request id {rid}; the server log has the details)", type="server_error",
                    code="engine_error")


def shutting_down(message: str) -> APIError:
    """503 for a request that a draining server refuses or aborts, with Retry-After."""
    return APIError(503, message, type="server_error", code="server_shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})
