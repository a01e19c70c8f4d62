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

log = logging.getLogger("kvcache")


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (systemd's, Kubernetes') ends `kvcache serve --replicas` as Ctrl-C does: Ray Serve and the Ray cluster
    it started are shut down and the KV event endpoints' directory is removed, instead of being left behind."""
    raise KeyboardInterrupt


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
