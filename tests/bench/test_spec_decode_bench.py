import argparse
import json

import pytest

from kvcache.bench import spec_decode


@pytest.mark.parametrize("method, temperature", [("ngram", "0"), ("ngram", "0.8"), ("draft_model", "0.8")])
def test_the_benchmark_compares_speculation_with_plain_decoding(tiny_llama, tmp_path, method, temperature):
    p = argparse.ArgumentParser()
    spec_decode.add_args(p)
    out = tmp_path / "sd.json"
    args = p.parse_args(["--model", tiny_llama, "--method", method, "--draft-quantization", "int8", "--quantization", "none", "--batches", "1,3", "--rounds", "1",
                         "--max-tokens", "24", "--kv-cache-memory", "16MiB", "--prompt-lookup-min", "1",
                         "--temperature", temperature, "--json", str(out)])
    assert spec_decode.run(args) == 0  # identical tokens in every row (sampled: seeded, the same draws)
    r = json.loads(out.read_text())
    assert r["temperature"] == float(temperature)
    assert r["speculative_config"]["method"] == method
    if method == "draft_model":  # the target's checkpoint, its weights int8
        assert (r["speculative_config"]["model"], r["speculative_config"]["quantization"]) == (tiny_llama, "int8")
    assert [(row["workload"], row["batch"]) for row in r["rows"]] == [("grounded", 1), ("grounded", 3),
                                                                      ("random", 1), ("random", 3)]
    for row in r["rows"]:
        assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
        assert 0 <= row["accepted_tokens"] <= row["draft_tokens"]
        assert 0 < row["propose_share"] < 1
    assert sum(row["drafts"] for row in r["rows"]) > 0


def test_the_profile_counts_verification_steps_apart(tiny_llama, tmp_path, capsys):
    """--profile: the plain engine has decode steps only; the speculating one, alone in its batch, one verify step
    per proposal, and its accepted tokens fewer decoding steps than plain decoding's for the same tokens."""
    p = argparse.ArgumentParser()
    spec_decode.add_args(p)
    out = tmp_path / "sd.json"
    args = p.parse_args(["--model", tiny_llama, "--quantization", "none", "--batches", "1", "--rounds", "1",
                         "--max-tokens", "24", "--kv-cache-memory", "16MiB", "--prompt-lookup-min", "1",
                         "--profile", "--json", str(out)])
    assert spec_decode.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        plain, spec = row["plain_profile"], row["spec_profile"]
        assert not any(k.startswith("verify") for k in plain) and "decode 1" in plain
        stepping = {name: sum(r["steps"] for k, r in prof.items() if k != "prefill/mixed")
                    for name, prof in (("plain", plain), ("spec", spec))}
        assert stepping["plain"] == 24 - 1  # the prefill step samples the first token
        verify = spec.get("verify 1", {"steps": 0})["steps"]
        assert verify == row["drafts"] and stepping["spec"] == 24 - 1 - row["accepted_tokens"]
    assert any(row["spec_profile"].get("verify 1") for row in rows)
    assert "steps by kind" in capsys.readouterr().out
