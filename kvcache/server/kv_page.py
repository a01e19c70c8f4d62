"""The live KV cache page of `kvcache serve`: `GET /kv` (one self-contained page, package data), its feed
`GET /kv/stream` (server-sent events, a snapshot per interval) and `GET /kv/snapshot` (the JSON, schema in
kv_snapshot.py; `?part=health` for the figures alone, what `kvcache top` reads).

With `--api-key` they need the key: `Authorization: Bearer <key>`, or the cookie that `POST /kv/login` (the page's
form) sets from it: an HMAC of the key, HttpOnly and SameSite=Strict, so the key is never in a URL or a script's
reach. Without it, `/kv` answers the login form and the others 401. `--no-kv-page` leaves every /kv path 404;
request text is in the snapshot only with `--kv-page-show-text` (prompts are user data).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import (
    HTMLResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from kvcache.server import top
from kvcache.server.engine_loop import EngineDeadError, EngineLoop
from kvcache.server.kv_snapshot import SnapshotHub
from kvcache.server.protocol import APIError

if TYPE_CHECKING:
    from kvcache.server.metrics import ServerMetrics

COOKIE = "kvcache_kv"
PAGE_PATHS = ("/kv", "/kv/", "/kv/login")  # reachable without the key: the page answers its login form
HISTORY_SAMPLE_S = 2.0  # the health history is sampled this often while nobody watches
LOGIN_BODY_BYTES = 4096
router = APIRouter()


def session_token(api_key: str) -> str:
    """The cookie's value: derived from the key, never the key itself."""
    return hmac.new(api_key.encode(), b"kvcache-kv-page", hashlib.sha256).hexdigest()


def cookie_ok(headers: dict[bytes, bytes], api_key: str | None) -> bool:
    """The request's cookies hold the page's session cookie for `api_key`."""
    raw = headers.get(b"cookie")
    if not api_key or not raw:
        return False
    jar = SimpleCookie()
    try:
        jar.load(raw.decode("latin-1"))
    except Exception:  # noqa: BLE001 -- an unreadable cookie is no cookie
        return False
    got = jar.get(COOKIE)
    return got is not None and hmac.compare_digest(got.value, session_token(api_key))


@dataclass
class KVPage:
    """The KV page's state (on `app.state.kv_page`): the engine loop and metrics it shows, the snapshot hub its
    viewers share, the page and its login form, and the health figures' last sample (rates are over the time since)."""

    loop: EngineLoop
    metrics: ServerMetrics
    api_key: str | None
    show_text: bool = False
    interval_s: float = 1.0
    hub: SnapshotHub = field(init=False)
    page: str = field(init=False)
    login: str = field(init=False)
    prev: dict = field(init=False, default_factory=dict)  # the last health sample and its time
    # the history thread and the viewers' snapshots both call health()
    lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.hub = SnapshotHub(self._request_snapshot, self.health, self.interval_s, self.loop.build_snapshot)
        self.page = resources.files("kvcache.server").joinpath("static/kv.html").read_text()
        self.login = resources.files("kvcache.server").joinpath("static/kv_login.html").read_text()

    def _request_snapshot(self, fut, ev_loop) -> None:
        self.loop.request_snapshot(fut, ev_loop, self.show_text)

    def samples(self) -> dict[str, float]:
        """The metrics' samples now, as `kvcache top` reads them."""
        return top.read_samples(self.metrics.render().decode())

    def health(self) -> dict:
        """The figures now, rates over the time since the last call."""
        with self.lock:
            cur, now = self.samples(), time.monotonic()
            snap = figures(cur, self.prev.get("samples"), now - self.prev["t"] if self.prev else None)
            self.prev.update(samples=cur, t=now)
        return snap

    def authorized(self, request: Request) -> bool:
        """The request carried the key or the page's cookie (Guard said so), or the server has no key."""
        return not self.api_key or request.scope.get("state", {}).get("authorized", False)

    def login_form(self, error: str, status: int) -> HTMLResponse:
        """The login form, saying what went wrong (if anything)."""
        return HTMLResponse(self.login.replace("{{error}}", error), status_code=status)

    def sample_history(self) -> None:
        """The health history while nobody watches (a viewer's snapshots add to it too), until the engine stops."""
        while not self.loop.stopped:
            time.sleep(HISTORY_SAMPLE_S)
            if self.hub.latest is None or time.time() - self.hub.latest["time"] > HISTORY_SAMPLE_S:
                try:
                    self.hub.record(self.health())
                except Exception:  # noqa: BLE001, S110 -- a metrics hiccup: the next sample will do
                    pass


