"""`kvcache serve --replicas K`: K engine replicas on Ray Serve behind one OpenAI-compatible ingress with a KV-aware
router.

- Each replica is a Ray Serve deployment of its own (`replica-0` ... `replica-{K-1}`, one Ray actor each) running the
  whole `kvcache serve` app (engine, engine loop, OpenAI routes, metrics) on a loopback port of its own; Ray Serve
  health-checks it (its engine loop must be alive) and restarts it when it dies.
- The ingress (deployment `router`, Ray Serve's HTTP proxy on --host/--port) proxies each request to one replica,
  streaming included. `--routing kv-aware` (the default) keeps an approximate prefix index, as SGLang's router does:
  the prompt (token ids in blocks of 16, text in blocks of 64 characters, chat messages as their JSON) is hashed
  block by block into a chain, each chain hash remembering the replicas it was sent to; a request goes to the
  replica it shares its longest prefix with (half its blocks at least) unless that one has more than
  `--routing-balance` requests in flight above the least loaded, and a new prefix to the replica holding the fewest
  prefix blocks (PrefixRouter: SGLang's cache-aware rule). `round-robin` is the baseline. A replica with the shared Redis tier configured (--kv-remote) still loads a prefix it misses from the
  tier, so a misrouted request costs a load, not a prefill.
- GET /metrics merges every replica's metrics with a `replica` label, plus the router's own counters
  (`kvcache:router_requests_total{decision}`, `kvcache:router_prefix_hit_routed_total`,
  `kvcache:router_retries_total`, `kvcache:router_replica_resets_total`). A replica that cannot be reached before a
  request starts streaming is skipped for a few seconds and the request retried on another (a request already
  streaming fails with the error).
- The ingress reads every replica's KV usage and process id each POLL_S seconds. A replica that could not be reached,
  or that comes back as another process (Ray Serve restarted it), starts with an empty cache: the router forgets
  every prefix it had sent there (PrefixRouter.forget), so that those prefixes are not sent to it as hits.
"""

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict

import httpx
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvcache.distributed.host import free_port, usable_cores

log = logging.getLogger("kvcache")
TOKEN_BLOCK, CHAR_BLOCK = 16, 64
INDEX_ENTRIES = 200_000  # chain hashes the router remembers (least recently routed forgotten first)
DOWN_S = 5.0  # a replica that could not be reached is skipped this long
POLL_S = 1.0  # how often the ingress reads each replica's KV usage and process id


