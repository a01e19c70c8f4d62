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
import time
from dataclasses import dataclass, field

import msgpack

from kvcache.engine.kv_events import END_SEQ
from kvcache.memory.block_hash import chain_hashes
from kvcache.memory.kv_events import external_hash
from kvcache.server.protocol import ChatCompletionRequest, CompletionRequest
from kvcache.server.request_params import chat_prompt

log = logging.getLogger("kvcache")
POLL_MS = 100  # the longest a new endpoint to follow waits for the subscriber thread
REPLAY_TIMEOUT_S = 2.0  # a replay request unanswered this long is given up
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
        # imported here: it imports torch, which only the keys' computation needs
        from kvcache.models.loader import read_checkpoint
        self.tokenizer = read_checkpoint(model).tokenizer
        self.block_size = block_size

    def __call__(self, body: dict, chat: bool) -> list[int]:
        if chat:
            req = ChatCompletionRequest.model_validate(body)
            text = chat_prompt(self.tokenizer, req.messages, req.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            req = CompletionRequest.model_validate(body)
            prompt = req.prompts()[0]
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        extra = (req.cache_salt,) if req.cache_salt is not None else ()
        return [external_hash(h) for h in chain_hashes(ids, self.block_size, extra, [])]


@dataclass
class _Feed:
    """One replica's events as the subscriber thread follows them: its SUB socket, the DEALER asking its replay
    endpoint (None: no replay), the sequence number to deliver next (None: any), the batches held back while a
    replay is in flight (seq -> events), and when that replay was asked for."""

    replica: int
    endpoint: str
    sub: object
    dealer: object | None
    next: int | None = None
    held: dict = field(default_factory=dict)
    replay_since: float | None = None


def _open(ctx, kind: int, endpoint: str, what: str):
    """A SUB (subscribed to every topic) or DEALER socket connected to `endpoint`; None, logged, if it cannot be.
    Neither drops what arrives: a replay is as long as the publisher's buffer."""
    import zmq
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        log.warning("cannot %s at %r: %s", what, endpoint, e)
        return None
    return sock


class EventSubscriber:
    """A thread following each replica's KV event publisher: one SUB socket per replica, connected to the endpoint
    `follow` names (a replica's new endpoint replaces its old socket). Each message received is decoded here and put
    on `batches` as (replica, endpoint, seq, events) for the router's own thread to apply, so that only that thread
    touches the router's state and the event loop never waits on a socket. A message that cannot be decoded is
    counted in `bad` and skipped: the next one's sequence number then shows the gap.

    With the replica's replay endpoint (engine/kv_events.py, vLLM's), nothing published while the publisher still
    keeps it is lost: on `follow` the subscriber asks for every batch from 0 (what was published before it
    connected), and on a gap for the batches missing; the batches received meanwhile are held, and everything goes
    to `batches` in sequence order, each batch once. A replay not answered within REPLAY_TIMEOUT_S is given up (the
    held batches go out with their gap, and that replica is followed without replay)."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue = queue.SimpleQueue()
        self.bad = 0
        self.replays = 0  # replay requests sent
        self.replayed = 0  # batches a replay delivered that the SUB socket had not
        self._follow: queue.SimpleQueue = queue.SimpleQueue()
        self._feeds: dict[int, _Feed] = {}  # per replica; the thread's own (read elsewhere only to inspect it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-router-events", daemon=True)
        self._thread.start()

    def follow(self, replica: int, endpoint: str, replay: str | None = None) -> None:
        self._follow.put((replica, endpoint, replay))

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def held(self) -> int:
        """Batches held back behind a replay in flight, over every replica."""
        return sum(len(f.held) for f in list(self._feeds.values()))

    def _run(self) -> None:
        import zmq
        ctx, poller = zmq.Context(), zmq.Poller()
        feeds = self._feeds
        owner: dict[object, _Feed] = {}
        try:
            while not self._stop.is_set():
                if not owner:  # a poll over no socket returns at once: wait for the first endpoint instead
                    try:
                        self._connect(ctx, poller, feeds, owner, *self._follow.get(timeout=POLL_MS / 1000))
                    except queue.Empty:
                        continue
                while not self._follow.empty():
                    self._connect(ctx, poller, feeds, owner, *self._follow.get())
                for sock, _ in poller.poll(POLL_MS):
                    feed = owner.get(sock)
                    if feed is not None:
                        self._receive(sock, feed, replayed=sock is feed.dealer)
                for feed in list(feeds.values()):
                    if feed.replay_since is not None and time.monotonic() - feed.replay_since > REPLAY_TIMEOUT_S:
                        log.warning("replica %d's KV events replay did not answer within %g s: following it "
                                    "without replay", feed.replica, REPLAY_TIMEOUT_S)
                        self._close_dealer(poller, owner, feed)
                        self._flush(feed)
        finally:
            for feed in feeds.values():
                feed.sub.close(linger=0)
                if feed.dealer is not None:
                    feed.dealer.close(linger=0)
            ctx.term()

    def _connect(self, ctx, poller, feeds: dict, owner: dict, replica: int, endpoint: str,
                 replay: str | None) -> None:
        import zmq
        old = feeds.pop(replica, None)
        if old is not None:
            for sock in (old.sub, old.dealer):
                if sock is not None:
                    poller.unregister(sock)
                    del owner[sock]
                    sock.close(linger=0)
        sock = _open(ctx, zmq.SUB, endpoint, f"follow replica {replica}'s KV events")
        if sock is None:
            return
        feed = _Feed(replica, endpoint, sock, None)
        feeds[replica], owner[sock] = feed, feed
        poller.register(sock, zmq.POLLIN)
        dealer = _open(ctx, zmq.DEALER, replay, f"ask replica {replica}'s KV events replay") if replay else None
        if dealer is not None:
            feed.dealer, owner[dealer] = dealer, feed
            poller.register(dealer, zmq.POLLIN)
            self._ask(feed, 0)  # what was published before this subscription connected

    def _ask(self, feed: _Feed, start: int) -> None:
        import zmq
        try:
            feed.dealer.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.ZMQError:  # not connected yet and nothing queued: the timeout gives it up
            pass
        feed.replay_since = time.monotonic()
        self.replays += 1

    @staticmethod
    def _close_dealer(poller, owner: dict, feed: _Feed) -> None:
        poller.unregister(feed.dealer)
        del owner[feed.dealer]
        feed.dealer.close(linger=0)
        feed.dealer = None

    def _receive(self, sock, feed: _Feed, replayed: bool) -> None:
        """Every message waiting on `sock` (the feed's SUB socket, or its DEALER when `replayed`)."""
        import zmq
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if replayed and len(frames) == 3 and frames[1] == END_SEQ:
                self._flush(feed)
                continue
            try:
                seq, events = decode_batch(frames)
            except ValueError as e:
                self.bad += 1
                log.warning("replica %d sent a KV event message that cannot be read: %s", feed.replica, e)
                continue
            if replayed and seq not in feed.held and (feed.next is None or seq >= feed.next):
                self.replayed += 1
            self._offer(feed, seq, events)

    def _offer(self, feed: _Feed, seq: int, events: list) -> None:
        """Deliver batch `seq` in order: a batch already delivered is dropped, one past a gap is held while a replay
        fills the gap."""
        if feed.next is not None and seq < feed.next:
            return
        if feed.replay_since is not None:
            feed.held[seq] = events
        elif feed.next is None or seq == feed.next:
            self._deliver(feed, seq, events)
        elif feed.dealer is not None:
            feed.held[seq] = events
            self._ask(feed, feed.next)
        else:
            self._deliver(feed, seq, events)  # the router sees the gap

    def _flush(self, feed: _Feed) -> None:
        """A replay ended (or was given up): deliver what was held, in sequence order; a gap left is a real one."""
        feed.replay_since = None
        for seq in sorted(feed.held):
            if feed.next is None or seq >= feed.next:
                self._deliver(feed, seq, feed.held[seq])
        feed.held.clear()

    def _deliver(self, feed: _Feed, seq: int, events: list) -> None:
        feed.next = seq + 1
        self.batches.put((feed.replica, feed.endpoint, seq, events))
