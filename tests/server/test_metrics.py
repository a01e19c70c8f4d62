"""ServerMetrics driven by a real engine on the tiny model: exact counter deltas, gauges, histogram counts,
and the Grafana dashboard's metric names."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache import LLM
from kvcache.engine.sampling_params import SamplingParams
from kvcache.server.metrics import ServerMetrics

MODEL = "tiny"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvcache-dashboard.json"


def samples(metrics: ServerMetrics) -> dict[str, float]:
    """Sample name -> value from a render; labels other than model_name and le are folded into the key."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            assert s.labels["model_name"] == MODEL
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "le")}
            if "le" in s.labels:
                extra["le"] = s.labels["le"]
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
            out[key] = s.value
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(n: int, start: int = 3) -> list[int]:
    return list(range(start, start + n))


def run_to_end(engine, metrics: ServerMetrics) -> list:
    seen = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        metrics.on_step(outs, time.monotonic())
        seen.extend(outs)
    return seen


@pytest.fixture
def engine(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory="2MiB", block_size=16).engine


def test_counters_histograms_and_gauges_on_a_known_workload(engine):
    m = ServerMetrics(engine, MODEL)
    lengths, max_tokens = {"a": 5, "b": 20, "c": 33}, {"a": 4, "b": 6, "c": 8}
    for i, rid in enumerate(lengths):
        engine.add_request(rid, prompt(lengths[rid], 3 + 50 * i), greedy(max_tokens[rid]), stream=True)
    outs = engine.step()
    m.on_step(outs, time.monotonic())
    first = samples(m)
    assert first["kvcache:num_requests_running"] == 3
    assert first["kvcache:num_requests_waiting"] == 0
    assert first["kvcache:time_to_first_token_seconds_count"] == 3
    assert first["kvcache:kv_blocks{state=used}"] == 1 + 2 + 3  # 6, 21 and 34 slots' worth of blocks
    outs = engine.step()  # c gets its second token, then the client goes away
    m.on_step(outs, time.monotonic())
    c_tokens = len(next(o for o in outs if o.request_id == "c").outputs[0].token_ids)
    assert engine.abort_request("c")
    m.on_abort("c")
    run_to_end(engine, m)

    s = samples(m)
    generated = max_tokens["a"] + max_tokens["b"] + c_tokens
    assert s["kvcache:prompt_tokens_total"] == sum(lengths.values())
    assert s["kvcache:generation_tokens_total"] == generated == engine.stats.generation_tokens
    assert s["kvcache:request_success_total{finished_reason=length}"] == 2
    assert s["kvcache:request_success_total{finished_reason=abort}"] == 1
    assert s["kvcache:request_success_total{finished_reason=stop}"] == 0
    assert s["kvcache:time_to_first_token_seconds_count"] == 3
    # One inter-token observation per step after a request's first: every token but each request's first.
    assert s["kvcache:inter_token_latency_seconds_count"] == generated - 3
    assert s["kvcache:e2e_request_latency_seconds_count"] == 2
    assert s["kvcache:request_queue_time_seconds_count"] == 2
    assert s["kvcache:e2e_request_latency_seconds_sum"] >= s["kvcache:request_queue_time_seconds_sum"] >= 0
    assert s["kvcache:num_preemptions_total"] == engine.scheduler.num_preemptions == 0
    assert s["kvcache:prefix_cache_queries_total"] == engine.kv.stats.queries == sum(lengths.values())
    assert s["kvcache:prefix_cache_hits_total"] == engine.kv.stats.hits
    # Nothing runs: the gauges are back at rest and the blocks partition the pool.
    assert s["kvcache:num_requests_running"] == s["kvcache:num_requests_waiting"] == 0
    assert s["kvcache:kv_cache_usage_perc"] == 0
    assert s["kvcache:kv_blocks{state=used}"] == 0
    assert s["kvcache:kv_cache_bytes_used"] == 0
    assert s["kvcache:kv_block_fragmentation"] == 0
    assert s["kvcache:running_seq_len_max"] == 0
    assert s["kvcache:kv_blocks{state=cached}"] == engine.kv.pool.num_cached > 0
    assert s["kvcache:kv_blocks{state=free}"] + s["kvcache:kv_blocks{state=cached}"] == engine.kv.pool.num_usable
    assert s["kvcache:kv_cache_bytes_total"] == engine.kv_cache_info()["total_bytes"]


