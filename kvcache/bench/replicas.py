"""`kvcache bench replicas`: K replicas on Ray Serve (`kvcache serve --replicas K`), KV-aware routing against
round-robin, on the shared-prefix and multi-turn workloads, side by side.

For each routing policy a server is started (a local Ray cluster, K replicas of the model with `--kv-cache-memory`
each), and each workload goes through `kvcache bench serve` (streaming /v1/completions, seeded prompts of common
English words). Around each workload the ingress's /metrics (every replica's counters under a `replica` label) is
read: the prefix-cache hit rate is the prompt tokens found cached over those looked up, summed over replicas. The
table has hit rate, mean TTFT and output tok/s per policy and workload, and KV-aware's ratio to round-robin.

Defaults (the issue's): 4 replicas; 16 system prompts x 8 users (prefix 256 words, each user message 32 of its own),
in a seeded random order: shared-prefix, one request per user; multi-turn, one conversation of 2 turns per user (the
second sent after the first's answer, with the whole history); the demo model
with a small pool each (128 MiB, 2,900 tokens: a replica holds a quarter of the system prompts beside its running
requests, not all of them, which is what routing is for).
"""
import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import httpx

from kvcache.bench.serve import wait_until_serving
from kvcache.bench.report import write_json
from kvcache.parallel.host import free_port


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--replicas", type=int, default=4,
                   help="engine replicas behind the router, at least 2 (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="128MiB", help="KV cache per replica, bytes (the demo: 2,900 tokens; "
                   "a quarter of the system prompts fits beside the running requests, all of them do not) "
                   "(default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="tokens of one request at most (default: %(default)s)")
    p.add_argument("--routing-balance", type=float, default=4,
                   help="kv-aware's --routing-balance, requests in flight (default: %(default)s)")
    p.add_argument("--groups", type=int, default=16, help="system prompts (both workloads) (default: %(default)s)")
    p.add_argument("--users", type=int, default=8, help="users per system prompt: shared-prefix, one request each; "
                   "multi-turn, one conversation each (default: %(default)s)")
    p.add_argument("--prefix-len", type=int, default=256, help="words of each system prompt (default: %(default)s)")
    p.add_argument("--suffix-len", type=int, default=32,
                   help="words of each user's own message (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=16,
                   help="output tokens of each request (default: %(default)s)")
    p.add_argument("--turns", type=int, default=2, help="multi-turn: turns per conversation (each after the last "
                   "one's answer, with the whole history) (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="requests in flight at most (default: %(default)s)")
    p.add_argument("--workloads", default="shared-prefix,multi-turn",
                   help="workloads to run, comma-separated, of shared-prefix, multi-turn (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the workloads' prompts and order (bench serve's --seed) (default: %(default)s)")
    p.add_argument("--json", default="results/replicas.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")


def _hits(url: str) -> tuple[float, float]:
    """(prompt tokens found cached, looked up), summed over the replicas."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        m = re.match(r"kvcache:prefix_cache_(hits|queries)_total\{[^}]*\}\s+(\S+)", line)
        if m:
            total[m.group(1)] += float(m.group(2))
    return total["hits"], total["queries"]


def _serve_args(args, policy: str) -> list[str]:
    cmd = ["--replicas", str(args.replicas), "--routing", policy, "--routing-balance", str(args.routing_balance),
           "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len)]
    return cmd + (["--model", args.model] if args.model else [])


BIND_ATTEMPTS = 3


def start_replicas(serve_args: list[str], log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """`kvcache serve <serve_args>` on a free loopback port, once every replica is up: (its process, its URL). A
    port taken before Ray's proxy binds it (another process picked it meanwhile) is tried again on another, up to
    BIND_ATTEMPTS times; any other failure to start raises RuntimeError naming the log, its processes stopped."""
    attempt = 0
    while True:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvcache.cli", "serve", *serve_args, "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until_serving(url, proc, timeout, "/replicas", every_replica_up)
            return proc, url
        except RuntimeError as e:
            stop_replicas(proc, leftovers=True)
            with open(log_path) as f:
                taken = "Failed to bind to address" in f.read()
            attempt += 1
            if not taken or attempt == BIND_ATTEMPTS:
                raise RuntimeError(f"kvcache serve --replicas: {e}; see {log_path}") from None


def every_replica_up(response) -> bool:
    """Whether a GET /replicas answer lists every replica with its process (all deployed)."""
    return all("pid" in x for x in response.json()["replicas"])


def stop_replicas(proc: subprocess.Popen, leftovers: bool = False, term: bool = False) -> None:
    """SIGINT to the server's process group (serve.shutdown() and ray.shutdown() run on the way out), or with `term`
    SIGTERM to the server alone (as a supervisor stops it); SIGKILL to the group after 60 s; with `leftovers`, SIGKILL
    too to what is left of the group once the server has exited (the Ray processes of a server that failed to
    start)."""
    if proc.poll() is None:
        if term:
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            leftovers = True
    if leftovers:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left of the group
            pass
        proc.wait()


def _workload_args(args, name: str, url: str) -> list[str]:
    common = ["--url", url, "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
              "--seed", str(args.seed)]
    if name == "shared-prefix":
        return common + ["--workload", "shared-prefix", "--num-groups", str(args.groups), "--requests-per-group",
                         str(args.users), "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len),
                         "--shuffle"]
    return common + ["--workload", "multi-turn", "--num-conversations", str(args.groups * args.users),
                     "--num-system-prompts", str(args.groups), "--num-turns", str(args.turns), "--prefix-len",
                     str(args.prefix_len), "--suffix-len", str(args.suffix_len), "--shuffle"]


def run(args: argparse.Namespace) -> int:
    from kvcache.bench import serve as bench_serve
    if args.replicas < 2:
        raise ValueError(f"--replicas must be at least 2 to compare routing, got {args.replicas}")
    names = [w for w in args.workloads.split(",") if w]
    if not names or set(names) - {"shared-prefix", "multi-turn"}:
        raise ValueError(f"--workloads must name shared-prefix and/or multi-turn, got {args.workloads!r}")
    results = {"replicas": args.replicas, "model": args.model or "demo", "workloads": {}}
    tmp = tempfile.mkdtemp(prefix="kvcache-bench-replicas-")
    for policy in ("kv-aware", "round-robin"):
        proc, url = start_replicas(_serve_args(args, policy), os.path.join(tmp, f"{policy}.log"), 600)
        try:
            for name in names:
                p = argparse.ArgumentParser()
                bench_serve.add_args(p)
                h0, q0 = _hits(url)
                rep = bench_serve.measure(p.parse_args(_workload_args(args, name, url)))
                if not rep["completed"]:
                    raise RuntimeError(f"no request of {name} completed under {policy} routing")
                h1, q1 = _hits(url)
                decisions = httpx.get(f"{url}/replicas", timeout=30).json()["decisions"]
                results["workloads"].setdefault(name, {})[policy] = {
                    "prefix_cache_hit_rate": (h1 - h0) / max(1.0, q1 - q0), "hit_tokens": h1 - h0,
                    "queried_tokens": q1 - q0, "mean_ttft_ms": rep["mean_ttft_ms"],
                    "output_tokens_per_s": rep["output_throughput"], "completed": rep["completed"],
                    "failed": rep["failed"], "router_decisions": decisions}
        finally:
            stop_replicas(proc)
    shutil.rmtree(tmp, ignore_errors=True)  # the servers' logs; kept where a run failed
    for name, w in results["workloads"].items():
        kv, rr = w["kv-aware"], w["round-robin"]
        w["hit_rate_ratio"] = _ratio(kv["prefix_cache_hit_rate"], rr["prefix_cache_hit_rate"])
        w["ttft_ratio"] = _ratio(kv["mean_ttft_ms"], rr["mean_ttft_ms"])
    _print(results)
    write_json(args.json, results)
    return 0


def _ratio(a: float, b: float) -> float | None:
    """a / b; None (no ratio: JSON null, printed n/a) when b is 0, as round-robin's hit rate can be."""
    return a / b if b else None


def _times(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _print(results: dict) -> None:
    print(f"\n{results['replicas']} replicas of {results['model']} on Ray Serve")
    print(f"{'workload':<14} {'routing':<12} {'hit rate':>9} {'mean TTFT ms':>13} {'out tok/s':>10} {'failed':>7}")
    for name, w in results["workloads"].items():
        for policy in ("kv-aware", "round-robin"):
            r = w[policy]
            print(f"{name:<14} {policy:<12} {r['prefix_cache_hit_rate']:>8.1%} {r['mean_ttft_ms']:>13.0f} "
                  f"{r['output_tokens_per_s']:>10.1f} {r['failed']:>7}")
        print(f"{'':<14} {'kv-aware / round-robin':<12}: hit rate {_times(w['hit_rate_ratio'])} (round-robin "
              f"{w['round-robin']['prefix_cache_hit_rate']:.1%}), mean TTFT {_times(w['ttft_ratio'])}")
