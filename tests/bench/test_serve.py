"""`kvcache bench serve` against a fake OpenAI-compatible server run in a background thread.

The fake streams one content chunk per requested token with fixed sleeps, then a usage chunk
and [DONE]; it records every body it receives and the peak number of requests in flight, and
fails requests on demand. Latency bounds are loose: the fake's sleeps are lower bounds only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvcache.bench.conversations import (WORDS, arrival_offsets, multi_turn_conversations, random_conversations,
                                         shared_prefix_conversations)
from kvcache.bench.serve import add_args, run

FIRST_DELAY = 0.03  # s before the first content chunk
TOKEN_DELAY = 0.005  # s between content chunks


class Fake:
    """State of the fake server; tests set the knobs and read what it received."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.received: list[dict] = []
        self.replies: list[str] = []
        self.in_flight = self.peak = self.count = 0
        self.fail_every = 0  # every n-th request answers HTTP 500
        self.break_every = 0  # every n-th request's stream stops before [DONE]
        self.no_usage = False
        self.first_delay = FIRST_DELAY
        self.auth: list[str | None] = []


def make_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        fake.received.append(body)
        fake.auth.append(request.headers.get("authorization"))
        fake.count += 1
        n = fake.count
        if fake.fail_every and n % fake.fail_every == 0:
            return JSONResponse({"error": {"message": f"boom on request {n}"}}, status_code=500)
        prompt = (body["prompt"] if not chat else " ".join(m["content"] for m in body["messages"]))
        pieces = [f"r{n}x{i} " for i in range(body["max_tokens"])]
        fake.replies.append("".join(pieces))

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            return "data: " + json.dumps({"choices": [choice], "usage": None}) + "\n\n"

        async def stream():
            fake.in_flight += 1
            fake.peak = max(fake.peak, fake.in_flight)
            try:
                if chat:  # like vLLM: a role-only first chunk, which must not count as the first token
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                    "content": ""}}]}) + "\n\n"
                await asyncio.sleep(fake.first_delay)
                for i, piece in enumerate(pieces):
                    if i:
                        await asyncio.sleep(TOKEN_DELAY)
                    yield chunk(piece)
                if fake.break_every and n % fake.break_every == 0:
                    return
                if not fake.no_usage:
                    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": len(pieces),
                             "total_tokens": len(prompt.split()) + len(pieces)}
                    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                fake.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server():
    fake = Fake()
    config = uvicorn.Config(make_app(fake), host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake server did not start")
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", fake
    srv.should_exit = True
    thread.join(5)


@pytest.fixture
def fake_url(server):
    url, fake = server
    fake.reset()
    return url, fake


def bench(url: str, tmp_path, *flags: str) -> tuple[int, dict]:
    p = argparse.ArgumentParser()
    add_args(p)
    out = tmp_path / "serve.json"
    rc = run(p.parse_args(["--url", url, "--json", str(out), *flags]))
    return rc, json.loads(out.read_text())


def test_random_workload_counts_tokens_and_measures_latencies(fake_url, tmp_path, capsys):
    url, fake = fake_url
    rc, r = bench(url, tmp_path, "--num-prompts", "8", "--input-len", "5:20", "--output-len", "3:9", "--seed", "4")
    assert rc == 0
    assert (r["completed"], r["failed"], r["first_error"]) == (8, 0, None)
    assert r["config"]["model"] == "fake-model"  # asked GET /v1/models
    expected = random_conversations(8, (5, 20), (3, 9), 0, 4)
    assert sorted(b["max_tokens"] for b in fake.received) == sorted(c.output_lens[0] for c in expected)
    assert r["total_output_tokens"] == sum(c.output_lens[0] for c in expected)
    assert r["total_input_tokens"] == sum(len(c.turns[0].split()) for c in expected)
    assert r["usage_reported"] == 8 and r["output_len_mismatches"] == 0
    for b in fake.received:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] is True
        assert b["model"] == "fake-model" and set(b["prompt"].split()) <= set(WORDS)
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"mean_{key}_ms"] and 0 < r[f"median_{key}_ms"] <= r[f"p99_{key}_ms"]
    # The fake sleeps 30 ms before the first token and 5 ms between tokens: lower bounds, loose upper ones.
    assert FIRST_DELAY * 1000 <= r["mean_ttft_ms"] < 5000
    assert 1 < r["mean_itl_ms"] < 2000 and 1 < r["mean_tpot_ms"] < 2000
    for q in r["requests"]:
        assert q["ok"] and 0 < q["ttft_ms"] <= q["e2el_ms"] and q["content_chunks"] == q["output_tokens"]
    assert r["request_throughput"] == pytest.approx(8 / r["duration_s"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    assert r["total_token_throughput"] > r["output_throughput"]
    table = capsys.readouterr().out
    assert "TTFT" in table and "ITL" in table and "8 / 0" in table


def test_max_concurrency_caps_requests_in_flight(fake_url, tmp_path):
    url, fake = fake_url
    rc, r = bench(url, tmp_path, "--num-prompts", "12", "--input-len", "4", "--output-len", "4",
                  "--max-concurrency", "3")
    assert rc == 0 and r["completed"] == 12
    assert 1 < fake.peak <= 3
    fake.reset()
    bench(url, tmp_path, "--num-prompts", "12", "--input-len", "4", "--output-len", "4")
    assert fake.peak > 3  # unlimited: all at once, so the tracker does see more


def test_failures_are_counted_not_raised(fake_url, tmp_path, capsys):
    url, fake = fake_url
    fake.fail_every = 3
    rc, r = bench(url, tmp_path, "--num-prompts", "9", "--input-len", "4", "--output-len", "2",
                  "--max-concurrency", "1")
    assert rc == 0
    assert (r["completed"], r["failed"]) == (6, 3)
    assert r["first_error"].startswith("HTTP 500") and "boom on request 3" in r["first_error"]
    assert r["total_output_tokens"] == 12
    fake.reset()
    fake.break_every = 2
    rc, r = bench(url, tmp_path, "--num-prompts", "4", "--input-len", "4", "--output-len", "2",
                  "--max-concurrency", "1")
    assert (r["completed"], r["failed"]) == (2, 2) and "[DONE]" in r["first_error"]
    assert "first error" in capsys.readouterr().out


def test_every_request_failing_returns_1(fake_url, tmp_path):
    url, fake = fake_url
    fake.fail_every = 1
    rc, r = bench(url, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "2")
    assert rc == 1 and r["completed"] == 0 and r["failed"] == 2
    assert r["mean_ttft_ms"] is None and r["request_throughput"] == 0


def test_timeout_fails_the_request(fake_url, tmp_path):
    url, fake = fake_url
    fake.first_delay = 1.0
    rc, r = bench(url, tmp_path, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--timeout", "0.1")
    assert r["failed"] == 2 and "--timeout 0.1 s" in r["first_error"]


def test_without_usage_content_chunks_are_counted(fake_url, tmp_path):
    url, fake = fake_url
    fake.no_usage = True
    rc, r = bench(url, tmp_path, "--num-prompts", "3", "--input-len", "6", "--output-len", "5", "--endpoint", "chat")
    assert r["completed"] == 3 and r["usage_reported"] == 0
    assert r["total_output_tokens"] == 15 and r["total_input_tokens"] == 18


def test_chat_sends_messages_and_skips_the_role_chunk_for_ttft(fake_url, tmp_path):
    url, fake = fake_url
    rc, r = bench(url, tmp_path, "--endpoint", "chat", "--num-prompts", "3", "--input-len", "6",
                  "--output-len", "4", "--model", "named", "--api-key", "sekret")
    assert r["completed"] == 3 and r["total_output_tokens"] == 12
    assert all(b["messages"][0]["role"] == "user" and b["model"] == "named" for b in fake.received)
    assert fake.auth == ["Bearer sekret"] * 3
    assert r["mean_ttft_ms"] >= FIRST_DELAY * 1000


def test_multi_turn_sends_growing_histories(fake_url, tmp_path):
    url, fake = fake_url
    rc, r = bench(url, tmp_path, "--workload", "multi-turn", "--endpoint", "chat", "--num-conversations", "2",
                  "--num-turns", "3", "--prefix-len", "10", "--suffix-len", "4", "--output-len", "3")
    assert (r["completed"], r["failed"]) == (6, 0)
    convs = multi_turn_conversations(2, 3, 10, 4, 3, 0)
    by_len: dict[int, list[list[dict]]] = {}
    for b in fake.received:
        by_len.setdefault(len(b["messages"]), []).append(b["messages"])
    assert sorted((k, len(v)) for k, v in by_len.items()) == [(2, 2), (4, 2), (6, 2)]
    for msgs in by_len[6]:
        assert msgs[0] == {"role": "system", "content": convs[0].system}
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert msgs[2]["content"] in fake.replies and msgs[4]["content"] in fake.replies
        # turn 3 repeats turn 2's history exactly
        assert any(msgs[:4] == shorter for shorter in by_len[4])

    fake.reset()
    rc, r = bench(url, tmp_path, "--workload", "multi-turn", "--num-conversations", "1", "--num-turns", "2",
                  "--prefix-len", "5", "--suffix-len", "3", "--output-len", "2")
    first, second = (b["prompt"] for b in fake.received)
    assert second.startswith(first + " " + fake.replies[0])
    assert r["total_input_tokens"] == len(first.split()) + len(second.split())


def test_multi_turn_stops_a_conversation_after_a_failed_turn(fake_url, tmp_path):
    url, fake = fake_url
    fake.fail_every = 1
    rc, r = bench(url, tmp_path, "--workload", "multi-turn", "--num-conversations", "2", "--num-turns", "3",
                  "--prefix-len", "2", "--suffix-len", "2", "--output-len", "2")
    assert len(fake.received) == 2 and (r["completed"], r["failed"]) == (0, 6)
    assert r["first_error"].startswith("HTTP 500")


def test_shared_prefix_prompts_share_their_group_prefix(fake_url, tmp_path):
    url, fake = fake_url
    rc, r = bench(url, tmp_path, "--workload", "shared-prefix", "--num-groups", "2", "--requests-per-group", "3",
                  "--prefix-len", "20", "--suffix-len", "5", "--output-len", "2")
    assert r["completed"] == 6
    prompts = [b["prompt"].split() for b in fake.received]
    assert all(len(p) == 25 for p in prompts)
    prefixes = [" ".join(p[:20]) for p in prompts]
    assert sorted(prefixes.count(x) for x in set(prefixes)) == [3, 3]
    assert len({" ".join(p[20:]) for p in prompts}) == 6
    convs = shared_prefix_conversations(2, 3, 20, 5, 2, 0)
    head = [" ".join(c.turns[0].split()[:20]) for c in convs]
    assert head[0] == head[2] == head[4] != head[1] == head[3] == head[5]  # request i is in group i % G

    fake.reset()
    bench(url, tmp_path, "--num-prompts", "4", "--input-len", "3:6", "--output-len", "2", "--shared-prefix-len", "8")
    assert len({" ".join(b["prompt"].split()[:8]) for b in fake.received}) == 1


def test_request_rate_paces_poisson_arrivals(fake_url, tmp_path):
    offsets = arrival_offsets(2000, 50.0, 1)
    assert offsets[0] == 0 and all(offsets[1:] >= offsets[:-1])
    assert 1 / 50 * 0.9 < offsets[-1] / 1999 < 1 / 50 * 1.1
    assert (arrival_offsets(5, 50.0, 1) == offsets[:5]).all() and (arrival_offsets(4, float("inf"), 1) == 0).all()
    url, fake = fake_url
    rc, r = bench(url, tmp_path, "--num-prompts", "5", "--input-len", "4", "--output-len", "2",
                  "--request-rate", "200", "--seed", "2")
    assert r["completed"] == 5 and r["config"]["request_rate"] == 200
    assert r["duration_s"] >= arrival_offsets(5, 200.0, 2)[-1]


def test_unreachable_url_and_bad_flags_are_clear_errors(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = argparse.ArgumentParser()
    add_args(p)
    with pytest.raises(OSError, match=f"cannot reach http://127.0.0.1:{port}"):
        run(p.parse_args(["--url", f"http://127.0.0.1:{port}/v1", "--num-prompts", "1"]))
    for flags, msg in ((["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
                       (["--request-rate", "0"], "--request-rate must be > 0"),
                       (["--url", "localhost:8000"], "must start with http"),
                       (["--workload", "shared-prefix", "--output-len", "2:4"], "one --output-len"),
                       (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0")):
        with pytest.raises(ValueError, match=msg):
            run(p.parse_args(flags))


def test_shuffled_shared_prefix_requests_are_the_same_requests_in_another_order():
    plain = shared_prefix_conversations(4, 3, 8, 4, 5, seed=1)
    mixed = shared_prefix_conversations(4, 3, 8, 4, 5, seed=1, shuffle=True)
    key = lambda c: c.turns[0]  # noqa: E731
    assert sorted(map(key, plain)) == sorted(map(key, mixed)) and list(map(key, plain)) != list(map(key, mixed))
    # unshuffled, request i is in group i % G: a round-robin over 4 replicas would follow the groups exactly
    prefixes = [key(c).rsplit(" ", 4)[0] for c in plain]
    assert prefixes[:4] == prefixes[4:8]


def test_multi_turn_conversations_behind_several_system_prompts():
    """The issue's replica workload: S system prompts x U users, conversation i behind system prompt i % S; shuffled,
    the same conversations start in another order. One system prompt (the default) keeps the earlier workload."""
    convs = multi_turn_conversations(12, 2, 8, 4, 3, seed=5, system_prompts=4)
    systems = [c.system for c in convs]
    assert len(set(systems)) == 4 and systems[:4] == systems[4:8] == systems[8:]
    assert all(len(c.turns) == 2 and c.output_lens == [3, 3] for c in convs)
    mixed = multi_turn_conversations(12, 2, 8, 4, 3, seed=5, system_prompts=4, shuffle=True)
    key = lambda c: (c.system, tuple(c.turns))  # noqa: E731
    assert sorted(map(key, convs)) == sorted(map(key, mixed)) and list(map(key, convs)) != list(map(key, mixed))
    one = multi_turn_conversations(3, 2, 8, 4, 3, seed=5)
    assert len({c.system for c in one}) == 1 and one[0].turns == multi_turn_conversations(3, 2, 8, 4, 3, 5)[0].turns
    with pytest.raises(ValueError, match="--num-system-prompts must be >= 1, got 3, 2, 8, 4, 0"):
        multi_turn_conversations(3, 2, 8, 4, 3, seed=5, system_prompts=0)