def test_fragmentation_and_lengths_of_one_sequence_after_prefill(engine):
    m = ServerMetrics(engine, MODEL)
    engine.add_request("a", prompt(5), greedy(4), stream=True)
    m.on_step(engine.step(), time.monotonic())
    s = samples(m)
    # 5 prompt tokens computed in one 16-slot block; the sampled token is not in the cache yet.
    assert s["kvcache:kv_block_fragmentation"] == pytest.approx(1 - 5 / 16)
    assert s["kvcache:running_seq_len_mean"] == s["kvcache:running_seq_len_max"] == 6
    assert s["kvcache:kv_blocks{state=used}"] == 1
    info = engine.kv_cache_info()
    assert s["kvcache:kv_cache_bytes_used"] == info["total_bytes"] // info["num_blocks"]
    assert s["kvcache:kv_cache_usage_perc"] == pytest.approx(1 / engine.kv.pool.num_usable)
    m.on_step(engine.step(), time.monotonic())
    assert samples(m)["kvcache:kv_block_fragmentation"] == pytest.approx(1 - 6 / 16)
    run_to_end(engine, m)


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_prefix_hits_and_block_states(tiny_llama, algo):
    engine = LLM(tiny_llama, kv_cache_memory="2MiB", block_size=16, prefix_caching_algo=algo).engine
    m = ServerMetrics(engine, MODEL)
    shared = prompt(32)
    engine.add_request("a", shared + [100, 101], greedy(2), stream=True)
    run_to_end(engine, m)
    engine.add_request("b", shared + [200], greedy(3), stream=True)
    m.on_step(engine.step(), time.monotonic())
    s = samples(m)
    assert s["kvcache:prefix_cache_hits_total"] == 32
    assert s["kvcache:prefix_cache_queries_total"] == 34 + 33
    assert s["kvcache:prefix_cache_hit_rate"] == pytest.approx(32 / 67)
    # b holds the two shared blocks plus its own; a's idle third block stays cached.
    assert s["kvcache:kv_blocks{state=used}"] == 3
    assert sum(s[f"kvcache:kv_blocks{{state={k}}}"] for k in ("free", "used", "cached")) == engine.kv.pool.num_usable
    run_to_end(engine, m)
    s = samples(m)
    assert s["kvcache:kv_blocks{state=used}"] == 0
    assert s["kvcache:kv_blocks{state=cached}"] == engine.kv.num_cached_blocks > 0


def test_preemptions_are_counted(tiny_llama):
    # 16 blocks of 16 tokens: three requests that each grow to 10 blocks cannot all stay.
    engine = LLM(tiny_llama, kv_cache_memory="128KiB", block_size=16, enable_prefix_caching=False).engine
    m = ServerMetrics(engine, MODEL)
    for i in range(3):
        engine.add_request(str(i), prompt(60, 3 + 70 * i), greedy(100), stream=True)
    run_to_end(engine, m)
    s = samples(m)
    assert engine.scheduler.num_preemptions > 0
    assert s["kvcache:num_preemptions_total"] == engine.scheduler.num_preemptions
    assert s["kvcache:request_success_total{finished_reason=length}"] == 3
    assert s["kvcache:generation_tokens_total"] == 300


def test_eviction_is_counted(tiny_llama):
    from kvcache.compress.spec import EvictionSpec
    engine = LLM(tiny_llama, kv_cache_memory="2MiB", block_size=16, kv_eviction="streaming", kv_budget=32).engine
    m = ServerMetrics(engine, MODEL)
    engine.add_request("a", prompt(100), greedy(20), stream=True)  # 100 -> 32 slots; then 48 -> 32 while decoding
    engine.add_request("b", prompt(100, 120), greedy(4), stream=True, eviction=EvictionSpec("none"))
    run_to_end(engine, m)
    s = samples(m)
    assert s["kvcache:kv_evicted_tokens_total"] == 68 + 16 == engine.evictor.stats.evicted_tokens
    assert s["kvcache:kv_eviction_freed_blocks_total"] == 5 + 1 == engine.evictor.stats.freed_blocks


