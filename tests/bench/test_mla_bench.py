import argparse
import json

from kvcache.bench import mla


def test_the_benchmark_measures_the_latent_pool_and_both_attention_forms(tmp_path):
    p = argparse.ArgumentParser()
    mla.add_args(p)
    out = tmp_path / "mla.json"
    args = p.parse_args(["--contexts", "32,80", "--batch", "2", "--steps", "2", "--json", str(out)])
    assert mla.run(args) == 0  # the engine's bytes per token are the planner's in every format
    r = json.loads(out.read_text())
    by = {row["kv_cache_dtype"]: row for row in r["bytes_per_token"]}
    assert by["float32"]["engine"] == 2 * (512 + 64) * 4 and by["int8"]["engine"] == 2 * (576 + 2)
    # 16 heads of 192-value keys and 128-value values against one 576-value latent
    assert by["bfloat16"]["mha_equivalent"] == 2 * 16 * (192 + 128) * 2
    presets = {row["model"]: row for row in r["presets"]}
    assert presets["deepseek-v3"]["latent"] == 70_272 and presets["deepseek-v3"]["mha_equivalent"] == 4_997_120
    assert [row["context"] for row in r["decode"]] == [32, 80]
    assert all(row["absorbed_step_s"] > 0 and row["expanded_step_s"] > 0 for row in r["decode"])
