"""`kvcache serve --replicas K`: replicas on Ray Serve behind the KV-aware router (a local Ray cluster started by the
command), as a user runs it; and the router's choices on their own."""
from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import time

import httpx
import msgpack
import openai
import pytest
import redis

from kvcache.bench.replicas import start_replicas, stop_replicas
from kvcache.router.kv_index import EngineKeys, EventSubscriber, decode_batch
from kvcache.router.ingress import relabel, relay
from kvcache.router.prefix_router import PrefixRouter, prefix_keys
from kvcache.engine.kv_events import encode_event
from kvcache.memory.block_hash import chain_hashes
from kvcache.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash

from drain_client import assert_clean_log, assert_refused_while_draining, signal_while_open
from live_server import API_KEY, scrape, start_server


def test_the_router_sends_a_prefix_where_it_went_balanced_against_load():
    r = PrefixRouter(3, "kv-aware", balance=2)
    a = prefix_keys({"model": "m", "prompt": list(range(40))})  # 3 blocks of 16 ids
    assert len(a) == 3
    first = r.choose(a)
    r.routed(a, first)
    longer = prefix_keys({"model": "m", "prompt": list(range(40)) + [7] * 20})
    assert longer[:2] == a[:2] and r.choose(longer) == first and r.decisions["prefix"] == 1
    assert prefix_keys({"model": "other", "prompt": list(range(40))})[0] != a[0]  # models never share
    # up to `balance` more requests in flight than the least-loaded replica: the prefix's replica keeps it
    r.inflight[first] = 2
    assert r.choose(longer) == first
    r.inflight[first] = 3  # more: the least loaded takes it
    assert r.choose(longer) != first and r.decisions["least_loaded"] == 1
    r.inflight[first] = 0
    r.down_until[first] = time.monotonic() + 60  # unreachable a moment ago: skipped
    assert r.choose(longer) != first
    r.down_until[first] = 0
    # a new prefix goes to the replica with the fewest prefix blocks, even a busier one: prefixes spread over the
    # caches evenly (SGLang's smallest tree)
    r.inflight = [0, 0, 0]
    r.inflight[(first + 1) % 3] = 5
    fresh = [prefix_keys({"model": "m", "prompt": [g] * 40}) for g in range(1, 3)]
    seen, before = [], r.decisions["smallest_cache"]
    for keys in fresh:
        seen.append(r.choose(keys))
        r.routed(keys, seen[-1])
    assert sorted(seen + [first]) == [0, 1, 2] and r.decisions["smallest_cache"] == before + 2
    assert r.held == [3, 3, 3]
    # a request sharing under half its blocks with any replica is a new prefix too
    half = prefix_keys({"model": "m", "prompt": list(range(16)) + [9] * 40})  # 4 blocks, the first one first's
    assert r.matched(half)[first] == 1
    r.choose(half)
    assert r.decisions["smallest_cache"] == before + 3
    text = prefix_keys({"model": "m", "messages": [{"role": "user", "content": "x" * 200}]})
    assert len(text) >= 3  # chat messages hash as their JSON, 64 characters a block
    shared = PrefixRouter(2, "kv-aware")  # a prefix both replicas were sent (a common system prompt)
    shared.routed(a, 0)
    shared.routed(a, 1)
    assert shared.matched(a) == [3, 3] and shared.matched(longer) == [2, 2]
    shared.inflight[0] = 1
    assert shared.choose(longer) == 1  # it matches alike everywhere: load decides
    rr = PrefixRouter(3, "round-robin")
    assert [rr.choose(a) for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="routing must be kv-aware or round-robin"):
        PrefixRouter(2, "random")


