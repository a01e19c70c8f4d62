"""`kvcache serve --engine-process`: the engine in a process of its own behind ZMQ (server/engine_client.py,
engine_core.py, wire.py). The same answers as the engine thread, the engine's metrics and KV page through it, a
message that cannot be decoded failing only its request, and a dead engine process failing every open request
(with /health 503) instead of hanging them."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from live_server import API_KEY, MODEL, scrape, start_server

from kvcache.server import wire

H = {"Authorization": f"Bearer {API_KEY}"}
REQUESTS = [
    ("/v1/completions", {"prompt": [5, 17, 42, 9], "max_tokens": 12, "temperature": 0, "n": 2, "logprobs": 2,
                         "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": ["the cat", "a dog sat"], "max_tokens": 9, "temperature": 0, "echo": True}),
    ("/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 16, "temperature": 0.8, "seed": 7, "n": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 10,
                              "temperature": 0, "logprobs": True, "top_logprobs": 3}),
]


@pytest.fixture(scope="module")
def remote(tiny_llama):
    srv = start_server(tiny_llama, engine_process=True)
    yield srv
    srv.stop()


def _answer(url: str, path: str, body: dict, stream: bool = False):
    """The response's JSON (streamed: each event's), without what differs between two servers by design."""
    body = dict(body, model=MODEL, stream=stream)
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, headers=H, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        out.pop("id"), out.pop("created")
        return out
    per_choice, rest = {}, []  # each choice's chunks in order (the choices of several prompts interleave by timing)
    with httpx.stream("POST", f"{url}{path}", json=body, headers=H, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                ev.pop("id", None), ev.pop("created", None)
                for c in ev.pop("choices"):
                    per_choice[c["index"]] = _merge(per_choice.get(c["index"]), c)
                rest.append(ev)
    return per_choice, [ev for ev in rest if ev.get("usage")]


def _merge(a, b):
    """Chunk `b` appended to what the chunks before it gave (`a`): strings and lists joined, other values the
    latest given, so that two streams that cut the same tokens into chunks differently compare equal."""
    if a is None:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b.get(k)) if k in a and k in b else b.get(k, a.get(k)) for k in {*a, *b}}
    if isinstance(a, str | list) and type(a) is type(b):
        return a + b
    return b if b is not None else a


@pytest.mark.parametrize("stream", [False, True])
def test_the_engine_process_answers_as_the_engine_thread_does(live, remote, stream):
    for path, body in REQUESTS:
        if stream and "prompt_logprobs" in body:
            continue  # refused with stream (vLLM's rule), on both
        assert _answer(remote.url, path, body, stream) == _answer(live.url, path, body, stream), (path, body)


def test_refusals_come_back_from_the_engine_process(live, remote):
    """A prompt the engine refuses (over the context length) is the engine's 400 through either."""
    body = {"model": MODEL, "prompt": list(range(3, 600)), "max_tokens": 4}
    answers = [httpx.post(f"{srv.url}/v1/completions", json=body, headers=H, timeout=60) for srv in (live, remote)]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[0].json()["error"]["message"] == answers[1].json()["error"]["message"]


def test_metrics_health_and_the_kv_page_come_from_the_engine_process(remote):
    before = scrape(remote.url).get("kvcache:request_success_total{finished_reason=length}", 0)
    _answer(remote.url, *REQUESTS[0])
    deadline = time.monotonic() + 10  # the engine process sends its metrics at most every 0.25 s
    while scrape(remote.url).get("kvcache:request_success_total{finished_reason=length}", 0) < before + 1:
        assert time.monotonic() < deadline, "the engine process's metrics did not arrive"
        time.sleep(0.05)
    samples = scrape(remote.url)
    assert samples["kvcache:num_requests_running"] == 0 and samples["kvcache:kv_blocks{state=used}"] == 0
    assert remote.loop.num_waiting == 0 and remote.loop.num_running == 0  # the queue limit's counts, idle
    assert httpx.get(f"{remote.url}/health").status_code == 200
    snap = httpx.get(f"{remote.url}/kv/snapshot", headers=H).json()
    idle = samples["kvcache:kv_blocks{state=free}"] + samples["kvcache:kv_blocks{state=cached}"]
    assert snap["pool"]["free"] + snap["pool"]["cached"] + snap["pool"]["pinned"] == idle
    assert snap["pool"]["used"] == 0 and len(snap["states"]) == snap["pool"]["num_blocks"]


