"""`kvcache bench throughput` end to end on a tiny model: table, JSON, baseline in the same run."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvcache.bench.roofline import workload_bytes, workload_flops
from kvcache.bench.workload import parse_range, random_workload
from kvcache.cli import main


@pytest.mark.bench
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_throughput_writes_json_with_baseline(tiny_llama, tmp_path, capsys, dtype):
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_llama, "--num-prompts", "6", "--input-len", "8:40",
               "--output-len", "4:12", "--seed", "3", "--baseline", "hf", "--hf-batch-sizes", "2,4",
               "--kv-cache-memory", "4MiB", "--device", "cpu", "--dtype", dtype, "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["machine"]["device"], r["dtype"], r["kv_cache_dtype"]) == ("cpu", dtype, dtype)
    assert r["machine"]["torch"] == torch.__version__
    roof = r["roofline"]
    assert roof["gemm_dtype"] == dtype and roof["gemm_gflops"] > 0 and roof["bandwidth_gbs"] > 0
    assert roof["min_time_s"] == max(roof["compute_time_s"], roof["memory_time_s"])
    assert roof["bound"] == ("compute" if roof["compute_time_s"] >= roof["memory_time_s"] else "memory")
    assert roof["workload_gbytes"] * 1e9 == pytest.approx(workload_bytes(
        random_workload(6, (8, 40), (4, 12), 320, 3, {0, 1, 2}), r["kvcache"]["weight_read_bytes"],
        r["kvcache"]["kv_bytes_per_token"]))
    work = random_workload(6, (8, 40), (4, 12), 320, 3, {0, 1, 2})
    assert r["workload"]["output_tokens"] == work.output_tokens
    assert r["workload"]["input_tokens"] == work.input_tokens
    for engine in ("kvcache", "hf"):
        assert r[engine]["output_tokens_per_s"] > 0
        assert r[engine]["peak_memory_bytes"] > 0
        assert 0 < r[engine]["roofline_fraction"]
    assert set(r["hf"]["by_batch_size"]) == {"2", "4"}
    best = max(v["output_tokens_per_s"] for v in r["hf"]["by_batch_size"].values())
    assert r["hf"]["output_tokens_per_s"] == best
    assert r["speedup"] == pytest.approx(r["kvcache"]["output_tokens_per_s"] / best)
    # the six prompts prefill in one step, then decode together: the steps at six rows against the memory roofline
    d, k = r["kvcache"]["decode_steps"], r["kvcache"]
    assert d["running"] == 6 and d["steps"] >= 3 and d["kv_tokens"] >= 6 * 9
    assert 0 < k["weight_read_bytes"] <= k["weight_bytes"]
    assert d["roofline_s"] == pytest.approx((k["weight_read_bytes"] + d["kv_tokens"] * k["kv_bytes_per_token"])
                                            / (roof["bandwidth_gbs"] * 1e9))
    assert d["x_roofline"] == pytest.approx(d["median_s"] / d["roofline_s"]) and d["median_s"] > 0
    table = capsys.readouterr().out
    assert "kvcache decode steps at 6 running sequences" in table
    assert "kvcache" in table and "transformers bs=2" in table and "speedup" in table
    assert f"device: cpu, {dtype} compute, {dtype} KV cache" in table and "-bound)" in table


def test_parse_range_and_workload_are_exact_and_seeded():
    assert parse_range("64:512") == (64, 512)
    assert parse_range("7") == (7, 7)
    for bad in ("0:4", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="A:B"):
            parse_range(bad)
    a = random_workload(10, (5, 9), (2, 3), 100, 1, {0, 1, 2})
    b = random_workload(10, (5, 9), (2, 3), 100, 1, {0, 1, 2})
    assert a == b
    assert all(5 <= len(p) <= 9 for p in a.prompts) and all(2 <= o <= 3 for o in a.output_lens)
    assert not {0, 1, 2} & {t for p in a.prompts for t in p}


def test_workload_flops_counts_layers_attention_and_head():
    """Every layer for every token, but in the last layer only the K and V of prompt tokens that sample nothing."""
    class Cfg:
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 8, 2, 2, 1
        intermediate_size, vocab_size, head_dim = 16, 10, 4
    work = random_workload(1, (3, 3), (2, 2), 10, 0)
    linear = 8 * (2 + 2) * 4 + 2 * 4 * 8 + 3 * 8 * 16
    tokens = 3 + 2 - 1  # positions 0..3; 2 and 3 sample (the prompt's last and the fed-back token)
    first = 2 * linear * tokens + 4 * 2 * 4 * (1 + 2 + 3 + 4)
    last = 2 * linear * 2 + 2 * (8 * 2 * 1 * 4) * 2 + 4 * 2 * 4 * (3 + 4)  # positions 0, 1: their K and V only
    assert workload_flops(Cfg, work) == first + last + 2 * 2 * 8 * 10


@pytest.mark.bench
@pytest.mark.parametrize("workload, extra", [
    ("shared-prefix", ["--num-groups", "3", "--requests-per-group", "4", "--prefix-len", "40", "--suffix-len", "6"]),
    ("multi-turn", ["--num-conversations", "3", "--num-turns", "3", "--prefix-len", "40", "--suffix-len", "6"]),
])
def test_bench_prefix_caching_modes_side_by_side(tiny_llama, tmp_path, capsys, workload, extra):
    """off / hash / radix in one run: same greedy outputs, fewer prefill tokens with caching, numbers that add up."""
    out = tmp_path / "prefix.json"
    rc = main(["bench", "throughput", "--model", tiny_llama, "--workload", workload, *extra, "--output-len", "5",
               "--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "64", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    modes = r["modes"]
    assert list(modes) == ["off", "hash", "radix"]
    n_req = 12 if workload == "shared-prefix" else 9
    for m, v in modes.items():
        assert v["requests"] == n_req and v["output_tokens"] == 5 * n_req
        assert v["outputs_match_first_mode"], f"{m} changed the greedy outputs"
        assert v["prefill_tokens_computed"] == v["input_tokens"] - v["prefix_cache_hits"]
        assert v["ttft_mean_s"] > 0
    assert modes["off"]["prefix_cache_hits"] == 0 and modes["off"]["prefill_reduction"] == 0
    for m in ("hash", "radix"):
        assert modes[m]["prefix_cache_hits"] > 0 and modes[m]["prefill_reduction"] > 0.3
        assert modes[m]["hit_rate"] == pytest.approx(modes[m]["prefix_cache_hits"] / modes[m]["prefix_cache_queries"])
    table = capsys.readouterr().out
    assert "prefix caching" in table and "radix" in table and "fewer" in table


def test_bench_prefix_rejects_bad_flags(tiny_llama, capsys):
    for flags, message in ((["--prefix-caching-modes", "off,lru"], "prefix-caching-modes"),
                           (["--output-len", "4:8"], "one --output-len"),
                           (["--baseline", "hf"], "baseline")):
        rc = main(["bench", "throughput", "--model", tiny_llama, "--workload", "shared-prefix", *flags])
        assert rc == 2 and message in capsys.readouterr().err


def test_workload_bytes_reads_weights_per_step_and_each_sequences_kv():
    work = random_workload(2, (3, 3), (2, 4), 10, 0)
    kv = sum(o * 3 + o * (o - 1) // 2 for o in work.output_lens)
    assert workload_bytes(work, 1000, 7) == max(work.output_lens) * 1000 + kv * 7


@pytest.mark.bench
def test_bench_attention_reports_bandwidth_against_the_torch_path(tmp_path, capsys, monkeypatch):
    out = tmp_path / "attn.json"
    rc = main(["bench", "attention", "--batch", "3", "--context", "70", "--kv-cache-dtype", "float32,int8",
               "--device", "cpu", "--backends", "cpu,torch", "--seconds", "0.05", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["heads"], r["kv_heads"], r["head_dim"]) == (32, 8, 128) and r["bandwidth_gbs"] > 0
    rows = {(x["kv_cache_dtype"], x["backend"]): x for x in r["results"]}
    assert set(rows) == {("float32", "cpu"), ("float32", "torch"), ("int8", "cpu"), ("int8", "torch")}
    assert rows["float32", "cpu"]["gbytes_read"] * 1e9 == 3 * 70 * 8 * 128 * 2 * 4
    assert rows["int8", "cpu"]["gbytes_read"] * 1e9 == 3 * 70 * 8 * (128 + 2) * 2  # codes and fp16 scales
    assert {x["layers"] for x in r["results"]} == {64}  # 1.7 and 0.4 MB a layer: as many as allowed, not 512 MiB
    for x in r["results"]:
        assert x["achieved_gbs"] == pytest.approx(x["gbytes_read"] / (x["time_ms"] / 1e3))
        assert x["speedup_vs_torch"] == pytest.approx(rows[x["kv_cache_dtype"], "torch"]["time_ms"] / x["time_ms"])
    assert "of bandwidth" in capsys.readouterr().out
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel tests run Triton interpreted on the CPU
    rc = main(["bench", "attention", "--device", "cpu", "--backends", "triton", "--batch", "1", "--context", "8"])
    assert rc == 2  # refused, with the reason, before anything is timed


@pytest.mark.bench
def test_bench_kv_cache_on_off_fits_the_growth_of_both(tiny_llama, tmp_path, capsys):
    out, png = tmp_path / "onoff.json", tmp_path / "onoff.png"
    rc = main(["bench", "kv-cache-on-off", "--model", tiny_llama, "--max-tokens", "120", "--prompt-len", "8",
               "--points", "8,30,60,120", "--repeats", "1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert len(r["cached_step_s"]) == 119 and set(r["uncached_step_s"]) == {"8", "30", "60", "120"}
    assert r["uncached_same_token"] == "4/4"  # recomputing the whole sequence gives the cached run's tokens
    # the exponents are the fits of the run's own timings (which is faster is the machine's business: tests never
    # assert time, and a loaded machine has turned the tiny model's ordering round)
    from kvcache.bench.kv_cache_on_off import fit_power
    unc = {int(n): t for n, t in r["uncached_step_s"].items()}
    assert r["step_exponent"]["uncached"] == pytest.approx(fit_power(list(unc), list(unc.values()))[1])
    assert r["step_exponent"]["cached"] == pytest.approx(
        fit_power([8 + i for i in range(1, 120)], r["cached_step_s"])[1])
    last = r["at"][-1]
    assert last["generated"] == 119 and last["speedup"] == pytest.approx(last["uncached_total_s"] / last["cached_total_s"])
    assert png.stat().st_size > 0 and "speedup" in capsys.readouterr().out


@pytest.mark.bench
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_bench_throughput_profile_splits_each_kind_of_step(tiny_llama, tmp_path, capsys, quant):
    from kvcache.attention import cpu_kernel
    from kvcache.models import decoder_layer
    from kvcache.models.linear import Dense
    real = (Dense.forward, decoder_layer.paged_attention, cpu_kernel.paged_decode)
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_llama, "--num-prompts", "5", "--input-len", "8:40",
               "--output-len", "4:12", "--seed", "2", "--kv-cache-memory", "4MiB", "--device", "cpu",
               "--quantization", quant, "--profile", "--json", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())["kvcache"]["profile"]
    assert "prefill/mixed" in prof and any(k.startswith("decode ") for k in prof)
    work = random_workload(5, (8, 40), (4, 12), 320, 2, {0, 1, 2})
    assert sum(r["steps"] for r in prof.values()) >= max(work.output_lens)
    for r in prof.values():
        assert r["kernels"] + r["forward_other"] + r["outside_forward"] == pytest.approx(1)
        assert 0 < r["kernels"] < 1 and r["forward_other"] >= 0 and r["outside_forward"] > 0
    assert "where the time goes" in capsys.readouterr().out
    assert (Dense.forward, decoder_layer.paged_attention, cpu_kernel.paged_decode) == real  # timers removed after


@pytest.mark.bench
def test_bench_offload_tiers_against_hash_alone(tiny_llama, tmp_path, capsys):
    """multi-turn with a pool that holds about one conversation: the cpu and disk tiers load the blocks hash
    alone recomputes (same greedy outputs, fewer prefill tokens), side by side in one run."""
    out = tmp_path / "tiers.json"
    pool = 12 * 16 * 512  # 12 blocks of the tiny model's 512 bytes per token
    rc = main(["bench", "throughput", "--model", tiny_llama, "--workload", "multi-turn", "--num-conversations", "4",
               "--num-turns", "3", "--prefix-len", "64", "--suffix-len", "8", "--output-len", "4",
               "--prefix-caching-modes", "hash,cpu,disk", "--kv-cache-memory", str(pool),
               "--kv-offload-dir", str(tmp_path / "tier"), "--json", str(out)])
    assert rc == 0
    modes = json.loads(out.read_text())["modes"]
    for m in ("cpu", "disk"):
        assert modes[m]["outputs_match_first_mode"]
        assert modes[m]["offload_loaded_blocks"] > 0 and modes[m]["prefill_reduction_vs_hash"] > 0
        assert modes[m]["prefill_tokens_computed"] == modes[m]["input_tokens"] - modes[m]["prefix_cache_hits"]
    assert os.listdir(tmp_path / "tier")  # the given directory is kept
    assert "tier disk / hash alone" in capsys.readouterr().out


@pytest.mark.bench
def test_bench_preemption_modes_side_by_side(tiny_llama, tmp_path, capsys):
    """A pool too small for the workload: both modes preempt the same requests, swap resumes every one of them
    from the cpu tier and prefills only the prompts, recompute prefills more; outputs are the same."""
    out = tmp_path / "p.json"
    rc = main(["bench", "throughput", "--model", tiny_llama, "--num-prompts", "8", "--input-len", "4:12",
               "--output-len", "40:60", "--seed", "2", "--kv-cache-memory", str(14 * 8 * 512), "--block-size", "8",
               "--no-enable-prefix-caching", "--preemption-modes", "recompute,swap", "--json", str(out)])
    assert rc == 0
    modes = json.loads(out.read_text())["preemption_modes"]
    rec, swap = modes["recompute"], modes["swap"]
    assert rec["num_preemptions"] > 0 and swap["num_swapped_in"] == swap["num_preemptions"] > 0
    work = random_workload(8, (4, 12), (40, 60), 320, 2, {0, 1, 2})
    assert swap["prefill_tokens_computed"] == work.input_tokens < rec["prefill_tokens_computed"]
    assert rec["outputs_match_first_mode"] and swap["outputs_match_first_mode"]
    assert swap["speedup_vs_first_mode"] == pytest.approx(swap["output_tokens_per_s"] / rec["output_tokens_per_s"])
    table = capsys.readouterr().out
    assert "preemption" in table and "swap" in table and "recompute" in table


@pytest.mark.bench
def test_bench_throughput_repeats_take_turns_and_keep_each_engines_fastest(tiny_llama, tmp_path, capsys, monkeypatch):
    import kvcache.bench.throughput as tp
    order = []
    for name in ("run_kvcache", "run_hf"):
        real = getattr(tp, name)
        monkeypatch.setattr(tp, name, lambda *a, _real=real, _name=name, **k: order.append(_name) or _real(*a, **k))
    out = tmp_path / "tp.json"
    rc = main(["bench", "throughput", "--model", tiny_llama, "--num-prompts", "4", "--input-len", "8:20",
               "--output-len", "4:8", "--seed", "3", "--baseline", "hf", "--hf-batch-sizes", "2,4", "--repeats", "3",
               "--kv-cache-memory", "4MiB", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    assert order == ["run_kvcache", "run_hf", "run_hf"] * 3  # in turns, not one engine's runs then the other's
    r = json.loads(out.read_text())
    for v in (r["kvcache"], *r["hf"]["by_batch_size"].values()):
        assert len(v["elapsed_runs_s"]) == 3 and v["elapsed_s"] == min(v["elapsed_runs_s"])
    best = r["hf"]
    assert best["output_tokens_per_s"] == max(v["output_tokens_per_s"] for v in r["hf"]["by_batch_size"].values())
    assert r["speedup"] == pytest.approx(r["kvcache"]["output_tokens_per_s"] / best["output_tokens_per_s"])
    assert r["speedup_of_medians"] == pytest.approx(sorted(best["elapsed_runs_s"])[1]
                                                    / sorted(r["kvcache"]["elapsed_runs_s"])[1])
    table = capsys.readouterr().out
    assert "each engine's fastest of 3 runs, taken in turns (kvcache " in table and "of the medians" in table


def test_bench_preemption_modes_are_checked_first(tiny_llama, capsys):
    for flags in (["--preemption-modes", "swap,evict"], ["--preemption-modes", "swap", "--workload", "multi-turn"]):
        rc = main(["bench", "throughput", "--model", tiny_llama, *flags])
        assert rc == 2 and "preemption-modes" in capsys.readouterr().err


@pytest.mark.bench
def test_bench_attention_reads_another_layer_at_each_call(monkeypatch):
    """Each timed call attends over the next layer of KV, as a decode step does, so that a layer's KV is not still
    in the CPU's caches from the last call."""
    import torch

    from kvcache.attention import cpu_kernel
    from kvcache.bench.attention import _decode_call, _store
    from kvcache.plan.model_source import load_model_shape
    shape = load_model_shape("llama-3-8b")
    store, tables = _store(shape, "float32", torch.float32, 2, 20, 16, torch.device("cpu"), seed=0, layers=3)
    assert all(torch.equal(store.k[0], store.k[i]) and store.k[0].abs().sum() > 0 for i in (1, 2))
    seen = []
    monkeypatch.setattr(cpu_kernel, "paged_decode", lambda out, q, k, v, *a: seen.append(
        next(i for i in range(3) if k is store.k[i] and v is store.v[i])))
    call = _decode_call("cpu", store, 3, torch.randn(2, 32, 128), tables, torch.full((2,), 20), 0.1)
    for _ in range(5):
        call()
    assert seen == [0, 1, 2, 0, 1]


