"""Bad benchmark flags are refused with one line naming the flag, before any model loads or any run starts."""
from __future__ import annotations

import pytest

from kvcache.cli import main


@pytest.mark.parametrize("argv, words", [
    (["throughput", "--num-prompts", "2", "--baseline", "hf", "--hf-batch-sizes=-1"], "--hf-batch-sizes"),
    (["throughput", "--num-prompts", "2", "--baseline", "hf", "--hf-batch-sizes", "8,0"], "--hf-batch-sizes"),
    (["kv-cache-on-off", "--max-tokens", "4", "--repeats", "0", "--plot", ""], "--repeats"),
    (["throughput", "--num-prompts", "2", "--repeats", "0"], "--repeats"),
    (["throughput", "--workload", "shared-prefix", "--repeats", "2"], "--repeats"),
    (["throughput", "--preemption-modes", "recompute,swap", "--repeats", "2"], "--repeats"),
    (["mla", "--contexts", "abc"], "--contexts"),
    (["mla", "--contexts", "0"], "--contexts"),
    (["sliding-window", "--lengths", "1"], "--lengths"),
    (["spec-decode", "--temperature", "-1"], "temperature"),
    (["spec-decode", "--doc-chars", "0"], "--doc-chars"),
])
def test_bad_benchmark_flags_are_refused_up_front(capsys, monkeypatch, argv, words):
    import kvcache.engine.llm as llm
    monkeypatch.setattr(llm.LLM, "__init__", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error: ") and words in err and "Traceback" not in err


def test_an_empty_json_path_writes_nothing(tmp_path, monkeypatch, capsys):
    from kvcache.bench.report import write_json
    monkeypatch.chdir(tmp_path)
    write_json("", {"a": 1})
    write_json(str(tmp_path / "r" / "x.json"), {"a": 1})
    assert [p.name for p in tmp_path.rglob("*.json")] == ["x.json"] and "wrote" in capsys.readouterr().out
