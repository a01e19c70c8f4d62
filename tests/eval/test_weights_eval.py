"""`kvcache eval weights`: each weight format and compute dtype against float32, quality and single-stream speed,
end to end on a tiny model."""
from __future__ import annotations

import json

import pytest

from kvcache.cli import main

from test_kv_quality import _tiny_corpus


@pytest.mark.bench
def test_command_end_to_end_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "w.json"
    rc = main(["eval", "weights", "--model", tiny_llama, "--corpus", _tiny_corpus(tmp_path / "c.txt"),
               "--num-docs", "2", "--context-len", "64", "--warmup", "4", "--chunk-size", "16", "--decode-prompt", "8",
               "--decode-tokens", "6", "--variants", "int8,none:bfloat16", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["variants"]
    assert list(r) == ["none:float32", "int8:float32", "none:bfloat16"]
    base, q, bf = r["none:float32"], r["int8:float32"], r["none:bfloat16"]
    assert (base["kl"], base["top1"], base["ppl_delta_pct"]) == (0.0, 1.0, 0.0)
    assert 0 < q["kl"] < 0.05 and q["top1"] > 0.8 and q["weight_bytes"] < 0.45 * base["weight_bytes"]
    assert 0 < bf["kl"] and bf["weight_bytes"] == base["weight_bytes"] // 2
    for v in r.values():
        assert v["decode_tok_s"] > 0 and v["speedup"] == pytest.approx(v["decode_tok_s"] / base["decode_tok_s"])
    assert "weights:compute" in capsys.readouterr().out
    assert main(["eval", "weights", "--model", tiny_llama, "--variants", "int4"]) == 2