def test_the_record_of_a_replica_is_bounded_by_its_pool_and_drops_chains_from_their_ends():
    """A replica whose pool holds 6 blocks cannot still hold two 4-block prefixes: the older one's last 2 blocks go
    from its record (its own LRU gives back a chain's end first), its first 2 stay; another replica's record is
    untouched, and a smaller pool reported later trims at once."""
    r = PrefixRouter(2, "kv-aware")
    r.set_pool(0, 6 * 16)
    a = prefix_keys({"model": "m", "prompt": list(range(64))})  # 4 blocks
    b = prefix_keys({"model": "m", "prompt": [5] * 64})
    r.routed(a, 0)
    r.routed(a, 1)
    r.routed(b, 0)
    assert r.matched(a) == [2, 4] and r.matched(b) == [4, 0] and r.held == [6, 4]
    assert all(k in r.index for k in a)  # replica 1 still holds a's last blocks
    r.routed(a, 0)  # a used again: now b is the older
    assert r.matched(a)[0] == 4 and r.matched(b)[0] == 2
    r.set_pool(1, 2 * 16)
    assert r.matched(a) == [4, 2] and r.held == [6, 2]
    r.set_pool(0, 1)  # less than a block: one key kept, the most recent chain's first
    assert r.held[0] == 1 and r.matched(a)[0] == 1 and r.matched(b)[0] == 0
    assert r.forget(0) == 1 and r.held == [0, 2] and r.matched(a) == [0, 2]
    assert len(r.index) == 2  # only replica 1's two keys remain


def test_a_replica_that_lost_its_cache_is_forgotten_and_others_keep_theirs():
    r = PrefixRouter(3, "kv-aware")
    a = prefix_keys({"model": "m", "prompt": list(range(48))})  # 3 blocks
    b = prefix_keys({"model": "m", "prompt": [5] * 48})
    r.routed(a, 0)
    r.routed(a, 1)  # a on two replicas
    r.routed(b, 0)
    assert r.held == [6, 3, 0] and len(r.index) == 6
    assert r.forget(0) == 6 and r.resets == 1
    assert r.held == [0, 3, 0] and len(r.index) == 3  # b's entries held by no one are gone
    assert r.matched(a) == [0, 3, 0] and r.matched(b) == [0, 0, 0]
    assert r.choose(a) == 1 and r.decisions["prefix"] == 1  # a still goes where it is cached
    assert r.choose(b) == 0 and r.decisions["smallest_cache"] == 1  # b is a new prefix again: the emptiest cache
    assert r.forget(2) == 0 and r.resets == 1  # nothing to forget: not counted
    r.routed(b, 0)
    assert r.held == [3, 3, 0]


def _engine_keys(ids: list[int]) -> list[int]:
    """The hashes an engine with blocks of 16 publishes for a prompt of `ids`."""
    return [external_hash(h) for h in chain_hashes(ids, 16, (), [])]


