"""`kvcache bench soak`: `kvcache serve` under a seeded mixed workload for a set time while faults are injected.

The workload: completions and chat, whole and streamed, n=2, prompts behind shared prefixes half the time, 30% of the
streams closed by the client after a few chunks, and bad requests (each must get a 4xx). The faults, each over a
window of the run: the Redis tier's server killed and restarted (`redis`), the disk tier's directory made read-only
(for root, which writes through that, replaced by a file) and restored (`disk`), a replica killed under --replicas (`replica`); at the end SIGTERM, with the server idle.

Recorded: every --sample-interval seconds the server's RSS, open file descriptors, threads and KV blocks held (with
--replicas: summed over the replicas' processes); per --window seconds the p50/p99 TTFT and ITL, successes and
5xx. Judged against the soak targets: no 5xx outside the faults' windows, RSS growth under 5% after the warm-up, no
growth in descriptors or threads, no block held once idle, each fault counted by the server (its tier's errors, or
the router's replica resets) and survived (requests succeed after it), and exit status 0 within
--shutdown-timeout + 5 s of SIGTERM. Writes JSON and a plot.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from kvcache.bench.report import write_json
from kvcache.parallel.host import free_port, redis_answers

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more").split()
FAULT_WINDOWS = {"redis": (0.15, 0.25), "disk": (0.40, 0.50), "replica": (0.65, 0.70)}  # fractions of --duration
GRACE_S = 5.0  # after a fault ends, requests still count as its own this long
KINDS = (("completion", 20), ("chat", 15), ("stream", 20), ("chat_stream", 15), ("n2", 10), ("bad", 10))
STREAM_DISCONNECT = 0.3
# what connections and requests in flight move between two samples (a leak grows past them, and keeps growing)
FD_SLACK, THREAD_SLACK = 4, 2


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times in seconds since the run's start."""

    kind: str
    sent: float
    status: int | str = 0  # the HTTP status, or "connection" / "timeout"
    ended: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    disconnected: bool = False
    fault: str | None = None  # the fault whose window it overlapped


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--duration", type=float, default=3600, help="seconds of load (default: %(default)s)")
    p.add_argument("--sample-interval", type=float, default=10,
                   help="seconds between RSS/fd/thread samples (default: %(default)s)")
    p.add_argument("--window", type=float, default=60, help="seconds per latency window (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before RSS growth is measured (default: 300, or a quarter of a shorter run)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens at most (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="256MiB", help="the server's KV pool (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=512, help="(default: %(default)s)")
    p.add_argument("--replicas", type=int, default=1, help="serve with --replicas (default: %(default)s)")
    p.add_argument("--faults", default=None, help="comma-separated, of redis, disk, replica (default: redis,disk, "
                   "and replica with --replicas > 1; '' for none)")
    p.add_argument("--shutdown-timeout", type=float, default=10, help="the server's (default: %(default)s)")
    p.add_argument("--redis-server", default="redis-server", help="the redis-server binary (default: %(default)s)")
    p.add_argument("--redis-maxmemory", default="1gb",
                   help="the Redis server's maxmemory, LRU-evicted beyond it (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--json", default="results/soak.json", help="(default: %(default)s; '' to skip)")
    p.add_argument("--plot", default="results/soak.png", help="(default: %(default)s; '' to skip)")


def check(args: argparse.Namespace) -> list[str]:
    """The faults to inject; ValueError for an argument out of range."""
    for name in ("duration", "sample_interval", "window"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.concurrency < 1 or args.max_tokens < 1 or args.replicas < 1:
        raise ValueError("--concurrency, --max-tokens and --replicas must be >= 1")
    default = "redis,disk" + (",replica" if args.replicas > 1 else "")
    faults = [f for f in (default if args.faults is None else args.faults).split(",") if f]
    for f in faults:
        if f not in FAULT_WINDOWS:
            raise ValueError(f"unknown fault {f!r}: choose from {', '.join(FAULT_WINDOWS)}")
    if "replica" in faults and args.replicas < 2:
        raise ValueError("the replica fault needs --replicas 2 or more")
    if "redis" in faults and shutil.which(args.redis_server) is None:
        raise ValueError(f"the redis fault needs {args.redis_server!r} (Debian: apt install redis-server)")
    return faults


def run(args: argparse.Namespace) -> int:
    faults = check(args)
    result = soak(args, faults)
    print_table(result)
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0 if all(result["verdicts"].values()) else 1


# ---- the server and its faults ------------------------------------------------------------------------------------

class Redis:
    """A redis-server of the soak's own, on a free port, killed and restarted by the `redis` fault."""

    def __init__(self, binary: str, directory: str, maxmemory: str) -> None:
        self.binary, self.dir, self.maxmemory, self.port, self.proc = binary, directory, maxmemory, free_port(), None

    def start(self) -> None:
        """Start it as a cache (maxmemory, least recently used keys evicted: how the tier is meant to be deployed,
        docs/tiers.md; unbounded, the engine's write-through fills the machine's memory within the hour) and wait
        (10 s at most) until it answers PING."""
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                                      "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
                                      "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not redis_answers(self.port):
            raise RuntimeError(f"redis-server did not answer on port {self.port} within 10 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def start_server(args, workdir: str, redis: Redis | None) -> tuple[subprocess.Popen, str, str]:
    """`kvcache serve` with the disk tier in `workdir` and `redis` as the remote tier: (process, URL, log path)."""
    from kvcache.bench.replicas import start_replicas
    from kvcache.bench.serve import wait_until_serving
    serve_args = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
                  "--served-model-name", "soak", "--shutdown-timeout", str(args.shutdown_timeout),
                  "--kv-offload-dir", os.path.join(workdir, "disk")]
    if args.model:
        serve_args += ["--model", args.model]
    if redis is not None:
        serve_args += ["--kv-remote", f"redis://127.0.0.1:{redis.port}/0", "--kv-remote-timeout", "0.5"]
    log_path = os.path.join(workdir, "serve.log")
    if args.replicas > 1:  # start_replicas stops what it started if it fails
        proc, url = start_replicas([*serve_args, "--replicas", str(args.replicas)], log_path, 300)
        return proc, url, log_path
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvcache.cli", "serve", *serve_args, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, 300)
    except BaseException:  # Ctrl-C too: the server runs in a session of its own, nothing else would stop it
        proc.kill()
        proc.wait()
        raise
    return proc, url, log_path


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc: the engine process, tensor-parallel ranks' parent)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def proc_sample(pids: list[int]) -> dict:
    """RSS (MiB), open descriptors and threads, summed over `pids` (a process that is gone counts nothing)."""
    rss = fds = threads = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            rss += int(status["VmRSS"].split()[0]) / 1024
            threads += int(status["Threads"])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, KeyError, ValueError):
            continue
    return {"rss_mib": round(rss, 1), "fds": fds, "threads": threads}


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text summed by metric name and the labels that matter here (state, tier, finished_reason), over
    replicas and models."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            keep = ",".join(f"{k}={s.labels[k]}" for k in ("state", "tier", "finished_reason") if k in s.labels)
            key = f"{s.name}{{{keep}}}" if keep else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def tier_errors(m: dict[str, float], tier: str) -> float:
    return sum(v for k, v in m.items() if k.startswith("kvcache:kv_offload_errors_total{") and f"tier={tier}" in k)


# ---- the workload -------------------------------------------------------------------------------------------------

def make_body(rng: random.Random, kind: str, prefixes: list[str], max_tokens: int) -> dict | bytes:
    """A request of `kind`: half of them behind one of the shared `prefixes`; `bad` ones are malformed."""
    if kind == "bad":
        return rng.choice([b"{not json", {"model": "soak", "prompt": "x", "max_tokens": -1},
                           {"model": "no-such-model", "prompt": "x"}, {"model": "soak", "messages": []},
                           {"model": "soak", "prompt": "x", "temperature": "hot"},
                           {"model": "soak", "prompt": [10 ** 9], "max_tokens": 2}])
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))
    text = f"{rng.choice(prefixes)} {words}" if rng.random() < 0.5 else words
    body: dict = {"model": "soak", "max_tokens": rng.randint(4, max_tokens), "temperature": rng.choice([0.0, 0.8]),
                  "seed": rng.randrange(2**31)}
    if kind in ("chat", "chat_stream"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if kind == "n2":
        body["n"] = 2
    if kind in ("stream", "chat_stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(client, url: str, rng: random.Random, kind: str, prefixes: list[str], max_tokens: int,
                      t0: float) -> Outcome:
    body = make_body(rng, kind, prefixes, max_tokens)
    path = "/v1/chat/completions" if kind.startswith("chat") or (isinstance(body, dict) and "messages" in body) \
        else "/v1/completions"
    out = Outcome(kind, time.monotonic() - t0)
    stop_after = rng.randint(1, 4) if kind in ("stream", "chat_stream") and rng.random() < STREAM_DISCONNECT else None
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    try:
        async with asyncio.timeout(120):
            async with client.stream("POST", url + path, **kw) as r:
                out.status = r.status_code
                if r.status_code == 200 and kind in ("stream", "chat_stream"):
                    await read_events(r, out, stop_after, t0)
                else:
                    await r.aread()
    except TimeoutError:
        out.status = "timeout"
    except Exception:  # noqa: BLE001 -- a refused or broken connection: what the soak counts
        out.status = "connection" if out.status == 0 else out.status
    out.ended = time.monotonic() - t0
    return out


async def read_events(r, out: Outcome, stop_after: int | None, t0: float) -> None:
    """Time the stream's content events; stop reading (the client goes away) after `stop_after` of them."""
    last, n = None, 0
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.status = f"error event {chunk['error'].get('code')}"
            return
        now = time.monotonic() - t0
        if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
            if last is None:
                out.ttft = now - out.sent
            else:
                out.itl.append(now - last)
            last, n = now, n + 1
            if stop_after is not None and n >= stop_after:
                out.disconnected = True
                return


async def workload(url: str, args, t0: float, end: float, outcomes: list[Outcome]) -> None:
    import httpx
    rng = random.Random(args.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(96)) for _ in range(8)]
    kinds, weights = zip(*KINDS)

    async def worker(i: int) -> None:
        wrng = random.Random(args.seed * 1000 + i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=5)) as client:
            while time.monotonic() < end:
                kind = wrng.choices(kinds, weights)[0]
                outcomes.append(await one_request(client, url, wrng, kind, prefixes, args.max_tokens, t0))
    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))


