"""`kvcache bench kv-page`: what the live KV page costs the engine.

1. The snapshot on a large pool: a random model of the demo model's KV shape per layer but 2 layers (the cost is
   per block, not per byte), `--num-blocks` blocks (default 100,000) filled with cached prefixes (finished
   requests) and held blocks (requests mid-decode, some sharing a prompt), both prefix-caching modes: how long
   `kv_snapshot.capture` holds the engine thread (median and max of `--repeats`), how long `build` then takes off
   it, the JSON's size and how long encoding it takes (also off it, once per interval for every viewer).
2. Serving throughput with viewers: `kvcache serve`'s app on a loopback port with the demo model, the same seeded
   requests run with no viewer and with `--viewers` (default 5) following /kv/stream, after a warm-up run; output
   tokens per second of each and its ratio to the mean of the runs without, which come first and last so that
   drift shows.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time

from kvcache.bench.report import write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=int, default=100_000,
                   help="blocks in the snapshot part's pool, at least 1000 (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block in the snapshot part (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5,
                   help="snapshots timed per prefix-caching mode, the median reported (default: %(default)s)")
    p.add_argument("--viewers", type=int, default=5,
                   help="KV page viewers following /kv/stream in the serving part (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16, help="requests per serving run (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="output tokens of each serving request (default: %(default)s)")
    p.add_argument("--model", default=None, help="the serving runs' model (default: the demo model)")
    p.add_argument("--quantization", default="int4", help="the serving runs' weights: none, int8, int4 "
                   "(default: %(default)s)")
    p.add_argument("--skip-serving", action="store_true", help="the snapshot part only")
    p.add_argument("--json", default="results/kv_page.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")


def _pool_engine(path: str, args, algo: str):
    from kvcache import LLM, SamplingParams
    per_token = 2 * 2 * 3 * 64 * 4  # 2 layers x K and V x 3 KV heads x head dim 64 x float32
    llm = LLM(path, kv_cache_memory=args.num_blocks * args.block_size * per_token, block_size=args.block_size,
              prefix_caching_algo=algo, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384)
    eng, rng = llm.engine, random.Random(0)
    usable = eng.kv.pool.num_usable
    cached_target = usable // 2  # half the pool cached and idle, as after a day of traffic
    tokens = 2048 - 64
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    done = 0
    while done * (tokens // args.block_size) < cached_target:
        batch = [[rng.randrange(3, 320) for _ in range(tokens)] for _ in range(16)]
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        done += len(batch)
    shared = [rng.randrange(3, 320) for _ in range(512)]
    running = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(64):  # held blocks: 64 requests mid-decode, half of them on one shared prompt
        prompt = shared + [i] if i % 2 else [rng.randrange(3, 320) for _ in range(512)]
        eng.add_request(f"r{i}", prompt, running)
    for _ in range(8):
        eng.step()
    return eng


def _snapshot_costs(args) -> list[dict]:
    from kvcache.models.random_checkpoint import save_random_checkpoint
    from kvcache.server import kv_snapshot
    from transformers import LlamaConfig
    rows = []
    with tempfile.TemporaryDirectory() as root:
        cfg = LlamaConfig(vocab_size=320, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=3, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048)
        path = save_random_checkpoint(os.path.join(root, "m"), cfg)
        for algo in ("hash", "radix"):
            eng = _pool_engine(path, args, algo)
            times, builds, snap = [], [], None
            for _ in range(args.repeats):
                raw = kv_snapshot.capture(eng)
                times.append(raw["took_ms"])
                t = time.perf_counter()
                snap = kv_snapshot.build(raw)
                builds.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            text = json.dumps(snap)
            encode_ms = (time.perf_counter() - t) * 1000
            pool = snap["pool"]
            rows.append({"prefix_caching": algo, "num_blocks": pool["num_blocks"], "held": pool["used"] +
                         pool["used_cached"] + pool["shared"] + pool["shared_cached"], "cached_idle": pool["cached"],
                         "requests": len(snap["requests"]), "take_ms_median": statistics.median(times),
                         "take_ms_max": max(times), "build_ms_median": statistics.median(builds),
                         "json_bytes": len(text), "encode_ms": encode_ms})
            eng.close()
    return rows


def _serve_runs(args) -> list[dict]:
    import httpx
    import uvicorn

    from kvcache.config import EngineConfig
    from kvcache.server.serve import create
    config = EngineConfig(model=args.model, kv_cache_memory="512MiB", quantization=args.quantization)
    app, loop = create(config, served_model_name="m", api_key=None, log_interval_s=3600)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    vocab = loop.engine.model.config.vocab_size
    rows = []
    try:
        for viewers in (None, 0, args.viewers, 0):  # None: a warm-up run, not reported
            stop = threading.Event()
            events = [0] * (viewers or 0)

            def view(i: int, events=events, stop=stop) -> None:
                with httpx.Client(timeout=None) as c, c.stream("GET", f"{url}/kv/stream") as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events[i] += 1
                        if stop.is_set():
                            return
            watchers = [threading.Thread(target=view, args=(i,), daemon=True) for i in range(viewers or 0)]
            for w in watchers:
                w.start()
            time.sleep(1.0 if viewers else 0)
            rng = random.Random(7)
            prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(64, 256))] for _ in range(args.requests)]
            produced, started = [0] * len(prompts), time.perf_counter()

            def ask(i: int) -> None:
                r = httpx.post(f"{url}/v1/completions", timeout=600, json={
                    "model": "m", "prompt": prompts[i], "max_tokens": args.max_tokens, "ignore_eos": True,
                    "temperature": 0})
                produced[i] = r.json()["usage"]["completion_tokens"]
            askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
            for a in askers:
                a.start()
            for a in askers:
                a.join()
            elapsed = time.perf_counter() - started
            stop.set()
            for w in watchers:  # each leaves at its next event, within an interval
                w.join(10)
            if viewers is not None:
                rows.append({"viewers": viewers, "seconds": elapsed, "output_tok_s": sum(produced) / elapsed,
                             "events_per_viewer": statistics.mean(events) if events else 0,
                             "snapshots_taken": app.state.kv_hub.taken})
    finally:
        server.should_exit = True
        thread.join(10)
        loop.stop()
    return rows


def run(args: argparse.Namespace) -> int:
    if args.num_blocks < 1000 or args.repeats < 1 or args.viewers < 1 or args.requests < 1:
        raise ValueError("--num-blocks must be at least 1000, --repeats, --viewers and --requests positive")
    snaps = _snapshot_costs(args)
    print(f"the KV snapshot on the engine thread, {args.num_blocks:,} blocks of {args.block_size} tokens "
          f"(median of {args.repeats})")
    print(f"{'prefix':>7} {'blocks':>8} {'held':>7} {'cached':>7} {'requests':>9} {'engine ms':>10} {'max ms':>7} "
          f"{'build ms':>9} {'JSON KiB':>9} {'encode ms':>10}")
    for r in snaps:
        print(f"{r['prefix_caching']:>7} {r['num_blocks']:>8,} {r['held']:>7,} {r['cached_idle']:>7,} "
              f"{r['requests']:>9} {r['take_ms_median']:>10.1f} {r['take_ms_max']:>7.1f} {r['build_ms_median']:>9.1f} "
              f"{r['json_bytes'] / 1024:>9,.0f} {r['encode_ms']:>10.1f}")
    serving = [] if args.skip_serving else _serve_runs(args)
    if serving:
        base = statistics.mean(r["output_tok_s"] for r in serving if r["viewers"] == 0)
        print(f"\nserving {args.requests} requests x {args.max_tokens} tokens ({args.quantization} weights), "
              f"with and without viewers of /kv/stream")
        print(f"{'viewers':>8} {'seconds':>8} {'out tok/s':>10} {'ratio':>7} {'events/viewer':>14}")
        for r in serving:
            r["ratio_to_none"] = r["output_tok_s"] / base
            print(f"{r['viewers']:>8} {r['seconds']:>8.2f} {r['output_tok_s']:>10.1f} {r['ratio_to_none']:>6.3f}x "
                  f"{r['events_per_viewer']:>14.1f}")
    write_json(args.json, {"snapshot": snaps, "serving": serving})
    return 0
