"""`kvcache bench throughput`: kvcache against Hugging Face transformers on one seeded workload.

Both engines run on the same device in the same dtype (kvcache's --device/--dtype), greedy, ignore EOS and
produce exactly the requested output lengths; the transformers baseline uses `generate` on static,
left-padded batches (what a server without continuous batching does). Peak memory is the device's
(CUDA: the allocator's peak) or the process's resident memory (CPU), sampled while each engine runs. The
roofline is measured on that device in that dtype: the workload's FLOPs at the GEMM rate, or the bytes it
must read at the memory bandwidth, whichever takes longer (the JSON says which).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import fields

import psutil

from kvcache.bench.step_profile import bucket, print_table as print_profile, profiling
from kvcache.bench.report import write_json
from kvcache.bench.workload import Workload, parse_range, random_workload
from kvcache.config import EngineConfig


class PeakMemory:
    """Peak memory while active: the CUDA allocator's peak on a CUDA device, else this process's resident memory
    sampled every 20 ms."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            import torch
            self.peak = torch.cuda.max_memory_allocated(self.device)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


class DecodeSteps:
    """Times the engine's decode-only steps (step_profile.bucket's rule, on the chunks the step ran), each with its
    rows and the KV tokens it read: a decode step must read the weights and every running sequence's cache, so the
    steps at the most rows are compared with that memory roofline. step() returns after the host has the sampled
    ids, so on a GPU its wall time is the device's."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[int, int, float]] = []  # (rows, KV tokens read, seconds)
        step, execute = engine.step, engine.runner.execute
        ran: list[tuple[int, int] | None] = []  # this step's forward: (rows, KV tokens) if it decoded only

        def recorded(chunks):
            decode = bucket(chunks).startswith("decode")
            ran.append((len(chunks), sum(s.num_computed_tokens - s.num_evicted + n for s, n in chunks))
                       if decode else None)
            return execute(chunks)

        def timed():
            ran.clear()
            t = time.perf_counter()
            out = step()
            if len(ran) == 1 and ran[0] is not None:
                self.steps.append((*ran[0], time.perf_counter() - t))
            return out
        engine.runner.execute, engine.step = recorded, timed

    def at_most_rows(self) -> dict | None:
        """The steps at the most rows seen: their count, median time and median KV tokens read."""
        if not self.steps:
            return None
        most = max(r for r, _, _ in self.steps)
        at = [(n, s) for r, n, s in self.steps if r == most]
        return {"running": most, "steps": len(at), "median_s": statistics.median(s for _, s in at),
                "kv_tokens": int(statistics.median(n for n, _ in at))}


def decode_roofline(d: dict, weight_bytes: int, kv_bytes_per_token: int, bandwidth_gbs: float) -> None:
    """Adds to DecodeSteps.at_most_rows' summary the memory roofline of its median step ((weights + the KV it
    reads) at the measured bandwidth) and how many times that roofline the step took."""
    d["roofline_s"] = (weight_bytes + d["kv_tokens"] * kv_bytes_per_token) / (bandwidth_gbs * 1e9)
    d["x_roofline"] = d["median_s"] / d["roofline_s"]


def positive_ints(flag: str, text: str, least: int = 1) -> list[int]:
    """A comma-separated list of integers >= `least` (a benchmark's --contexts, --lengths, ...); ValueError naming
    the flag otherwise, before anything runs."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if min(values) < least:
        raise ValueError(f"{flag} values must be at least {least}, got {text!r}")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64,
                   help="random workload: requests (default: %(default)s)")
    p.add_argument("--input-len", default="64:512",
                   help="random workload: prompt length range A:B (tokens) (default: %(default)s)")
    p.add_argument("--output-len", default=None, help="output length range A:B (tokens; default 32:256); "
                   "shared-prefix / multi-turn take one length (default 64)")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="hf: run the same workload on Hugging Face transformers too, and compare; none: kvcache "
                        "alone (default: %(default)s)")
    p.add_argument("--hf-batch-sizes", default="8,16,32", help="static batch sizes to try for transformers; "
                   "the best one is the baseline (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="random workload: run kvcache and each transformers batch size this many times, taking turns "
                        "(a shared machine's slow spells land on both), and keep each one's fastest run; every run's "
                        "time is in the JSON and the speedup of the medians is printed too (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the results here (default: not written)")
    p.add_argument("--profile", action="store_true", help="random workload: split each step's time into kernels, "
                   "the rest of the forward and the rest of the step, by kind of step (CPU)")
    p.add_argument("--workload", default="random", choices=["random", "shared-prefix", "multi-turn"],
                   help="random: against transformers; shared-prefix / multi-turn: prefix caching off vs hash vs "
                        "radix (default: %(default)s)")
    p.add_argument("--prefix-caching-modes", default="off,hash,radix",
                   help="shared-prefix / multi-turn: modes to run, of off, hash, radix, cpu, disk (cpu, "
                   "disk: hash plus that offload tier) (default: %(default)s)")
    p.add_argument("--num-groups", type=int, default=4,
                   help="shared-prefix: groups sharing a prefix (default: %(default)s)")
    p.add_argument("--requests-per-group", type=int, default=16,
                   help="shared-prefix: requests per group (default: %(default)s)")
    p.add_argument("--prefix-len", type=int, default=512,
                   help="shared prefix (multi-turn: system prompt) tokens (default: %(default)s)")
    p.add_argument("--suffix-len", type=int, default=64, help="tokens of each request's own suffix (multi-turn: "
                   "of each user message) (default: %(default)s)")
    p.add_argument("--num-conversations", type=int, default=8,
                   help="multi-turn: conversations (default: %(default)s)")
    p.add_argument("--num-turns", type=int, default=4,
                   help="multi-turn: turns per conversation (default: %(default)s)")
    p.add_argument("--preemption-modes", default=None,
                   help="random workload: run these of recompute, swap one after the other (with a --kv-cache-memory "
                        "too small for the workload) and compare them; swap uses --kv-offload-memory (default 4GiB) "
                        "(default: not run)")


