import argparse
import json

from kvcache.bench import kv_page


def test_the_benchmark_times_the_snapshot_and_serving_with_viewers(tiny_llama, tmp_path):
    p = argparse.ArgumentParser()
    kv_page.add_args(p)
    out = tmp_path / "kv.json"
    args = p.parse_args(["--num-blocks", "3000", "--repeats", "2", "--viewers", "2", "--requests", "2",
                         "--max-tokens", "8", "--model", tiny_llama, "--quantization", "none", "--json", str(out)])
    assert kv_page.run(args) == 0
    r = json.loads(out.read_text())
    assert [s["prefix_caching"] for s in r["snapshot"]] == ["hash", "radix"]
    for s in r["snapshot"]:
        assert s["num_blocks"] > 3000 and s["held"] > 0 and s["cached_idle"] > 1000 and s["requests"] == 64
        assert s["take_ms_median"] > 0 and s["json_bytes"] > 3000
    assert [s["viewers"] for s in r["serving"]] == [0, 2, 0]
    assert all(s["output_tok_s"] > 0 for s in r["serving"]) and r["serving"][1]["events_per_viewer"] >= 1
