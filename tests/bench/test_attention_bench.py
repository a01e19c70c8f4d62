import argparse
import json

import pytest

from kvcache.bench import attention


def _run(tmp_path, *argv):
    p = argparse.ArgumentParser()
    attention.add_args(p)
    out = tmp_path / "attention.json"
    args = p.parse_args(["--device", "cpu", "--batch", "2", "--context", "128", "--seconds", "0.05", "--backends",
                         "cpu,torch", "--json", str(out), *argv])
    assert attention.run(args) == 0
    return json.loads(out.read_text())


def test_kivi_formats_run_on_the_engine_s_block_size_beside_the_others(tmp_path):
    """int4 and int2 (KIVI) run, on 64-token blocks (one key group, the engine's default for them) for every format
    of the run; each backend's time is real and the kernel's bytes are the format's."""
    r = _run(tmp_path, "--kv-cache-dtype", "float32,int8,int4,int2")
    assert r["block_size"] == 64
    rows = {(x["kv_cache_dtype"], x["backend"]): x for x in r["results"]}
    assert set(rows) == {(f, b) for f in ("float32", "int8", "int4", "int2") for b in ("cpu", "torch")}
    assert all(x["time_ms"] > 0 and x["speedup_vs_torch"] > 0 for x in rows.values())
    read = {f: rows[(f, "cpu")]["gbytes_read"] for f in ("float32", "int8", "int4", "int2")}
    assert read["float32"] > read["int8"] > read["int4"] > read["int2"]


def test_a_kivi_context_off_its_key_group_is_refused_with_the_next_one(tmp_path):
    with pytest.raises(ValueError, match=r"multiple of 64 \(e\.g\. 192\)"):
        _run(tmp_path, "--kv-cache-dtype", "int4", "--context", "130")
