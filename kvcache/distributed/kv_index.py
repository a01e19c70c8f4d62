"""What the KV-aware router (replicas.py) learns of the replicas' pools: the engine's own block hashes for a request
(EngineKeys), and each replica's KV events, followed over ZeroMQ (EventSubscriber, decode_batch).

The events are the engine's (engine/kv_events.py, vLLM's wire format): three frames, the topic, an 8-byte big-endian
sequence number and a msgpack `[ts, [event, ...], rank]`. Their block hashes are the low 64 bits of the chain keys
of memory/block_hash.py, which EngineKeys computes from the request as the replica will: the same token ids (the
server's tokenizer and chat template) and the same extra keys (the request's cache_salt).
"""
from __future__ import annotations

import logging
import queue
import threading

import msgpack

from kvcache.memory.block_hash import chain_hashes
from kvcache.memory.kv_events import external_hash
from kvcache.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("kvcache")
POLL_MS = 100  # the longest a new endpoint to follow waits for the subscriber thread
ARITY = {"BlockStored": 7, "BlockRemoved": 3, "AllBlocksCleared": 1}  # items of each event, its tag first


def decode_batch(frames: list[bytes]) -> tuple[int, list]:
    """(sequence number, events) of one published message; ValueError if it is not laid out as the engine sends
    (so every event returned has its tag's arity, and a BlockStored or BlockRemoved a list of int hashes)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message is 3 frames, the second of 8 bytes; got {len(frames)} frames of "
                         f"{[len(f) for f in frames]} bytes")
    try:
        batch = msgpack.unpackb(frames[2], raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"the payload ({len(frames[2])} bytes) is not msgpack: {e}") from None
    if not (isinstance(batch, list) and len(batch) == 3 and isinstance(batch[1], list)):
        raise ValueError(f"a KV event batch is [ts, [event, ...], rank]; got {type(batch).__name__} "
                         f"of {len(batch) if isinstance(batch, list) else '-'} items")
    for i, event in enumerate(batch[1]):
        tag = event[0] if isinstance(event, list) and event else None
        if (not isinstance(tag, str) or len(event) != ARITY.get(tag)
                or len(event) > 1 and not (isinstance(event[1], list) and all(isinstance(h, int) for h in event[1]))):
            raise ValueError(f"event {i} of {len(batch[1])} is not a KV event: {str(event)[:80]}")
    return int.from_bytes(frames[1], "big"), batch[1]


class EngineKeys:
    """The block hashes a replica's engine publishes for a request's prompt, computed in the ingress.

    Invariant: for a body the server accepts, these are the engine's hashes of the prompt's full blocks (its first
    prompt for a batch of completions): the server's request models parse it, a text prompt is tokenized as
    /v1/completions does (special tokens added), chat messages go through the server's chat template and are
    tokenized without special tokens, and the extra keys are (cache_salt,) when the request has one, as the engine
    keys its blocks (layer group 0's, whose tag is empty). A body the request models, the chat template or the
    tokenizer reject raises (the caller falls back to approximate keys)."""

    def __init__(self, model: str | None, block_size: int) -> None:
        from kvcache.models.loader import read_checkpoint  # these import torch: only where keys are computed
        from kvcache.server.app import chat_prompt
        self.tokenizer, self.chat_prompt = read_checkpoint(model).tokenizer, chat_prompt
        self.block_size = block_size

    def __call__(self, body: dict, chat: bool) -> list[int]:
        if chat:
            req = ChatCompletionRequest.model_validate(body)
            text = self.chat_prompt(self.tokenizer, req.messages, req.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            req = CompletionRequest.model_validate(body)
            prompt = req.prompts()[0]
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        extra = (req.cache_salt,) if req.cache_salt is not None else ()
        return [external_hash(h) for h in chain_hashes(ids, self.block_size, extra, [])]


class EventSubscriber:
    """A thread following each replica's KV event publisher: one SUB socket per replica, connected to the endpoint
    `follow` names (a replica's new endpoint replaces its old socket). Each message received is decoded here and put
    on `batches` as (replica, endpoint, seq, events) for the router's own thread to apply, so that only that thread
    touches the router's state and the event loop never waits on a socket. A message that cannot be decoded is
    counted in `bad` and skipped: the next one's sequence number then shows the gap."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue = queue.SimpleQueue()
        self.bad = 0
        self._follow: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-router-events", daemon=True)
        self._thread.start()

    def follow(self, replica: int, endpoint: str) -> None:
        self._follow.put((replica, endpoint))

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        import zmq
        ctx, poller = zmq.Context(), zmq.Poller()
        socks: dict[int, zmq.Socket] = {}
        owner: dict[zmq.Socket, tuple[int, str]] = {}
        try:
            while not self._stop.is_set():
                while not self._follow.empty():
                    self._connect(ctx, poller, socks, owner, *self._follow.get())
                for sock, _ in poller.poll(POLL_MS):
                    self._receive(sock, *owner[sock])
        finally:
            for sock in socks.values():
                sock.close(linger=0)
            ctx.term()

    @staticmethod
    def _connect(ctx, poller, socks: dict, owner: dict, replica: int, endpoint: str) -> None:
        import zmq
        old = socks.pop(replica, None)
        if old is not None:
            poller.unregister(old)
            del owner[old]
            old.close(linger=0)
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            log.warning("cannot follow replica %d's KV events at %r: %s", replica, endpoint, e)
            return
        socks[replica], owner[sock] = sock, (replica, endpoint)
        poller.register(sock, zmq.POLLIN)

    def _receive(self, sock, replica: int, endpoint: str) -> None:
        """Every message waiting on `sock`."""
        import zmq
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                seq, events = decode_batch(frames)
            except ValueError as e:
                self.bad += 1
                log.warning("replica %d sent a KV event message that cannot be read: %s", replica, e)
                continue
            self.batches.put((replica, endpoint, seq, events))
