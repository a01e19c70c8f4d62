import argparse
import json

import pytest

from kvcache.bench import sliding_window


def test_the_benchmark_measures_the_blocks_given_back_against_one_table(tmp_path):
    p = argparse.ArgumentParser()
    sliding_window.add_args(p)
    out = tmp_path / "sw.json"
    args = p.parse_args(["--window", "16", "--block-size", "8", "--lengths", "16,64,256", "--requests", "16",
                         "--max-num-batched-tokens", "64", "--json", str(out)])
    assert sliding_window.run(args) == 0  # both runs gave the same greedy tokens
    r = json.loads(out.read_text())
    mistral, gemma = r["mistral"], r["gemma3"]
    per_block = mistral["per_request"][0]["all_bytes"] // 2  # 16 tokens: two blocks of every layer
    # every layer slides: the window's blocks (2) and one more, whatever the length; the planner says the same
    assert [row["given_back_bytes"] // per_block for row in mistral["per_request"]] == [2, 3, 3]
    assert [row["one_table_bytes"] // per_block for row in mistral["per_request"]] == [2, 8, 32]
    assert all(row["planner_bytes"] == row["given_back_bytes"] for row in mistral["per_request"])
    # 5 local layers to 1 global: one table keeps every block of every layer; with a table per layer group the
    # local layers hold 3 blocks each, the global one every block (256 tokens: 32 + 5 x 3 of 6 layer-blocks)
    assert all(row["one_table_bytes"] == row["all_bytes"] for row in gemma["per_request"])
    assert all(row["planner_bytes"] == row["given_back_bytes"] for row in gemma["per_request"])
    long = gemma["per_request"][-1]
    assert long["given_back_bytes"] * 6 == long["all_bytes"] // 32 * (32 + 5 * 3)
    for shape in (mistral, gemma):
        c = shape["concurrency"]
        assert c["request_tokens"] == 128 and c["prompt_tokens"] == 112  # 8x and 7x the window
        g, o = c["given_back"], c["one_table"]
        assert o["most_decoding"] <= 4  # the pool holds 4 requests whole
        assert g["most_decoding"] > o["most_decoding"]
        assert g["mean_decoding_while_waiting"] > o["mean_decoding_while_waiting"] >= o["mean_decoding"] / 2
        assert g["preemptions"] <= o["preemptions"]


@pytest.mark.parametrize("prompt_len", ["0", "128"])
def test_a_prompt_as_long_as_the_request_is_refused(tmp_path, prompt_len):
    p = argparse.ArgumentParser()
    sliding_window.add_args(p)
    args = p.parse_args(["--window", "16", "--prompt-len", prompt_len, "--json", str(tmp_path / "sw.json")])
    with pytest.raises(ValueError, match="--prompt-len must be from 1 to 127"):
        sliding_window.run(args)
    assert not (tmp_path / "sw.json").exists()
