"""`kvcache bench pressure` on a tiny random-weight Llama: the constrained runs preempt or evict, preemption's
outputs are the unconstrained run's (top-1 100%, KL 0), the ladder's evictions show in its quality columns, and the
JSON and plot are written; bad settings are refused."""
import argparse
import json

import pytest

from kvcache.eval import pressure


def _args(tiny, tmp_path, *extra):
    p = argparse.ArgumentParser()
    pressure.add_args(p)
    return p.parse_args(["--model", tiny, "--prompts", "random", "--num-requests", "8", "--prompt-len", "128",
                         "--output-len", "96", "--pool-requests", "3", "--max-num-batched-tokens", "64",
                         "--max-evict", "0.5", "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png"),
                         *extra])


def test_preemption_is_exact_and_the_ladder_reports_its_cost(tiny_llama, tmp_path):
    assert pressure.run(_args(tiny_llama, tmp_path)) == 0
    runs = json.loads((tmp_path / "p.json").read_text())["runs"]
    assert list(runs) == ["unconstrained", "preempt", "ladder 0.5"] and (tmp_path / "p.png").stat().st_size > 0
    free, preempt, ladder = runs.values()
    assert free["num_preemptions"] == 0 and preempt["num_preemptions"] > 0
    assert free["top1"] == preempt["top1"] == preempt["min_request_top1"] == 1.0
    assert preempt["kl"] < 1e-9 and preempt["pressure_evicted_tokens"] == 0
    assert ladder["pressure_evicted_tokens"] > 0
    assert sum(r["kv_degradation"]["evicted_tokens"] for r in ladder["per_request"]) == ladder["pressure_evicted_tokens"]
    assert ladder["min_request_top1"] < 1.0 and ladder["kl"] > preempt["kl"]  # evicting costs something measurable
    for r in runs.values():
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["itl_p50_s"] <= r["itl_p99_s"] and r["output_tokens_per_s"] > 0
    assert preempt["throughput_vs_preempt"] == 1.0


def test_a_pool_that_holds_the_workload_is_refused(tiny_llama, tmp_path):
    with pytest.raises(SystemExit, match="--pool-requests 8 must be below --num-requests 8"):
        pressure.run(_args(tiny_llama, tmp_path, "--pool-requests", "8"))


def test_the_corpus_gives_distinct_windows_or_says_why():
    class Words:
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text.split())))
    got = pressure.prompts(Words(), 9, 100)
    assert len(got) == 9 and all(len(w) == 100 for w in got) and got[8][0] == 100  # the 9th: doc 0's 2nd window
    with pytest.raises(ValueError, match="cannot give 9 distinct windows of 100,000 tokens"):
        pressure.prompts(Words(), 9, 100_000)