# ---- the run ------------------------------------------------------------------------------------------------------

def soak(args, faults: list[str]) -> dict:
    workdir = tempfile.mkdtemp(prefix="kvcache-soak-")
    redis = Redis(args.redis_server, workdir, args.redis_maxmemory) if "redis" in faults else None
    if redis is not None:
        redis.start()
    try:
        proc, url, log_path = start_server(args, workdir, redis)
        try:
            return asyncio.run(_drive(args, faults, proc, url, log_path, workdir, redis))
        finally:
            if proc.poll() is None:
                from kvcache.bench.replicas import stop_replicas
                stop_replicas(proc, leftovers=True)
    finally:
        if redis is not None:
            redis.kill()
        if os.path.isdir(os.path.join(workdir, "disk")):
            os.chmod(os.path.join(workdir, "disk"), 0o755)  # else rmtree cannot empty it
        shutil.rmtree(workdir, ignore_errors=True)


async def _drive(args, faults, proc, url, log_path, workdir, redis) -> dict:
    import httpx
    t0 = time.monotonic()
    end = t0 + args.duration
    outcomes: list[Outcome] = []
    samples: list[dict] = []
    fault_log: list[dict] = []
    async with httpx.AsyncClient(timeout=30) as probe:
        async def metrics() -> dict[str, float]:
            try:
                return metric_sums((await probe.get(f"{url}/metrics")).text)
            except Exception:  # noqa: BLE001 -- down for a moment (a fault): an empty sample
                return {}

        async def sampler() -> None:
            k = 0
            while (due := t0 + k * args.sample_interval) < end:  # on a fixed clock: a slow probe does not drift it
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                samples.append(await _sample(probe, url, proc, args.replicas, metrics, t0, redis))
                k = max(k + 1, math.ceil((time.monotonic() - t0) / args.sample_interval))  # slots a stall missed

        async def injector() -> None:
            for name in sorted(faults, key=lambda f: FAULT_WINDOWS[f][0]):
                start, stop = (t0 + f * args.duration for f in FAULT_WINDOWS[name])
                await asyncio.sleep(max(0.0, start - time.monotonic()))
                before = await metrics()
                began = time.monotonic() - t0
                error = None
                try:
                    await asyncio.to_thread(_inject, name, True, workdir, redis, url)
                    await asyncio.sleep(max(0.0, stop - time.monotonic()))
                    await asyncio.to_thread(_inject, name, False, workdir, redis, url)
                except Exception as e:  # noqa: BLE001 -- the harness's own failure: reported, the run goes on
                    error = f"{type(e).__name__}: {e}"
                fault_log.append({"fault": name, "start_s": round(began, 1), "end_s": round(time.monotonic() - t0, 1),
                                  "before": before, "harness_error": error})
            await asyncio.sleep(max(0.0, end - time.monotonic()))

        await asyncio.gather(workload(url, args, t0, end, outcomes), sampler(), injector())
        await asyncio.sleep(3)  # idle: every request has ended
        idle = await _sample(probe, url, proc, args.replicas, metrics, t0, redis)
        final = await metrics()
    for f in fault_log:
        f["counted"] = _counted(f.pop("before"), final, f["fault"])
        f["requests_ok_after"] = sum(o.status == 200 for o in outcomes if o.sent > f["end_s"] + GRACE_S)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=args.shutdown_timeout + 60)
    except subprocess.TimeoutExpired:
        status = "hung"
    exit_s = time.monotonic() - signalled
    with open(log_path) as f:
        tracebacks = f.read().count("Traceback")
    return summarize(args, faults, outcomes, samples, idle, fault_log, status, exit_s, tracebacks)


