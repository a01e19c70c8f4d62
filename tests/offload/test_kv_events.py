"""KV events (issue 15, `--kv-events-endpoint`): a ZeroMQ subscriber, decoding with vLLM's own msgspec structs, follows
what the pool and each offload tier hold; replaying the events gives exactly the pool's findable blocks."""
from __future__ import annotations

import random
import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvcache import LLM, SamplingParams
from kvcache.config import EngineConfig
from kvcache.engine.kv_events import END_SEQ, ZmqEventPublisher, binds
from kvcache.memory.kv_events import KVEventLog, external_hash


# vLLM's structs (vllm/distributed/kv_events.py, the array_like layout its subscribers decode): if these decode what
# kvcache sends, a vLLM-compatible router does too.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A SUB socket bound where the engine connects, keeping per medium the set of hashes the events say it holds."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.port = _port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.held: dict[str, set[int]] = {}
        self.seqs: list[int] = []
        self.batches: list[KVEventBatch] = []

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def drain(self, quiet_s: float = 0.5) -> None:
        """Apply every message until none has arrived for `quiet_s`."""
        while self.sock.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            batch = DECODER.decode(payload)
            self.batches.append(batch)
            for e in batch.events:
                if isinstance(e, BlockStored):
                    self.held.setdefault(e.medium, set()).update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    self.held.setdefault(e.medium, set()).difference_update(e.block_hashes)
                else:
                    self.held.get("GPU", set()).clear()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def sub():
    s = Subscriber()
    yield s
    s.close()


def _pool_hashes(engine) -> set[int]:
    kv = engine.kv
    if kv.radix:
        return {external_hash(h) for n in kv.radix._nodes() for h in n.hashes}
    return {external_hash(h) for h in kv.pool._cached}


def _connected(llm, sub) -> None:
    """Wait until the subscriber receives (PUB drops what it sends before the connection is up)."""
    before = len(sub.batches)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(sub.batches) == before:
        llm.engine.kv_events.cleared()
        llm.engine.event_publisher.notify()
        sub.drain(0.2)
    assert len(sub.batches) > before, "no KV event reached the subscriber"


