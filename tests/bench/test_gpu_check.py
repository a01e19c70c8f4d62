"""The one-shot GPU check (`make gpu-check`, issue 14) is run on a GPU only when a session is lent one, so its
plumbing is checked here on the CPU: `--small` end to end, as on the GPU machine, which has no server packages
(fastapi and uvicorn are made unimportable for the run), and what it writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_check_runs_end_to_end_without_the_server_packages(tmp_path):
    blocked = tmp_path / "blocked"
    for name in ("fastapi", "uvicorn"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    out = tmp_path / "gc"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "scripts/gpu_check.py", "--small", "--skip", "tests", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    steps = {s["step"]: s["returncode"] for s in report["steps"]}
    assert steps == {"attention": 0, "throughput": 0, "decode_graphs": 0, "decode_eager": 0}
    rows = {(x["kv_cache_dtype"], x["backend"]): x for x in report["attention"]["results"]}
    assert set(rows) == {("float32", "cpu"), ("float32", "torch"), ("fp8_e4m3", "cpu"), ("fp8_e4m3", "torch")}
    assert all(x["time_ms"] > 0 and 0 < x["bandwidth_fraction"] for x in rows.values())
    tp = report["throughput"]
    assert tp["dtype"] == "bfloat16" and tp["workload"]["num_prompts"] == 8
    assert tp["kvcache"]["output_tokens_per_s"] > 0 and tp["kvcache"]["decode_steps"]["x_roofline"] > 0
    assert report["decode_graphs"]["graphs_tokens_per_s"] > 0 and report["decode_graphs"]["eager_tokens_per_s"] > 0
    summary = (out / "summary.txt").read_text()
    assert summary.splitlines() == report["summary"]
    assert "transformers best static batch" in summary and "decode attention, 4 x 256 on cpu" in summary
