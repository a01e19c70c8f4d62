"""Publishes the KV cache events (memory/kv_events.py) over ZeroMQ in vLLM's wire format, for KV-aware routers
(llm-d, Dynamo, vLLM's router, SGLang's router) to follow what each instance holds (`--kv-events-endpoint`).

Each message is three frames, as vLLM sends them: the topic, an 8-byte big-endian sequence number (0, 1, 2, ...:
a gap is a lost batch), and a msgpack payload laid out as vLLM's msgspec structs with `array_like`:
`[ts, [event, ...], data_parallel_rank]`, where an event is `["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`.
Media: "GPU" for the engine's pool (vLLM's name for it, on any device), "CPU", "DISK" and "REMOTE" for the offload
tiers. The first batch is an AllBlocksCleared: a router that followed an earlier run of this instance forgets it.

The engine thread only wakes the publisher after each step; a thread of its own drains the log (so events the
offload writer records while the engine idles go out too, within 50 ms), encodes and sends. A PUB socket never
blocks: a subscriber that is slow or absent loses messages past the high-water mark, as ZeroMQ does.
Endpoints follow vLLM: one with a wildcard (`tcp://*:5557`), `ipc://` or `inproc://` is bound, any other
(`tcp://router-host:5557`) is connected to, for a subscriber that binds.

Replay (vLLM's `replay_endpoint`, `buffer_steps`): the last `buffer_steps` batches are kept, and a ROUTER socket bound
at the replay endpoint answers a request `[b"", start_seq (8 bytes, big-endian)]` (a DEALER's; a REQ sends the same)
with every kept batch numbered start_seq or later, one message `[b"", seq, payload]` each, in order, then
`[b"", END_SEQ, b""]`. A subscriber that connected late, or saw a gap, gets back what it missed while it is kept.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from kvcache.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog

log = logging.getLogger("kvcache")
POLL_S = 0.05  # the longest an event waits while the engine is idle, and a replay request
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last message carries it, and an empty payload (vLLM's)
BUFFER_STEPS = 10_000  # batches kept for replay (vLLM's default)


def encode_event(event: KVEvent) -> list:
    """One event as vLLM's msgspec array_like layout (tag first)."""
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, None,
                event.medium]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {event!r}")


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (else it connects to it): vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass
class PublisherState:
    """What the publisher thread shares with its owner: the wake-up, the stop flag and the counters."""

    wake: threading.Event = field(default_factory=threading.Event)
    stop: bool = False
    published_batches: int = 0
    published_events: int = 0
    failed_batches: int = 0
    replays: int = 0  # replay requests answered


@dataclass
class _Sockets:
    """What the publisher thread owns: the context, the PUB socket, the replay ROUTER (or None) and the batches kept
    for replay, (seq, payload) oldest first."""

    ctx: object
    pub: object
    replay: object | None
    kept: deque


class ZmqEventPublisher:
    """A PUB socket and the thread that feeds it from `events`.

    The thread owns the socket and holds only the log and a PublisherState, never the publisher: an engine
    dropped without close() is collected, and the finalizer stops the thread, which closes the socket."""

    def __init__(self, events: KVEventLog, endpoint: str, topic: str = "", data_parallel_rank: int = 0,
                 hwm: int = 100_000, replay_endpoint: str | None = None, buffer_steps: int = BUFFER_STEPS) -> None:
        import zmq
        self.events, self.endpoint, self.replay_endpoint = events, endpoint, replay_endpoint
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.set_hwm(hwm)
        sock.setsockopt(zmq.LINGER, 0)
        replay = ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            try:
                (sock.bind if binds(endpoint) else sock.connect)(endpoint)
            except zmq.ZMQError as e:
                raise ValueError(f"kv_events_endpoint {endpoint!r} cannot be used: {e}") from None
            if replay is not None:
                replay.setsockopt(zmq.LINGER, 0)
                replay.set_hwm(buffer_steps + 1)  # a whole replay and its end marker, never dropped at the HWM
                try:
                    replay.bind(replay_endpoint)
                except zmq.ZMQError as e:
                    raise ValueError(f"kv_events_replay_endpoint {replay_endpoint!r} cannot be bound: {e}") from None
        except ValueError:
            sock.close()
            if replay is not None:
                replay.close()
            ctx.term()
            raise
        self.state = PublisherState()
        events.cleared()
        sockets = _Sockets(ctx, sock, replay, deque(maxlen=buffer_steps))
        self._thread = threading.Thread(target=_publish_loop, args=(events, sockets, topic.encode(),
                                                                    data_parallel_rank, endpoint, self.state),
                                        name="kvcache-kv-events", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self.state)

    @property
    def published_events(self) -> int:
        return self.state.published_events

    def notify(self) -> None:
        """A step ended: send what it recorded now rather than at the next poll."""
        self.state.wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is left, then close the socket (idempotent)."""
        self._finalizer()
        self._thread.join(timeout)

    def info(self) -> dict:
        st = self.state
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "published_batches": st.published_batches, "published_events": st.published_events,
                "failed_batches": st.failed_batches, "replays": st.replays}


def _stop(state: PublisherState) -> None:
    state.stop = True
    state.wake.set()


def _publish_loop(events: KVEventLog, s: _Sockets, topic: bytes, rank: int, endpoint: str,
                  state: PublisherState) -> None:
    """The publisher thread: every wake-up (or POLL_S), send what the log holds as one batch and answer the replay
    requests waiting; on stop, send the rest and close the sockets."""
    import msgpack
    pack = msgpack.Packer(use_bin_type=True)
    seq = 0
    try:
        while True:
            state.wake.wait(POLL_S)
            state.wake.clear()
            batch = events.take()
            if batch:
                payload = pack.pack([time.time(), [encode_event(e) for e in batch], rank])
                try:
                    s.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    state.published_batches += 1
                    state.published_events += len(batch)
                except Exception:  # never let the thread die: count, log, carry on (a replay still has it)
                    state.failed_batches += 1
                    log.exception("publishing %d KV events to %s failed", len(batch), endpoint)
                if s.replay is not None:  # kept only where someone can ask for it
                    s.kept.append((seq, payload))
                seq += 1
            while s.replay is not None and s.replay.poll(0):
                try:
                    _answer_replay(s.replay, s.kept, state)
                except Exception:  # a bad request or a vanished client: the next one is served
                    log.exception("answering a KV events replay request failed")
            if state.stop:
                return
    finally:
        s.pub.close()
        if s.replay is not None:
            s.replay.close()
        s.ctx.term()


def _answer_replay(sock, kept: deque, state: PublisherState) -> None:
    """One request waiting on the ROUTER `sock`: [client, b"", start_seq] gets every kept batch from start_seq on,
    then the END_SEQ marker, counted in state.replays before the marker goes (a client that got it sees the count);
    a request laid out otherwise is logged and dropped."""
    import zmq
    frames = sock.recv_multipart()
    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        log.warning("a KV events replay request is [b'', 8-byte start sequence number]; got %d frames of %s bytes",
                    len(frames) - 1, [len(f) for f in frames[1:]])
        return
    client, start = frames[0], int.from_bytes(frames[2], "big")
    for seq, payload in list(kept):
        if seq >= start:
            sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
    state.replays += 1
    sock.send_multipart((client, b"", END_SEQ, b""), zmq.NOBLOCK)
