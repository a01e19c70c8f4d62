"""`kvcache bench replicas`' table: its ratios when round-robin scores 0 (the run itself is tests/server's)."""
from __future__ import annotations

from kvcache.bench.replicas import _print, _ratio


def test_a_ratio_over_zero_is_no_ratio_and_prints_n_a(capsys):
    run = {"prefix_cache_hit_rate": 0.444, "mean_ttft_ms": 120.0, "output_tokens_per_s": 50.0, "failed": 0}
    rr = {**run, "prefix_cache_hit_rate": 0.0, "mean_ttft_ms": 200.0}
    w = {"kv-aware": run, "round-robin": rr, "hit_rate_ratio": _ratio(0.444, 0.0), "ttft_ratio": _ratio(120.0, 200.0)}
    assert w["hit_rate_ratio"] is None and w["ttft_ratio"] == 0.6
    _print({"replicas": 2, "model": "demo", "workloads": {"shared-prefix": w}})
    out = capsys.readouterr().out
    assert "hit rate n/a (round-robin 0.0%), mean TTFT 0.60x" in out and "44.4%" in out
