"""The replicas' ingress (RouterIngress, which deployments.py serves on Ray Serve): each request proxied to the
replica PrefixRouter chooses, streaming included, retried on another while none of it was sent; each replica's
KV usage, process and KV events followed; /replicas and the merged /metrics.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvcache.router.kv_index import EngineKeys, EventSubscriber
from kvcache.server.errors import error_response, shutting_down
from kvcache.router.prefix_router import Key, PrefixRouter, prefix_keys

log = logging.getLogger("kvcache")
DOWN_S = 5.0  # a replica that could not be reached is skipped this long
POLL_S = 1.0  # how often the ingress reads each replica's KV usage and process id
FORWARDED = ("authorization", "content-type")  # request headers passed to a replica
RETURNED = ("content-type", "retry-after")  # response headers passed back to the client


class RouterIngress:
    """The ingress's state and work, for a Ray Serve deployment whose routes call it (deployments.py): `handles` are
    the replicas' deployment handles, in replica order."""

    def __init__(self, handles: list, policy: str, balance: float, model: str | None, block_size: int) -> None:
        self.handles = handles
        self.router = PrefixRouter(len(handles), policy, balance, block_size)
        self.urls: list[str | None] = [None] * len(handles)
        self.pids: list[int | None] = [None] * len(handles)
        self.endpoints: list[str | None] = [None] * len(handles)  # each replica's KV events, followed
        self.subscriber = EventSubscriber()
        self.engine_keys = _engine_keys(model, block_size) if policy == "kv-aware" else None
        self.tokenizing = ThreadPoolExecutor(1, "kvcache-router-keys")  # one: a tokenizer is not thread-safe
        self.key_kinds = {"engine": 0, "text": 0}  # requests keyed by the engine's hashes, or by prefix_keys
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.retries = 0
        self.draining = False  # kvcache serve --replicas is shutting down: new requests get 503
        self.poller: asyncio.Task | None = None

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
                keys = await asyncio.get_running_loop().run_in_executor(self.tokenizing, self.engine_keys, body, chat)
                self.key_kinds["engine"] += 1
                return keys
            except Exception as e:  # noqa: BLE001 -- a body the server will refuse, or one hashed otherwise
                log.debug("routing a request by its text prefix: %s", e)
        self.key_kinds["text"] += 1
        return prefix_keys(body)

    async def _url(self, i: int, refresh: bool = False) -> str:
        """Replica i's address, asked of its handle the first time or when `refresh` (it may have restarted)."""
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
                except Exception:  # noqa: BLE001, S112 -- a replica restarting: its usage is unknown for now
                    continue
                self.router.kv_usage[i] = info["kv_usage"]
                self._seen(i, info)
                self.router.set_pool(i, info["pool_tokens"])
            self._drain()
            await asyncio.sleep(POLL_S)

    def _start_polling(self) -> None:
        if self.poller is None:  # started on the serving event loop
            self.poller = asyncio.get_running_loop().create_task(self._poll())

    async def proxy(self, request: Request, path: str):
        """`request` passed to the replica chosen for it (another if that one cannot be reached), its response
        streamed back with the replica's number in `x-kvcache-replica`; 503 when no replica could be reached."""
        refused = self.refusal()
        if refused is not None:
            return refused
        self._start_polling()
        body = await request.body()
        keys = await self._request_keys(body, path)
        self._drain()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        sent = await self._send(request.method, path, body, headers, keys)
        if sent is None:
            return JSONResponse({"error": {"message": "no replica could be reached", "type": "server_error",
                                           "code": "no_replica"}}, status_code=503)
        i, upstream = sent
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

        async def done() -> None:
            await upstream.aclose()
            self.router.inflight[i] -= 1
        kept = {k: v for k, v in upstream.headers.items() if k.lower() in RETURNED}
        kept["x-kvcache-replica"] = str(i)
        return StreamingResponse(relay(upstream.aiter_raw(), sse, i, done), status_code=upstream.status_code,
                                 headers=kept)

    def begin_drain(self) -> None:
        """Refuse new requests from now on (`kvcache serve --replicas` on SIGTERM or SIGINT, through the deployment's
        handle); the ones under way go on."""
        self.draining = True

    def refusal(self) -> Response | None:
        """503 with Retry-After in OpenAI's error shape while the server drains, else None."""
        if not self.draining:
            return None
        return error_response(shutting_down("the server is shutting down and takes no new requests; retry on "
                                            "another instance"))

    async def _request_keys(self, body: bytes, path: str) -> list[Key]:
        """The prefix keys a request is routed by: none for round-robin, /v1/models or a body that is no JSON object."""
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        if isinstance(parsed, dict) and self.router.policy == "kv-aware" and path != "/v1/models":
            return await self._keys(parsed, chat=path == "/v1/chat/completions")
        return []

    async def _send(self, method: str, path: str, body: bytes, headers: dict,
                    keys: list[Key]) -> tuple[int, httpx.Response] | None:
        """The request sent to a replica, counted in flight there: (its number, its response, still streaming);
        None when every replica was tried and none could be reached."""
        tried: set[int] = set()
        while len(tried) < len(self.handles):
            i = self.router.choose(keys, tried)
            self.router.inflight[i] += 1
            try:
                url = await self._url(i, refresh=bool(tried))  # (a restarted replica is forgotten here)
                self.router.routed(keys, i)
                return i, await self.client.send(self.client.build_request(
                    method, f"{url}{path}", content=body, headers=headers), stream=True)
            except Exception as e:  # noqa: BLE001 -- unreachable: try another replica
                self._unreachable(i, e)
                tried.add(i)
        return None

    def _unreachable(self, i: int, error: Exception) -> None:
        """Replica i refused or timed out: it is restarting, with an empty cache; skip it for DOWN_S seconds."""
        self.router.inflight[i] -= 1
        self.router.down_until[i] = time.monotonic() + DOWN_S
        self.router.forget(i)
        self.urls[i] = None
        self.retries += 1
        log.warning("replica %d unreachable (%s); retrying on another", i, error)

    async def replica_list(self) -> dict:
        """Each replica's address, process and in-flight count (an error for one restarting: its handle waits
        for the new process), and the router's decisions and records."""
        self._start_polling()
        out = [await self._replica_info(i) for i in range(len(self.handles))]
        r = self.router
        return {"policy": r.policy, "replicas": out, "decisions": r.decisions, "retries": self.retries,
                "held": r.held, "stored": [len(s) for s in r.stored], "resets": r.resets, "event_gaps": r.gaps,
                "event_replays": self.subscriber.replays, "events_replayed": self.subscriber.replayed,
                "keys": self.key_kinds}

    async def _replica_info(self, i: int) -> dict:
        """Replica i's address and process, or why it did not answer; and its requests in flight."""
        try:
            addr = await asyncio.wait_for(self.handles[i].address.remote(), timeout=5 * POLL_S)
            # its KV events are followed from here on (or from the first request); what the replica
            # published before the subscription connected comes back from its replay endpoint
            self._seen(i, addr)
            return {**addr, "inflight": self.router.inflight[i]}
        except TimeoutError:
            return {"error": f"no answer within {5 * POLL_S:g} s (restarting?)", "inflight": self.router.inflight[i]}
        except Exception as e:  # noqa: BLE001
            return {"error": str(e), "inflight": self.router.inflight[i]}

    async def metrics(self) -> Response:
        """Every replica's metrics with a `replica` label (one restarting is missing), then the router's own."""
        lines = []
        for i in range(len(self.handles)):
            try:
                r = await self.client.get(f"{await self._url(i)}/metrics")
                lines += relabel(r.text, i, keep_meta=not lines)
            except Exception:  # noqa: BLE001 -- a replica restarting is missing from this scrape
                self.urls[i] = None
        lines += self._router_metrics()
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def _router_metrics(self) -> list[str]:
        """The router's counters in Prometheus text."""
        d = self.router.decisions
        lines = ["# HELP kvcache:router_requests_total Requests routed, by decision.",
                 "# TYPE kvcache:router_requests_total counter"]
        lines += [f'kvcache:router_requests_total{{decision="{k}"}} {v}' for k, v in d.items()]
        lines += ["# TYPE kvcache:router_prefix_hit_routed_total counter",
                  f"kvcache:router_prefix_hit_routed_total {d['prefix']}",
                  "# TYPE kvcache:router_retries_total counter", f"kvcache:router_retries_total {self.retries}",
                  ("# HELP kvcache:router_replica_resets_total Times a replica's routing entries were dropped "
                   "(restarted or unreachable)."), "# TYPE kvcache:router_replica_resets_total counter",
                  f"kvcache:router_replica_resets_total {self.router.resets}",
                  ("# HELP kvcache:router_prompt_keys_total Requests keyed by the engine's block hashes, or by "
                   "their text (the tokenizer could not hash them)."),
                  "# TYPE kvcache:router_prompt_keys_total counter"]
        lines += [f'kvcache:router_prompt_keys_total{{kind="{k}"}} {v}' for k, v in self.key_kinds.items()]
        lines += ["# HELP kvcache:router_kv_event_gaps_total KV event batches lost (that replica's record rebuilt).",
                  "# TYPE kvcache:router_kv_event_gaps_total counter",
                  f"kvcache:router_kv_event_gaps_total {self.router.gaps}",
                  ("# HELP kvcache:router_kv_event_batches_replayed_total KV event batches the router missed "
                   "and got back from a replica's replay endpoint."),
                  "# TYPE kvcache:router_kv_event_batches_replayed_total counter",
                  f"kvcache:router_kv_event_batches_replayed_total {self.subscriber.replayed}"]
        return lines


def _engine_keys(model: str | None, block_size: int) -> EngineKeys | None:
    """The engine's block hashes of requests, or None where the model's tokenizer cannot be loaded."""
    try:
        return EngineKeys(model, block_size)
    except Exception as e:  # noqa: BLE001 -- any tokenizer failure: route every request by prefix_keys
        log.warning("the router cannot load the model's tokenizer (%s); it routes by text prefixes", e)
        return None


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
