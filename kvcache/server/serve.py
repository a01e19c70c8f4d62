"""`kvcache serve`: load the model, start the engine (in a process of its own, or on a thread: the loop), serve the
API with uvicorn."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal

from kvcache.config import EngineConfig
from kvcache.plan.sizes import parse_bytes

log = logging.getLogger("kvcache.server")
ENGINE_DEAD_STATUS = 3  # `kvcache serve` exits with it when the engine died (2 is bad input, as for every command)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("served_model", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face directory or GGUF file (default: --model, else the SmolLM2-135M demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on, 1..65535 (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the file or "
                   "directory name)")
    p.add_argument("--api-key", default=os.environ.get("KVCACHE_API_KEY"),
                   help="require Authorization: Bearer KEY on every endpoint but /health and /metrics "
                        "(default: env KVCACHE_API_KEY)")
    p.add_argument("--max-waiting-requests", type=int, default=512,
                   help="beyond this many queued requests new ones get 503 with Retry-After (default: %(default)s)")
    p.add_argument("--max-request-body", default="4MiB",
                   help="largest request body accepted, bytes, e.g. 4MiB (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM or SIGINT: seconds the requests in flight get to finish before they are aborted; "
                        "new ones get 503 meanwhile, and a second signal exits at once (default: %(default)s)")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between throughput log lines (default: %(default)s)")
    p.add_argument("--no-kv-page", action="store_true", help="do not serve the live KV cache page (/kv)")
    p.add_argument("--kv-page-show-text", action="store_true",
                   help="show each request's prompt text on the KV page (prompts are user data: off by default)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own, behind ZMQ: this process parses HTTP, tokenizes "
                        "and streams while the engine schedules and steps, each with its own GIL; "
                        "--no-engine-process runs it on a thread of this process (default: on; with --replicas each "
                        "replica runs its engine in-process)")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas on Ray Serve behind one ingress (a local Ray cluster is started; needs "
                        "pip install 'ray[serve]') (default: %(default)s, no Ray)")
    p.add_argument("--routing", default="kv-aware", choices=["kv-aware", "round-robin"],
                   help="with --replicas: send a request to the replica holding its longest prefix (balanced against "
                        "requests in flight), or round-robin (default: %(default)s)")
    p.add_argument("--routing-balance", type=float, default=4,
                   help="kv-aware: requests in flight a replica holding a request's prefix may have above the least "
                        "loaded one and still get it (SGLang's --balance-abs-threshold; 0: spread by load) "
                        "(default: %(default)s)")


def model_name(path: str | None, given: str | None) -> str:
    if given:
        return given
    if path is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(path)).removesuffix(".gguf")


def create(config: EngineConfig, served_model_name: str | None = None, api_key: str | None = None,
           max_waiting_requests: int = 512, max_body_bytes: int = 4 * 2**20, log_interval_s: float = 10.0,
           kv_page_on: bool = True, kv_page_show_text: bool = False, engine_process: bool = False):
    """Build the engine, its loop (started) and the app; returns (app, loop). With `engine_process` the engine
    runs in a process of its own and the loop is its EngineClient (server/engine_client.py)."""
    from kvcache.server.app import build_app

    if max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {max_waiting_requests}")
    name = model_name(config.model, served_model_name)
    if engine_process:
        from kvcache.server.engine_client import EngineClient
        loop = EngineClient(config, name, log_interval_s)
        metrics = loop.metrics
    else:
        from kvcache.server.engine_loop import EngineLoop, build_engine
        from kvcache.server.metrics import ServerMetrics
        engine = build_engine(config)
        metrics = ServerMetrics(engine, name)
        loop = EngineLoop(engine, metrics, log_interval_s)
    loop.start()
    return build_app(loop, name, metrics, api_key, max_waiting_requests, max_body_bytes, kv_page_on,
                     kv_page_show_text), loop


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first of the server's own arguments that is out of range (before any model loads)."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not args.shutdown_timeout >= 0:  # NaN too
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if getattr(args, "engine_process", None) and args.replicas != 1:
        raise ValueError("--engine-process runs one engine beside this process; with --replicas each replica runs "
                         "its own engine in-process (drop one of the two)")


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    import uvicorn

    from kvcache.server.drain import DrainingServer

    if args.served_model:
        config.model = args.served_model
    check_args(args)
    with _stop_on_signal() as stopped:  # loading the weights, building the engine
        app, loop = create(config, args.served_model_name, args.api_key or None, args.max_waiting_requests,
                           parse_bytes(args.max_request_body), args.log_interval, not args.no_kv_page,
                           args.kv_page_show_text, args.engine_process is not False)
    if stopped:
        return 0
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the model", args.host)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"), loop,
                            args.shutdown_timeout)
    server.install_signals()
    return serve_until_dead(server, loop)


@contextlib.contextmanager
def _stop_on_signal():
    """While the server starts: SIGTERM or SIGINT ends the start-up with one log line (no traceback), and the
    block's value turns truthy. A loader thread left behind is a daemon: the process exits without it."""
    stopped: list[bool] = []

    def interrupt(sig, frame):
        raise KeyboardInterrupt(signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stopped
    except KeyboardInterrupt as e:
        log.info("%s while starting: stopped before serving", e.args[0] if e.args else "SIGINT")
        stopped.append(True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until_dead(server, loop) -> int:
    """Run the uvicorn `server` until it is stopped (0) or the engine dies (ENGINE_DEAD_STATUS): a dead engine
    shuts the server down, after its pending requests got their 503s, so that a supervisor (systemd,
    Kubernetes) restarts the process instead of leaving one that answers 503 for ever."""
    def shut_down() -> None:
        log.error("the engine has stopped; shutting the server down (exit status %d)", ENGINE_DEAD_STATUS)
        server.should_exit = True  # uvicorn polls it; pending requests have been answered already

    loop.on_dead = shut_down
    if loop.error is not None:  # died before the callback was set
        shut_down()
    try:
        server.run()
    finally:
        loop.stop()
        loop.engine.close()  # the offload writer's queue and the last KV events
    if loop.error is not None:
        return ENGINE_DEAD_STATUS
    log.info("engine stopped, offload tiers and KV events flushed; exiting (status 0)")
    return 0
