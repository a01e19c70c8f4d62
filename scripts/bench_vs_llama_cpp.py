"""kvcache serve against llama.cpp's server on the same GGUF, the same seeded workloads, one after the other.

    python scripts/bench_vs_llama_cpp.py --json results/vs_llama_cpp.json [--kvcache-args "--quantization int8"]

llama.cpp's server is built (once, cached) by scripts/build_llama_cpp.sh from the llama.cpp that llama-cpp-python's
source distribution vendors; it runs CPU-only with --threads (default: every core) and one slot per concurrent
request. Each workload goes through `kvcache bench serve` (streaming /v1/completions, token ids counted from the
servers' usage), first against llama.cpp, then against `kvcache serve`; the JSON holds both and their ratios.

Workloads (the project's reference ones): single-stream (one request at a time: prompt 64, output 256), 32 prompts
(in 64-256, out 32-128), 64 prompts (in 64-512, out 32-256), all with EOS ignored so outputs have exact lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys

from kvcache.bench.serve import wait_until_serving
from kvcache.parallel.host import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "single-stream": ["--num-prompts", "8", "--input-len", "64:64", "--output-len", "256:256", "--max-concurrency", "1"],
    "32-prompts": ["--num-prompts", "32", "--input-len", "64:256", "--output-len", "32:128"],
    "64-prompts": ["--num-prompts", "64", "--input-len", "64:512", "--output-len", "32:256"],
}


def serve(cmd: list[str], url: str, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_until_serving(url, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def bench(url: str, workload: str, out: str, seed: int) -> dict:
    cmd = [sys.executable, "-m", "kvcache.cli", "bench", "serve", "--url", url, *WORKLOADS[workload], "--seed",
           str(seed), "--json", out]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.load(open(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the demo model)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads")
    p.add_argument("--kvcache-args", default="", help="extra `kvcache serve` flags, e.g. '--quantization int8'")
    p.add_argument("--llama-server", default=None, help="a llama-server binary (default: build or reuse the cached one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/vs_llama_cpp.json")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from kvcache.bench.report import write_json
    from kvcache.models.loader import demo_model_path
    model = args.model or demo_model_path()
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    server = args.llama_server or subprocess.run(["bash", os.path.join(ROOT, "scripts", "build_llama_cpp.sh")],
                                                 check=True, capture_output=True, text=True).stdout.split()[-1]
    out_dir = os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out_dir, exist_ok=True)
    slots = 64  # one per concurrent request: the largest workload sends 64 at once
    results: dict = {"model": model, "threads": args.threads, "kvcache_args": args.kvcache_args, "workloads": {}}
    engines = {
        "llama.cpp": lambda port: [server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--threads",
                                   str(args.threads), "--parallel", str(slots), "--ctx-size", str(slots * 1024),
                                   "--no-webui"],
        "kvcache": lambda port: [sys.executable, "-m", "kvcache.cli", "serve", model, "--port", str(port),
                                 *shlex.split(args.kvcache_args)],
    }
    for name, command in engines.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = serve(command(port), url, os.path.join(out_dir, f"{name}.server.log"))
        try:
            for w in workloads:
                r = bench(url, w, os.path.join(out_dir, f"{name}.{w}.json"), args.seed)
                results["workloads"].setdefault(w, {})[name] = r
        finally:
            stop(proc)
    print(f"\n{'workload':<15}{'llama.cpp out tok/s':>21}{'kvcache out tok/s':>19}{'ratio':>8}")
    for w, r in results["workloads"].items():
        a, b = r["llama.cpp"]["output_throughput"], r["kvcache"]["output_throughput"]
        r["ratio"] = b / a
        print(f"{w:<15}{a:>21.1f}{b:>19.1f}{r['ratio']:>7.2f}x")
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
