"""`kvcache bench soak` for 60 s on the tiny model, as CI's short soak: a mixed workload with client disconnects and
bad requests while the Redis tier's server is killed and restarted and the disk tier's directory is made unusable,
then SIGTERM. The hour-long run is the same command with --duration 3600 (docs/serving.md)."""
from __future__ import annotations

import json
import os

import pytest

from kvcache.cli import main


def test_a_short_soak_with_faults_passes_its_checks(tiny_llama, tmp_path, capsys):
    out = tmp_path / "soak.json"
    status = main(["bench", "soak", "--model", tiny_llama, "--duration", "60", "--sample-interval", "5", "--window",
                   "15", "--warmup", "15", "--kv-cache-memory", "1MiB", "--concurrency", "8", "--json", str(out),
                   "--plot", str(tmp_path / "soak.png")])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    v = r["verdicts"]
    # what a loaded CI machine cannot change: no 5xx outside the faults, 4xx for bad input, nothing held when idle,
    # both faults counted by the server and survived, and a clean exit on SIGTERM (RSS is reported, not judged here)
    for name in ("no_unexpected_5xx", "bad_requests_got_4xx", "idle_blocks_zero", "faults_counted_and_survived",
                 "clean_exit", "no_fd_growth", "no_thread_growth"):
        assert v[name], (name, r["requests"], r["faults"], r["exit"], r["growth_after_warmup"])
    assert status == (0 if all(v.values()) else 1)
    assert [f["fault"] for f in r["faults"]] == ["redis", "disk"]
    kinds = r["requests"]["by_kind"]
    assert set(kinds) == {"completion", "chat", "stream", "chat_stream", "n2", "bad"}
    assert r["requests"]["disconnected"] > 0
    assert all(w["requests"] > 0 for w in r["windows"]) and len(r["windows"]) == 4
    assert len(r["samples"]) >= 10 and all(s["rss_mib"] > 0 for s in r["samples"])
    assert os.path.getsize(tmp_path / "soak.png") > 10_000
    assert "PASS  clean_exit" in printed


@pytest.mark.parametrize("argv, words", [
    (["--faults", "flood"], "unknown fault 'flood'"),
    (["--faults", "replica"], "needs --replicas 2"),
    (["--duration", "0"], "--duration must be > 0"),
    (["--redis-server", "/nonexistent/redis"], "the redis fault needs"),
])
def test_bad_soak_flags_are_refused_before_any_server_starts(argv, words, capsys):
    assert main(["bench", "soak", *argv, "--json", ""]) == 2
    assert words in capsys.readouterr().err
