"""`kvcache serve --replicas K`: K engine replicas on Ray Serve behind one OpenAI-compatible ingress with a KV-aware
router.

- Each replica is a Ray Serve deployment of its own (`replica-0` ... `replica-{K-1}`, one Ray actor each) running the
  whole `kvcache serve` app (engine, engine loop, OpenAI routes, metrics) on a loopback port of its own; Ray Serve
  health-checks it (its engine loop must be alive) and restarts it when it dies.
- The ingress (deployment `router`, Ray Serve's HTTP proxy on --host/--port) proxies each request to one replica,
  streaming included. `--routing kv-aware` (the default) sends a request to the replica holding its longest prefix
  (half its blocks at least) unless that one has more than `--routing-balance` requests in flight above the least
  loaded, and a new prefix to the replica holding the fewest prefix blocks (PrefixRouter: SGLang's cache-aware
  rule). What a replica holds comes from its KV events (each replica's engine publishes them on an ipc:// endpoint
  of its own, which the ingress follows, asking the replica's replay endpoint for what it missed: kv_index.py),
  overlaid with what was sent to it and not yet confirmed; a
  request is keyed by the engine's own block hashes (the server's tokenizer and chat template, the request's
  cache_salt), or, when it cannot be hashed so, by an approximate chain of text hashes (prefix_keys) recorded as
  sent. `round-robin` is the baseline. A replica with the shared Redis tier configured (--kv-remote) still loads a
  prefix it misses from the tier, so a misrouted request costs a load, not a prefill.
- GET /metrics merges every replica's metrics with a `replica` label, plus the router's own counters
  (`kvcache:router_requests_total{decision}`, `kvcache:router_prefix_hit_routed_total`,
  `kvcache:router_retries_total`, `kvcache:router_replica_resets_total`, `kvcache:router_prompt_keys_total{kind}`,
  `kvcache:router_kv_event_gaps_total`). A replica that cannot be reached before a
  request starts streaming is skipped for a few seconds and the request retried on another (a request already
  streaming fails with the error).
- The ingress reads every replica's KV usage, process id and KV events endpoint each POLL_S seconds. A replica that
  could not be reached, or that comes back as another process (Ray Serve restarted it), starts with an empty cache:
  the router forgets everything it held (PrefixRouter.forget), so that those prefixes are not sent to it as hits,
  and follows the new process's events.
"""

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvcache.parallel.host import free_port, usable_cores
from kvcache.router.kv_index import EngineKeys, EventSubscriber
from kvcache.memory.kv_events import MEDIUM_POOL

log = logging.getLogger("kvcache")
Key = bytes | int  # a prefix key: the engine's block hash (EngineKeys), or prefix_keys' approximation
TOKEN_BLOCK, CHAR_BLOCK = 16, 64
INDEX_ENTRIES = 200_000  # chain hashes the router remembers (least recently routed forgotten first)
DOWN_S = 5.0  # a replica that could not be reached is skipped this long
POLL_S = 1.0  # how often the ingress reads each replica's KV usage and process id


