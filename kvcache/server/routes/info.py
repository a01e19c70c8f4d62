"""What the server tells about itself: GET /health, /metrics (Prometheus), /v1/models and /v1/models/{model}."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvcache.server.errors import error_response, shutting_down
from kvcache.server.protocol import APIError
from kvcache.server.state import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 while the engine loop runs and takes requests, else 503 (a supervisor's liveness check; a load balancer
    takes a draining instance out on it)."""
    loop = server_state(request).loop
    if loop.alive:
        return Response(status_code=200)
    if loop.draining:
        return error_response(shutting_down("the server is shutting down"))
    return error_response(APIError(503, "the engine loop is not running", type="server_error", code="engine_dead"))


@router.get("/metrics")
async def prometheus(request: Request):
    """The Prometheus text of server/metrics.py."""
    metrics = server_state(request).metrics
    return Response(metrics.render(), media_type=metrics.content_type)


@router.get("/v1/models")
async def models(request: Request):
    """The one model this server serves, as OpenAI lists models."""
    return {"object": "list", "data": [server_state(request).model_card()]}


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str):
    """The served model's card; 404 for any other name."""
    state = server_state(request)
    if model != state.model_name:
        raise state.no_such_model(model)
    return state.model_card()
