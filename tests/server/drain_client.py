"""Clients of a server being stopped by a signal (test_drain.py, test_replicas.py): streams and whole requests
opened before the signal, and the checks every drain must pass."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

async def stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, on_event=lambda: None
                 ) -> list[dict | str]:
    """The events of one streamed completion: each `data:` payload, JSON-decoded but for [DONE]; `on_event()` is
    called after each."""
    body = {"model": "tiny", "prompt": [5 + i, 17, 42], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                on_event()
    return events


async def whole(client: httpx.AsyncClient, url: str, max_tokens: int) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [9, 10, 11],
                                                             "max_tokens": max_tokens, "ignore_eos": True})


def streams_started(client, url: str, n: int, max_tokens: int, running: int) -> tuple[list[asyncio.Task],
                                                                                   asyncio.Event]:
    """`n` stream tasks, and an event set once `running` of them have received an event (so they run in the
    engine)."""
    started, ready = set(), asyncio.Event()

    def seen(i):
        started.add(i)
        if len(started) == running:
            ready.set()

    tasks = [asyncio.create_task(stream(client, url, i, max_tokens, lambda i=i: seen(i))) for i in range(n)]
    return tasks, ready


async def signal_while_open(proc, url: str, sig: int, streams: int, max_tokens: int, wholes: int, running: int):
    """Open `streams` streams and `wholes` whole requests, wait until `running` streams have sent an event, send `sig`,
    then try a new request and /health; returns (stream events, whole responses, new response, health response)."""
    async with httpx.AsyncClient(timeout=60) as client:
        tasks, ready = streams_started(client, url, streams, max_tokens, running)
        whole_tasks = [asyncio.create_task(whole(client, url, max_tokens)) for _ in range(wholes)]
        await asyncio.wait_for(ready.wait(), 60)
        proc.send_signal(sig)
        proc.signalled_at = time.monotonic()
        health = await draining(client, url)
        new = await whole(client, url, 4)
        return await asyncio.gather(*tasks), await asyncio.gather(*whole_tasks), new, health


def assert_refused_while_draining(new: httpx.Response, health: httpx.Response) -> None:
    assert new.status_code == 503 and new.headers["retry-after"] == "1"
    assert new.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["error"]["code"] == "server_shutting_down"


def assert_clean_log(text: str, last: str = "exiting (status 0)") -> None:
    """No traceback, and the shutdown's `last` line."""
    assert "Traceback" not in text and "Event loop is closed" not in text
    assert last in text


async def draining(client: httpx.AsyncClient, url: str, timeout: float = 60) -> httpx.Response:
    """GET /health until it answers 503 (the drain has begun; a loaded machine may take a while to run the signal's
    handler): that response."""
    deadline = time.monotonic() + timeout
    while True:
        health = await client.get(f"{url}/health")
        if health.status_code == 503 or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.05)