def _stored(keys: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(keys, None, [0] * 16 * len(keys), 16, medium)


def _apply(router: PrefixRouter, replica: int, seq: int, *events) -> None:
    """`events` sent as the engine's publisher sends a batch (engine/kv_events.py), received as the ingress does."""
    payload = msgpack.packb([time.time(), [encode_event(e) for e in events], 0], use_bin_type=True)
    router.apply(replica, *decode_batch([b"", seq.to_bytes(8, "big"), payload]))


def test_the_router_follows_each_replicas_kv_events_and_stops_preferring_a_replica_that_removed_a_prefix():
    r = PrefixRouter(2, "kv-aware", balance=2)
    a = _engine_keys(list(range(48)))  # 3 blocks
    _apply(r, 0, 5, AllBlocksCleared(), _stored(a))  # the first batch seen may be any: nothing before it is known
    _apply(r, 1, 0, _stored(a[:1]), _stored(a[1:]))
    assert r.matched(a) == [3, 3] and r.stored == [set(a), set(a)] and r.held == [3, 3]
    r.inflight[1] = 1
    assert r.choose(a) == 0 and r.decisions["prefix"] == 1  # held alike: the less loaded
    _apply(r, 0, 6, BlockRemoved(a[1:], "GPU"))  # replica 0 evicted the prefix's end
    assert r.matched(a) == [1, 3]
    assert r.choose(a) == 1 and r.decisions["prefix"] == 2  # the deepest now, though busier
    _apply(r, 0, 7, _stored(a[1:], "CPU"))  # in an offload tier, not in the pool: not held
    assert r.matched(a) == [1, 3]
    _apply(r, 1, 1, AllBlocksCleared())
    assert r.matched(a) == [1, 0] and r.held == [1, 0]
    # a gap (batch 8 was lost, with whatever it stored or removed): replica 0's stored blocks are dropped and rebuilt
    # from the batch after it
    b = _engine_keys([7] * 32)
    _apply(r, 0, 9, _stored(b))
    assert r.gaps == 1 and r.stored[0] == set(b) and r.matched(a)[0] == 0
    _apply(r, 0, 10, _stored(a[:1]))
    assert r.gaps == 1 and r.matched(a)[0] == 1
    # a restart (another process): everything is forgotten, and its events are followed from the next batch seen
    assert r.forget(0) == 3 and r.held[0] == 0 and r.resets == 1
    _apply(r, 0, 0, AllBlocksCleared(), _stored(b))
    assert r.gaps == 1 and r.matched(b) == [2, 0]


def test_a_prefix_sent_counts_as_held_until_its_events_settle_it():
    """Between routing a request and its replica's BlockStored the router remembers where it sent the prefix; the
    events then take over: BlockStored moves the keys to the stored record, BlockRemoved drops them."""
    r = PrefixRouter(2, "kv-aware")
    a = _engine_keys(list(range(64)))  # 4 blocks
    first = r.choose(a)
    r.routed(a, first)
    assert r.matched(a)[first] == 4 and r.held[first] == 4 and r.stored[first] == set()
    assert r.choose(a) == first and r.decisions["prefix"] == 1  # not yet stored: still goes there
    _apply(r, first, 0, _stored(a[:3]))
    assert r.held[first] == 4 and list(r.recent[first]) == [a[3]] and r.stored[first] == set(a[:3])
    r.routed(a, first)  # sent again: only the key not confirmed is recorded as sent
    assert list(r.recent[first]) == [a[3]]
    _apply(r, first, 1, BlockRemoved([a[3]], "GPU"))  # stored then evicted, its BlockStored unseen: settled anyway
    assert r.matched(a)[first] == 3 and r.held[first] == 3 and not r.index
    _apply(r, first, 3, _stored(a))  # a gap: the stored record is rebuilt, the record of keys sent kept
    r.routed(a, 1 - first)
    _apply(r, 1 - first, 0, AllBlocksCleared())  # a cleared pool: prefixes sent and not yet stored stay
    assert r.matched(a) == [4, 4] and r.gaps == 1


def test_a_kv_event_message_that_is_not_the_engines_is_refused_with_what_it_is():
    def frames(payload) -> list[bytes]:
        return [b"", (0).to_bytes(8, "big"), msgpack.packb(payload)]
    with pytest.raises(ValueError, match=r"3 frames, the second of 8 bytes; got 2 frames of \[0, 8\] bytes"):
        decode_batch(frames([0, [], 0])[:2])
    with pytest.raises(ValueError, match="is not msgpack"):
        decode_batch([b"", bytes(8), b"\xc1"])
    with pytest.raises(ValueError, match=r"\[ts, \[event, ...\], rank\]; got list of 2 items"):
        decode_batch(frames([0, []]))
    with pytest.raises(ValueError, match="event 1 of 2 is not a KV event"):
        decode_batch(frames([0, [["AllBlocksCleared"], ["BlockRemoved", ["x"], "GPU"]], 0]))
    assert decode_batch(frames([0, [["BlockRemoved", [1, 2], "GPU"]], 0])) == (0, [["BlockRemoved", [1, 2], "GPU"]])


class FakePublisher:
    """A replica's KV event sockets driven by hand: a PUB bound at `endpoint` and a ROUTER at `replay` whose requests
    the test answers (or not) with `answer`."""

    def __init__(self, tmp_path) -> None:
        import zmq
        self.endpoint, self.replay = f"ipc://{tmp_path}/ev.ipc", f"ipc://{tmp_path}/ev-replay.ipc"
        self.ctx = zmq.Context()
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind(self.endpoint)
        self.router.bind(self.replay)

    @staticmethod
    def payload(seq: int) -> bytes:
        return msgpack.packb([0.0, [encode_event(BlockStored([seq], None, [1] * 4, 4, "GPU"))], 0])

    def send(self, seq: int) -> None:
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.payload(seq)])

    def request(self, timeout_s: float = 5) -> tuple[bytes, int]:
        """The next replay request: (client, start)."""
        assert self.router.poll(int(timeout_s * 1000)), "no replay request came"
        client, empty, start = self.router.recv_multipart()
        assert empty == b"" and len(start) == 8
        return client, int.from_bytes(start, "big")

    def answer(self, client: bytes, seqs) -> None:
        from kvcache.engine.kv_events import END_SEQ
        for seq in seqs:
            self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), self.payload(seq)])
        self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