def figures(cur: dict[str, float], before: dict[str, float] | None = None, dt: float | None = None) -> dict:
    """kvcache top's figures and warnings (the same code as top's), rates over `dt` seconds since `before`."""
    snap = top.snapshot(cur, before, dt)
    snap["warnings"] = top.warnings_for(snap)
    snap["time"] = time.time()
    return snap


def add_routes(app: FastAPI, loop: EngineLoop, metrics: ServerMetrics, api_key: str | None, show_text: bool = False,
               interval_s: float = 1.0) -> SnapshotHub:
    """The /kv routes on `app` over the engine `loop`, and the thread sampling their health history; returns their
    SnapshotHub."""
    page = KVPage(loop, metrics, api_key, show_text, interval_s)
    app.state.kv_page = page
    threading.Thread(target=page.sample_history, name="kvcache-kv-history", daemon=True).start()
    app.include_router(router)
    return page.hub


def _page(request: Request) -> KVPage:
    return request.app.state.kv_page


@router.get("/kv")
@router.get("/kv/")
async def kv_view(request: Request):
    """The page, or its login form (401) without the key."""
    page = _page(request)
    if not page.authorized(request):
        return page.login_form("", 401)
    return HTMLResponse(page.page, headers={"Cache-Control": "no-store"})


@router.post("/kv/login")
async def kv_login(request: Request):
    """The login form's key: right, the page's cookie and a redirect to it; wrong or too large, the form again."""
    page = _page(request)
    raw = bytearray()
    async for part in request.stream():  # open to anyone: read 4 KiB at most, whatever the body claims
        raw += part
        if len(raw) > LOGIN_BODY_BYTES:
            return page.login_form("request too large", 413)
    body = raw.decode("utf-8", "replace")
    key = (parse_qs(body).get("key") or [""])[0]
    if not page.api_key:
        return RedirectResponse("/kv", status_code=303)
    if not hmac.compare_digest(key.encode(), page.api_key.encode()):
        return page.login_form("wrong key", 401)
    resp = RedirectResponse("/kv", status_code=303)
    resp.set_cookie(COOKIE, session_token(page.api_key), httponly=True, samesite="strict", path="/kv")
    return resp


@router.get("/kv/snapshot")
async def kv_snapshot(request: Request):
    """The latest snapshot's JSON; `?part=health` for the health figures and the samples they came from alone."""
    page = _page(request)
    part = request.query_params.get("part")
    if part not in (None, "health"):
        return Response(json.dumps({"error": {"message": f"part must be health or absent; got {part!r}",
                                              "type": "invalid_request_error"}}), 400,
                        media_type="application/json")
    if part == "health":  # light: no engine-thread work; the samples let `kvcache top` keep its own window
        cur = await asyncio.to_thread(page.samples)
        h = figures(cur)
        return Response(json.dumps({"version": 1, "time": h["time"], "health": h, "samples": cur}),
                        media_type="application/json")
    return Response(await _json(page.hub), media_type="application/json")


@router.get("/kv/stream")
async def kv_stream(request: Request):
    """The snapshots as server-sent events, a new one each interval, until the client leaves or the engine stops."""
    hub = _page(request).hub
    first = await _json(hub)  # a dead engine answers 503 here, before any event is sent

    async def events():
        last, text = None, first
        while not await request.is_disconnected():
            if text is not last:
                last = text
                yield f"data: {text}\n\n"
            await asyncio.sleep(hub.interval_s)
            try:
                text = await _json(hub)
            except APIError:  # the engine stopped: the stream ends (EventSource reconnects and gets the 503)
                return
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})


async def _json(hub: SnapshotHub) -> str:
    """The latest snapshot as JSON text, serialized once per snapshot whatever the number of viewers. APIError 503
    when the engine is not running (it has nobody to take one)."""
    try:
        snap = await hub.get()
    except EngineDeadError:
        raise APIError(503, "the engine is not running: no KV snapshot", type="server_error",
                       code="engine_dead") from None
    if hub.json_text is None or hub.json_text[0] is not snap:
        hub.json_text = (snap, await asyncio.to_thread(json.dumps, snap))
    return hub.json_text[1]