def test_log_line_covers_the_time_since_the_previous_line(engine):
    m = ServerMetrics(engine, MODEL)
    t0 = time.monotonic()
    m.log_line(t0)
    engine.add_request("a", prompt(10), greedy(5), stream=True)
    run_to_end(engine, m)
    line = m.log_line(t0 + 2.0)
    assert line.startswith("Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 2.5 tokens/s, ")
    assert "Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%" in line
    assert m.log_line(t0 + 3.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")


def test_render_names_and_content_type(engine):
    m = ServerMetrics(engine, MODEL)
    assert m.content_type.startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    expected = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
                "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "kv_block_fragmentation", "running_seq_len_mean",
                "running_seq_len_max", "prefix_cache_hit_rate", "kv_cache_bytes_used", "kv_cache_bytes_total",
                "kv_blocks"}
    assert {"kvcache:" + n for n in expected} <= names


def test_dashboard_uses_only_exposed_series(tiny_llama, tmp_path):
    """Against an engine with every optional metric (offload tiers, swap, KV events)."""
    engine = LLM(tiny_llama, kv_cache_memory="1MiB", kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path),
                 preemption_mode="swap", kv_events_endpoint=f"ipc://{tmp_path}/kv-events").engine
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 36
    assert any(i["name"] == "DS_PROMETHEUS" for i in board["__inputs"])
    assert any(v["name"] == "model_name" for v in board["templating"]["list"])
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    families = [f for f in text_string_to_metric_families(ServerMetrics(engine, MODEL).render().decode())
                if not f.name.endswith("_created")]  # prometheus_client's start-time series, not graphed
    exposed = {s.name for f in families for s in f.samples}
    # a labelled counter shows no sample until its first label set (an offload error reason) is counted
    exposed |= {f.name + "_total" for f in families if f.type == "counter"}
    used = {n for e in exprs for n in re.findall(r"kvcache:[a-zA-Z0-9_]+", e)}
    assert used and used <= exposed, sorted(used - exposed)
    # And every metric ServerMetrics exposes is on the dashboard, by one of its series.
    assert not [f.name for f in families if not any(s.name in used for s in f.samples)
                and not (f.type == "counter" and f.name + "_total" in used)]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_cache_reports_its_true_bytes(tiny_llama, dtype):
    """bytes per token, pool bytes and the residual blocks are the planner's, and used bytes count what
    sequences hold, private residual blocks included."""
    eng = LLM(tiny_llama, kv_cache_memory="2MiB", kv_cache_dtype=dtype).engine
    info = eng.kv_cache_info()
    m = ServerMetrics(eng, MODEL)
    s = samples(m)
    assert s["kvcache:kv_cache_bytes_per_token"] == info["bytes_per_token"] < 256  # fp32 here costs 512
    assert s["kvcache:kv_cache_bytes_total"] == info["total_bytes"] == eng.store.nbytes - eng.store.nbytes // (
        info["num_blocks"] + 1)  # the store holds one more block: the null block
    key = next(k for k in s if k.startswith("kvcache:cache_config_info"))
    assert f"cache_dtype={dtype}" in key and f"residual_blocks_per_seq={info['seq_blocks']}" in key
    assert (info["seq_blocks"] > 0) == (dtype == "int4")
    eng.add_request("a", prompt(70), greedy(2))
    eng.step()
    m.on_step([], time.monotonic())
    held = 2 + info["seq_blocks"] if dtype == "int4" else 5  # 71 tokens: 2 blocks of 64, or 5 of 16
    assert samples(m)["kvcache:kv_blocks{state=used}"] == held
    run_to_end(eng, m)
    eng.check_no_leaks()