def test_a_request_whose_message_cannot_be_decoded_fails_alone(remote, monkeypatch):
    """One request's add message is garbage to the engine process, another's output is garbage to the API process:
    each of the two gets an error, the request beside them its answer, and no block stays held."""
    pack_request, unpack_output = wire.pack_request, wire.unpack_output

    def bad_request(prompt, *args):
        return b"\xc1 not msgpack" if prompt == [7, 7, 7] else pack_request(prompt, *args)

    def bad_output(rid, frame, prompt_ids):
        out, ids = unpack_output(rid, frame, prompt_ids)
        if ids == [8, 8, 8]:
            raise wire.WireError("a test's damaged frame")
        return out, ids

    monkeypatch.setattr(wire, "pack_request", bad_request)
    monkeypatch.setattr(wire, "unpack_output", bad_output)
    results = {}

    def post(prompt):
        results[prompt[0]] = httpx.post(f"{remote.url}/v1/completions", headers=H, timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 40, "ignore_eos": True})

    threads = [threading.Thread(target=post, args=(p,)) for p in ([7, 7, 7], [8, 8, 8], [9, 9, 9])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[7].status_code == 500
    assert "could not be decoded by the engine process" in results[7].json()["error"]["message"]
    assert results[8].status_code == 500 and "could not be decoded" in results[8].json()["error"]["message"]
    assert results[9].status_code == 200 and results[9].json()["usage"]["completion_tokens"] == 40
    deadline = time.monotonic() + 10
    while scrape(remote.url)["kvcache:kv_blocks{state=used}"] != 0:  # the damaged one was aborted there
        assert time.monotonic() < deadline, "blocks stayed held"
        time.sleep(0.05)
    assert scrape(remote.url)["kvcache:num_requests_running"] == 0


def _stream_while(srv, end_engine, hang_s: float) -> list[str]:
    """The `data:` payloads of a long stream during which `end_engine()` is called (once the first arrived); the
    stream must end within `hang_s` seconds after (a hang guard)."""
    events, started = [], threading.Event()

    def stream():
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 480, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=H, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    end_engine()
    t.join(hang_s)
    assert not t.is_alive(), "the stream hung on an engine that had gone"
    return events


def test_a_dead_engine_process_fails_every_open_request(tiny_llama):
    srv = start_server(tiny_llama, engine_process=True)
    dead = threading.Event()
    srv.loop.on_dead = dead.set
    try:
        events = _stream_while(srv, lambda: os.kill(srv.loop.process.pid, signal.SIGKILL), 10)  # target: 1 s
        assert dead.wait(5)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert "signal SIGKILL" in str(srv.loop.error)
        assert httpx.get(f"{srv.url}/health").status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", headers=H, json={"model": MODEL, "prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        srv.stop()


def test_an_engine_that_stops_unasked_fails_every_open_request(tiny_llama):
    """The engine process ends its loop on an exception (EngineDeadError: a rank died, steps kept failing): it
    closes and says so, unasked. Stood in for here by a "closed" frame on the client's socket: the client takes it
    as the engine's death (the process is killed if it lingers) and fails what is open, as for a crash."""
    import zmq
    srv = start_server(tiny_llama, engine_process=True)
    dead = threading.Event()
    srv.loop.on_dead = dead.set
    try:
        def closed_unasked():
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(f"ipc://{srv.loop._dir}/out")
            push.send_multipart([b"closed"])
            push.close(linger=1000)
            ctx.term()

        events = _stream_while(srv, closed_unasked, 30)
        assert dead.wait(5)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert srv.loop.process.poll() is not None
        assert httpx.get(f"{srv.url}/health").status_code == 503
    finally:
        srv.stop()


def test_engine_process_with_replicas_is_refused():
    import argparse

    from kvcache.server.serve import check_args
    with pytest.raises(ValueError, match="--engine-process runs one engine"):
        check_args(argparse.Namespace(port=8000, shutdown_timeout=1.0, engine_process=True, replicas=2))
