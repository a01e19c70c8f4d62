import argparse
import json

from kvcache.bench import tensor_parallel


def test_the_benchmark_runs_one_and_two_ranks_side_by_side(tmp_path, tiny_model_dirs):
    p = argparse.ArgumentParser()
    tensor_parallel.add_args(p)
    out = tmp_path / "tp.json"
    args = p.parse_args(["--model", tiny_model_dirs["llama"], "--num-prompts", "4", "--input-len", "8:32",
                         "--output-len", "4:12", "--single-stream", "1", "--kv-cache-memory", "1MiB",
                         "--max-model-len", "256", "--json", str(out)])
    assert tensor_parallel.run(args) == 0
    r = json.loads(out.read_text())
    assert set(r["workloads"]) == {"batch", "single stream"}
    for w in r["workloads"].values():
        one, two = w["rows"]
        assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
        assert two["same_tokens_as_1"] and one["speedup_vs_1"] == 1.0 and two["speedup_vs_1"] > 0
        # 2 KV heads: one per rank, half the bytes per token, as the planner counts per GPU
        assert two["kv_bytes_per_token_per_rank"] * 2 == one["kv_bytes_per_token_per_rank"]
        for row in (one, two):
            assert row["kv_bytes_per_token_per_rank"] == row["planner_kv_bytes_per_token_per_gpu"]
        assert two["num_blocks"] == 2 * one["num_blocks"]  # the same bytes per rank hold twice the tokens
