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
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

from kvcache.memory.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventLog

log = logging.getLogger("kvcache")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
POLL_S = 0.05  # the longest an event waits while the engine is idle


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


class ZmqEventPublisher:
    """A PUB socket and the thread that feeds it from `events`.

    The thread owns the socket and holds only the log and a PublisherState, never the publisher: an engine
    dropped without close() is collected, and the finalizer stops the thread, which closes the socket."""

    def __init__(self, events: KVEventLog, endpoint: str, topic: str = "", data_parallel_rank: int = 0,
                 hwm: int = 100_000) -> None:
        import zmq
        self.events, self.endpoint = events, endpoint
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.set_hwm(hwm)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            (sock.bind if binds(endpoint) else sock.connect)(endpoint)
        except zmq.ZMQError as e:
            sock.close()
            ctx.term()
            raise ValueError(f"kv_events_endpoint {endpoint!r} cannot be used: {e}") from None
        self.state = PublisherState()
        events.cleared()
        self._thread = threading.Thread(target=_publish_loop, args=(events, ctx, sock, topic.encode(),
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
        return {"endpoint": self.endpoint, "published_batches": st.published_batches,
                "published_events": st.published_events, "failed_batches": st.failed_batches}


def _stop(state: PublisherState) -> None:
    state.stop = True
    state.wake.set()


def _publish_loop(events: KVEventLog, ctx, sock, topic: bytes, rank: int, endpoint: str,
                  state: PublisherState) -> None:
    """The publisher thread: every wake-up (or POLL_S), send what the log holds as one batch; on stop, send the rest
    and close the socket."""
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
                    sock.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                    seq += 1
                    state.published_batches += 1
                    state.published_events += len(batch)
                except Exception:  # never let the thread die: count, log, carry on
                    state.failed_batches += 1
                    log.exception("publishing %d KV events to %s failed", len(batch), endpoint)
            if state.stop:
                return
    finally:
        sock.close()
        ctx.term()
