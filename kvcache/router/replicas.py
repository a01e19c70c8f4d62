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

The parts: prefix_router.py (PrefixRouter, prefix_keys), ingress.py (the proxy, /replicas, /metrics), kv_index.py (the
engine's block hashes, the KV events), deployments.py (the Ray Serve application); this module starts it all.
"""

import dataclasses
import logging
import signal
import tempfile
import time

from kvcache.parallel.host import usable_cores
from kvcache.router.deployments import ReplicaOptions, build_app
from kvcache.router.prefix_router import check_routing
from kvcache.server.drain import FLUSH_S, SECOND_SIGNAL_STATUS

log = logging.getLogger("kvcache")


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (systemd's, Kubernetes') ends `kvcache serve --replicas` as Ctrl-C does: Ray Serve and the Ray cluster
    it started are shut down and the KV event endpoints' directory is removed, instead of being left behind."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


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
    why, deploying = None, False
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deploying = True
        serve.run(build_app(args.replicas, options, args.routing, args.routing_balance), name="kvcache",
                  route_prefix="/")
        log.info("serving %d replicas behind %s routing on http://%s:%d (Ray Serve)", args.replicas, args.routing,
                 args.host, args.port)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt as e:
        why = e.args[0] if e.args else "SIGINT"
    finally:  # on an error too: nothing of Ray's stays behind
        status = _stop(serve, ray, events_dir, why, deploying, args.replicas, args.shutdown_timeout)
    return status


class _Again(BaseException):
    """A second SIGTERM or SIGINT while the server stops."""


def _raise_again(signum, frame) -> None:
    raise _Again(signal.Signals(signum).name)


def _stop(serve, ray, events_dir, why: str | None, deploying: bool, num_replicas: int, timeout_s: float) -> int:
    """Stop after the signal `why` (None: an error): drain the replicas if the application was being deployed, shut
    Ray Serve down, then the Ray cluster, and remove the KV events' directory. A second signal skips the rest of the
    drain and Ray Serve's own graceful shutdown. Returns the exit status (0, or SECOND_SIGNAL_STATUS)."""
    previous = {sig: signal.signal(sig, _raise_again) for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        if why is not None and deploying:
            _drain(serve, num_replicas, timeout_s, why)
        elif why is not None:
            log.info("%s while starting: stopped before serving", why)
        serve.shutdown()
    except _Again as again:
        log.warning("%s again: exiting now, without finishing the drain (status %d)", again.args[0],
                    SECOND_SIGNAL_STATUS)
        status = SECOND_SIGNAL_STATUS
    finally:
        for sig in previous:  # the Ray cluster's own shutdown runs to its end
            signal.signal(sig, signal.SIG_IGN)
        ray.shutdown()
        events_dir.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status


def _drain(serve, num_replicas: int, timeout_s: float, why: str) -> None:
    """The drain of `kvcache serve` (server/drain.py) across the replicas: the router refuses new requests, then each
    replica drains (its open requests run up to `timeout_s`, then are aborted with the shutdown's error) and closes
    its engine. A replica that cannot be reached or does not answer in time is logged and skipped."""
    try:
        serve.get_app_handle("kvcache").begin_drain.remote().result(timeout_s=30)
    except Exception as e:  # noqa: BLE001 -- not deployed yet (nothing to drain), or its router is gone
        log.warning("the router could not be told to refuse new requests: %s", _first_line(e))
    log.info("%s: draining %d replicas for up to %g s (--shutdown-timeout); new requests get 503", why,
             num_replicas, timeout_s)
    calls = {}
    for i in range(num_replicas):  # all at once: they drain side by side
        try:
            calls[i] = serve.get_deployment_handle(f"replica-{i}", "kvcache").drain.remote(timeout_s)
        except Exception as e:  # noqa: BLE001 -- not deployed yet: nothing of it to drain
            log.warning("replica %d could not be drained: %s", i, _first_line(e))
    deadline = time.monotonic() + timeout_s + FLUSH_S + 30  # one for all: a stuck replica does not add up
    aborted = 0
    for i, call in calls.items():
        try:
            aborted += call.result(timeout_s=max(1.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 -- a dead or stuck replica: the others still drain
            log.warning("replica %d did not drain: %s", i, _first_line(e))
    log.info("replicas drained (%d requests aborted at the timeout); shutting Ray Serve down", aborted)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
