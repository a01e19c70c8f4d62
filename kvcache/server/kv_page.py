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
from http.cookies import SimpleCookie
from importlib import resources
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse

from kvcache.server import top
from kvcache.server.engine_loop import EngineDeadError
from kvcache.server.protocol import APIError
from kvcache.server.kv_snapshot import SnapshotHub

COOKIE = "kvcache_kv"
PAGE_PATHS = ("/kv", "/kv/", "/kv/login")  # reachable without the key: the page answers its login form
HISTORY_SAMPLE_S = 2.0  # the health history is sampled this often while nobody watches
LOGIN_BODY_BYTES = 4096


def session_token(api_key: str) -> str:
    """The cookie's value: derived from the key, never the key itself."""
    return hmac.new(api_key.encode(), b"kvcache-kv-page", hashlib.sha256).hexdigest()


def cookie_ok(headers: dict[bytes, bytes], api_key: str | None) -> bool:
    raw = headers.get(b"cookie")
    if not api_key or not raw:
        return False
    jar = SimpleCookie()
    try:
        jar.load(raw.decode("latin-1"))
    except Exception:
        return False
    got = jar.get(COOKIE)
    return got is not None and hmac.compare_digest(got.value, session_token(api_key))


def add_routes(app: FastAPI, loop, metrics, api_key: str | None, show_text: bool = False,
               interval_s: float = 1.0) -> SnapshotHub:
    """The /kv routes on `app` over the engine `loop`; returns their SnapshotHub."""
    prev: dict = {}
    lock = threading.Lock()  # the history thread and the viewers' snapshots both call health()

    def samples() -> dict[str, float]:
        return top.read_samples(metrics.render().decode())

    def figures(cur: dict[str, float], before: dict[str, float] | None = None, dt: float | None = None) -> dict:
        """kvcache top's figures and warnings (the same code as top's), rates over `dt` seconds since `before`."""
        snap = top.snapshot(cur, before, dt)
        snap["warnings"] = top.warnings_for(snap)
        snap["time"] = time.time()
        return snap

    def health() -> dict:
        """The figures now, rates over the time since the last call."""
        with lock:
            cur, now = samples(), time.monotonic()
            snap = figures(cur, prev.get("samples"), now - prev["t"] if prev else None)
            prev.update(samples=cur, t=now)
        return snap

    hub = SnapshotHub(lambda fut, ev_loop: loop.request_snapshot(fut, ev_loop, show_text), health, interval_s)
    page = resources.files("kvcache.server").joinpath("static/kv.html").read_text()
    login = resources.files("kvcache.server").joinpath("static/kv_login.html").read_text()

    def authorized(request: Request) -> bool:
        return not api_key or request.scope.get("state", {}).get("authorized", False)

    def sample_history() -> None:
        """The health history while nobody watches (a viewer's snapshots add to it too), until the engine stops."""
        while not loop.stopped:
            time.sleep(HISTORY_SAMPLE_S)
            if hub.latest is None or time.time() - hub.latest["time"] > HISTORY_SAMPLE_S:
                try:
                    hub.record(health())
                except Exception:  # a metrics hiccup: the next sample will do
                    pass

    threading.Thread(target=sample_history, name="kvcache-kv-history", daemon=True).start()

    @app.get("/kv")
    @app.get("/kv/")
    async def kv_page(request: Request):
        if not authorized(request):
            return HTMLResponse(login.replace("{{error}}", ""), status_code=401)
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.post("/kv/login")
    async def kv_login(request: Request):
        raw = bytearray()
        async for part in request.stream():  # open to anyone: read 4 KiB at most, whatever the body claims
            raw += part
            if len(raw) > LOGIN_BODY_BYTES:
                return HTMLResponse(login.replace("{{error}}", "request too large"), status_code=413)
        body = raw.decode("utf-8", "replace")
        key = (parse_qs(body).get("key") or [""])[0]
        if not api_key:
            return RedirectResponse("/kv", status_code=303)
        if not hmac.compare_digest(key.encode(), api_key.encode()):
            return HTMLResponse(login.replace("{{error}}", "wrong key"), status_code=401)
        resp = RedirectResponse("/kv", status_code=303)
        resp.set_cookie(COOKIE, session_token(api_key), httponly=True, samesite="strict", path="/kv")
        return resp

    @app.get("/kv/snapshot")
    async def kv_snapshot(request: Request):
        part = request.query_params.get("part")
        if part not in (None, "health"):
            return Response(json.dumps({"error": {"message": f"part must be health or absent; got {part!r}",
                                                  "type": "invalid_request_error"}}), 400,
                            media_type="application/json")
        if part == "health":  # light: no engine-thread work; the samples let `kvcache top` keep its own window
            cur = await asyncio.to_thread(samples)
            h = figures(cur)
            return Response(json.dumps({"version": 1, "time": h["time"], "health": h, "samples": cur}),
                            media_type="application/json")
        return Response(await _json(hub), media_type="application/json")

    @app.get("/kv/stream")
    async def kv_stream(request: Request):
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

    return hub


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