def test_offload_tier_counters_mirror_the_tiers(tiny_llama, tmp_path):
    """With a cpu and a disk tier under a 4-block pool, a prompt computed, pushed out and asked again is loaded from
    the cpu tier: the per-tier counters equal the tiers' own totals, and the loaded blocks are counted."""
    bpt = LLM(tiny_llama, kv_cache_memory="1MiB").kv_cache_info()["bytes_per_token"]
    engine = LLM(tiny_llama, kv_cache_memory=6 * 16 * bpt, block_size=16, kv_offload_memory="1MiB",
                 kv_offload_dir=str(tmp_path)).engine
    m = ServerMetrics(engine, MODEL)
    for i, p in enumerate((prompt(70), prompt(70, start=100), prompt(70))):
        engine.add_request(f"r{i}", p, greedy(2))
        run_to_end(engine, m)
        engine.offload.flush()
    m.on_step([], time.monotonic())
    s = samples(m)
    cpu, disk = engine.offload.tiers
    assert s["kvcache:kv_offload_stored_blocks_total{tier=cpu}"] == cpu.stats.stored == 8  # 4 full blocks each
    assert s["kvcache:kv_offload_stored_blocks_total{tier=disk}"] == disk.stats.stored == 8
    assert s["kvcache:kv_offload_hits_total{tier=cpu}"] == cpu.stats.hits > 0
    assert s["kvcache:kv_offload_loaded_blocks_total"] == engine.offload.loaded_blocks > 0
    assert s["kvcache:kv_offload_bytes_used{tier=disk}"] == disk.used_bytes > 0


def test_swap_and_load_metrics_follow_the_engine(tiny_llama):
    """Swap preemptions under a pool that must preempt: the swap counters mirror the scheduler's, the load histogram
    has one observation per step that loaded, and the tier's swap bytes go back to 0 when all is done."""
    engine = LLM(tiny_llama, kv_cache_memory=12 * 8 * 512, block_size=8, preemption_mode="swap",
                 kv_offload_memory="4MiB", max_num_batched_tokens=48).engine
    m = ServerMetrics(engine, MODEL)
    loads = []
    real = engine.offload.load
    engine.offload.load = lambda batch: (loads.append(len(batch)), real(batch))[1]
    for i in range(4):
        engine.add_request(f"r{i}", prompt(5, start=3 + i), greedy(40))
    run_to_end(engine, m)
    s = samples(m)
    sched = engine.scheduler
    assert s["kvcache:kv_swap_out_total"] == sched.num_swapped_out == s["kvcache:num_preemptions_total"] > 0
    assert s["kvcache:kv_swap_in_total"] == sched.num_swapped_in == sched.num_swapped_out
    assert s["kvcache:kv_swap_fallbacks_total"] == 0
    assert s["kvcache:kv_offload_load_seconds_count"] == len(loads) > 0
    assert s["kvcache:kv_swap_bytes{tier=cpu}"] == 0


def test_pressure_ladder_metrics_follow_the_engine(tiny_llama):
    """Under --kv-pressure-policy ladder and a pool that must give way, the ladder's counters mirror its stats, and
    each request's kv_degradation adds up to them."""
    engine = LLM(tiny_llama, kv_cache_memory=24 * 8 * 512, block_size=8, kv_pressure_policy="ladder",
                 max_num_batched_tokens=48).engine
    m = ServerMetrics(engine, MODEL)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(60, start=3 + i), greedy(60))
    outs = run_to_end(engine, m)
    s, st = samples(m), engine.scheduler.pressure.stats
    assert s["kvcache:kv_pressure_evictions_total"] == st.evictions > 0
    assert s["kvcache:kv_pressure_evicted_tokens_total"] == st.evicted_tokens > 0
    assert s["kvcache:kv_pressure_freed_blocks_total"] == st.freed_blocks > 0
    assert s["kvcache:kv_pressure_failed_total"] == st.failed
    assert s["kvcache:kv_evicted_tokens_total"] == 0  # --kv-eviction's counter is another one
    assert sum(o.kv_degradation["evicted_tokens"] for o in outs if o.finished) == st.evicted_tokens