def _result(work: Workload, elapsed: float, peak: int) -> dict:
    return {"elapsed_s": elapsed, "output_tokens_per_s": work.output_tokens / elapsed,
            "total_tokens_per_s": (work.input_tokens + work.output_tokens) / elapsed,
            "requests_per_s": len(work.prompts) / elapsed, "peak_memory_bytes": peak}


def run_kvcache(args: argparse.Namespace, work: Workload, device: str, keep_outputs: bool = False) -> dict:
    from kvcache.engine.llm import LLM
    from kvcache.engine.sampling_params import SamplingParams
    with PeakMemory(device) as rss:
        llm = LLM(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in work.output_lens]
        decode = DecodeSteps(llm.engine)
        with profiling(llm.engine) if args.profile else nullcontext() as prof:
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=True)
            elapsed = time.perf_counter() - t
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != work.output_lens:
        raise RuntimeError("kvcache produced output lengths other than requested")
    llm.engine.check_no_leaks()
    info = llm.kv_cache_info()
    res = _result(work, elapsed, rss.peak)
    for key in ("num_preemptions", "num_swapped_in", "num_swap_fallbacks", "prefill_tokens_computed"):
        res[key] = info[key]
    if keep_outputs:
        res["outputs"] = [o.outputs[0].token_ids for o in outs]
    res["kv_cache_bytes"] = info["total_bytes"]
    res["weight_bytes"] = info["weight_bytes"]
    res["weight_read_bytes"] = info["weight_read_bytes"]  # what a decode step reads at least: the rooflines'
    res["kv_bytes_per_token"] = info["bytes_per_token"]
    res["decode_steps"] = decode.at_most_rows()  # the roofline is added once the bandwidth is measured (run)
    if prof is not None:
        res["profile"] = prof.table()
    del llm, outs
    gc.collect()
    return res


