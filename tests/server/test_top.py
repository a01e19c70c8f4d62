"""`kvcache top`: warnings at their thresholds, the rendered table, deltas between polls, and `--once`
against an unreachable port and against a small HTTP server that serves a real ServerMetrics render."""
from __future__ import annotations

import argparse
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcache import LLM
from kvcache.engine.sampling_params import SamplingParams
from kvcache.server.metrics import ServerMetrics
from kvcache.server.top import (THRESHOLDS, MetricsUnreachableError, add_args, read_samples, render_snapshot, run,
                                snapshot, warnings_for)

HEALTHY = {"url": "http://x", "window_s": 2.0, "running": 3, "waiting": 1, "kv_usage": 0.5, "blocks_used": 64,
           "blocks_cached": 32, "blocks_free": 160, "kv_bytes_used": 3 * 2**20, "kv_bytes_total": 12 * 2**20,
           "fragmentation": 0.05, "seq_len_mean": 1000.0, "seq_len_max": 4000.0, "prefix_hit_rate": 0.5,
           "prefix_queries": 1000.0, "preemptions": 7.0, "preemptions_delta": 2.0, "prompt_tps": 123.4,
           "generation_tps": 56.7, "ttft_mean_s": 0.25, "e2e_mean_s": 1.5}
EPS = 1e-6


def args_for(url: str, once: bool = True) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(["--url", url, "--interval", "0.1"] + (["--once"] if once else []))


def test_a_healthy_snapshot_has_no_warnings():
    assert warnings_for(HEALTHY) == []


@pytest.mark.parametrize("key, above, flag", [
    ("kv_usage", True, "--kv-cache-memory"),
    ("fragmentation", True, "--block-size"),
    ("seq_len_mean", True, "--max-model-len"),
    ("prefix_hit_rate", False, "--enable-prefix-caching"),
])
def test_each_warning_fires_just_past_its_threshold(key, above, flag):
    t = THRESHOLDS[key]
    step = 1 if key == "seq_len_mean" else EPS
    past, short = (t + step, t - step) if above else (t - step, t + step)
    warns = warnings_for({**HEALTHY, key: past})
    assert len(warns) == 1 and flag in warns[0]
    assert warnings_for({**HEALTHY, key: short}) == []
    assert warnings_for({**HEALTHY, key: t}) == []  # at the threshold is still fine


def test_warning_texts_name_cause_and_flags():
    bad = {**HEALTHY, "kv_usage": 0.99, "fragmentation": 0.3, "seq_len_mean": 20000.0, "prefix_hit_rate": 0.01}
    text = "\n".join(warnings_for(bad))
    for flag in ("--kv-cache-memory", "--gpu-memory-utilization", "--max-num-seqs", "--kv-cache-dtype",
                 "--block-size", "--max-model-len", "--kv-eviction", "--enable-prefix-caching",
                 "--scheduling-policy lpm"):
        assert flag in text
    assert len(warnings_for(bad)) == 4


def test_no_hit_rate_warning_before_any_lookup():
    assert warnings_for({**HEALTHY, "prefix_hit_rate": 0.0, "prefix_queries": 0.0}) == []
    assert warnings_for({k: None for k in HEALTHY}) == []  # a server that lacks every figure


def test_render_snapshot_shows_the_figures():
    text = render_snapshot(HEALTHY)
    for figure in ("running 3", "waiting 1", "preemptions 7 (+2)", "usage 50.0%", "3.00 MiB / 12.00 MiB",
                   "used 64", "cached 32", "free 160", "5.0%", "mean 1,000", "max 4,000 tokens", "hit rate 50.0%",
                   "prompt 123.4", "generation 56.7 tokens/s", "TTFT mean 0.250 s", "e2e mean 1.500 s",
                   "Warnings: none", "last 2.0 s"):
        assert figure in text, figure
    warned = render_snapshot({**HEALTHY, "kv_usage": 0.97})
    assert "usage 97.0%" in warned and "! KV cache usage 97.0% is above 95%" in warned


def test_snapshot_takes_rates_and_means_from_deltas():
    def poll(prompt, gen, ttft_sum, ttft_n, hits, queries):
        return {"kvcache:prompt_tokens_total": prompt, "kvcache:generation_tokens_total": gen,
                "kvcache:time_to_first_token_seconds_sum": ttft_sum,
                "kvcache:time_to_first_token_seconds_count": ttft_n,
                "kvcache:prefix_cache_hits_total": hits, "kvcache:prefix_cache_queries_total": queries,
                "kvcache:prefix_cache_hit_rate": hits / queries, "kvcache:num_preemptions_total": 1.0}
    first, second = poll(100, 10, 1.0, 4, 10, 100), poll(300, 50, 2.0, 8, 70, 200)
    s = snapshot(second, first, 2.0)
    assert s["prompt_tps"] == 100 and s["generation_tps"] == 20
    assert s["ttft_mean_s"] == pytest.approx(0.25)
    assert s["prefix_hit_rate"] == pytest.approx(0.6)  # the window's 60 of 100, not the lifetime 70 of 200
    assert s["preemptions_delta"] == 0
    alone = snapshot(second)
    assert alone["prompt_tps"] is None and alone["window_s"] is None
    assert alone["ttft_mean_s"] == pytest.approx(0.25) and alone["prefix_hit_rate"] == pytest.approx(0.35)
    restarted = snapshot(first, second, 2.0)  # counters went down: the server restarted
    assert restarted["prompt_tps"] == 50