def _prompts(n, length, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(length // 2)]
    return [shared + [rng.randrange(3, 300) for _ in range(length - len(shared))] for _ in range(n)]


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_events_replayed_give_the_pool_that_the_engine_holds(tiny_llama, sub, algo):
    """A pool too small for the prompts evicts cached blocks as it goes: after every round the subscriber's view
    (stored minus removed) is exactly the set of blocks the pool can serve, and sequence numbers have no gap."""
    llm = LLM(tiny_llama, kv_cache_memory=24 * 16 * 512, prefix_caching_algo=algo, kv_events_endpoint=sub.endpoint)
    _connected(llm, sub)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    evictions = 0
    for round_ in range(3):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(3, 100, seed=round_)], greedy, use_tqdm=False)
        sub.drain()
        assert sub.held.get("GPU", set()) == _pool_hashes(llm.engine)
        evictions = llm.kv_cache_info()["prefix_cache_evictions"]
    assert evictions > 0 and sub.held["GPU"]
    assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))
    stored = [e for b in sub.batches for e in b.events if isinstance(e, BlockStored)]
    assert all(e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
    assert any(e.parent_block_hash is not None for e in stored)  # the later blocks of a prompt chain on the first
    llm.reset_prefix_cache()
    llm.engine.step()  # an idle step: the reset's event goes out with it
    sub.drain()
    assert isinstance(sub.batches[-1].events[-1], AllBlocksCleared) and not sub.held["GPU"]
    llm.engine.close()


def test_the_same_prefix_has_the_same_hash_in_every_instance(tiny_llama, sub):
    """Routers match prefixes across instances by hash: two engines publish the same hashes for the same prompt,
    and a cache_salt makes them differ."""
    prompt = _prompts(1, 64)[0]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    seen = []
    for salt in (None, None, "tenant"):
        llm = LLM(tiny_llama, kv_cache_memory="8MiB", kv_events_endpoint=sub.endpoint)
        _connected(llm, sub)
        sub.held.clear()
        llm.generate([{"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}], greedy,
                     use_tqdm=False)
        sub.drain()
        seen.append(frozenset(sub.held["GPU"]))
        llm.engine.close()
    assert len(seen[0]) == 64 // 16 and seen[0] == seen[1] and not seen[0] & seen[2]


def test_offload_tiers_publish_under_their_medium(tiny_llama, sub, tmp_path):
    llm = LLM(tiny_llama, kv_cache_memory=24 * 16 * 512, kv_offload_memory="64MiB", kv_offload_dir=str(tmp_path),
              kv_events_endpoint=sub.endpoint)
    _connected(llm, sub)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for round_ in range(2):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(3, 100, seed=round_)], greedy, use_tqdm=False)
    llm.engine.offload.flush()
    sub.drain()
    cpu, disk = llm.engine.offload.tiers
    in_tier = {external_hash(int.from_bytes(k[16:], "little")) for k in cpu._index}
    assert sub.held["CPU"] == in_tier == sub.held["DISK"] and len(in_tier) == cpu.stats.stored
    assert sub.held["GPU"] == _pool_hashes(llm.engine) and sub.held["GPU"] < sub.held["CPU"]
    llm.engine.close()


def test_a_full_cpu_tier_publishes_what_it_drops(tiny_llama, sub):
    llm = LLM(tiny_llama, kv_offload_memory=100_000, kv_events_endpoint=sub.endpoint)
    _connected(llm, sub)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(4, 100)], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.engine.offload.flush()
    sub.drain()
    cpu = llm.engine.offload.tiers[0]
    removed = [e for b in sub.batches for e in b.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert removed and sub.held["CPU"] == {external_hash(int.from_bytes(k[16:], "little")) for k in cpu._index}
    assert cpu.used_bytes <= cpu.capacity
    llm.engine.close()


def test_endpoints_are_checked():
    with pytest.raises(ValueError, match="kv_events_endpoint must be a ZeroMQ endpoint"):
        EngineConfig(kv_events_endpoint="http://router:5557")
    assert binds("tcp://*:5557") and binds("ipc:///tmp/kv") and not binds("tcp://10.0.0.1:5557")


def test_an_endpoint_in_use_is_refused_before_loading(tiny_llama):
    port = _port()
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind(f"tcp://*:{port}")
    try:
        with pytest.raises(ValueError, match="cannot be used"):
            LLM(tiny_llama, kv_cache_memory="8MiB", kv_events_endpoint=f"tcp://*:{port}")
    finally:
        holder.close(0)
        ctx.term()


def _publish(log: KVEventLog, pub: ZmqEventPublisher, first: int, n: int) -> None:
    """Batches of one BlockStored each, hashes first .. first + n - 1, each recorded once the last batch went out
    (the start's AllBlocksCleared first), so that every one is a batch of its own."""
    for h in range(first, first + n + 1):
        deadline = time.monotonic() + 5
        while pub.state.published_batches < h + 1 and time.monotonic() < deadline:
            pub.notify()
            time.sleep(0.005)
        assert pub.state.published_batches == h + 1
        if h < first + n:
            log.stored([h], None, [1, 2])  # block size 2


def _replay(endpoint: str, start: int, timeout_s: float = 5) -> list[tuple[int, bytes]]:
    """Ask `endpoint` as vLLM's subscribers do (a DEALER: [b'', start]); the (seq, payload) answered, END excluded."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        got = []
        while sock.poll(int(timeout_s * 1000)):
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError(f"no END_SEQ within {timeout_s} s; got {len(got)} batches")
    finally:
        sock.close(0)
        ctx.term()


def test_a_replay_endpoint_gives_back_the_kept_batches_from_the_sequence_asked(tmp_path):
    """vLLM's replay protocol: batches published before anyone listened come back in order from the start asked,
    only the last buffer_steps of them are kept, and a malformed request is dropped without stopping the
    publisher (the next request is answered)."""
    log = KVEventLog(2)
    replay = f"ipc://{tmp_path}/replay.ipc"
    pub = ZmqEventPublisher(log, f"ipc://{tmp_path}/events.ipc", replay_endpoint=replay, buffer_steps=5)
    try:
        _publish(log, pub, 0, 3)  # batches 0 (AllBlocksCleared), 1, 2, 3
        got = _replay(replay, 0)
        assert [s for s, _ in got] == [0, 1, 2, 3]
        batches = [DECODER.decode(p) for _, p in got]
        assert isinstance(batches[0].events[0], AllBlocksCleared)
        assert [b.events[0].block_hashes for b in batches[1:]] == [[0], [1], [2]]
        assert [s for s, _ in _replay(replay, 2)] == [2, 3]
        _publish(log, pub, 3, 4)  # batches 4 .. 7: only 3 .. 7 are kept
        assert [s for s, _ in _replay(replay, 0)] == [3, 4, 5, 6, 7]
        assert _replay(replay, 8) == []
        ctx = zmq.Context()
        bad = ctx.socket(zmq.DEALER)
        bad.connect(replay)
        bad.send_multipart((b"", b"\x01\x02"))  # a start that is not 8 bytes
        assert not bad.poll(300)
        bad.close(0)
        ctx.term()
        assert [s for s, _ in _replay(replay, 7)] == [7]
        assert pub.info()["replays"] == 5 and pub.info()["replay_endpoint"] == replay
    finally:
        pub.close()


def test_replay_settings_are_checked_before_loading(tmp_path):
    with pytest.raises(ValueError, match="give --kv-events-endpoint too"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match="must differ"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://*:5557")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint must be a ZeroMQ endpoint"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="http://*:5558")
    for steps in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="kv_events_buffer_steps must be a positive integer"):
            EngineConfig(kv_events_buffer_steps=steps)
    ctx = zmq.Context()
    holder = ctx.socket(zmq.ROUTER)
    port = _port()
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:  # a replay endpoint in use: refused, and the events port it had bound is free again (bound twice)
        events = f"tcp://*:{_port()}"
        for _ in range(2):
            with pytest.raises(ValueError, match="cannot be bound"):
                ZmqEventPublisher(KVEventLog(16), events, replay_endpoint=f"tcp://127.0.0.1:{port}")
    finally:
        holder.close(0)
        ctx.term()