def _delivered(sub: EventSubscriber, n: int, timeout_s: float = 5) -> list[int]:
    """The sequence numbers of the next `n` batches the subscriber delivers (fewer if they do not come in time)."""
    got, end = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < end:
        try:
            _, _, seq, events = sub.batches.get(timeout=0.05)
        except queue.Empty:
            continue
        assert events[0][1] == [seq]
        got.append(seq)
    return got


def test_the_subscriber_fills_what_it_missed_from_the_replay_in_order_and_once(tmp_path):
    """Following late asks the replay from 0, and live batches received meanwhile wait behind it; a gap in the live
    stream asks for the missing batches; every batch reaches the router once, in order."""
    fake, sub = FakePublisher(tmp_path), EventSubscriber()
    try:
        sub.follow(0, fake.endpoint, fake.replay)
        client, start = fake.request()
        assert start == 0
        end = time.monotonic() + 5  # the SUB socket connects: live batches now arrive, and wait for the replay
        while sub.batches.empty() and time.monotonic() < end and not sub.held():
            fake.send(3)
            time.sleep(0.05)
        fake.send(4)
        assert sub.batches.empty()
        fake.answer(client, [0, 1, 2, 3])  # the publisher kept 0 .. 3 (3 also came live: delivered once)
        assert _delivered(sub, 5) == [0, 1, 2, 3, 4]
        fake.send(4)  # a duplicate: dropped
        fake.send(7)  # 5 and 6 lost: held, and asked for
        client, start = fake.request()
        assert start == 5 and sub.batches.empty()
        fake.answer(client, [5, 6, 7])
        fake.send(8)
        assert _delivered(sub, 5, 2) == [5, 6, 7, 8]
        assert (sub.replays, sub.replayed, sub.bad) == (2, 5, 0)
    finally:
        sub.close()
        fake.close()


def test_a_subscriber_with_nothing_to_follow_yet_waits_instead_of_spinning():
    """Before the first `follow` its poller has no socket, which zmq answers at once: the thread must block on the
    follow queue, not spin holding the GIL (it slowed a tokenizer load on the main thread 18-fold)."""
    sub = EventSubscriber()
    try:
        start = _thread_cpu(sub._thread.native_id)
        time.sleep(1.0)
        cpu = _thread_cpu(sub._thread.native_id) - start  # that thread's own: what else runs does not count
        assert cpu < 0.05, f"the idle subscriber thread used {cpu:.2f} s of CPU in 1 s"
    finally:
        sub.close()


def _thread_cpu(tid: int) -> float:
    """Seconds of CPU (user and system) thread `tid` of this process has used (Linux's /proc)."""
    if not os.path.exists(f"/proc/self/task/{tid}/stat"):
        pytest.skip("a thread's own CPU time is read from Linux's /proc")
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14 and 15)


def test_a_replay_that_never_answers_is_given_up_and_later_gaps_reach_the_router(tmp_path, monkeypatch, caplog):
    import kvcache.router.kv_index as kv_index
    monkeypatch.setattr(kv_index, "REPLAY_TIMEOUT_S", 0.5)
    fake, sub = FakePublisher(tmp_path), EventSubscriber()
    try:
        sub.follow(0, fake.endpoint, fake.replay)
        fake.request()  # never answered
        end = time.monotonic() + 5
        while not sub.held() and time.monotonic() < end:
            fake.send(2)
            time.sleep(0.05)
        assert _delivered(sub, 1) == [2]  # after the timeout, without 0 and 1 (gone with the replay)
        router = PrefixRouter(1, "kv-aware")
        router.apply(0, 2, [])
        fake.send(4)  # followed without replay now: a gap goes straight through, and the router counts it
        assert _delivered(sub, 1) == [4] and sub.replays == 1
        router.apply(0, 4, [])
        assert router.gaps == 1
        assert "did not answer within 0.5 s" in caplog.text
    finally:
        sub.close()
        fake.close()


