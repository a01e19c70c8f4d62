"""`kvcache serve` with the engine on a thread of the server against `--engine-process`, one after the other on
the same machine and workloads: 64 concurrent streams (output tok/s, ITL p50/p99) while /metrics and /health are
probed every 100 ms (their latency p50/p99), then one stream at a time (TPOT). Prints a table with the ratios and
writes JSON (with the machine).

    python scripts/bench_engine_process.py                 # the demo model
    python scripts/bench_engine_process.py --rounds 2      # thread, process, thread, process
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_llama_cpp import serve, stop  # noqa: E402

from kvcache.bench.report import write_json  # noqa: E402
from kvcache.parallel.host import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAMS = ["--num-prompts", "64", "--input-len", "64:512", "--output-len", "32:256", "--ignore-eos"]
SINGLE = ["--num-prompts", "6", "--max-concurrency", "1", "--input-len", "64:64", "--output-len", "128:128",
          "--ignore-eos"]


def probe(url: str, path: str, stop_: threading.Event, out: list[float]) -> None:
    """GET url+path every 100 ms until `stop_`; each answer's seconds into `out`."""
    with httpx.Client(timeout=30) as c:
        while not stop_.is_set():
            t = time.perf_counter()
            c.get(url + path)
            out.append(time.perf_counter() - t)
            stop_.wait(0.1)


def workload(url: str, args: list[str], out: str, seed: int) -> dict:
    subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "serve", "--url", url, *args, "--seed", str(seed),
                    "--json", out], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def one_round(mode: str, model: str | None, out_dir: str, seed: int, extra: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvcache.cli", "serve", *([model] if model else []), "--port", str(port), *extra,
           *(["--engine-process"] if mode == "process" else [])]
    proc = serve(cmd, url, os.path.join(out_dir, f"{mode}.server.log"))
    try:
        lat = {"/metrics": [], "/health": []}
        done = threading.Event()
        probes = [threading.Thread(target=probe, args=(url, p, done, lat[p])) for p in lat]
        for t in probes:
            t.start()
        try:
            many = workload(url, STREAMS, os.path.join(out_dir, f"{mode}.streams.json"), seed)
        finally:
            done.set()
            for t in probes:
                t.join()
        single = workload(url, SINGLE, os.path.join(out_dir, f"{mode}.single.json"), seed)
    finally:
        stop(proc)
    ms = lambda xs, q: float(np.percentile(np.asarray(xs) * 1000, q))  # noqa: E731
    return {"mode": mode, "output_tok_s": many["output_throughput"], "failed": many["failed"] + single["failed"],
            "itl_p50_ms": many["median_itl_ms"], "itl_p99_ms": many["p99_itl_ms"],
            "ttft_p99_ms": many["p99_ttft_ms"], "single_tpot_ms": single["median_tpot_ms"],
            **{f"{p[1:]}_p{q}_ms": ms(v, q) for p, v in lat.items() for q in (50, 99)},
            "probes": len(lat["/metrics"])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or GGUF (default: the demo model)")
    p.add_argument("--rounds", type=int, default=1, help="thread/process pairs, interleaved (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--serve-args", default="", help="more kvcache serve arguments, one string")
    p.add_argument("--json", default="results/engine_process.json", help="(default: %(default)s)")
    args = p.parse_args()
    out_dir = os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out_dir, exist_ok=True)
    runs = [one_round(mode, args.model, out_dir, args.seed, args.serve_args.split())
            for _ in range(args.rounds) for mode in ("thread", "process")]
    keys = ["output_tok_s", "itl_p50_ms", "itl_p99_ms", "ttft_p99_ms", "single_tpot_ms", "metrics_p50_ms",
            "metrics_p99_ms", "health_p50_ms", "health_p99_ms"]
    print(f"\n{'':<8}" + "".join(f"{k:>16}" for k in keys))
    for r in runs:
        print(f"{r['mode']:<8}" + "".join(f"{r[k]:>16.1f}" for k in keys))
    base = {k: np.mean([r[k] for r in runs if r["mode"] == "thread"]) for k in keys}
    proc = {k: np.mean([r[k] for r in runs if r["mode"] == "process"]) for k in keys}
    ratios = {k: float(proc[k] / base[k]) for k in keys}
    print(f"{'ratio':<8}" + "".join(f"{ratios[k]:>15.2f}x" for k in keys))
    write_json(args.json, {"runs": runs, "process_over_thread": ratios, "serve_args": args.serve_args})
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
