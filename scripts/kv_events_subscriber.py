"""Follow a kvcache (or vLLM) instance's KV events and print what it holds, per medium.

    kvcache serve --kv-events-endpoint 'tcp://*:5557' --kv-events-replay-endpoint 'tcp://*:5558' &
    python scripts/kv_events_subscriber.py --connect tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558

Each message is (topic, 8-byte big-endian sequence number, msgpack of [ts, [event, ...], data_parallel_rank]);
events are ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ["BlockRemoved", hashes,
medium] and ["AllBlocksCleared"] (see kvcache/engine/kv_events.py). A gap in the sequence numbers is reported;
with --replay (the instance's --kv-events-replay-endpoint, vLLM's replay_endpoint) what was published before this
subscriber connected, and the batches of a gap, are asked for and applied in order (a DEALER sends
[b"", start_seq]; the answer is [b"", seq, payload] per batch, then [b"", END_SEQ, b""]).
"""
from __future__ import annotations

import argparse
import time

import msgpack
import zmq


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Holdings:
    """What the events say the instance holds, per medium; batches applied in order, each once."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}
        self.last: int | None = None

    def apply(self, seq: int, payload: bytes, how: str) -> None:
        if self.last is not None and seq <= self.last:
            return  # replayed and received live both
        if self.last is not None and seq != self.last + 1:
            print(f"! missed batches {self.last + 1}..{seq - 1}")
        self.last = seq
        ts, events, rank = msgpack.unpackb(payload)
        for e in events:
            if e[0] == "BlockStored":
                self.held.setdefault(e[6], set()).update(e[1])
            elif e[0] == "BlockRemoved":
                self.held.setdefault(e[2], set()).difference_update(e[1])
            elif e[0] == "AllBlocksCleared":
                self.held.get("GPU", set()).clear()
        print(f"batch {seq} ({how}) at {ts:.3f}: {len(events)} events; holding " +
              ", ".join(f"{m} {len(h)} blocks" for m, h in sorted(self.held.items())))


def replay(sock, start: int, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
    """The batches from `start` on that the instance still keeps (none if it does not answer in time)."""
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    got = []
    while sock.poll(timeout_ms):
        _, seq, payload = sock.recv_multipart()
        if seq == END_SEQ:
            break
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", default="tcp://127.0.0.1:5557", help="the endpoint the instance binds")
    p.add_argument("--replay", default=None, help="the instance's replay endpoint: fetch what was missed")
    p.add_argument("--topic", default="", help="the instance's --kv-events-topic")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    args = p.parse_args()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.connect(args.connect)
    sock.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    dealer = ctx.socket(zmq.DEALER) if args.replay else None
    state = Holdings()
    if dealer is not None:
        dealer.connect(args.replay)
        for seq, payload in replay(dealer, 0):  # what was published before this subscriber connected
            state.apply(seq, payload, "replayed")
    end = time.monotonic() + args.seconds if args.seconds else None
    try:
        while end is None or time.monotonic() < end:
            if not sock.poll(200):
                continue
            _, seq_bytes, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if dealer is not None and state.last is not None and seq > state.last + 1:
                for s, p_ in replay(dealer, state.last + 1):
                    if s < seq:
                        state.apply(s, p_, "replayed")
            state.apply(seq, payload, "live")
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(0)
        if dealer is not None:
            dealer.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
