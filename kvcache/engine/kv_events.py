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


class ZmqEventPublisher:
    """A PUB socket and the thread that feeds it from `events`."""

    def __init__(self, events: KVEventLog, endpoint: str, topic: str = "", data_parallel_rank: int = 0,
                 hwm: int = 100_000) -> None:
        import msgpack
        import zmq
        self.events, self.endpoint, self.rank = events, endpoint, data_parallel_rank
        self._topic = topic.encode()
        self._pack = msgpack.Packer(use_bin_type=True)
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            (self._socket.bind if binds(endpoint) else self._socket.connect)(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            self._ctx.term()
            raise ValueError(f"kv_events_endpoint {endpoint!r} cannot be used: {e}") from None
        self.published_batches = 0
        self.published_events = 0
        self.failed_batches = 0
        self._wake = threading.Event()
        self._stop = False
        events.cleared()
        self._thread = threading.Thread(target=self._run, name="kvcache-kv-events", daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """A step ended: send what it recorded now rather than at the next poll."""
        self._wake.set()

    def _run(self) -> None:
        seq = 0
        while True:
            self._wake.wait(POLL_S)
            self._wake.clear()
            batch = self.events.take()
            if batch:
                payload = self._pack.pack([time.time(), [encode_event(e) for e in batch], self.rank])
                try:
                    self._socket.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                    seq += 1
                    self.published_batches += 1
                    self.published_events += len(batch)
                except Exception:  # never let the thread die: count, log, carry on
                    self.failed_batches += 1
                    log.exception("publishing %d KV events to %s failed", len(batch), self.endpoint)
            if self._stop:
                return

    def close(self, timeout: float = 2.0) -> None:
        """Send what is left, then close the socket."""
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self._socket.close()
        self._ctx.term()

    def info(self) -> dict:
        return {"endpoint": self.endpoint, "published_batches": self.published_batches,
                "published_events": self.published_events, "failed_batches": self.failed_batches}
