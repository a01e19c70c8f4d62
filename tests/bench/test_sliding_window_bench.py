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
    # every layer slides: the window's blocks (2) and one more, whatever the length; the planner says the same
    assert [row["given_back"] for row in mistral["per_request"]] == [2, 3, 3]
    assert [row["one_table"] for row in mistral["per_request"]] == [2, 8, 32]
    assert all(row["planner"] == row["given_back"] for row in mistral["per_request"])
    # a global layer among the local ones: one table keeps every block
    assert all(row["given_back"] == row["one_table"] == row["all_blocks"] for row in gemma["per_request"])
    c = mistral["concurrency"]
    assert c["given_back"]["mean_decoding"] > c["one_table"]["mean_decoding"] and c["given_back"]["preemptions"] == 0
