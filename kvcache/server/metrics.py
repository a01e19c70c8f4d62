"""Prometheus metrics of the server: vLLM's names and units under a `kvcache:` prefix, plus KV cache health.

Every metric carries the label `model_name`. vLLM's (same meaning, same units, same buckets):

| metric | type | unit |
|---|---|---|
| `kvcache:num_requests_running` | gauge | requests with a sequence in the running batch |
| `kvcache:num_requests_waiting` | gauge | requests queued (never admitted, or preempted) |
| `kvcache:kv_cache_usage_perc` | gauge | fraction 0..1 of usable blocks held (idle cached ones count free) |
| `kvcache:prefix_cache_queries_total` | counter | prompt tokens looked up in the prefix cache |
| `kvcache:prefix_cache_hits_total` | counter | of those, tokens found cached |
| `kvcache:num_preemptions_total` | counter | preemptions (a sequence's blocks freed, to be recomputed) |
| `kvcache:prompt_tokens_total` | counter | prompt tokens of requests submitted |
| `kvcache:generation_tokens_total` | counter | tokens sampled |
| `kvcache:spec_decode_num_drafts_total` | counter | speculative decoding: proposals verified |
| `kvcache:spec_decode_num_draft_tokens_total` | counter | speculative decoding: tokens proposed |
| `kvcache:spec_decode_num_accepted_tokens_total` | counter | speculative decoding: proposed tokens accepted |
| `kvcache:spec_decode_num_accepted_tokens_per_pos_total` | counter | proposals whose token at `position` was accepted |
| `kvcache:request_success_total{finished_reason}` | counter | requests finished: stop, length, abort |
| `kvcache:time_to_first_token_seconds` | histogram | seconds from arrival to the first sampled token |
| `kvcache:inter_token_latency_seconds` | histogram | seconds between a request's successive token steps |
| `kvcache:e2e_request_latency_seconds` | histogram | seconds from arrival to finish |
| `kvcache:request_queue_time_seconds` | histogram | seconds from arrival to first scheduled |

KV cache health (ours):

| metric | type | unit |
|---|---|---|
| `kvcache:kv_block_fragmentation` | gauge | fraction 0..1 of running sequences' block slots holding no token |
| `kvcache:running_seq_len_mean`, `_max` | gauge | tokens (prompt + output) of running sequences |
| `kvcache:prefix_cache_hit_rate` | gauge | fraction 0..1, hits / queries since start-up |
| `kvcache:kv_cache_bytes_used`, `kvcache:kv_cache_bytes_total` | gauge | bytes of KV blocks held / of the whole pool |
| `kvcache:kv_blocks{state}` | gauge | blocks; they sum to the pool (see below) |
| `kvcache:kv_cache_bytes_per_token` | gauge | bytes one cached token costs in the storage format, scales included |
| `kvcache:kv_offload_{hits,misses,stored_blocks}_total{tier}` | counter | block lookups found / not found, blocks written (offload tiers) |
| `kvcache:kv_offload_bytes_{in,out}_total{tier}` | counter | bytes written to / read from a tier |
| `kvcache:kv_offload_errors_total{tier,reason}` | counter | failed or refused values: write, read, disk_full, checksum, fingerprint, ... |
| `kvcache:kv_offload_loaded_blocks_total` | counter | blocks loaded from the tiers into the pool instead of recomputed |
| `kvcache:kv_offload_bytes_used{tier}` | gauge | bytes a tier holds (swapped sequences included) |
| `kvcache:kv_offload_load_seconds` | histogram | seconds one step took to copy what it loaded from the tiers (and swap) into the pool |
| `kvcache:kv_swap_{out,in,fallbacks}_total` | counter | preemptions swapped out; of those, resumed from the tier; swap preemptions recomputed instead (tier full, read failed) |
| `kvcache:kv_swap_bytes{tier}` | gauge | bytes of swapped-out sequences a tier holds |
| `kvcache:kv_pressure_{evictions,evicted_tokens,freed_blocks,failed}_total` | counter | the memory-pressure ladder (--kv-pressure-policy ladder): its compactions, the cache slots they emptied, the blocks they returned, and those that found no block to write into |
| `kvcache:kv_events_published_total` | counter | KV events sent to `--kv-events-endpoint` (vLLM's BlockStored/BlockRemoved/AllBlocksCleared) |
| `kvcache:cache_config_info{...}` | gauge (1) | labels: block_size, cache_dtype, num_gpu_blocks, bytes_per_token, residual_blocks_per_seq (vLLM's name) |
| `kvcache:kv_evicted_tokens_total` | counter | cache slots emptied by token eviction (--kv-eviction), per request |
| `kvcache:kv_eviction_freed_blocks_total` | counter | blocks eviction's compactions returned to the pool |

Block states: `used` is held by a sequence, `cached` is idle but holds a prefix a request can take
back (an allocation may evict it), `free` is idle and empty.

The engine's loop calls `on_step` after each `engine.step()` and `on_abort` after a successful
`engine.abort_request` (on the engine thread, or in the engine process, server/engine_core.py, which sends
`render`'s text to the API process); HTTP threads call `render`. Only the engine's loop reads engine state.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:  # the engine pulls in torch; this module needs only its attributes
    from kvcache.engine.llm_engine import LLMEngine, RequestOutput

PREFIX = "kvcache:"
# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so that dashboards and SLO rules carry over.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                             120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Loads from the tiers: a block is ~50 KB to a few MB, a step loads up to thousands of them.
LOAD_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort", "error")  # engine/outputs.py's (not imported: that pulls in torch)
BLOCK_STATES = ("free", "used", "cached")


@dataclass(slots=True)
class _RequestState:
    """What ServerMetrics remembers of a request between its outputs."""

    last_token_time: float  # time.monotonic() seconds of its last observed step
    num_steps: int  # output tokens of its longest sample so far: one per step that gave it tokens


class ServerMetrics:
    """The server's Prometheus registry, fed from the engine thread (see the module docstring)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.content_type = CONTENT_TYPE_LATEST
        info = engine.kv_cache_info()
        self._bytes_total = int(info["total_bytes"])
        self._num_blocks = int(info["num_blocks"])  # usable blocks the KV budget bought
        # Registered in this order, which is the order /metrics lists them in.
        self._add_request_metrics()
        self._add_latency_metrics()
        self._add_kv_metrics(info)
        self._tiers = {}
        if engine.offload:
            self._add_offload_metrics([t.name for t in engine.offload.tiers])
        self._swaps = {name: self._counter(f"kv_swap_{name}", doc) for name, doc in (
            ("out", "Preemptions that swapped the sequence's KV out to an offload tier (--preemption-mode swap)."),
            ("in", "Swapped-out sequences resumed from the tier's copy."),
            ("fallbacks", "Swap preemptions recomputed instead: the tier had no room, or a read failed."))}
        self._pressure = {name: self._counter(f"kv_pressure_{name}", doc) for name, doc in (
            ("evictions", "Compactions the memory-pressure ladder made (--kv-pressure-policy ladder)."),
            ("evicted_tokens", "Cache slots the pressure ladder emptied, summed over requests."),
            ("freed_blocks", "KV blocks the pressure ladder's compactions returned to the pool."),
            ("failed", "Pressure-ladder compactions that found no fresh block to write into (it preempted)."))}
        self._events = self._counter("kv_events_published", "KV events published to --kv-events-endpoint.") \
            if engine.event_publisher else None

        self._lock = threading.Lock()  # on_step/on_abort (engine thread) against log_line (any thread)
        self._requests: dict[str, _RequestState] = {}
        # Engine totals already added to the counters: the counters mirror the engine's totals.
        self._seen: dict[str, int] = {}
        self._log_time = time.monotonic()
        self._log_tokens = {"prompt": 0, "generation": 0, "hits": 0, "queries": 0}  # since the last log line
        self._last_running = self._last_waiting = 0
        self._last_usage = self._last_hit_rate = 0.0
        with self._lock:
            self._refresh()
            self._log_tokens = dict.fromkeys(self._log_tokens, 0)  # the first line covers only what follows

    # ---- registration -----------------------------------------------------------------------

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _labelled(self, kind: type, name: str, doc: str, labels: list[str]):
        """A metric family with labels beyond model_name, to be given their values per sample."""
        return kind(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

    def _add_request_metrics(self) -> None:
        """vLLM's scheduler, prefix cache, token and speculative decoding counts, and finished requests."""
        gauge, counter = self._gauge, self._counter
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (new or preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: fraction of usable blocks held by "
                                                     "sequences; 1 means 100 percent.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached.")
        self.preemptions = counter("num_preemptions", "Preemptions: sequences whose blocks were freed to be "
                                                      "recomputed later.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of submitted requests.")
        self.evicted_tokens = counter("kv_evicted_tokens", "Cache slots emptied by token eviction (--kv-eviction), "
                                                           "summed over requests.")
        self.eviction_freed_blocks = counter("kv_eviction_freed_blocks", "KV blocks that token eviction's "
                                                                         "compactions returned to the pool.")
        self.generation_tokens = counter("generation_tokens", "Generated (sampled) tokens.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative decoding: proposals verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens "
                                                                        "accepted.")
        self._spec_per_pos = self._labelled(Counter, "spec_decode_num_accepted_tokens_per_pos", "Speculative "
                                            "decoding: proposals whose token at this position was accepted.",
                                            ["position"])
        self._success = self._labelled(Counter, "request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"])
        for reason in FINISH_REASONS:  # present at 0 from the start, as vLLM does
            self._success.labels(self.model_name, reason)

    def _add_latency_metrics(self) -> None:
        """vLLM's latency histograms, with its buckets."""
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token, seconds.", TTFT_BUCKETS_S)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between a request's successive token "
                                                                  "steps, seconds.", ITL_BUCKETS_S)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish, seconds.",
                                   REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled, seconds.",
                                          REQUEST_LATENCY_BUCKETS_S)

    def _add_kv_metrics(self, info: dict) -> None:
        """KV cache health: fragmentation, sequence lengths, hit rate, bytes, block states, the cache's config."""
        gauge = self._gauge
        self.fragmentation = gauge("kv_block_fragmentation", "Fraction of token slots in running sequences' "
                                                             "blocks that hold no token yet (0..1).")
        self.seq_len_mean = gauge("running_seq_len_mean", "Mean length of running sequences, tokens.")
        self.seq_len_max = gauge("running_seq_len_max", "Longest running sequence, tokens.")
        self.hit_rate = gauge("prefix_cache_hit_rate", "Prefix cache hits / queries since start-up (0..1).")
        self.bytes_used = gauge("kv_cache_bytes_used", "Bytes of KV blocks held by sequences.")
        self.bytes_total = gauge("kv_cache_bytes_total", "Bytes of the whole KV block pool.")
        blocks = self._labelled(Gauge, "kv_blocks", "KV blocks by state: used (held by a sequence), cached (idle, "
                                                    "holding a reusable prefix), free (idle, empty).", ["state"])
        self.blocks = {s: blocks.labels(self.model_name, s) for s in BLOCK_STATES}
        self.bytes_total.set(self._bytes_total)
        gauge("kv_cache_bytes_per_token", "Bytes one cached token costs across all layers, scales included "
                                          "(the planner's formula).").set(info["bytes_per_token"])
        config = {"block_size": info["block_size"], "cache_dtype": info["dtype"], "num_gpu_blocks": info["num_blocks"],
                  "bytes_per_token": info["bytes_per_token"], "residual_blocks_per_seq": info["seq_blocks"]}
        self._labelled(Gauge, "cache_config_info", "KV cache configuration (value 1; the labels carry it). "
                       "residual_blocks_per_seq: pool blocks each request holds for its fp16 key residual (int4/int2).",
                       list(config)).labels(self.model_name, *map(str, config.values())).set(1)

    def _add_offload_metrics(self, tiers: list[str]) -> None:
        """Per offload tier: lookups, writes, bytes, errors, bytes held; and the loads into the pool."""
        def per_tier(family) -> dict:
            return {t: family.labels(self.model_name, t) for t in tiers}

        for name, doc in (("hits", "Offload tier lookups that found the block."),
                          ("misses", "Offload tier lookups that did not find the block."),
                          ("stored_blocks", "Blocks written to an offload tier."),
                          ("bytes_in", "Bytes written to an offload tier."),
                          ("bytes_out", "Bytes read from an offload tier.")):
            self._tiers[name] = per_tier(self._labelled(Counter, "kv_offload_" + name, doc, ["tier"]))
        self._tier_errors = self._labelled(Counter, "kv_offload_errors", "Offload values failed or refused, by "
                                           "reason.", ["tier", "reason"])
        self._tier_used = per_tier(self._labelled(Gauge, "kv_offload_bytes_used", "Bytes an offload tier holds.",
                                                  ["tier"]))
        self._loaded = self._counter("kv_offload_loaded_blocks", "Blocks loaded from the offload tiers into the pool "
                                                                 "instead of recomputed.")
        self._load_seconds = self._histogram("kv_offload_load_seconds", "Seconds a step took to copy the blocks it "
                                             "loaded from the offload tiers (and swap) into the pool.", LOAD_BUCKETS_S)
        self._swap_bytes = per_tier(self._labelled(Gauge, "kv_swap_bytes", "Bytes of swapped-out sequences an "
                                                   "offload tier holds.", ["tier"]))

    # ---- engine thread ----------------------------------------------------------------------

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        """Record one `engine.step()`: its `outputs` and `now` (time.monotonic() seconds after it returned)."""
        with self._lock:
            self._refresh()
            for out in outputs:
                self._observe(out, now)
            # Requests that ended without an output or on_abort (an engine error) must not pile up here.
            live = self.engine.requests
            for rid in [r for r in self._requests if r not in live]:
                del self._requests[rid]

    def on_abort(self, request_id: str) -> None:
        """Record a request the server aborted; call it only when `engine.abort_request` returned True."""
        with self._lock:
            self._requests.pop(request_id, None)
            self._success.labels(self.model_name, "abort").inc()
            # No step may follow (it was the last request): bring running/blocks up to date now.
            self._refresh()

    def _observe(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        steps = max((len(c.token_ids) for c in out.outputs), default=0)
        state = self._requests.get(out.request_id)
        if state is None and steps and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            state = self._requests[out.request_id] = _RequestState(m.first_token_time, 1)
        if state is not None and steps > state.num_steps:
            # Streaming requests arrive every step (one new step each). A request seen only when it
            # finished covered several steps since: spread the time evenly, so the histogram's count
            # and sum stay right (one observation per step, their total the decode time).
            new = steps - state.num_steps
            gap = (now - state.last_token_time) / new
            for _ in range(new):
                self.itl.observe(gap)
            state.last_token_time, state.num_steps = now, steps
        if out.finished:
            self._requests.pop(out.request_id, None)
            end = m.finished_time if m.finished_time is not None else now
            self.e2e.observe(end - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            reason = (out.outputs[0].finish_reason if out.outputs else None) or "stop"
            self._success.labels(self.model_name, reason).inc()

    def _advance(self, key: str, counter: Counter, total: int) -> int:
        """Add to `counter` what the engine total `total` grew by since last seen; returns that delta."""
        delta = total - self._seen.get(key, 0)
        if delta < 0:  # the engine's total restarted: all of it is new
            delta = total
        self._seen[key] = total
        if delta:
            counter.inc(delta)
        return delta

    def _refresh(self) -> None:
        """Gauges from engine state, counters from the engine totals' growth."""
        self._advance_totals()
        if self._tiers:
            self._advance_offload()
        sched = self.engine.scheduler
        for name, total in (("out", sched.num_swapped_out), ("in", sched.num_swapped_in),
                            ("fallbacks", sched.num_swap_fallbacks)):
            self._advance(f"swap:{name}", self._swaps[name], total)
        ladder = sched.pressure
        if ladder is not None:
            for name, counter in self._pressure.items():
                self._advance(f"pressure:{name}", counter, getattr(ladder.stats, name))
        if self._events is not None:
            self._advance("events", self._events, self.engine.event_publisher.published_events)
        self._set_pool_gauges()
        self._set_sequence_gauges()

    def _advance_totals(self) -> None:
        """The token, prefix cache, preemption, speculative decoding and eviction counters (and the log line's)."""
        eng, kv = self.engine, self.engine.kv
        st, lt = eng.stats, self._log_tokens
        lt["prompt"] += self._advance("prompt", self.prompt_tokens, st.prompt_tokens)
        lt["generation"] += self._advance("generation", self.generation_tokens, st.generation_tokens)
        lt["queries"] += self._advance("queries", self.prefix_queries, kv.stats.queries)
        lt["hits"] += self._advance("hits", self.prefix_hits, kv.stats.hits)
        self._advance("preemptions", self.preemptions, eng.scheduler.num_preemptions)
        self._advance("spec_drafts", self.spec_drafts, st.spec_drafts)
        self._advance("spec_draft_tokens", self.spec_draft_tokens, st.spec_draft_tokens)
        self._advance("spec_accepted", self.spec_accepted, st.spec_accepted_tokens)
        for pos, n in enumerate(st.spec_accepted_per_position):
            self._advance(f"spec_pos:{pos}", self._spec_per_pos.labels(self.model_name, str(pos)), n)
        self._advance("evicted", self.evicted_tokens, eng.evictor.stats.evicted_tokens)
        self._advance("eviction_freed", self.eviction_freed_blocks, eng.evictor.stats.freed_blocks)

    def _advance_offload(self) -> None:
        """The offload tiers' counters and bytes held, and the loads into the pool."""
        offload = self.engine.offload
        for tier in offload.tiers:
            st = tier.stats
            for name, counters in self._tiers.items():
                self._advance(f"{tier.name}:{name}", counters[tier.name],
                              st.stored if name == "stored_blocks" else getattr(st, name))
            for reason, n in list(st.errors.items()):
                self._advance(f"{tier.name}:error:{reason}", self._tier_errors.labels(self.model_name, tier.name,
                                                                                      reason), n)
            self._tier_used[tier.name].set(tier.used_bytes + tier.held_bytes)
        self._advance("loaded", self._loaded, offload.loaded_blocks)
        for took in offload.take_load_latencies():
            self._load_seconds.observe(took)
        for tier in offload.tiers:
            self._swap_bytes[tier.name].set(tier.held_bytes)

    def _set_pool_gauges(self) -> None:
        """Running and waiting requests, the pool's usage, block states and bytes, the hit rate."""
        kv, sched = self.engine.kv, self.engine.scheduler
        running = {s.request_id for s in sched.running}
        waiting = {s.request_id for s in sched.waiting} - running
        self.running.set(len(running))
        self.waiting.set(len(waiting))
        usable = kv.pool.num_usable
        used = usable - kv.num_free_blocks
        usage = used / usable
        self.kv_usage.set(usage)
        self._last_running, self._last_waiting, self._last_usage = len(running), len(waiting), usage
        cached = kv.num_idle_cached_blocks
        self.blocks["used"].set(used)
        self.blocks["cached"].set(cached)
        self.blocks["free"].set(usable - used - cached)
        # Pro rata of the pool as the planner sized it: plan is the one source of bytes per block.
        self.bytes_used.set(used * self._bytes_total // self._num_blocks if self._num_blocks else 0)
        self._last_hit_rate = kv.stats.hit_rate
        self.hit_rate.set(self._last_hit_rate)

    def _set_sequence_gauges(self) -> None:
        """The running sequences' fragmentation and lengths."""
        kv = self.engine.kv
        slots = filled = 0
        lengths = []
        for seq in self.engine.scheduler.running:
            released = kv.num_released(seq.seq_id) * kv.block_size  # sliding-window blocks given back
            n = len(kv.block_tables.get(seq.seq_id, ())) * kv.block_size - released
            slots += n
            filled += min(seq.num_computed_tokens - seq.num_evicted - released, n)
            lengths.append(seq.num_tokens)
        self.fragmentation.set((slots - filled) / slots if slots else 0.0)
        self.seq_len_mean.set(sum(lengths) / len(lengths) if lengths else 0.0)
        self.seq_len_max.set(max(lengths, default=0))

    # ---- any thread -------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (serve it with `content_type`)."""
        return generate_latest(self.registry)

    def log_line(self, now: float | None = None) -> str:
        """A vLLM-like status line over the time since the previous call (throughputs in tokens/s).

        The prefix cache hit rate is over the lookups since the previous call; the lifetime rate
        when there were none.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            dt = now - self._log_time
            lt = self._log_tokens
            prompt_tps = lt["prompt"] / dt if dt > 0 else 0.0
            gen_tps = lt["generation"] / dt if dt > 0 else 0.0
            hit_rate = lt["hits"] / lt["queries"] if lt["queries"] else self._last_hit_rate
            running, waiting, usage = self._last_running, self._last_waiting, self._last_usage
            self._log_time = now
            self._log_tokens = dict.fromkeys(lt, 0)
        return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
                f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
