"""The Ray Serve application of `kvcache serve --replicas K`: K EngineReplica deployments (`replica-0` ...), each a
whole `kvcache serve` app on a loopback port of its actor's, and the `router` ingress (ingress.py) bound to them."""
# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request) as objects.
import asyncio
import dataclasses
import os
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvcache.parallel.host import free_port
from kvcache.router.ingress import RouterIngress


@dataclasses.dataclass
class ReplicaOptions:
    config: dict  # EngineConfig fields
    served_model_name: str | None
    api_key: str | None
    threads: int
    events_dir: str  # where the replicas' KV event endpoints (ipc:// sockets) live; the caller removes it


class EngineReplica:
    """One `kvcache serve` app on a loopback port of this actor's (a Ray Serve deployment: build_app)."""

    def __init__(self, index: int, options: ReplicaOptions) -> None:
        import torch
        import uvicorn

        from kvcache.config import EngineConfig
        from kvcache.server.serve import create
        torch.set_num_threads(options.threads)
        self.index = index
        self.draining = False  # drain() has begun: the health check passes while the replica winds down
        # the router follows this replica's KV events here (a process's own path: a restart gets a new one)
        self.events = f"ipc://{options.events_dir}/replica-{index}-{os.getpid()}.ipc"
        self.replay = f"ipc://{options.events_dir}/replica-{index}-{os.getpid()}-replay.ipc"
        config = EngineConfig(**{**options.config, "kv_events_endpoint": self.events,
                                 "kv_events_replay_endpoint": self.replay})
        self.app, self.loop = create(config, options.served_model_name, options.api_key)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
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

    async def drain(self, timeout_s: float) -> int:
        """Drain this replica as `kvcache serve` drains on a signal (server/drain.py), then stop its HTTP server and
        close its engine (the offload writer, the last KV events); returns the number of requests aborted."""
        from kvcache.server.drain import FLUSH_S, drain_engine
        self.draining = True
        aborted = await drain_engine(self.loop, timeout_s, f"replica {self.index}")
        self.server.should_exit = True
        await asyncio.to_thread(self.thread.join, FLUSH_S + 1)
        await asyncio.to_thread(self.loop.stop)  # blocking joins and flushes: off the replica's event loop
        await asyncio.to_thread(self.loop.engine.close)
        return aborted

    def check_health(self) -> None:
        """Ray Serve's health check: it restarts a replica whose engine loop or HTTP server has stopped (but not
        while it drains)."""
        if self.draining:
            return
        if not self.loop.alive or not self.thread.is_alive():
            raise RuntimeError(f"replica {self.index}'s engine loop is not running")


def build_app(num_replicas: int, options: ReplicaOptions, policy: str, balance: int):
    """The Ray Serve application: K replica deployments and the router ingress bound to them."""
    from ray import serve

    replica = serve.deployment(EngineReplica, ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": {
        "OMP_NUM_THREADS": str(options.threads)}}}, health_check_period_s=2, health_check_timeout_s=30)
    replicas = [replica.options(name=f"replica-{i}").bind(i, options) for i in range(num_replicas)]
    return _router(options, policy, balance).options(name="router").bind(*replicas)


def _router(options: ReplicaOptions, policy: str, balance: int):
    """The ingress deployment: RouterIngress behind its own FastAPI app (one per application: Ray Serve's ingress
    rewrites the app's routes)."""
    from ray import serve

    web = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    @serve.ingress(web)
    class Router(RouterIngress):
        def __init__(self, *replicas) -> None:
            super().__init__(list(replicas), policy, balance, options.config["model"], options.config["block_size"])

        @web.post("/v1/completions")
        async def completions(self, request: Request):
            return await self.proxy(request, "/v1/completions")

        @web.post("/v1/chat/completions")
        async def chat(self, request: Request):
            return await self.proxy(request, "/v1/chat/completions")

        @web.get("/v1/models")
        async def models(self, request: Request):
            return await self.proxy(request, "/v1/models")

        @web.get("/health")
        async def health(self):
            return self.refusal() or Response(status_code=200)

        @web.get("/replicas")
        async def replicas(self):
            return await self.replica_list()

        @web.get("/metrics")
        async def prometheus(self):
            return await self.metrics()

    return Router