def run_hf(model_path: str | None, work: Workload, batch_size: int, device: str, dtype) -> dict:
    """transformers on `device` in `dtype` (kvcache's), static batches of `batch_size`."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvcache.models.loader import demo_model_path
    path = model_path or demo_model_path()
    with PeakMemory(device) as rss:
        if os.path.isfile(path):
            d, name = os.path.split(os.path.abspath(path))
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.to(device).eval()
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        t = time.perf_counter()
        for i in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[i:i + batch_size]
            new = max(work.output_lens[i:i + batch_size])
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=pad)
            if out.shape[1] != width + new:
                raise RuntimeError("transformers stopped early")
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - t
    del model
    gc.collect()
    res = _result(work, elapsed, rss.peak)
    res["batch_size"] = batch_size
    return res


def fastest(runs: list[dict]) -> dict:
    """One engine's fastest of its runs of the workload, with every run's time in `elapsed_runs_s` (in order)."""
    return dict(min(runs, key=lambda r: r["elapsed_s"]), elapsed_runs_s=[r["elapsed_s"] for r in runs])


def run(args: argparse.Namespace) -> int:
    """`kvcache bench throughput`: the workload through kvcache (and transformers' static batches with --baseline
    hf), the roofline of the same run, a table and the JSON."""
    sizes = _checked_sizes(args)  # before any work
    if args.workload != "random":
        from kvcache.bench.prefix_sharing import run as run_prefix_sharing
        return run_prefix_sharing(args)
    import torch

    from kvcache.bench.roofline import measure_gemm_gflops
    from kvcache.engine.sizing import resolve_device_dtype
    from kvcache.models.loader import read_config
    torch.manual_seed(args.seed)
    config = EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
    device, dtype = resolve_device_dtype(config)
    gflops = measure_gemm_gflops(dtype=dtype, device=device)
    cfg = read_config(args.model)
    special = {t for t in (cfg.bos_token_id, cfg.eos_token_id, getattr(cfg, "pad_token_id", None)) if isinstance(t, int)}
    args.output_len = args.output_len or "32:256"
    work = random_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                           cfg.vocab_size, args.seed, special)
    results: dict = {
        "workload": {"num_prompts": len(work.prompts), "input_len": args.input_len, "output_len": args.output_len,
                     "seed": args.seed, "input_tokens": work.input_tokens, "output_tokens": work.output_tokens},
        "machine": {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else None, "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": str(dtype).removeprefix("torch.") if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
    }
    _run_turns(args, work, device, dtype, sizes, results)
    _add_roofline(results, cfg, work, gflops, device, dtype)
    _print_table(results)
    if "preemption_modes" in results:
        from kvcache.bench.preemption import print_table as print_preemption
        print_preemption(results["preemption_modes"])
    if "profile" in results["kvcache"]:
        print_profile(results["kvcache"]["profile"])
    if args.json:
        write_json(args.json, results)
    return 0


def _checked_sizes(args: argparse.Namespace) -> list[int]:
    """transformers' batch sizes to run (none without --baseline hf); ValueError for flags that do not go
    together, before any work."""
    sizes = positive_ints("--hf-batch-sizes", args.hf_batch_sizes) if args.baseline == "hf" else []
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if args.repeats > 1 and (args.preemption_modes or args.workload != "random"):
        raise ValueError("--repeats applies to the random workload without --preemption-modes")
    if args.preemption_modes:
        from kvcache.bench.preemption import parse_modes
        parse_modes(args.preemption_modes)
        if args.workload != "random":
            raise ValueError("--preemption-modes runs the random workload; drop --workload or --preemption-modes")
    return sizes


def _run_turns(args: argparse.Namespace, work: Workload, device, dtype, sizes: list[int], results: dict) -> None:
    """`args.repeats` turns of kvcache then each transformers batch size; the fastest run of each into `results`
    (with the speed-up over transformers' best batch size)."""
    kv_runs: list[dict] = []
    hf_runs: dict[int, list[dict]] = {bs: [] for bs in sizes}
    for _ in range(args.repeats):  # in turns: kvcache, then each batch size, then again
        if args.preemption_modes:
            from kvcache.bench.preemption import run_modes
            results["preemption_modes"] = run_modes(args, work, str(device), run_kvcache)
            kv_runs.append(next(iter(results["preemption_modes"].values())))
        else:
            kv_runs.append(run_kvcache(args, work, str(device)))
        for bs in sizes:
            hf_runs[bs].append(run_hf(args.model, work, bs, str(device), dtype))
    results["kvcache"] = fastest(kv_runs)
    if args.baseline == "hf":
        by_size = {bs: fastest(r) for bs, r in hf_runs.items()}
        best = max(by_size.values(), key=lambda r: r["output_tokens_per_s"])
        results["hf"] = dict(best, by_batch_size={str(k): v for k, v in by_size.items()})
        results["speedup"] = results["kvcache"]["output_tokens_per_s"] / best["output_tokens_per_s"]
        results["speedup_of_medians"] = (statistics.median(best["elapsed_runs_s"])
                                         / statistics.median(results["kvcache"]["elapsed_runs_s"]))


def _add_roofline(results: dict, cfg, work: Workload, gflops: float, device, dtype) -> None:
    """The workload's roofline (its FLOPs at the GEMM rate, its bytes at the memory bandwidth, measured in this
    run) and each run's fraction of it; each decode step kind's fraction of the bandwidth."""
    from kvcache.bench.roofline import measure_bandwidth_gbs, measure_gemm_gflops, workload_bytes, workload_flops
    # The rates are measured before and after the runs and the better kept: one short measurement can land on
    # a slow moment of a shared machine and flatter every engine.
    gflops = max(gflops, measure_gemm_gflops(dtype=dtype, device=device))
    bandwidth = measure_bandwidth_gbs(device=device)
    flops = workload_flops(cfg, work)
    nbytes = workload_bytes(work, results["kvcache"]["weight_read_bytes"], results["kvcache"]["kv_bytes_per_token"])
    compute_s, memory_s = flops / (gflops * 1e9), nbytes / (bandwidth * 1e9)
    min_time = max(compute_s, memory_s)
    results["roofline"] = {"gemm_gflops": gflops, "gemm_dtype": results["dtype"], "bandwidth_gbs": bandwidth,
                           "workload_gflop": flops / 1e9, "workload_gbytes": nbytes / 1e9, "compute_time_s": compute_s,
                           "memory_time_s": memory_s, "bound": "compute" if compute_s >= memory_s else "memory",
                           "min_time_s": min_time}
    for r in [results["kvcache"], *results.get("hf", {}).get("by_batch_size", {}).values()]:
        r["roofline_fraction"] = min_time / r["elapsed_s"]
    for r in {id(r): r for r in [results["kvcache"], *results.get("preemption_modes", {}).values()]}.values():
        if r.get("decode_steps"):
            decode_roofline(r["decode_steps"], r["weight_read_bytes"], r["kv_bytes_per_token"], bandwidth)
    if "hf" in results:
        results["hf"]["roofline_fraction"] = min_time / results["hf"]["elapsed_s"]


def _print_table(r: dict) -> None:
    w, roof, m = r["workload"], r["roofline"], r["machine"]
    print(f"\nworkload: {w['num_prompts']} prompts, input {w['input_len']} ({w['input_tokens']:,} tokens), "
          f"output {w['output_len']} ({w['output_tokens']:,} tokens), seed {w['seed']}")
    print(f"device: {m['device']}{' (' + m['device_name'] + ')' if m['device_name'] else ''}, {r['dtype']} compute, "
          f"{r['kv_cache_dtype']} KV cache, torch {m['torch']}; both engines")
    print(f"roofline ({roof['bound']}-bound): {roof['workload_gflop']:,.0f} GFLOP at {roof['gemm_gflops']:.1f} GFLOP/s "
          f"{roof['gemm_dtype']} GEMM = {roof['compute_time_s']:.1f} s; {roof['workload_gbytes']:,.1f} GB to read at "
          f"{roof['bandwidth_gbs']:.1f} GB/s = {roof['memory_time_s']:.1f} s")
    rows = [("kvcache", r["kvcache"])]
    if "hf" in r:
        rows += [(f"transformers bs={k}", v) for k, v in r["hf"]["by_batch_size"].items()]
    mem = "peak GPU MiB" if m["device"].startswith("cuda") else "peak RSS MiB"
    head = f"{'engine':<22}{'time s':>9}{'out tok/s':>11}{'total tok/s':>13}{'req/s':>8}{mem:>14}{'roofline':>10}"
    print(head)
    print("-" * len(head))
    for name, v in rows:
        print(f"{name:<22}{v['elapsed_s']:>9.1f}{v['output_tokens_per_s']:>11.1f}{v['total_tokens_per_s']:>13.1f}"
              f"{v['requests_per_s']:>8.2f}{v['peak_memory_bytes'] / 2**20:>14.0f}{v['roofline_fraction']:>9.0%}")
    d = r["kvcache"].get("decode_steps")
    if d:
        print(f"kvcache decode steps at {d['running']} running sequences: {d['median_s'] * 1e3:.2f} ms (median of "
              f"{d['steps']}); memory roofline {d['roofline_s'] * 1e3:.2f} ms (weights + {d['kv_tokens']:,} KV tokens "
              f"at {roof['bandwidth_gbs']:.1f} GB/s): {d['x_roofline']:.2f}x")
    runs = r["kvcache"].get("elapsed_runs_s", [])
    if len(runs) > 1:
        spread = "; ".join(f"{name} {min(v['elapsed_runs_s']):.2f}-{max(v['elapsed_runs_s']):.2f} s" for name, v in rows)
        print(f"each engine's fastest of {len(runs)} runs, taken in turns ({spread})")
    if "speedup" in r:
        medians = f"; of the medians {r['speedup_of_medians']:.2f}x" if len(runs) > 1 else ""
        print(f"\nspeedup (output tokens/s) kvcache / best transformers (bs={r['hf']['batch_size']}): "
              f"{r['speedup']:.2f}x{medians}")