def _inject(name: str, on: bool, workdir: str, redis: Redis | None, url: str) -> None:
    """Begin (`on`) or end the fault `name`."""
    import httpx
    if name == "redis":
        redis.kill() if on else redis.start()
    elif name == "disk":
        disk_unwritable(os.path.join(workdir, "disk"), on)
    elif name == "replica" and on:
        pids = [r["pid"] for r in httpx.get(f"{url}/replicas", timeout=30).json()["replicas"] if "pid" in r]
        os.kill(pids[0], signal.SIGKILL)


def disk_unwritable(path: str, on: bool) -> None:
    """Make the disk tier's directory read-only (`on`) or writable again. Root writes through a read-only mode, so
    for root the directory is moved aside and a file put in its place (every write and read then fails)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o500 if on else 0o755)
    elif on:
        os.rename(path, path + ".aside")
        open(path, "w").close()
    else:
        os.remove(path)
        os.rename(path + ".aside", path)


async def _sample(probe, url, proc, replicas: int, metrics, t0: float, redis: Redis | None) -> dict:
    m = await metrics()
    pids = [proc.pid, *child_pids(proc.pid)]  # the engine process (--engine-process, the default) is a child
    if replicas > 1:
        try:
            pids = [r["pid"] for r in (await probe.get(f"{url}/replicas")).json()["replicas"] if "pid" in r]
        except Exception:  # noqa: BLE001
            pids = []
    alive_redis = [redis.proc.pid] if redis is not None and redis.proc.poll() is None else []
    return {"t_s": round(time.monotonic() - t0, 1), **proc_sample(pids),
            "redis_rss_mib": proc_sample(alive_redis)["rss_mib"] if redis is not None else None,
            "blocks_used": m.get("kvcache:kv_blocks{state=used}"),
            "running": m.get("kvcache:num_requests_running"), "waiting": m.get("kvcache:num_requests_waiting")}


def _counted(before: dict, after: dict, fault: str) -> bool:
    """Whether the server counted the fault: its tier's errors, or the router's replica resets, went up."""
    if fault in ("redis", "disk"):
        return tier_errors(after, fault) > tier_errors(before, fault)
    return after.get("kvcache:router_replica_resets_total", 0) > before.get("kvcache:router_replica_resets_total", 0)


# ---- the report ---------------------------------------------------------------------------------------------------

FAILED = ("connection", "timeout")


def _is_5xx(o: Outcome) -> bool:
    """A server-side failure: a 5xx, an error event, a broken connection or no answer in time."""
    return (isinstance(o.status, int) and o.status >= 500) or (isinstance(o.status, str))


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def summarize(args, faults, outcomes, samples, idle, fault_log, status, exit_s, tracebacks) -> dict:
    for o in outcomes:  # a request that overlapped a fault's window (and its grace) is that fault's own
        o.fault = next((f["fault"] for f in fault_log if o.sent <= f["end_s"] + GRACE_S and o.ended >= f["start_s"]),
                       None)
    unexpected = [o for o in outcomes if _is_5xx(o) and o.fault is None]
    bad = [o for o in outcomes if o.kind == "bad" and o.fault is None]  # a fault may cut one off before its 4xx
    windows = []
    for w in range(int(args.duration // args.window + (args.duration % args.window > 0))):
        inside = [o for o in outcomes if w * args.window <= o.sent < (w + 1) * args.window]
        ttft = [o.ttft for o in inside if o.ttft is not None]
        itl = [x for o in inside for x in o.itl]
        windows.append({"start_s": w * args.window, "requests": len(inside),
                        "ok": sum(o.status == 200 for o in inside), "5xx": sum(_is_5xx(o) for o in inside),
                        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
                        "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99)})
    warmup = args.warmup if args.warmup is not None else min(300.0, args.duration / 4)
    # a killed replica comes back as a new process: growth is measured from after its return
    since = max([warmup] + [f["end_s"] + GRACE_S for f in fault_log if f["fault"] == "replica"])
    after = [x for x in samples if x["t_s"] >= since and x["rss_mib"]]
    growth = _growth(after)
    faults_ok = len(fault_log) == len(faults) and all(
        f["counted"] and f["requests_ok_after"] > 0 and f["harness_error"] is None for f in fault_log)
    verdicts = {
        "no_unexpected_5xx": not unexpected,
        "bad_requests_got_4xx": all(isinstance(o.status, int) and 400 <= o.status < 500 for o in bad),
        "rss_growth_under_5pct": growth["rss_pct"] is not None and growth["rss_pct"] < 5,
        "no_fd_growth": growth["fds"] is not None and growth["fds"] <= FD_SLACK,
        "no_thread_growth": growth["threads"] is not None and growth["threads"] <= THREAD_SLACK,
        "idle_blocks_zero": idle.get("blocks_used") == 0,
        "faults_counted_and_survived": faults_ok,
        "clean_exit": status == 0 and exit_s <= args.shutdown_timeout + 5 and tracebacks == 0,
    }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"}, "faults": fault_log,
        "requests": {"total": len(outcomes), "by_kind": _by_kind(outcomes),
                     "disconnected": sum(o.disconnected for o in outcomes),
                     "5xx_in_faults": sum(_is_5xx(o) and o.fault is not None for o in outcomes),
                     "5xx_unexpected": len(unexpected),
                     "unexpected_examples": [asdict(o) | {"itl": len(o.itl)} for o in unexpected[:5]]},
        "samples": samples, "idle": idle, "windows": windows, "growth_after_warmup": growth | {"warmup_s": since},
        "exit": {"status": status, "seconds_after_sigterm": round(exit_s, 2), "tracebacks_in_log": tracebacks},
        "verdicts": verdicts,
    }


def _by_kind(outcomes: list[Outcome]) -> dict:
    out: dict = {}
    for o in outcomes:
        k = out.setdefault(o.kind, {})
        k[str(o.status)] = k.get(str(o.status), 0) + 1
    return out


def _growth(after: list[dict]) -> dict:
    """Growth over the samples after the warm-up: the median of their last third against that of their first third
    (one late or early sample moves neither), RSS in %, descriptors and threads in counts (positive: growth)."""
    if len(after) < 3:
        return {"rss_pct": None, "fds": None, "threads": None}
    third = max(1, len(after) // 3)

    def medians(key):
        return float(np.median([x[key] for x in after[:third]])), float(np.median([x[key] for x in after[-third:]]))
    (rss0, rss1), (fd0, fd1), (th0, th1) = medians("rss_mib"), medians("fds"), medians("threads")
    return {"rss_pct": round((rss1 - rss0) / rss0 * 100, 2), "rss_first_mib": rss0, "rss_last_mib": rss1,
            "fds": fd1 - fd0, "threads": th1 - th0}


def print_table(r: dict) -> None:
    q = r["requests"]
    print(f"soak: {q['total']:,} requests in {r['config']['duration']:g} s, {q['disconnected']} closed early by the "
          f"client; 5xx: {q['5xx_unexpected']} unexpected, {q['5xx_in_faults']} during faults")
    print(f"{'window s':>9} {'requests':>9} {'ok':>6} {'5xx':>5} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8}")
    for w in r["windows"]:
        print(f"{w['start_s']:>9g} {w['requests']:>9} {w['ok']:>6} {w['5xx']:>5} {w['ttft_p50_ms'] or '-':>9} "
              f"{w['ttft_p99_ms'] or '-':>8} {w['itl_p50_ms'] or '-':>8} {w['itl_p99_ms'] or '-':>8}")
    for f in r["faults"]:
        print(f"fault {f['fault']:<8} {f['start_s']:>7g}-{f['end_s']:<7g} s  counted: {f['counted']}  "
              f"requests ok after: {f['requests_ok_after']}"
              + (f"  (the harness failed: {f['harness_error']})" if f["harness_error"] else ""))
    g, e = r["growth_after_warmup"], r["exit"]
    print(f"after {g['warmup_s']:g} s warm-up: RSS {g.get('rss_first_mib', '-')} -> {g.get('rss_last_mib', '-')} MiB "
          f"({g['rss_pct']}%), fds {g['fds']:+}, threads {g['threads']:+}; idle blocks held: "
          f"{r['idle']['blocks_used']}" if g["rss_pct"] is not None else "too few samples after the warm-up")
    print(f"SIGTERM: exit status {e['status']} after {e['seconds_after_sigterm']} s, {e['tracebacks_in_log']} "
          "tracebacks in the log")
    for name, ok in r["verdicts"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [x["t_s"] for x in r["samples"]]
    a.plot(t, [x["rss_mib"] for x in r["samples"]], label="RSS (MiB)")
    a2 = a.twinx()
    a2.plot(t, [x["fds"] for x in r["samples"]], "g--", label="open fds")
    a2.plot(t, [x["threads"] for x in r["samples"]], "r:", label="threads")
    a.set_ylabel("RSS (MiB)")
    a2.set_ylabel("fds, threads")
    a.legend(loc="upper left")
    a2.legend(loc="upper right")
    mid = [w["start_s"] + r["config"]["window"] / 2 for w in r["windows"]]
    for key, style in (("ttft_p99_ms", "o-"), ("itl_p99_ms", "s-"), ("ttft_p50_ms", "o:"), ("itl_p50_ms", "s:")):
        b.plot(mid, [w[key] for w in r["windows"]], style, label=key.replace("_ms", " (ms)"))
    b.set_yscale("log")
    b.set_xlabel("seconds")
    b.legend(loc="upper left", fontsize=8)
    for f in r["faults"]:
        for ax in (a, b):
            ax.axvspan(f["start_s"], f["end_s"], color="orange", alpha=0.2)
        a.text(f["start_s"], a.get_ylim()[1], f["fault"], va="top", fontsize=8)
    a.set_title("kvcache bench soak: process and latency over time (faults shaded)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")