def test_once_against_an_unreachable_port_fails_with_one_line():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MetricsUnreachableError, match="cannot reach") as info:
        run(args_for(f"http://127.0.0.1:{port}"))
    assert isinstance(info.value, OSError) and "\n" not in str(info.value)


class _Serve:
    """A tiny HTTP server on 127.0.0.1 that answers /metrics with `body()`."""

    def __init__(self, body, content_type: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = body() if self.path == "/metrics" else b""
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep the test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> _Serve:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_once_prints_a_snapshot_of_a_live_render(tiny_llama, capsys):
    engine = LLM(tiny_llama, kv_cache_memory="2MiB", block_size=16).engine
    metrics = ServerMetrics(engine, "tiny")
    engine.add_request("a", list(range(3, 8)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       stream=True)
    metrics.on_step(engine.step(), time.monotonic())  # one sequence of 6 tokens running, 5 of 16 slots filled
    with _Serve(metrics.render, metrics.content_type) as srv:
        assert run(args_for(srv.url + "/")) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # --once does not clear the screen
    assert srv.url in out
    assert "running 1   waiting 0" in out
    assert "used 1 " in out
    assert "Fragmentation  68.8%" in out  # 1 - 5/16
    assert "mean 6   max 6 tokens" in out
    assert "! 68.8% of allocated KV token slots are empty" in out
    assert "TTFT mean" in out and "no rates yet" in out
    samples = read_samples(metrics.render().decode())
    assert samples["kvcache:kv_blocks{state=used}"] == 1


def test_tier_and_swap_lines_from_a_live_render(tiny_llama, tmp_path, capsys):
    """With a cpu and a disk tier and swap: one line per tier (bytes held, swap bytes, hit rate, stored, errors)."""
    engine = LLM(tiny_llama, kv_cache_memory=12 * 8 * 512, block_size=8, preemption_mode="swap",
                 kv_offload_memory="4MiB", kv_offload_dir=str(tmp_path), max_num_batched_tokens=48).engine
    metrics = ServerMetrics(engine, "tiny")
    for i in range(4):
        engine.add_request(str(i), list(range(3 + i, 8 + i)), SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True))
    while engine.has_unfinished_requests():
        metrics.on_step(engine.step(), time.monotonic())
    engine.offload.flush()
    metrics.on_step([], time.monotonic())
    with _Serve(metrics.render, metrics.content_type) as srv:
        assert run(args_for(srv.url)) == 0
    out = capsys.readouterr().out
    cpu, disk = engine.offload.tiers
    sched = engine.scheduler
    assert "tier cpu" in out and "tier disk" in out
    assert f"stored {cpu.stats.stored:,}" in out and "(0 B swap)" in out
    assert f"Swap           out {sched.num_swapped_out}   in {sched.num_swapped_in}   fell back to recompute 0" in out
    snap = snapshot(read_samples(metrics.render().decode()))
    assert [t["tier"] for t in snap["tiers"]] == ["cpu", "disk"] and snap["tiers"][0]["bytes_used"] == cpu.used_bytes


def test_a_server_without_kvcache_metrics_is_an_error():
    with _Serve(lambda: b"# TYPE other gauge\nother 1\n", "text/plain") as srv:
        with pytest.raises(ValueError, match="no kvcache"):
            run(args_for(srv.url))


def test_the_pressure_ladder_evicting_is_warned_about():
    warns = warnings_for({**HEALTHY, "pressure_evicted_tokens": 900.0, "pressure_evicted_delta": 120.0})
    assert len(warns) == 1 and "evicted 120 cached tokens" in warns[0] and "in this window" in warns[0]
    assert "kv_pressure" in warns[0] and "--kv-cache-memory" in warns[0]
    assert warnings_for({**HEALTHY, "pressure_evicted_tokens": 900.0, "pressure_evicted_delta": 0.0}) == []
    once = warnings_for({**HEALTHY, "window_s": None, "pressure_evicted_tokens": 900.0})
    assert len(once) == 1 and "since start-up" in once[0]
