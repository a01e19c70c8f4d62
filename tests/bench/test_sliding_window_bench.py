import argparse
import json

from kvcache.bench import sliding_window


def test_the_benchmark_measures_the_blocks_given_back_against_one_table(tmp_path):
    p = argparse.ArgumentParser()
    sliding_window.add_args(p)
    out = tmp_path / "sw.json"
    args = p.parse_args(["--window", "16", "--block-size", "8", "--lengths", "16,64,256", "--requests", "6",
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
        assert c["given_back"]["mean_decoding"] > c["one_table"]["mean_decoding"] and c["given_back"]["preemptions"] == 0