def prefix_keys(body: dict) -> list[bytes]:
    """The chain of block hashes of a request's prompt: key i covers the first i + 1 blocks."""
    prompt = body.get("prompt", body.get("messages"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        blocks = [",".join(map(str, prompt[i:i + TOKEN_BLOCK])).encode() for i in range(0, len(prompt), TOKEN_BLOCK)]
    else:
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
        blocks = [text[i:i + CHAR_BLOCK].encode() for i in range(0, len(text), CHAR_BLOCK)]
    keys, h = [], hashlib.sha256(str(body.get("model")).encode()).digest()
    for b in blocks:
        h = hashlib.sha256(h + b).digest()
        keys.append(h)
    return keys


class PrefixRouter:
    """Which replica a request goes to (no I/O: the ingress keeps the in-flight counts and KV usage it reads).

    KV-aware, SGLang's cache-aware rule (its router's and vllm-router's default) at this scale:
    - a request whose longest prefix some replica was sent (at least CACHE_SHARE of its blocks) goes to that replica,
      unless it has more than `balance` requests in flight above the least-loaded one: then to the least loaded;
    - any other request (a new prefix) goes to the replica holding the fewest prefix blocks (its "smallest tree"),
      so that distinct prefixes spread evenly over the replicas' caches instead of piling where load last dipped;
    - ties go to the least loaded, then the least KV usage.
    A prefix every replica holds (a common system prompt) matches everywhere alike, so those requests spread by load.

    The record of what a replica holds is bounded by its pool (`set_pool`, from the replica's KV size; SGLang's router
    bounds its trees alike): past it the replica's least recently sent blocks are dropped, a chain's last blocks
    first, as the replica's own LRU gives them back. Without the bound the router kept sending a conversation to the
    replica that once held its history, long after that replica had evicted it."""

    CACHE_SHARE = 0.5  # SGLang's --cache-threshold default

    def __init__(self, num_replicas: int, policy: str = "kv-aware", balance: float = 4) -> None:
        if policy not in ("kv-aware", "round-robin"):
            raise ValueError(f"routing must be kv-aware or round-robin, got {policy!r}")
        if not balance >= 0:
            raise ValueError(f"routing balance must be >= 0, got {balance}")
        self.n, self.policy, self.balance = num_replicas, policy, balance
        self.index: OrderedDict[bytes, int] = OrderedDict()  # chain hash -> bit mask of the replicas sent it
        self.recent: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]  # LRU per replica
        self.capacity: list[int | None] = [None] * num_replicas  # blocks each replica's pool holds (None: unknown)
        self.inflight = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self.down_until = [0.0] * num_replicas
        self.next = 0
        self.decisions = {"prefix": 0, "least_loaded": 0, "smallest_cache": 0, "round_robin": 0}
        self.resets = 0  # forget() calls that cleared something

    @property
    def held(self) -> list[int]:
        """Chain hashes recorded per replica (its record's size)."""
        return [len(r) for r in self.recent]

    def up(self) -> list[int]:
        now = time.monotonic()
        live = [i for i in range(self.n) if self.down_until[i] <= now]
        return live or list(range(self.n))

    def matched(self, keys: list[bytes]) -> list[int]:
        """Per replica, the leading blocks of `keys` it was sent before."""
        depth = [0] * self.n
        open_ = (1 << self.n) - 1  # replicas still matching
        for k in keys:
            open_ &= self.index.get(k, 0)
            if not open_:
                break
            for r in range(self.n):
                if open_ >> r & 1:
                    depth[r] += 1
        return depth

    def choose(self, keys: list[bytes], exclude: set[int] = frozenset()) -> int:
        live = [i for i in self.up() if i not in exclude] or [i for i in range(self.n) if i not in exclude]
        if not live:
            raise RuntimeError("no replica left to try")
        if self.policy == "round-robin":
            for _ in range(self.n):
                i, self.next = self.next, (self.next + 1) % self.n
                if i in live:
                    self.decisions["round_robin"] += 1
                    return i
        depth = self.matched(keys)
        least = min(self.inflight[r] for r in live)
        deepest = max(depth[r] for r in live)
        if keys and deepest >= self.CACHE_SHARE * len(keys):
            holders = [r for r in live if depth[r] == deepest]
            near = [r for r in holders if self.inflight[r] - least <= self.balance]
            if near:
                self.decisions["prefix"] += 1
                return min(near, key=lambda r: (self.inflight[r], self.kv_usage[r]))
            self.decisions["least_loaded"] += 1
            return min(live, key=lambda r: (self.inflight[r], self.kv_usage[r]))
        self.decisions["smallest_cache"] += 1
        held = self.held
        return min(live, key=lambda r: (held[r], self.inflight[r], self.kv_usage[r]))

    def routed(self, keys: list[bytes], replica: int) -> None:
        """Remember that `replica` now holds these prefixes (the most recently used of its blocks, the chain's first
        ones most of all), forgetting what its pool can no longer hold."""
        bit, recent = 1 << replica, self.recent[replica]
        for k in reversed(keys):
            self.index[k] = self.index.get(k, 0) | bit
            self.index.move_to_end(k)
            recent[k] = None
            recent.move_to_end(k)
        self._trim(replica)
        while len(self.index) > INDEX_ENTRIES:
            k, mask = self.index.popitem(last=False)
            for r in range(self.n):
                if mask >> r & 1:
                    del self.recent[r][k]

    def set_pool(self, replica: int, tokens: int) -> None:
        """`replica`'s KV pool holds `tokens` tokens: its record keeps at most that many blocks' worth of keys (a key
        covers TOKEN_BLOCK token ids, or CHAR_BLOCK characters: about as many tokens of English text)."""
        self.capacity[replica] = max(1, tokens // TOKEN_BLOCK)
        self._trim(replica)

    def _trim(self, replica: int) -> None:
        cap, recent, bit = self.capacity[replica], self.recent[replica], 1 << replica
        while cap is not None and len(recent) > cap:
            k, _ = recent.popitem(last=False)
            mask = self.index[k] & ~bit
            if mask:
                self.index[k] = mask
            else:
                del self.index[k]

    def forget(self, replica: int) -> int:
        """Drop every prefix `replica` was sent (it lost its cache: restarted, or unreachable and so restarting);
        returns how many it held. Entries no other replica holds leave the index."""
        held, bit = len(self.recent[replica]), 1 << replica
        if not held:
            return 0
        for k in self.recent[replica]:
            mask = self.index[k] & ~bit
            if mask:
                self.index[k] = mask
            else:
                del self.index[k]
        self.recent[replica].clear()
        self.resets += 1
        return held


def relabel(text: str, replica: int, keep_meta: bool) -> list[str]:
    """A replica's Prometheus text with replica="i" added to every sample (HELP/TYPE lines kept once)."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            if keep_meta:
                out.append(line)
            continue
        m = re.match(r"([^{\s]+)(\{([^}]*)\})?\s+(.*)", line)
        if not m:
            continue
        labels = f'replica="{replica}"' + (f",{m.group(3)}" if m.group(3) else "")
        out.append(f"{m.group(1)}{{{labels}}} {m.group(4)}")
    return out


async def relay(chunks, sse: bool, replica: int, done):
    """A replica's response passed through chunk by chunk; `done()` is awaited at the end, whatever happens. If the
    replica fails mid-response, a server-sent-events stream ends as the server ends a failed stream (vLLM's way): an
    error event naming the replica, then [DONE] (the request is not retried: part of it was sent); any other
    response just ends where the connection broke."""
    try:
        async for chunk in chunks:
            yield chunk
    except httpx.HTTPError as e:
        log.warning("replica %d failed mid-response: %s", replica, e)
        if sse:
            err = {"error": {"message": f"replica {replica} failed while streaming this response ({e}); the request "
                                        "was not retried", "type": "server_error", "code": "replica_failed"}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await done()


@dataclasses.dataclass
class ReplicaOptions:
    config: dict  # EngineConfig fields
    served_model_name: str | None
    api_key: str | None
    threads: int


def build_app(num_replicas: int, options: ReplicaOptions, policy: str, balance: int):
    """The Ray Serve application: K replica deployments and the router ingress bound to them."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {
        "OMP_NUM_THREADS": str(options.threads)}}}, health_check_period_s=2, health_check_timeout_s=30)
    class EngineReplica:
        """One `kvcache serve` app on a loopback port of this actor's."""

        def __init__(self, index: int) -> None:
            import torch
            import uvicorn

            from kvcache.config import EngineConfig
            from kvcache.server.serve import create
            torch.set_num_threads(options.threads)
            self.index = index
            self.app, self.loop = create(EngineConfig(**options.config), options.served_model_name, options.api_key)
            self.port = free_port()
            self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                        log_level="warning"))
            self.thread = threading.Thread(target=self.server.run, name="kvcache-replica-http", daemon=True)
            self.thread.start()
            while not self.server.started:
                if not self.thread.is_alive():
                    raise RuntimeError(f"replica {index}'s HTTP server did not start")
                time.sleep(0.02)

        def address(self) -> dict:
            return {"url": f"http://127.0.0.1:{self.port}", "pid": os.getpid()}

        def load(self) -> dict:
            info = self.loop.engine.kv_cache_info()
            return {"kv_usage": info["usage"], "prefix_cache_hits": info["prefix_cache_hits"],
                    "prefix_cache_queries": info["prefix_cache_queries"], "pid": os.getpid(),
                    "pool_tokens": info["num_tokens"]}

        def check_health(self) -> None:
            if not self.loop.alive or not self.thread.is_alive():
                raise RuntimeError(f"replica {self.index}'s engine loop is not running")

    web = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    @serve.ingress(web)
    class Router:
        def __init__(self, *replicas) -> None:
            self.handles = list(replicas)
            self.router = PrefixRouter(len(replicas), policy, balance)
            self.urls: list[str | None] = [None] * len(replicas)
            self.pids: list[int | None] = [None] * len(replicas)
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
            self.retries = 0
            self.poller: asyncio.Task | None = None

        def _seen(self, i: int, pid: int) -> None:
            """Replica i answered from process `pid`: another process than before has an empty cache."""
            if self.pids[i] is not None and pid != self.pids[i]:
                log.info("replica %d restarted (process %d, was %d): forgetting the %d prefix blocks sent to it", i,
                         pid, self.pids[i], self.router.forget(i))
                self.urls[i] = None
            self.pids[i] = pid

        async def _url(self, i: int, refresh: bool = False) -> str:
            if refresh or self.urls[i] is None:
                addr = await self.handles[i].address.remote()
                self._seen(i, addr["pid"])
                self.urls[i] = addr["url"]
            return self.urls[i]

        async def _poll(self) -> None:
            """Each replica's KV usage (a tie-breaker of the routing rule) and process, every POLL_S seconds."""
            while True:
                for i, h in enumerate(self.handles):
                    try:
                        info = await asyncio.wait_for(h.load.remote(), timeout=5 * POLL_S)
                    except Exception:  # noqa: BLE001 -- a replica restarting: its usage is unknown for now
                        continue
                    self.router.kv_usage[i] = info["kv_usage"]
                    self._seen(i, info["pid"])
                    self.router.set_pool(i, info["pool_tokens"])
                await asyncio.sleep(POLL_S)

        async def _proxy(self, request: Request, path: str):
            if self.poller is None:  # started on the serving event loop
                self.poller = asyncio.get_running_loop().create_task(self._poll())
            body = await request.body()
            try:
                parsed = json.loads(body) if body else {}
            except ValueError:
                parsed = {}
            keys = prefix_keys(parsed) if isinstance(parsed, dict) else []
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            tried: set[int] = set()
            while True:
                i = self.router.choose(keys, tried)
                self.router.inflight[i] += 1
                try:
                    url = await self._url(i, refresh=bool(tried))  # (a restarted replica is forgotten here)
                    self.router.routed(keys, i)
                    upstream = await self.client.send(self.client.build_request(
                        request.method, f"{url}{path}", content=body, headers=headers), stream=True)
                except (httpx.HTTPError, Exception) as e:  # noqa: BLE001 -- unreachable: try another replica
                    self.router.inflight[i] -= 1
                    self.router.down_until[i] = time.monotonic() + DOWN_S
                    self.router.forget(i)  # refused or timed out: restarting, with an empty cache
                    self.urls[i] = None
                    tried.add(i)
                    self.retries += 1
                    log.warning("replica %d unreachable (%s); retrying on another", i, e)
                    if len(tried) >= len(self.handles):
                        return JSONResponse({"error": {"message": "no replica could be reached", "type":
                                                       "server_error", "code": "no_replica"}}, status_code=503)
                    continue
                break

            sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

            async def done() -> None:
                await upstream.aclose()
                self.router.inflight[i] -= 1
            kept = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "retry-after")}
            kept["x-kvcache-replica"] = str(i)
            return StreamingResponse(relay(upstream.aiter_raw(), sse, i, done), status_code=upstream.status_code,
                                     headers=kept)

        @web.post("/v1/completions")
        async def completions(self, request: Request):
            return await self._proxy(request, "/v1/completions")

        @web.post("/v1/chat/completions")
        async def chat(self, request: Request):
            return await self._proxy(request, "/v1/chat/completions")

        @web.get("/v1/models")
        async def models(self, request: Request):
            return await self._proxy(request, "/v1/models")

        @web.get("/health")
        async def health(self):
            return Response(status_code=200)

        @web.get("/replicas")
        async def replicas(self):
            """Each replica's address, process and in-flight count, and the router's decisions."""
            out = []
            for i in range(len(self.handles)):
                try:
                    out.append({**(await self.handles[i].address.remote()), "inflight": self.router.inflight[i]})
                except Exception as e:  # noqa: BLE001
                    out.append({"error": str(e), "inflight": self.router.inflight[i]})
            return {"policy": self.router.policy, "replicas": out, "decisions": self.router.decisions,
                    "retries": self.retries, "held": self.router.held, "resets": self.router.resets}

        @web.get("/metrics")
        async def metrics(self):
            lines = []
            for i in range(len(self.handles)):
                try:
                    r = await self.client.get(f"{await self._url(i)}/metrics")
                    lines += relabel(r.text, i, keep_meta=not lines)
                except Exception:  # noqa: BLE001 -- a replica restarting is missing from this scrape
                    self.urls[i] = None
            d = self.router.decisions
            lines += ["# HELP kvcache:router_requests_total Requests routed, by decision.",
                      "# TYPE kvcache:router_requests_total counter"]
            lines += [f'kvcache:router_requests_total{{decision="{k}"}} {v}' for k, v in d.items()]
            lines += ["# TYPE kvcache:router_prefix_hit_routed_total counter",
                      f"kvcache:router_prefix_hit_routed_total {d['prefix']}",
                      "# TYPE kvcache:router_retries_total counter", f"kvcache:router_retries_total {self.retries}",
                      "# HELP kvcache:router_replica_resets_total Times a replica's routing entries were dropped "
                      "(restarted or unreachable).", "# TYPE kvcache:router_replica_resets_total counter",
                      f"kvcache:router_replica_resets_total {self.router.resets}"]
            return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    replicas = [EngineReplica.options(name=f"replica-{i}").bind(i) for i in range(num_replicas)]
    return Router.options(name="router").bind(*replicas)


def serve_replicas(args, config) -> int:
    """`kvcache serve --replicas K`: start a local Ray cluster and Ray Serve, deploy, and serve until interrupted."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if config.tensor_parallel_size > 1:
        raise ValueError("--replicas with --tensor-parallel-size is not supported yet: run one or the other")
    import ray  # after the refusals: they need no Ray
    from ray import serve
    cores = usable_cores()
    from kvcache.server.serve import model_name
    options = ReplicaOptions(dataclasses.asdict(config), model_name(config.model, args.served_model_name),
                             args.api_key or None, max(1, cores // args.replicas))
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(args.replicas, options, args.routing, args.routing_balance), name="kvcache",
                  route_prefix="/")
        log.info("serving %d replicas behind %s routing on http://%s:%d (Ray Serve)", args.replicas, args.routing,
                 args.host, args.port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