def prefix_keys(body: dict) -> list[bytes]:
    """An approximate chain of block hashes of a request's prompt, for requests EngineKeys cannot hash as the engine
    does: key i covers the first i + 1 blocks (16 token ids, or 64 characters of text or of the chat messages'
    JSON)."""
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
    """Which replica a request goes to (no I/O: the ingress keeps the in-flight counts and KV usage it reads, and
    feeds each replica's KV events to `apply`; one thread calls every method).

    KV-aware, SGLang's cache-aware rule (its router's and vllm-router's default) at this scale:
    - a request whose longest prefix some replica holds (at least CACHE_SHARE of its blocks) goes to that replica,
      unless it has more than `balance` requests in flight above the least-loaded one: then to the least loaded;
    - any other request (a new prefix) goes to the replica holding the fewest prefix blocks (its "smallest tree"),
      so that distinct prefixes spread evenly over the replicas' caches instead of piling where load last dipped;
    - ties go to the least loaded, then the least KV usage.
    A prefix every replica holds (a common system prompt) matches everywhere alike, so those requests spread by load.

    What a replica holds is the union of two records, disjoint per replica:
    - `stored`: the block hashes its pool ("GPU" medium; the offload tiers' media are not counted) holds, from its
      KV events (BlockStored adds, BlockRemoved removes, AllBlocksCleared clears). A batch whose sequence number
      does not follow the last one (batches were lost, and the replay could not give them back) clears it, to be
      rebuilt from that batch on.
    - `recent`: keys sent to it that its events have not confirmed yet (a prefill takes time), or that can never be
      (the text keys of `prefix_keys`, for requests the ingress cannot hash as the engine does). An event for a key
      settles it: BlockStored moves it to `stored`, BlockRemoved drops it. What stays is bounded by the replica's
      pool (`set_pool`; SGLang's router bounds its trees alike): past it the least recently sent keys are dropped, a
      chain's last blocks first, as the replica's own LRU gives them back. A gap leaves it as it is.
    `forget` (the replica restarted, or could not be reached) clears both."""

    CACHE_SHARE = 0.5  # SGLang's --cache-threshold default

    def __init__(self, num_replicas: int, policy: str = "kv-aware", balance: float = 4,
                 block_size: int = TOKEN_BLOCK) -> None:
        check_routing(policy, balance)
        self.n, self.policy, self.balance, self.block_size = num_replicas, policy, balance, block_size
        self.index: OrderedDict[Key, int] = OrderedDict()  # key sent -> bit mask of the replicas `recent` holds it in
        self.recent: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(num_replicas)]  # LRU per replica
        self.stored: list[set[int]] = [set() for _ in range(num_replicas)]  # per replica, from its KV events
        self.next_seq: list[int | None] = [None] * num_replicas  # the sequence number each one's next batch carries
        self.capacity: list[int | None] = [None] * num_replicas  # blocks each replica's pool holds (None: unknown)
        self.inflight = [0] * num_replicas
        self.kv_usage = [0.0] * num_replicas
        self.down_until = [0.0] * num_replicas
        self.next = 0
        self.decisions = {"prefix": 0, "least_loaded": 0, "smallest_cache": 0, "round_robin": 0}
        self.resets = 0  # forget() calls that cleared something
        self.gaps = 0  # event batches that did not follow the last one

    @property
    def held(self) -> list[int]:
        """Prefix blocks recorded per replica (stored and sent, not yet confirmed)."""
        return [len(s) + len(r) for s, r in zip(self.stored, self.recent)]

    def up(self) -> list[int]:
        now = time.monotonic()
        live = [i for i in range(self.n) if self.down_until[i] <= now]
        return live or list(range(self.n))

    def holders(self, key: Key) -> int:
        """Bit mask of the replicas holding `key`, in either record."""
        mask = self.index.get(key, 0)
        for r, stored in enumerate(self.stored):
            if key in stored:
                mask |= 1 << r
        return mask

    def matched(self, keys: list[Key]) -> list[int]:
        """Per replica, how many leading blocks of `keys` it holds."""
        depth = [0] * self.n
        open_ = (1 << self.n) - 1  # replicas still matching
        for k in keys:
            open_ &= self.holders(k)
            if not open_:
                break
            for r in range(self.n):
                if open_ >> r & 1:
                    depth[r] += 1
        return depth

    def choose(self, keys: list[Key], exclude: set[int] = frozenset()) -> int:
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

    def routed(self, keys: list[Key], replica: int) -> None:
        """Remember that `replica` was sent these prefixes (the most recently used of its blocks, the chain's first
        ones most of all), those its events have not shown it holding, forgetting what its pool can no longer hold."""
        bit, recent, stored = 1 << replica, self.recent[replica], self.stored[replica]
        for k in reversed(keys):
            if k in stored:
                continue
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

    def apply(self, replica: int, seq: int, events: list) -> None:
        """One batch of `replica`'s KV events, numbered `seq`, as kv_index.decode_batch gives them."""
        if self.next_seq[replica] not in (None, seq):
            log.info("replica %d's KV events jumped from batch %d to %d: rebuilding its %d stored blocks from here",
                     replica, self.next_seq[replica], seq, len(self.stored[replica]))
            self.stored[replica].clear()
            self.gaps += 1
        self.next_seq[replica] = seq + 1
        stored = self.stored[replica]
        for event in events:
            if event[0] == "AllBlocksCleared":
                stored.clear()
            elif event[-1] == MEDIUM_POOL:  # BlockStored or BlockRemoved, of the pool
                (stored.update if event[0] == "BlockStored" else stored.difference_update)(event[1])
                for h in event[1]:
                    self._unsend(replica, h)

    def set_pool(self, replica: int, tokens: int) -> None:
        """`replica`'s KV pool holds `tokens` tokens: its record of keys sent keeps at most that many blocks' worth
        (a text key covers CHAR_BLOCK characters: about TOKEN_BLOCK tokens of English text)."""
        self.capacity[replica] = max(1, tokens // self.block_size)
        self._trim(replica)

    def _trim(self, replica: int) -> None:
        cap, recent = self.capacity[replica], self.recent[replica]
        while cap is not None and len(recent) > cap:
            k, _ = recent.popitem(last=False)
            self._unmask(replica, k)

    def _unsend(self, replica: int, key: Key) -> None:
        """Drop `key` from `replica`'s record of keys sent, if it is there."""
        if key in self.recent[replica]:
            del self.recent[replica][key]
            self._unmask(replica, key)

    def _unmask(self, replica: int, key: Key) -> None:
        mask = self.index[key] & ~(1 << replica)
        if mask:
            self.index[key] = mask
        else:
            del self.index[key]

    def forget(self, replica: int) -> int:
        """Drop everything recorded of `replica` (it lost its cache: restarted, or unreachable and so restarting),
        and expect its events afresh; returns how many blocks it held. Keys no other replica was sent leave the
        index."""
        held = self.held[replica]
        for k in self.recent[replica]:
            self._unmask(replica, k)
        self.recent[replica].clear()
        self.stored[replica].clear()
        self.next_seq[replica] = None
        if held:
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
    events_dir: str  # where the replicas' KV event endpoints (ipc:// sockets) live; the caller removes it


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
            # the router follows this replica's KV events here (a process's own path: a restart gets a new one)
            self.events = f"ipc://{options.events_dir}/replica-{index}-{os.getpid()}.ipc"
            self.replay = f"ipc://{options.events_dir}/replica-{index}-{os.getpid()}-replay.ipc"
            config = EngineConfig(**{**options.config, "kv_events_endpoint": self.events,
                                     "kv_events_replay_endpoint": self.replay})
            self.app, self.loop = create(config, options.served_model_name, options.api_key)
            self.port = free_port()
            self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                        log_level="warning"))
            self.thread = threading.Thread(target=self.server.run, name="kvcache-replica-http", daemon=True)
            self.thread.start()
            while not self.server.started:
                if not self.thread.is_alive():
                    raise RuntimeError(f"replica {index}'s HTTP server did not start")
                time.sleep(0.02)

        def _process(self) -> dict:
            """Which process this is, and where its KV events (and their replay) are: what the router's _seen reads."""
            return {"pid": os.getpid(), "kv_events": self.events, "kv_events_replay": self.replay}

        def address(self) -> dict:
            return {"url": f"http://127.0.0.1:{self.port}", **self._process()}

        def load(self) -> dict:
            info = self.loop.engine.kv_cache_info()
            return {"kv_usage": info["usage"], "prefix_cache_hits": info["prefix_cache_hits"],
                    "prefix_cache_queries": info["prefix_cache_queries"], "pool_tokens": info["num_tokens"],
                    **self._process()}

        def check_health(self) -> None:
            if not self.loop.alive or not self.thread.is_alive():
                raise RuntimeError(f"replica {self.index}'s engine loop is not running")

    web = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    @serve.ingress(web)
    class Router:
        def __init__(self, *replicas) -> None:
            self.handles = list(replicas)
            self.router = PrefixRouter(len(replicas), policy, balance, options.config["block_size"])
            self.urls: list[str | None] = [None] * len(replicas)
            self.pids: list[int | None] = [None] * len(replicas)
            self.endpoints: list[str | None] = [None] * len(replicas)  # each replica's KV events, followed
            self.subscriber = EventSubscriber()
            self.engine_keys = self._engine_keys() if policy == "kv-aware" else None
            self.tokenizing = ThreadPoolExecutor(1, "kvcache-router-keys")  # one: a tokenizer is not thread-safe
            self.key_kinds = {"engine": 0, "text": 0}  # requests keyed by the engine's hashes, or by prefix_keys
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
            self.retries = 0
            self.poller: asyncio.Task | None = None

        @staticmethod
        def _engine_keys() -> EngineKeys | None:
            try:
                return EngineKeys(options.config["model"], options.config["block_size"])
            except Exception as e:  # noqa: BLE001 -- any tokenizer failure: route every request by prefix_keys
                log.warning("the router cannot load the model's tokenizer (%s); it routes by text prefixes", e)
                return None

        def _seen(self, i: int, info: dict) -> None:
            """Replica i answered from process info["pid"]: another process than before has an empty cache. Its KV
            events are followed at info["kv_events"] (batches from an endpoint no longer followed are dropped)."""
            pid = info["pid"]
            if self.pids[i] is not None and pid != self.pids[i]:
                log.info("replica %d restarted (process %d, was %d): forgetting the %d prefix blocks it held", i,
                         pid, self.pids[i], self.router.forget(i))
                self.urls[i] = None
            self.pids[i] = pid
            if info["kv_events"] != self.endpoints[i]:
                self.endpoints[i] = info["kv_events"]
                self.subscriber.follow(i, info["kv_events"], info["kv_events_replay"])

        def _drain(self) -> None:
            """Apply the KV event batches received since the last call."""
            while not self.subscriber.batches.empty():
                i, endpoint, seq, events = self.subscriber.batches.get()
                if endpoint == self.endpoints[i]:
                    self.router.apply(i, seq, events)

        async def _keys(self, body: dict, chat: bool) -> list[Key]:
            """The request's prefix keys: the engine's block hashes if they can be computed, else prefix_keys'."""
            if self.engine_keys is not None:
                try:
                    keys = await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.engine_keys, body,
                                                                           chat)
                    self.key_kinds["engine"] += 1
                    return keys
                except Exception as e:  # noqa: BLE001 -- a body the server will refuse, or one hashed otherwise
                    log.debug("routing a request by its text prefix: %s", e)
            self.key_kinds["text"] += 1
            return prefix_keys(body)

        async def _url(self, i: int, refresh: bool = False) -> str:
            if refresh or self.urls[i] is None:
                addr = await self.handles[i].address.remote()
                self._seen(i, addr)
                self.urls[i] = addr["url"]
            return self.urls[i]

        async def _poll(self) -> None:
            """Each replica's KV usage (a tie-breaker of the routing rule), process and KV events endpoint, every
            POLL_S seconds; and the events received meanwhile, applied."""
            while True:
                for i, h in enumerate(self.handles):
                    try:
                        info = await asyncio.wait_for(h.load.remote(), timeout=5 * POLL_S)
                    except Exception:  # noqa: BLE001 -- a replica restarting: its usage is unknown for now
                        continue
                    self.router.kv_usage[i] = info["kv_usage"]
                    self._seen(i, info)
                    self.router.set_pool(i, info["pool_tokens"])
                self._drain()
                await asyncio.sleep(POLL_S)

        def _start_polling(self) -> None:
            if self.poller is None:  # started on the serving event loop
                self.poller = asyncio.get_running_loop().create_task(self._poll())

        async def _proxy(self, request: Request, path: str):
            self._start_polling()
            body = await request.body()
            try:
                parsed = json.loads(body) if body else {}
            except ValueError:
                parsed = {}
            keys = []
            if isinstance(parsed, dict) and self.router.policy == "kv-aware" and path != "/v1/models":
                keys = await self._keys(parsed, chat=path == "/v1/chat/completions")
            self._drain()
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
            """Each replica's address, process and in-flight count (an error for one restarting: its handle waits
            for the new process), and the router's decisions and records."""
            self._start_polling()
            out = []
            for i in range(len(self.handles)):
                try:
                    addr = await asyncio.wait_for(self.handles[i].address.remote(), timeout=5 * POLL_S)
                    # its KV events are followed from here on (or from the first request); what the replica
                    # published before the subscription connected comes back from its replay endpoint
                    self._seen(i, addr)
                    out.append({**addr, "inflight": self.router.inflight[i]})
                except asyncio.TimeoutError:
                    out.append({"error": f"no answer within {5 * POLL_S:g} s (restarting?)",
                                "inflight": self.router.inflight[i]})
                except Exception as e:  # noqa: BLE001
                    out.append({"error": str(e), "inflight": self.router.inflight[i]})
            r = self.router
            return {"policy": r.policy, "replicas": out, "decisions": r.decisions, "retries": self.retries,
                    "held": r.held, "stored": [len(s) for s in r.stored], "resets": r.resets, "event_gaps": r.gaps,
                    "event_replays": self.subscriber.replays, "events_replayed": self.subscriber.replayed,
                    "keys": self.key_kinds}

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
                      f"kvcache:router_replica_resets_total {self.router.resets}",
                      "# HELP kvcache:router_prompt_keys_total Requests keyed by the engine's block hashes, or by "
                      "their text (the tokenizer could not hash them).", "# TYPE kvcache:router_prompt_keys_total counter"]
            lines += [f'kvcache:router_prompt_keys_total{{kind="{k}"}} {v}' for k, v in self.key_kinds.items()]
            lines += ["# HELP kvcache:router_kv_event_gaps_total KV event batches lost (that replica's record rebuilt).",
                      "# TYPE kvcache:router_kv_event_gaps_total counter",
                      f"kvcache:router_kv_event_gaps_total {self.router.gaps}",
                      "# HELP kvcache:router_kv_event_batches_replayed_total KV event batches the router missed "
                      "and got back from a replica's replay endpoint.",
                      "# TYPE kvcache:router_kv_event_batches_replayed_total counter",
                      f"kvcache:router_kv_event_batches_replayed_total {self.subscriber.replayed}"]
            return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    replicas = [EngineReplica.options(name=f"replica-{i}").bind(i) for i in range(num_replicas)]
    return Router.options(name="router").bind(*replicas)


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (systemd's, Kubernetes') ends `kvcache serve --replicas` as Ctrl-C does: Ray Serve and the Ray cluster
    it started are shut down and the KV event endpoints' directory is removed, instead of being left behind."""
    raise KeyboardInterrupt


