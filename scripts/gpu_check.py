"""The GPU check, in one go: `make gpu-check` (or `python3 scripts/gpu_check.py`) on a machine with one NVIDIA GPU and
torch, triton and transformers installed. It needs no network and installs nothing (wheels in .whl/, gguf say, are
the caller's to install first); it never imports the server, so fastapi and uvicorn may be absent.

It runs, in order (each step its own process, with a time limit; --deadline bounds the whole):
1. `kvcache bench attention`: 64 sequences x 4,096 tokens with Llama-3-8B's heads, bfloat16 and fp8, the Triton
   kernel against the portable torch path, as a fraction of the measured memory bandwidth (about 20 s on an H200);
2. the cuda-marked tests (parity with transformers on the GPU in float32, bfloat16 and float16 for the tiny models,
   every KV format on each attention backend with prefix caching, n > 1 and eviction, the Triton kernels, the
   loading peak), in parallel workers where pytest-xdist is installed (over 160 s on an H200's machine: the kernels
   compile anew for each shape), then the gpu_memory-marked ones alone (the profiled KV budget, CUDA graphs);
3. `kvcache bench throughput` on a random-weight model of Llama-3.2-1B's shape in bfloat16 (256 requests, prompts
   128-1,024 tokens, outputs 64-512, EOS ignored, seed 0) against transformers' best static batch on the same GPU
   (a few minutes);
4. single-stream decode on that model (4 requests one at a time, 128 tokens in, 256 out) with the decode steps'
   CUDA graphs and with --enforce-eager, as a ratio.
Failures of the test steps are appended to test_failures.log as they happen, so a step stopped by its time limit
still names them.

It writes gpu_check.json and summary.txt in --out (default results/gpu_check). `--small` runs the same steps on tiny
sizes, on whatever device is there, to check the plumbing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json): the throughput model's shape, with random weights
LLAMA_32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000,
                   eos_token_id=128001,
                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SMALL = dict(LLAMA_32_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2)


DEADLINE = [float("inf")]  # --deadline: the whole check's end, as time.perf_counter()


def run_step(name: str, cmd: list[str], out: str, timeout: int) -> dict:
    """Run one step as its own process (a crash or a hang is one failed step); its log goes to out/<name>.log. It
    gets `timeout` seconds, or what is left before --deadline where that is less (none left: skipped)."""
    t = time.perf_counter()
    timeout = int(min(timeout, DEADLINE[0] - t))
    if timeout < 10:
        return skipped(name, " ".join(cmd))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    import torch
    if torch.cuda.is_available():  # the C++ CPU kernels serve no step there: not compiled (a minute)
        env.setdefault("KVCACHE_CPU_KERNEL", "0")
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    step = {"step": name, "returncode": rc, "seconds": round(time.perf_counter() - t, 1), "command": " ".join(cmd)}
    print(f"{name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {step['seconds']} s", flush=True)
    return step


def skipped(name: str, command: str = "") -> dict:
    print(f"{name}: skipped (--deadline reached)", flush=True)
    return {"step": name, "returncode": "skipped", "seconds": 0.0, "command": command}


def make_model(directory: str, config: dict) -> str | None:
    """A random-weight Llama of `config`'s shape in bfloat16, saved with a word-level tokenizer (prompts are ids);
    None, and nothing built, where --deadline leaves no time for a step that would use it."""
    import torch
    if DEADLINE[0] - time.perf_counter() < 30:
        return None
    from transformers import AutoModelForCausalLM, LlamaConfig
    sys.path.insert(0, ROOT)
    from kvcache.models.random_checkpoint import write_tokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    write_tokenizer(directory, config["vocab_size"])
    del model
    torch.cuda.empty_cache()  # the steps after this size their KV caches from the device's free memory
    return directory


def summarize(out: str, steps: list[dict]) -> dict:
    """The figures each step's JSON holds, against the issue's targets, as one JSON and a short text."""
    result: dict = {"steps": steps}
    attn_path, tp_path = os.path.join(out, "attention.json"), os.path.join(out, "throughput.json")
    word = {0: "ok", "skipped": "skipped"}
    lines = [f"{s['step']}: {word.get(s['returncode'], 'FAILED')} ({s['seconds']} s)" for s in steps]
    if os.path.isfile(attn_path):
        attn = json.load(open(attn_path))
        result["attention"] = attn
        lines.append(f"decode attention, {attn['batch']} x {attn['context']} on {attn['device_name'] or attn['device']} "
                     f"({attn['bandwidth_gbs']:.0f} GB/s measured):")
        for r in attn["results"]:
            lines.append(f"  {r['kv_cache_dtype']:<9} {r['backend']:<7} {r['time_ms']:8.3f} ms  {r['achieved_gbs']:7.0f} GB/s  "
                         f"{r['bandwidth_fraction']:4.0%} of bandwidth  {r['speedup_vs_torch'] or 0:5.2f}x torch")
    if os.path.isfile(tp_path):
        tp = json.load(open(tp_path))
        result["throughput"] = tp
        k = tp["kvcache"]
        lines.append(f"throughput ({tp['workload']['num_prompts']} requests, {tp['dtype']}): kvcache "
                     f"{k['output_tokens_per_s']:.0f} out tok/s, {k['roofline_fraction']:.0%} of the "
                     f"{tp['roofline']['bound']}-bound roofline")
        d = k.get("decode_steps")
        if d:
            lines.append(f"  decode steps at {d['running']} running: {d['median_s'] * 1e3:.2f} ms, {d['x_roofline']:.2f}x "
                         f"their memory roofline (target within 2x)")
        if "hf" in tp:
            lines.append(f"  transformers best static batch (bs={tp['hf']['batch_size']}): "
                         f"{tp['hf']['output_tokens_per_s']:.0f} out tok/s; speedup {tp['speedup']:.2f}x (target 5x)")
    g_path, e_path = os.path.join(out, "graphs.json"), os.path.join(out, "eager.json")
    if os.path.isfile(g_path) and os.path.isfile(e_path):
        g, e = (json.load(open(x))["kvcache"]["output_tokens_per_s"] for x in (g_path, e_path))
        result["decode_graphs"] = {"graphs_tokens_per_s": g, "eager_tokens_per_s": e, "speedup": g / e}
        lines.append(f"single-stream decode: CUDA graphs {g:.0f} out tok/s, --enforce-eager {e:.0f}: {g / e:.2f}x")
    result["summary"] = lines
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_check"))
    p.add_argument("--small", action="store_true", help="tiny sizes, any device: checks the plumbing only")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out: tests, attention, throughput, graphs")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole check: a step that would "
                   "run past them is stopped, and later steps are skipped")
    args = p.parse_args()
    if args.deadline:
        DEADLINE[0] = time.perf_counter() + args.deadline
    os.makedirs(args.out, exist_ok=True)
    for name in ("attention.json", "throughput.json", "graphs.json", "eager.json", "test_failures.log"):
        if os.path.isfile(os.path.join(args.out, name)):  # an earlier run's, which a skipped step would leave
            os.remove(os.path.join(args.out, name))
    skip = set(filter(None, args.skip.split(",")))
    py = sys.executable
    steps = []
    if "attention" not in skip:
        import torch
        size = ["--batch", "4", "--context", "256", "--seconds", "0.2"] if args.small else ["--batch", "64",
                                                                                             "--context", "4096"]
        formats = "bfloat16,fp8_e4m3" if torch.cuda.is_available() else "float32,fp8_e4m3"  # the CPU kernel's
        steps.append(run_step("attention", [py, "-m", "kvcache.cli", "bench", "attention", *size, "--kv-cache-dtype",
                                            formats, "--json", os.path.join(args.out, "attention.json")],
                              args.out, 120))
    if "tests" not in skip:
        os.environ.setdefault("KVCACHE_KERNEL_EXAMPLES", "4")  # each new shape compiles the kernels anew
        os.environ["KVCACHE_FAILURE_LOG"] = os.path.join(args.out, "test_failures.log")  # kept if the step times out
        # Workers in parallel where pytest-xdist is there (the Triton kernels' compiles are CPU-bound); the tests that
        # derive the KV budget from the device's free memory after them, alone (a worker's memory is not free)
        par = ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))] if importlib.util.find_spec("xdist") else []
        par += ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []
        pytest = [py, "-m", "pytest", "-q", "-rfE", "--durations", "10", "-p", "no:cacheprovider", "tests/models",
                  "tests/engine", "tests/attention", "tests/memory"]
        steps.append(run_step("tests", [*pytest, *par, "-m", "(cuda or triton) and not gpu_memory"], args.out, 240))
        steps.append(run_step("tests_memory", [*pytest, "-m", "gpu_memory"], args.out, 90))
    # --small: a KV pool the tiny model's few requests fill a fraction of (the 2 GiB CPU default took 3 s to zero)
    small_kv = ["--kv-cache-memory", "64MiB"] if args.small else []
    if "throughput" not in skip:
        model = make_model(os.path.join(args.out, "model"), SMALL if args.small else LLAMA_32_1B) or ""
        work = (["--num-prompts", "8", "--input-len", "16:64", "--output-len", "4:16", "--hf-batch-sizes", "4,8"]
                if args.small else ["--num-prompts", "256", "--input-len", "128:1024", "--output-len", "64:512",
                                    "--hf-batch-sizes", "64,256"])
        cmd = [py, "-m", "kvcache.cli", "bench", "throughput", "--model", model, *work, "--seed", "0", "--baseline",
               "hf", "--dtype", "bfloat16", "--max-model-len", "2048", *small_kv, "--json",
               os.path.join(args.out, "throughput.json")]
        steps.append(run_step("throughput", cmd, args.out, 300) if model else skipped("throughput"))
    if "graphs" not in skip:  # single-stream decode, CUDA graphs against --enforce-eager, on the same model
        model = os.path.join(args.out, "model")
        if not os.path.isdir(model):
            model = make_model(model, SMALL if args.small else LLAMA_32_1B) or ""
        work = ["--num-prompts", "2" if args.small else "4", "--input-len", "128", "--output-len",
                "16" if args.small else "256", "--max-num-seqs", "1", "--seed", "0", "--dtype", "bfloat16",
                "--max-model-len", "2048", *small_kv]
        for name, extra in (("graphs", []), ("eager", ["--enforce-eager"])):
            cmd = [py, "-m", "kvcache.cli", "bench", "throughput", "--model", model, *work, *extra, "--json",
                   os.path.join(args.out, f"{name}.json")]
            steps.append(run_step(f"decode_{name}", cmd, args.out, 150) if model else skipped(f"decode_{name}"))
    summarize(args.out, steps)
    return 0 if all(s["returncode"] == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
