"""A live kvcache server on a loopback port, serving a tiny random-weight model, for the server tests."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
MODEL = "tiny"


@dataclass
class LiveServer:
    url: str
    app: object
    loop: object  # EngineLoop
    server: object  # uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.loop.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, run=None, **kwargs) -> LiveServer:
    """Build engine, loop and app, and run uvicorn in a thread until it accepts connections: `server.run()`,
    or `run(server, loop)` if given (as `kvcache serve` runs it)."""
    import uvicorn

    from kvcache.config import EngineConfig
    from kvcache.server.serve import create

    engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in EngineConfig.__dataclass_fields__}
    config = EngineConfig(model=model_dir, kv_cache_memory=engine_kwargs.pop("kv_cache_memory", "8MiB"),
                          max_model_len=engine_kwargs.pop("max_model_len", 512), **engine_kwargs)
    app, loop = create(config, served_model_name=MODEL, api_key=kwargs.pop("api_key", API_KEY), **kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run if run is None else lambda: run(server, loop), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", app, loop, server, thread)


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed by name and labels other than model_name."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
