"""Follow a kvcache (or vLLM) instance's KV events and print what it holds, per medium.

    kvcache serve --kv-events-endpoint 'tcp://*:5557' &
    python scripts/kv_events_subscriber.py --connect tcp://127.0.0.1:5557

Each message is (topic, 8-byte big-endian sequence number, msgpack of [ts, [event, ...], data_parallel_rank]);
events are ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium], ["BlockRemoved", hashes,
medium] and ["AllBlocksCleared"] (see kvcache/engine/kv_events.py). A gap in the sequence numbers is reported.
"""
from __future__ import annotations

import argparse
import time

import msgpack
import zmq


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", default="tcp://127.0.0.1:5557", help="the endpoint the instance binds")
    p.add_argument("--topic", default="", help="the instance's --kv-events-topic")
    p.add_argument("--seconds", type=float, default=0, help="stop after this long (0: never)")
    args = p.parse_args()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.connect(args.connect)
    sock.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    held: dict[str, set[int]] = {}
    last = None
    end = time.monotonic() + args.seconds if args.seconds else None
    try:
        while end is None or time.monotonic() < end:
            if not sock.poll(200):
                continue
            _, seq_bytes, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if last is not None and seq != last + 1:
                print(f"! missed batches {last + 1}..{seq - 1}")
            last = seq
            ts, events, rank = msgpack.unpackb(payload)
            for e in events:
                kind = e[0]
                if kind == "BlockStored":
                    held.setdefault(e[6], set()).update(e[1])
                elif kind == "BlockRemoved":
                    held.setdefault(e[2], set()).difference_update(e[1])
                elif kind == "AllBlocksCleared":
                    held.get("GPU", set()).clear()
            print(f"batch {seq} at {ts:.3f}: {len(events)} events; holding " +
                  ", ".join(f"{m} {len(h)} blocks" for m, h in sorted(held.items())))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(0)
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