@pytest.mark.parametrize("model", ["tiny_llama", pytest.param("demo_path", marks=pytest.mark.demo)])
def test_the_router_hashes_completion_and_chat_prompts_as_the_engine_stores_them(model, request, tmp_path):
    """A server publishing its KV events, followed by the router's subscriber only after the requests (what came
    before arrives from the replay endpoint): the keys the router computes for a
    text prompt, token ids, chat messages and a salted chat request are exactly the blocks the engine then stored
    (and the salt keys them apart). The tiny model's word-level tokenizer, and the demo model's BPE one and chat
    template (which adds a system prompt of its own)."""
    path = request.getfixturevalue(model)
    endpoint, replay = f"ipc://{tmp_path}/events.ipc", f"ipc://{tmp_path}/replay.ipc"
    srv = start_server(path, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
                       kv_cache_memory="64MiB")  # every prompt stays cached
    sub = EventSubscriber()
    try:
        keys = EngineKeys(path, srv.loop.engine.config.block_size)
        words = " ".join(f"w{5 + i}" for i in range(40))  # 40 tokens of the tiny model's, more of the demo's
        chat = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "system", "content": words},
                                                              {"role": "user", "content": "w9 w10"}]}
        bodies = [("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": words}),
                  ("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": [[4] * 35, [5] * 20]}),
                  ("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "cache_salt": "tenant-2"})]
        expected = [keys(body, path.endswith("chat/completions")) for path, body in bodies]
        assert all(len(k) >= 2 for k in expected) and expected[2] != expected[3]
        assert set(expected[0]).isdisjoint(expected[2])
        router = PrefixRouter(1, "kv-aware")
        for path, body in bodies:
            r = httpx.post(f"{srv.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            assert r.status_code == 200, r.text
        sub.follow(0, endpoint, replay)  # after the requests: what was published before comes from the replay
        end = time.monotonic() + 10
        while not all(router.matched(k) == [len(k)] for k in expected) and time.monotonic() < end:
            time.sleep(0.05)
            while not sub.batches.empty():
                _, _, seq, events = sub.batches.get()
                router.apply(0, seq, events)
        assert [router.matched(k)[0] for k in expected] == [len(k) for k in expected] and router.gaps == 0
        assert sub.bad == 0 and sub.replays == 1 and sub.replayed >= len(bodies)
    finally:
        sub.close()
        srv.stop()


def test_replicas_refuse_one_kv_events_endpoint_for_all(tiny_llama):
    from types import SimpleNamespace

    from kvcache.config import EngineConfig
    from kvcache.router.replicas import serve_replicas
    with pytest.raises(ValueError, match=r"--kv-events-endpoint tcp://\*:5557 with --replicas 2: each replica"):
        serve_replicas(SimpleNamespace(replicas=2), EngineConfig(model=tiny_llama, kv_events_endpoint="tcp://*:5557"))


def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event_and_done():
    import asyncio
    import json

    async def upstream():
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        raise httpx.ReadError("connection reset by peer")

    async def collect(sse: bool) -> tuple[bytes, int]:
        closed = []

        async def done():
            closed.append(1)
        return b"".join([c async for c in relay(upstream(), sse, 3, done)]), len(closed)

    out, closed = asyncio.run(collect(True))
    events = [e.removeprefix("data: ") for e in out.decode().strip().split("\n\n")]
    assert events[0] == '{"choices": [{"text": "a"}]}' and events[-1] == "[DONE]" and closed == 1
    err = json.loads(events[1])["error"]
    assert err["code"] == "replica_failed" and "replica 3 failed while streaming" in err["message"]
    assert "connection reset by peer" in err["message"]
    out, closed = asyncio.run(collect(False))  # not a stream of events: it just ends, and is still closed
    assert out == b'data: {"choices": [{"text": "a"}]}\n\n' and closed == 1


def test_metrics_get_a_replica_label():
    text = "# HELP a x\n# TYPE a counter\na_total{model_name=\"m\"} 3.0\nb 1\n"
    assert relabel(text, 2, keep_meta=False) == ['a_total{replica="2",model_name="m"} 3.0', 'b{replica="2"} 1']
    assert relabel(text, 0, keep_meta=True)[:2] == ["# HELP a x", "# TYPE a counter"]


@contextlib.contextmanager
def serving_replicas(model: str, tmp_path, *args: str):
    """`kvcache serve --replicas ...` on a free loopback port, until every replica is up: its URL. Stopped after by
    SIGTERM to the server alone, as a supervisor stops it: it must exit 0 having removed its KV event endpoints'
    directory (Ray's shutdown runs on that way out too)."""
    log_path = tmp_path / "serve.log"
    proc, url = start_replicas(["--model", model, "--kv-cache-memory", "1MiB", "--max-model-len", "256",
                                "--served-model-name", "tiny", *args], str(log_path), 180)
    try:
        yield url
    finally:
        stop_replicas(proc, term=True)
    events_dir = re.search(r"KV event endpoints live in (\S+)", log_path.read_text()).group(1)
    assert proc.returncode == 0 and not os.path.exists(events_dir), log_path.read_text()[-2000:]


def _replicas(url: str) -> dict:
    return httpx.get(f"{url}/replicas", timeout=30).json()


def test_two_replicas_on_ray_serve_route_by_prefix_and_survive_a_killed_replica(tiny_model_dirs, tmp_path):
    with serving_replicas(tiny_model_dirs["llama"], tmp_path, "--replicas", "2") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        FULL = {"ignore_eos": True}  # tokens are counted below: a sampled EOS (temperature 1) would end one early
        groups = [[3 + g] * 40 for g in range(2)]  # two prefixes of 2 full blocks and more
        where = {}
        for i in range(6):
            g = i % 2
            raw = client.completions.with_raw_response.create(model="tiny", prompt=groups[g] + [100 + i], max_tokens=3,
                                                              extra_body=FULL)
            where.setdefault(g, set()).add(raw.headers["x-kvcache-replica"])
        assert all(len(v) == 1 for v in where.values())  # a prefix stays on its replica
        streamed = list(client.completions.create(model="tiny", prompt=groups[0] + [9], max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True}, extra_body=FULL))
        # every token streams through the router (a chunk's text may be empty: an EOS past which it goes on)
        assert [c.usage.completion_tokens for c in streamed if c.usage] == [4]
        assert any(c.choices and c.choices[0].text for c in streamed)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'kvcache:prefix_cache_hits_total{replica="0"' in metrics and 'replica="1"' in metrics
        assert "kvcache:router_prefix_hit_routed_total 5" in metrics  # all but each prefix's first request
        end = time.monotonic() + 30
        while not all((state := _replicas(url))["stored"]):  # each replica's events reach the router
            assert time.monotonic() < end, state
            time.sleep(0.5)
        assert state["keys"] == {"engine": 7, "text": 0} and state["event_gaps"] == 0, state  # the engine's hashes
        before = state["replicas"]
        os.kill(before[0]["pid"], signal.SIGKILL)
        for i in range(4):  # requests to the killed replica are retried on the other one before streaming
            out = client.completions.create(model="tiny", prompt=groups[i % 2] + [200 + i], max_tokens=2,
                                            extra_body=FULL)
            assert out.usage.completion_tokens == 2
        end = time.monotonic() + 120
        while True:  # Ray Serve restarts it
            state = _replicas(url)
            now = state["replicas"]
            if "pid" in now[0] and now[0]["pid"] != before[0]["pid"]:
                break
            assert time.monotonic() < end, now
            time.sleep(1)
        # the restarted replica's cache is empty, and so is the router's record of it: both prefixes are the other
        # replica's now (their requests were retried there), so they go there as hits, not back to the empty one
        assert state["held"][0] == 0 and state["held"][1] > 0 and state["resets"] >= 1, state
        for g in range(2):
            raw = client.completions.with_raw_response.create(model="tiny", prompt=groups[g] + [300], max_tokens=2,
                                                              extra_body=FULL)
            assert raw.headers["x-kvcache-replica"] == "1" and raw.parse().usage.completion_tokens == 2
        assert "kvcache:router_replica_resets_total" in httpx.get(f"{url}/metrics", timeout=30).text


def test_a_replica_that_misses_loads_the_prefix_from_the_shared_redis_tier(tiny_model_dirs, tmp_path, redis_server):
    """Round-robin sends the same prompt to both replicas: the first computes it and writes its blocks through to
    Redis, the second, which never saw it, loads them from there (and gives the same tokens)."""
    with serving_replicas(tiny_model_dirs["llama"], tmp_path, "--replicas", "2", "--routing", "round-robin",
                          "--kv-remote", redis_server.url) as url:
        _one_prompt_on_both_replicas(url, redis_server.url)


def _one_prompt_on_both_replicas(url: str, redis_url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompt = [(7 * i) % 300 + 3 for i in range(100)]  # 6 full blocks of 16 and 4 tokens
    first = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert first.headers["x-kvcache-replica"] == "0"
    r = redis.Redis.from_url(redis_url)
    end = time.monotonic() + 30
    while r.dbsize() < 6:  # written through by replica 0's background thread
        assert time.monotonic() < end, r.dbsize()
        time.sleep(0.1)
    second = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert second.headers["x-kvcache-replica"] == "1"
    assert second.parse().choices[0].text == first.parse().choices[0].text
    metrics = scrape(url)
    assert metrics["kvcache:kv_offload_loaded_blocks_total{replica=1}"] == 6, metrics
    assert metrics["kvcache:kv_offload_hits_total{replica=1,tier=redis}"] >= 6
    assert metrics["kvcache:kv_offload_loaded_blocks_total{replica=0}"] == 0


def test_replicas_drain_on_sigterm_the_router_refusing_and_each_replica_aborting_what_its_timeout_leaves(
        tiny_model_dirs, tmp_path):
    """SIGTERM to `kvcache serve --replicas 2` with 24 streams in flight (one at a time per replica, 500 tokens each):
    the router answers 503 to new requests and /health; each stream ends whole or with the shutdown's error event
    and [DONE], through the router; the process exits 0 with no traceback."""
    log_path = tmp_path / "serve.log"
    proc, url = start_replicas(["--model", tiny_model_dirs["llama"], "--kv-cache-memory", "1MiB", "--max-model-len",
                                "512", "--max-num-seqs", "1", "--served-model-name", "tiny", "--replicas", "2",
                                "--routing", "round-robin", "--shutdown-timeout", "1"], str(log_path), 180)
    try:
        events, wholes, new, health = asyncio.run(signal_while_open(proc, url, signal.SIGTERM, 24, 500, 1, 2))
        assert proc.wait(timeout=120) == 0
    finally:
        stop_replicas(proc, leftovers=proc.poll() is None)
    assert_refused_while_draining(new, health)
    aborted = 0
    for ev in events:
        assert ev[-1] == "[DONE]"
        if "error" in ev[-2]:
            assert ev[-2]["error"]["code"] == "server_shutting_down", ev[-2]
            aborted += 1
        else:
            assert ev[-2]["choices"][0]["finish_reason"] == "length"
    # 22 queue behind the two running: about 5 s of work a replica (500 tokens take the tiny model about 0.3 s on Zen
    # 3), so the 1 s timeout leaves most of them (22 of 24 in a run here) even where the signal's handler runs late
    # on a loaded machine. With 6 streams, a CI run finished all of them.
    assert aborted >= 2
    log = log_path.read_text()
    assert_clean_log(log, "replicas drained")
    assert "SIGTERM: draining 2 replicas" in log