@pytest.mark.bench
def test_bench_linear_times_each_layout_against_onednn(tiny_llama, tmp_path, capsys):
    out = tmp_path / "linear.json"
    rc = main(["bench", "linear", "--model", tiny_llama, "--rows", "1,13", "--seconds", "0.01", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    from kvcache.plan.model_source import load_model_shape
    shape = load_model_shape(tiny_llama)
    h, hd, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    layers = {x["layer"]: (x["in"], x["out"]) for x in r["results"]}
    assert layers == {"qkv": (h, (shape.num_attention_heads + 2 * shape.num_kv_heads) * hd),
                      "o_proj": (shape.num_attention_heads * hd, h), "gate_up": (h, 2 * i), "down": (i, h),
                      "lm_head": (h, shape.vocab_size)}
    assert len(r["results"]) == 5 * 2 * 3  # layers x rows x layouts
    for x in r["results"]:
        assert x["copies"] == 64  # tiny weights: as many copies as allowed, not 256 MiB of them
        assert x["gflops"] == pytest.approx(2 * x["rows"] * x["in"] * x["out"] / (x["ms"] / 1e3) / 1e9)
        base = next(b for b in r["results"] if b["layout"] == "onednn" and b["layer"] == x["layer"]
                    and b["rows"] == x["rows"])
        assert x["vs_onednn"] == pytest.approx(base["ms"] / x["ms"])
    assert "panels/onednn" in capsys.readouterr().out
    assert main(["bench", "linear", "--model", tiny_llama, "--rows", "0"]) == 2  # refused before anything runs
    assert main(["bench", "linear", "--model", tiny_llama, "--layouts", "mkl"]) == 2


@pytest.mark.bench
def test_profile_counts_the_native_decode_loop_as_kernels(tiny_llama):
    """A decode step's layers in one native call (decode_layers) are kernel time, not "rest of forward": a 100 ms
    delay put inside that call lands in the kernels column of every decode step that made it (and the rest of the
    forward stays under one delay, so the check holds on a loaded machine)."""
    import time

    from kvcache import LLM, SamplingParams
    from kvcache.bench.step_profile import profiling
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory="4MiB", enable_prefix_caching=False)
    first = llm.engine.runner.model.layers[0]
    if first.kernels is None or llm.engine.runner.model.decode_stack is None:
        pytest.skip("no native decode loop on this build")
    real, calls = first.kernels, []
    DELAY = 0.3  # a tiny step's other work stays far under it, even on a machine busy with other work

    class Delayed:
        def __getattr__(self, name):
            return getattr(real, name)

        def decode_layers(self, *a):
            calls.append(1)
            time.sleep(DELAY)
            return real.decode_layers(*a)

    first.kernels = Delayed()
    with profiling(llm.engine) as prof:
        llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    first.kernels = real
    decode = prof.rows["decode 1"]
    assert len(calls) == decode["steps"] == 3
    assert decode["kernels_s"] >= DELAY * len(calls)
    assert decode["forward_other_s"] < DELAY
