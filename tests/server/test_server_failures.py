"""The server survives what once stopped its engine: the issue's two reproducers, a fault injected into one
request's path (the others still answer correctly; the failed one gets a 500 or an error event naming its
request id, never a traceback), and a dead engine that shuts the server down with a non-zero status."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from live_server import API_KEY, MODEL, scrape, start_server
from tiny_models import OVERFLOW_TOKEN, make_fp16_overflow_model
from kvcache import LLM, SamplingParams
from kvcache.engine import sampling_step
from kvcache.engine.llm_engine import MAX_CONSECUTIVE_FAILURES
from kvcache.engine.model_runner import ModelRunner
from kvcache.server.serve import ENGINE_DEAD_STATUS, serve_until_dead

H = {"Authorization": f"Bearer {API_KEY}"}
BAD_SEED = 4242
INTERNALS = ("Traceback", "frame #", ".py", "c10::", "THPUtils")


def post(client: httpx.Client, url: str, body: dict | bytes, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body}).encode()
    return client.post(f"{url}{path}", content=content, headers={**H, "Content-Type": "application/json"},
                       timeout=60)


def assert_clean_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert not any(x in r.text for x in INTERNALS), r.text
    for w in words:
        assert w in error["message"], error
    return error


def assert_healthy(client: httpx.Client, url: str) -> None:
    assert client.get(f"{url}/health").status_code == 200
    assert post(client, url, {"prompt": "w5 w6", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def srv(tiny_llama):
    s = start_server(tiny_llama, max_waiting_requests=16)
    yield s
    s.stop()


def test_the_issues_reproducers_leave_the_server_healthy(srv):
    with httpx.Client() as client:
        r = post(client, srv.url, {"prompt": "w5 w5 w5 w6", "max_tokens": 4, "kv_eviction": "h2o",
                                   "kv_budget": 10**30})
        error = assert_clean_error(r, 400, "kv_budget", "above max_model_len 512")
        assert error["param"] == "kv_budget"
        r = post(client, srv.url, {"prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 1, "seed": 1,
                                   "repetition_penalty": 1e-300})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert_healthy(client, srv.url)


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "w5", "kv_budget": -1}, "kv_budget", "at least 1 token"),
    ({"prompt": "w5", "kv_budget": "nan"}, "kv_budget", "(0, 1]"),
    ({"prompt": "w5", "kv_budget": 64}, "kv_budget", "needs a kv_eviction policy"),
    ({"prompt": "w5", "kv_eviction": "streaming", "kv_budget": 10**6}, "kv_budget", "above max_model_len"),
    ({"prompt": "w5", "temperature": float("nan")}, "temperature", "finite"),
    ({"prompt": "w5", "top_p": float("inf")}, "top_p", "finite"),
    ({"prompt": "w5", "presence_penalty": 10**400}, "presence_penalty", "valid number"),
    ({"prompt": "w5", "n": 10**300}, "n", "characters)"),  # the number is cut short in the message
    ({"prompt": "w5", "stop_token_ids": list(range(2000))}, "stop_token_ids", "at most 1024"),
    ({"prompt": [[5, 6]] * 17}, "prompt", "queues at most 16"),
])
def test_out_of_range_values_get_a_400_naming_the_field(srv, body, param, words):
    with httpx.Client() as client:
        error = assert_clean_error(post(client, srv.url, body), 400, words)
        assert error["param"] == param
        assert len(error["message"]) < 300
        assert_healthy(client, srv.url)


def test_unreadable_json_is_a_400_and_the_connection_stays_usable(srv):
    with httpx.Client() as client:  # one keep-alive connection for all of these
        for body, words in [(b'{"prompt": "w5", "max_tokens": ' + b"9" * 5000 + b"}", "too many digits"),
                            (b"[" * 100_000, "nests too deeply"), (b'{"prompt": "w5",', "malformed"),
                            (b"\xff\xfe", "malformed")]:
            r = post(client, srv.url, body)
            assert_clean_error(r, 400, words)
            assert "close" not in r.headers.get("connection", "")
            assert_healthy(client, srv.url)


def test_an_unexpected_error_is_a_500_with_the_request_id_and_the_connection_stays_usable(srv, monkeypatch, caplog):
    def broken(text, special=True):
        raise RuntimeError("internal detail that must not leak")
    monkeypatch.setattr(srv.loop.engine, "tokenize", broken)
    with httpx.Client() as client:
        r = post(client, srv.url, {"prompt": "w5 w6"})
        rid = r.headers["x-request-id"]
        error = assert_clean_error(r, 500, rid)
        assert error["code"] == "internal_error" and "internal detail" not in r.text
        assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)  # the traceback is logged
        monkeypatch.undo()
        assert_healthy(client, srv.url)


def test_every_response_carries_a_request_id(srv):
    with httpx.Client() as client:
        ok = post(client, srv.url, {"prompt": "w5", "max_tokens": 1})
        bad = post(client, srv.url, {"prompt": "w5", "n": 0})
        ids = {ok.headers["x-request-id"], bad.headers["x-request-id"], client.get(f"{srv.url}/health").headers[
            "x-request-id"]}
        assert len(ids) == 3
        assert ok.json()["id"] == f"cmpl-{ok.headers['x-request-id']}"


@pytest.fixture
def faulty_sampler(monkeypatch):
    """The sampler raises for every batch that holds the request seeded with BAD_SEED."""
    real = sampling_step.sample

    def faulty(logits, rows, eos):
        if any(r.params.seed == BAD_SEED for r in rows):
            raise RuntimeError("injected sampler fault")
        return real(logits, rows, eos)
    monkeypatch.setattr(sampling_step, "sample", faulty)


def test_a_fault_in_one_request_fails_it_alone_while_the_others_answer(srv, tiny_llama, faulty_sampler):
    good = [{"prompt": f"w{5 + i} w9 w{20 + i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            for i in range(4)]
    bad = {"prompt": "w7 w8", "max_tokens": 8, "temperature": 1.0, "seed": BAD_SEED, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[client.post(f"{srv.url}/v1/completions", headers=H,
                                                      json={"model": MODEL, **b}) for b in [*good, bad]])
    errors_before = scrape(srv.url)["kvcache:request_success_total{finished_reason=error}"]
    *answers, failed = asyncio.run(burst())
    error = assert_clean_error(failed, 500, failed.headers["x-request-id"], "sampling")
    assert scrape(srv.url)["kvcache:request_success_total{finished_reason=error}"] == errors_before + 1
    assert error["code"] == "engine_error" and error["type"] == "server_error"
    offline = LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=512)
    for body, r in zip(good, answers):
        assert r.status_code == 200, r.text
        ref = offline.generate(body["prompt"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0]
        assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    with httpx.Client() as client:
        assert_healthy(client, srv.url)


def test_a_streamed_request_that_fails_ends_with_an_error_event(srv, faulty_sampler):
    body = {"model": MODEL, "prompt": "w7 w8", "max_tokens": 8, "seed": BAD_SEED, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=H, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "engine_error" and r.headers["x-request-id"] in error["message"]
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.APIError, match="sampling"):  # the official client raises on the event
        for _ in client.completions.create(model=MODEL, prompt="w7 w8", max_tokens=8, seed=BAD_SEED, stream=True):
            pass
    with httpx.Client() as c:
        assert_healthy(c, srv.url)


def test_a_dead_engine_shuts_the_server_down_with_a_non_zero_status(tiny_llama, monkeypatch):
    status: list[int] = []

    def run(server, loop):
        status.append(serve_until_dead(server, loop))
    dead = start_server(tiny_llama, run=run)
    try:
        def broken(self, chunks):
            raise RuntimeError("injected: the device is gone")
        monkeypatch.setattr(ModelRunner, "execute", broken)
        with httpx.Client() as client:
            for _ in range(MAX_CONSECUTIVE_FAILURES - 1):
                assert_clean_error(post(client, dead.url, {"prompt": "w5 w6", "max_tokens": 2}), 500, "batch")
            # the last straw: the engine gives up, and this request is answered as the server goes down
            assert_clean_error(post(client, dead.url, {"prompt": "w5 w6", "max_tokens": 2}), 503, "shutting down")
        dead.thread.join(30)
        assert status == [ENGINE_DEAD_STATUS] and not dead.loop.alive
    finally:
        dead.stop()


def test_requests_queued_when_the_engine_dies_are_all_answered(tiny_llama, monkeypatch):
    """Requests arrive while failing steps run: whether running, queued for the engine thread or new, each gets
    its 500 or 503, none hangs, and the server still exits with ENGINE_DEAD_STATUS. One request a step
    (max_num_seqs 1), and the first failing step held until the others have queued behind it: the requests of the
    steps that failed before the last get 500, the last one's and those still queued 503, however slow the
    machine."""
    status: list[int] = []
    dead = start_server(tiny_llama, run=lambda server, loop: status.append(serve_until_dead(server, loop)),
                        max_num_seqs=1)
    n = 8

    held = threading.Event()

    def held_and_broken(self, chunks):
        deadline = time.monotonic() + 30
        while not held.is_set() and dead.loop.num_waiting < n - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.set()  # the first step only
        raise RuntimeError("injected: the device is gone")
    monkeypatch.setattr(ModelRunner, "execute", held_and_broken)

    async def at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i: int):
                try:
                    r = await client.post(f"{dead.url}/v1/completions", headers=H,
                                          json={"model": MODEL, "prompt": f"w{5 + i}", "max_tokens": 2})
                except httpx.HTTPError as e:  # refused once the server is down: also an answer, not a hang
                    return type(e).__name__
                assert not any(x in r.text for x in INTERNALS)
                return r.status_code
            return await asyncio.gather(*[one(i) for i in range(n)])
    try:
        answers = asyncio.run(at_once())
        # the failed steps' requests: 500; the last straw's, and those queued behind it, 503 as the server goes down
        assert answers.count(500) == MAX_CONSECUTIVE_FAILURES - 1 and 503 in answers, answers
        assert set(answers) <= {500, 503, "ConnectError"}, answers
        dead.thread.join(30)
        assert status == [ENGINE_DEAD_STATUS]
    finally:
        dead.stop()


def test_a_dead_engine_answers_503_until_the_server_is_down(tiny_llama, monkeypatch):
    """Without serve_until_dead (an embedding application's own server): /health and requests answer 503."""
    dead = start_server(tiny_llama)
    try:
        monkeypatch.setattr(ModelRunner, "execute", lambda self, chunks: 1 / 0)
        with httpx.Client() as client:
            for _ in range(MAX_CONSECUTIVE_FAILURES):
                post(client, dead.url, {"prompt": "w5 w6", "max_tokens": 2})
            for _ in range(100):
                if not dead.loop.alive:
                    break
                threading.Event().wait(0.05)
            assert client.get(f"{dead.url}/health").status_code == 503
            assert_clean_error(post(client, dead.url, {"prompt": "w5"}), 503, "engine")
    finally:
        dead.stop()


def test_float16_overflow_is_a_500_for_that_request_and_the_server_serves_on(tiny_llama, tmp_path):
    path = make_fp16_overflow_model(tiny_llama, str(tmp_path / "overflow"))
    srv = start_server(path, dtype="float16", max_model_len=128)
    try:
        with httpx.Client() as client:
            bad = post(client, srv.url, {"prompt": [5, 6, OVERFLOW_TOKEN], "max_tokens": 4})
            error = assert_clean_error(bad, 500, "non-finite logits", bad.headers["x-request-id"])
            assert error["code"] == "engine_error"
            assert_healthy(client, srv.url)
    finally:
        srv.stop()


def test_the_server_builds_its_engine_on_a_thread_that_ends(tiny_llama):
    """build_engine loads on a thread of its own (so that the engine thread is the only OpenMP master) and hands
    back the engine, or re-raises the loading error itself on the caller's thread."""
    import threading

    from kvcache.config import EngineConfig
    from kvcache.server.engine_loop import build_engine
    engine = build_engine(EngineConfig(model=tiny_llama, kv_cache_memory="1MiB"))
    assert engine.kv_cache_info()["num_blocks"] > 0
    assert not [t for t in threading.enumerate() if t.name == "kvcache-load"]
    with pytest.raises(ValueError, match="max_model_len 99,999 exceeds"):
        build_engine(EngineConfig(model=tiny_llama, max_model_len=99_999))