def check_routing(policy: str, balance: float) -> None:
    """ValueError unless the router can take this policy and balance."""
    if policy not in ("kv-aware", "round-robin"):
        raise ValueError(f"routing must be kv-aware or round-robin, got {policy!r}")
    if not balance >= 0:  # NaN too
        raise ValueError(f"routing balance must be >= 0, got {balance}")


def serve_replicas(args, config) -> int:
    """`kvcache serve --replicas K`: start a local Ray cluster and Ray Serve, deploy, and serve until interrupted."""
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if config.tensor_parallel_size > 1:
        raise ValueError("--replicas with --tensor-parallel-size is not supported yet: run one or the other")
    if config.kv_events_endpoint is not None:
        raise ValueError(f"--kv-events-endpoint {config.kv_events_endpoint} with --replicas {args.replicas}: each "
                         "replica publishes its KV events on an endpoint of its own, which the router follows "
                         "(GET /replicas lists them)")
    check_routing(args.routing, args.routing_balance)  # before Ray: inside a deployment its reason would be lost
    import ray  # after the refusals: they need no Ray
    from ray import serve
    cores = usable_cores()
    from kvcache.server.serve import model_name
    events_dir = tempfile.TemporaryDirectory(prefix="kvcache-events-")
    options = ReplicaOptions(dataclasses.asdict(config), model_name(config.model, args.served_model_name),
                             args.api_key or None, max(1, cores // args.replicas), events_dir.name)
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a supervisor's stop: the same way out as Ctrl-C's
    log.info("the replicas' KV event endpoints live in %s", events_dir.name)
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
        events_dir.cleanup()
