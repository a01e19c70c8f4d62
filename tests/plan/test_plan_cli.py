"""`kvcache plan` and `kvcache simulate` through `kvcache.cli.main`: exact numbers, JSON and text output,
files written, one-line errors (exit 2, no traceback), and no torch on these paths."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from kvcache.cli import main
from kvcache.plan.presets import GPU_PRESETS, MODEL_PRESETS

LLAMA3_8B_PARAMS = 8_030_261_248
TINY_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": 100, "intermediate_size": 128}
ALLOCATORS = ["reserve-max", "contiguous", "paged-1", "paged-16", "paged-64", "paged-256"]
RESULT_KEYS = {"mean_utilization", "peak_utilization", "mean_pool_usage", "peak_pool_usage", "internal_fragmentation",
               "external_fragmentation", "peak_concurrency", "mean_concurrency", "waited", "oom", "preemptions",
               "finished", "makespan_s", "pool_tokens", "name"}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str) -> dict:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def assert_clean_error(rc: int, out: str, err: str) -> str:
    """Exit 2, nothing on stdout, exactly one `kvcache: error: ...` line on stderr; returns the message."""
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcache: error: ")
    assert out == ""
    return lines[0]


# ---- plan: presets, the KV formula, totals ----

def test_plan_list_shows_every_model_and_gpu_preset(capsys):
    rc, out, err = run(capsys, "plan", "--list")
    assert rc == 0 and err == ""
    lines = out.splitlines()
    models_at, gpus_at = lines.index("models:"), lines.index("gpus:")
    model_names = [line.split()[0] for line in lines[models_at + 1:gpus_at]]
    gpu_names = [line.split()[0] for line in lines[gpus_at + 1:]]
    assert model_names == list(MODEL_PRESETS)
    assert gpu_names == list(GPU_PRESETS)
    h100 = next(line for line in lines if line.split()[0] == "h100-80gb")
    assert f"{GPU_PRESETS['h100-80gb']:,}" in h100


def test_plan_llama3_70b_fp16_batch16_16k_is_80_gib(capsys):
    r = run_json(capsys, "plan", "llama-3-70b", "--batch", "16", "--seq-len", "16384", "--kv-cache-dtype", "float16")
    assert r["bytes_per_token"] == 327_680 == 80 * 2 * 8 * 128 * 2
    assert r["total_bytes"] == 85_899_345_920 == 16 * 16384 * 327_680
    assert r["kv_cache_dtype"] == "float16"
    assert (r["batch"], r["seq_len"], r["num_kv_heads"], r["head_dim"]) == (16, 16384, 8, 128)
    assert "kv_budget" not in r  # no device given: no capacity section


def test_plan_llama3_70b_bf16_128k_is_40_gib(capsys):
    r = run_json(capsys, "plan", "llama-3-70b", "--seq-len", "131072", "--kv-cache-dtype", "bfloat16")
    assert r["batch"] == 1
    assert r["total_bytes"] == 42_949_672_960 == 40 * 2**30


def test_plan_text_shows_substituted_formula(capsys):
    rc, out, err = run(capsys, "plan", "llama-3-70b", "--batch", "16", "--seq-len", "16384",
                       "--kv-cache-dtype", "float16")
    assert rc == 0
    assert "80 full layers x 2 x 8 kv_heads x 128 head_dim x 2 bytes = 327,680 bytes/token" in out
    assert "85,899,345,920 bytes (80.00 GiB)" in out
    assert not out.lstrip().startswith("{")


# ---- plan: capacity on a GPU ----

def test_plan_capacity_on_h100_adds_up(capsys):
    r = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb")
    for key in ("kv_cache_bytes", "num_blocks", "max_tokens", "max_concurrency", "max_seq_len_for_batch"):
        assert key in r
    memory = GPU_PRESETS["h100-80gb"]
    assert r["memory_per_gpu"] == memory
    assert r["weight_bytes"] == LLAMA3_8B_PARAMS * 2
    assert r["activation_bytes"] > 0
    assert r["kv_budget"] == int(memory * 0.9) - r["weight_bytes"] - r["activation_bytes"]
    assert r["bytes_per_token"] == r["gpu_bytes_per_token"] == 131_072
    assert r["block_bytes"] == 16 * 131_072
    assert r["num_blocks"] == r["kv_budget"] // r["block_bytes"]
    assert r["max_tokens"] == r["num_blocks"] * 16
    assert r["kv_cache_bytes"] == r["num_blocks"] * r["block_bytes"] <= r["kv_budget"]
    assert r["seq_len"] == 8192  # the model's context
    assert r["max_concurrency"] == pytest.approx(r["num_blocks"] / math.ceil(8192 / 16))
    assert r["max_seq_len_for_batch"] == r["max_tokens"]  # batch 1 gets the whole pool
    assert r["kv_heads_per_gpu"] == 8


def test_plan_activation_reserve_zero(capsys):
    default = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb")
    r = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--activation-reserve", "0")
    assert r["activation_bytes"] == 0
    assert r["kv_budget"] == int(GPU_PRESETS["h100-80gb"] * 0.9) - LLAMA3_8B_PARAMS * 2
    assert r["num_blocks"] > default["num_blocks"]
    assert r["num_blocks"] == r["kv_budget"] // r["block_bytes"]


def test_plan_activation_reserve_given_in_bytes(capsys):
    r = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--activation-reserve", "1GiB")
    assert r["activation_bytes"] == 2**30
    assert r["kv_budget"] == int(GPU_PRESETS["h100-80gb"] * 0.9) - LLAMA3_8B_PARAMS * 2 - 2**30


def test_plan_two_gpus_split_weights_and_kv_heads(capsys):
    one = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb")
    r = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--num-gpus", "2")
    assert (r["num_gpus"], r["tensor_parallel_size"], r["pipeline_parallel_size"]) == (2, 2, 1)
    assert r["weight_bytes"] == LLAMA3_8B_PARAMS * 2 // 2 == one["weight_bytes"] // 2
    assert r["kv_heads_per_gpu"] == 4
    assert r["gpu_bytes_per_token"] == 131_072 // 2 and r["bytes_per_token"] == 131_072  # whole model vs one GPU
    assert r["kv_cache_bytes"] == 2 * r["num_blocks"] * r["block_bytes"]
    assert r["num_blocks"] > 2 * one["num_blocks"]  # half the weights and half the bytes per token per GPU


def test_plan_tp16_replicates_the_8_kv_heads(capsys):
    r = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--num-gpus", "16",
                 "--tensor-parallel-size", "16")
    assert r["tensor_parallel_size"] == 16
    assert r["kv_heads_per_gpu"] == 1
    assert r["gpu_bytes_per_token"] == 32 * 2 * 1 * 128 * 2  # one head per GPU, not half of one
    assert r["weight_bytes"] == int(LLAMA3_8B_PARAMS * 2 / 16)


@pytest.mark.parametrize("extra", [["--num-gpus", "3", "--gpu", "h100-80gb"], ["--tensor-parallel-size", "3"]])
def test_plan_rejects_tp_that_does_not_fit_the_kv_heads(capsys, extra):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-8b", *extra))
    assert "tensor_parallel_size 3" in msg
    assert "8 KV heads" in msg


def test_plan_config_file_with_kv_cache_memory_writes_json(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out_path = tmp_path / "plan.json"
    rc, out, err = run(capsys, "plan", str(config), "--kv-cache-memory", "1MiB", "--kv-cache-dtype", "float32",
                       "--json", str(out_path))
    assert rc == 0, err
    assert f"wrote {out_path}" in out
    assert "2 full layers x 2 x 2 kv_heads x 16 head_dim x 4 bytes = 512 bytes/token" in out  # text, not JSON
    r = json.loads(out_path.read_text())
    assert r["bytes_per_token"] == 2 * 2 * 2 * 16 * 4 == 512
    assert r["kv_budget"] == 2**20
    assert (r["weight_bytes"], r["activation_bytes"]) == (0, 0)
    assert r["num_blocks"] == 2**20 // (16 * r["bytes_per_token"]) == 128
    assert r["max_tokens"] == 128 * 16
    assert r["seq_len"] == 256  # max_position_embeddings
    assert r["max_concurrency"] == pytest.approx(128 / (256 / 16))


# ---- plan: bad input ----

def test_plan_unknown_preset_suggests_close_names(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-7b"))
    assert "'llama-3-7b'" in msg
    assert "did you mean" in msg and "llama-3-8b" in msg and "llama-3-70b" in msg


def test_plan_config_without_layer_count_names_the_field(capsys, tmp_path):
    cfg = {k: v for k, v in TINY_CONFIG.items() if k != "num_hidden_layers"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    msg = assert_clean_error(*run(capsys, "plan", str(path)))
    assert "num_hidden_layers" in msg


def test_plan_gguf_name_without_gguf_magic(capsys, tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all")
    msg = assert_clean_error(*run(capsys, "plan", str(path)))
    assert str(path) in msg and "not a GGUF file" in msg


def test_plan_json_list_is_not_a_config(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("[1, 2, 3]")
    msg = assert_clean_error(*run(capsys, "plan", str(path)))
    assert str(path) in msg and "list" in msg


@pytest.mark.parametrize("flag, value", [("--batch", "0"), ("--seq-len", "-5"), ("--num-parameters", "-5"),
                                         ("--num-parameters", "0"), ("--tensor-parallel-size", "0")])
def test_plan_rejects_non_positive_sizes(capsys, flag, value):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-8b", flag, value, "--gpu", "h100-80gb"))
    assert flag in msg and value in msg


def test_plan_refuses_a_gpu_and_a_memory_together(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--memory", "10GB"))
    assert "--gpu" in msg and "--memory" in msg


def test_plan_refuses_kivi_on_mla_as_the_engine_does(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "deepseek-v3", "--kv-cache-dtype", "int4"))
    assert "int4" in msg and "MLA" in msg


@pytest.mark.parametrize("dtype, kv, per_token", [("float32", "float32", 262_144), ("float16", "float16", 131_072),
                                                  ("int8", "bfloat16", 131_072), ("auto", "bfloat16", 131_072)])
def test_plan_kv_auto_follows_the_weight_dtype(capsys, dtype, kv, per_token):
    r = run_json(capsys, "plan", "llama-3-8b", "--dtype", dtype, "--gpu", "h100-80gb")
    assert (r["kv_cache_dtype"], r["bytes_per_token"]) == (kv, per_token)


def test_plan_unknown_kv_dtype_lists_supported(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-8b", "--kv-cache-dtype", "int3"))
    assert "'int3'" in msg
    for name in ("float32", "bfloat16", "float16", "fp8_e4m3", "int8", "int4", "int2"):
        assert name in msg


def test_plan_unknown_gpu_lists_presets(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-8b", "--gpu", "h100"))
    assert "'h100'" in msg
    for name in GPU_PRESETS:
        assert name in msg


def test_plan_kv_cache_memory_below_one_block(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-8b", "--kv-cache-memory", "1KiB"))
    assert "1,024" in msg and "one block" in msg
    assert "2,097,152" in msg  # 16 tokens x 131,072 bytes


def test_plan_weights_do_not_fit(capsys):
    msg = assert_clean_error(*run(capsys, "plan", "llama-3-70b", "--memory", "16GiB"))
    assert "weights" in msg
    assert f"{70_553_706_496 * 2:,}" in msg


# ---- simulate ----

@pytest.fixture(scope="module")
def sim200() -> dict:
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["simulate", "--num-requests", "200", "--seed", "1", "--json"]) == 0
    return json.loads(buf.getvalue())


def test_simulate_json_has_every_allocator(sim200):
    allocators = sim200["allocators"]
    assert list(allocators) == ALLOCATORS
    for name, row in allocators.items():
        assert RESULT_KEYS <= set(row), name
        assert row["name"] == name
        assert row["finished"] + row["oom"] == 200
        assert 0 < row["mean_utilization"] <= 1
    assert sim200["trace"]["requests"] == 200
    assert sim200["bytes_per_token"] == 131_072  # llama-3-8b bf16
    assert sim200["pool_tokens"] == 4 * 2**30 // 131_072
    assert sim200["pool_bytes"] == 4 * 2**30


def test_simulate_paging_beats_reservation(sim200):
    a = sim200["allocators"]
    assert a["paged-16"]["mean_utilization"] >= 0.95
    assert a["reserve-max"]["mean_utilization"] < 0.5
    assert a["paged-1"]["internal_fragmentation"] == 0
    assert a["paged-1"]["mean_utilization"] >= a["paged-16"]["mean_utilization"] \
        >= a["paged-64"]["mean_utilization"] >= a["paged-256"]["mean_utilization"]


def test_simulate_text_table(capsys):
    rc, out, err = run(capsys, "simulate", "--num-requests", "50", "--seed", "1")
    assert rc == 0, err
    assert out.startswith("trace: 50 requests")
    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert set(ALLOCATORS) <= rows


def test_simulate_plot_writes_png(capsys, tmp_path):
    png = tmp_path / "util.png"
    rc, out, err = run(capsys, "simulate", "--num-requests", "50", "--seed", "1", "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out


def test_simulate_saved_trace_replays_identically(capsys, tmp_path, sim200):
    trace = tmp_path / "T.jsonl"
    first = run_json(capsys, "simulate", "--num-requests", "200", "--seed", "1", "--save-trace", str(trace))
    lines = trace.read_text().splitlines()
    assert len(lines) == 200
    assert set(json.loads(lines[0])) >= {"arrival_s", "prompt_tokens", "output_tokens"}
    again = run_json(capsys, "simulate", "--trace", str(trace))
    assert again["trace"]["source"] == str(trace)
    assert again["trace"]["requests"] == 200
    assert {k: v for k, v in again["trace"].items() if k != "source"} == \
        {k: v for k, v in first["trace"].items() if k != "source"}
    assert again["allocators"]["paged-16"] == first["allocators"]["paged-16"] == sim200["allocators"]["paged-16"]
    assert again["allocators"] == first["allocators"]


def test_simulate_prefix_sharing_row(capsys):
    r = run_json(capsys, "simulate", "--num-requests", "100", "--seed", "1", "--prefix-groups", "4",
                 "--prefix-len", "512")
    assert list(r["allocators"]) == [*ALLOCATORS, "paged-16+prefix"]
    shared, plain = r["allocators"]["paged-16+prefix"], r["allocators"]["paged-16"]
    assert shared["finished"] == 100
    # the 512 shared prefix tokens are stored once per group, so more requests fit at once
    assert shared["peak_concurrency"] > plain["peak_concurrency"]
    assert shared["waited"] < plain["waited"]
    no_prefix = run_json(capsys, "simulate", "--num-requests", "100", "--seed", "1")
    assert "paged-16+prefix" not in no_prefix["allocators"]


def test_simulate_seed_scenario_default_80gb(capsys):
    rc, out, err = run(capsys, "simulate", "--scenario", "seed")
    assert rc == 0, err
    assert out.startswith("Pool 80 GiB = 655,360 tokens x 131,072 bytes/token.")
    assert "free the 2.3 GiB one, then ask for 7.5 GiB" in out
    assert "contiguous:" in out and "paged-16:" in out and "reserve-max:" in out
    assert "refused" not in out  # 80 GB: everything fits somewhere
    assert "hole before it is too small" in out


def test_simulate_seed_scenario_15gib_contiguous_refuses(capsys):
    rc, out, err = run(capsys, "simulate", "--scenario", "seed", "--kv-cache-memory", "15GiB")
    assert rc == 0, err
    sections = {}
    for line in out.splitlines()[1:]:
        if not line.startswith(" "):
            current = line.rstrip(":")
            sections[current] = []
        else:
            sections[current].append(line.strip())
    assert "7.5 GiB -> refused" in sections["contiguous"]
    assert any(s.startswith("7.5 GiB request: refused") and "contiguous" in s for s in sections["contiguous"])
    assert "7.5 GiB -> 3,840 blocks" in sections["paged-16"]
    assert any(s.startswith("7.5 GiB request: fits") for s in sections["paged-16"])
    r = run_json(capsys, "simulate", "--scenario", "seed", "--kv-cache-memory", "15GiB")
    fits = {o["allocator"]: o["new_fits"] for o in r["outcomes"]}
    assert fits["contiguous"] is False and fits["paged-16"] is True
    assert r["pool_bytes"] == 15 * 2**30


# ---- simulate: bad input ----

def test_simulate_trace_with_bad_line_names_file_and_line(capsys, tmp_path):
    trace = tmp_path / "T.jsonl"
    good = json.dumps({"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 3})
    trace.write_text(f"{good}\n{good}\nnot json\n")
    msg = assert_clean_error(*run(capsys, "simulate", "--trace", str(trace)))
    assert "T.jsonl:3" in msg and "not JSON" in msg


def test_simulate_unknown_length_spec(capsys):
    msg = assert_clean_error(*run(capsys, "simulate", "--prompt-len", "triangle:1:2"))
    assert "'triangle:1:2'" in msg and "prompt" in msg and "uniform:LO:HI" in msg


def test_simulate_pool_below_one_block(capsys):
    msg = assert_clean_error(*run(capsys, "simulate", "--kv-cache-memory", "1KiB"))
    assert "--kv-cache-memory 1KiB" in msg and "not one block" in msg


def test_simulate_bad_block_sizes_is_a_clean_error(capsys):
    rc, out, err = run(capsys, "simulate", "--block-sizes", "16,abc")
    assert_clean_error(rc, out, err)


def test_simulate_bad_block_sizes_message_names_the_flag(capsys):
    # The message should say which flag holds the bad value, not just "invalid literal for int()".
    msg = assert_clean_error(*run(capsys, "simulate", "--block-sizes", "16,abc"))
    assert "--block-sizes" in msg and "abc" in msg


# ---- no torch on these paths ----

def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_plan_modules_import_without_torch():
    p = _python("import kvcache.cli, kvcache.plan.model_source, kvcache.plan.simulate, kvcache.plan.report, "
                "kvcache.plan.capacity; import sys; assert 'torch' not in sys.modules, 'torch imported'")
    assert p.returncode == 0, p.stderr


def test_plan_and_simulate_commands_run_without_torch():
    p = _python("import json, sys\nfrom kvcache.cli import main\n"
                "assert main(['plan', 'smollm2-135m', '--json']) == 0\n"
                "assert main(['simulate', '--num-requests', '20', '--json']) == 0\n"
                "assert 'torch' not in sys.modules, 'torch imported'\n")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout[:p.stdout.index("\n}\n") + 2])
    assert plan["bytes_per_token"] == 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64


def test_plan_kv_cache_memory_share_is_of_the_gpu(capsys):
    """As the engine takes it on CUDA: 25% of the named GPU's memory, not of this machine's RAM."""
    r = run_json(capsys, "plan", "llama-3-8b", "--gpu", "h100-80gb", "--kv-cache-memory", "25%")
    assert r["kv_budget"] == int(GPU_PRESETS["h100-80gb"] * 0.25)
