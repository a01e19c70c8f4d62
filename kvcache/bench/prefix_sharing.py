"""`kvcache bench throughput --workload shared-prefix|multi-turn`: prefix caching off, hash and radix side by side.

shared-prefix: G groups x R requests; each prompt is its group's P-token prefix plus its own
S-token suffix; requests of different groups interleave (request i is in group i % G), all
submitted at once. multi-turn: C conversations share a P-token system prompt; each of T turns
resends the whole history (earlier prompts and replies) plus an S-token user message, all
conversations' turn t submitted together once turn t-1 has finished.

Every mode runs the same token ids through one engine built from one loaded checkpoint, one
mode after the other; greedy outputs must be identical across modes (checked and reported).
Modes cpu and disk are hash prefix caching with an offload tier below the pool (--kv-offload-memory, default
4GiB; --kv-offload-dir, default a temporary directory removed afterwards): with a --kv-cache-memory too small for
the conversations, they show what keeping the dropped prefix blocks saves against hash alone. Between turns the
tiers' background writer finishes what it was given (timed with the run): a user's next message comes seconds
later, while a small model's turn takes milliseconds, and without the wait the blocks a turn found in the tiers
depended on the writer thread's timing against the engine's (a CI run found none on disk).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import tempfile
import time
from dataclasses import fields

import numpy as np

from kvcache.bench.report import write_json
from kvcache.bench.workload import parse_range
from kvcache.config import EngineConfig

MODES = ("off", "hash", "radix", "cpu", "disk")  # cpu, disk: hash prefix caching plus that offload tier
_counter = itertools.count()


def _tokens(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return allowed[rng.integers(0, len(allowed), n)].tolist()


def shared_prefix_prompts(groups: int, per_group: int, prefix_len: int, suffix_len: int, allowed: np.ndarray,
                          seed: int) -> list[list[int]]:
    """G x R prompts, request i in group i % G: the group's prefix then a suffix of its own."""
    if min(groups, per_group, prefix_len, suffix_len) < 1:
        raise ValueError("--num-groups, --requests-per-group, --prefix-len and --suffix-len must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, allowed, prefix_len) for _ in range(groups)]
    return [prefixes[i % groups] + _tokens(rng, allowed, suffix_len) for i in range(groups * per_group)]


def _run_batch(engine, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], list[float]]:
    """Submit all prompts at once, run to completion; greedy outputs and time to first token per request (s)."""
    from kvcache.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"r{next(_counter)}" for _ in prompts]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done = engine.run_to_completion()
    outs = [done[r] for r in ids]
    return ([o.outputs[0].token_ids for o in outs],
            [o.metrics.first_token_time - o.metrics.arrival_time for o in outs])


def _run_mode(args: argparse.Namespace, loaded, mode: str, allowed: np.ndarray) -> dict:
    from kvcache.engine.llm_engine import LLMEngine
    cfg = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    cfg.update(enable_prefix_caching=mode != "off", prefix_caching_algo=mode if mode == "radix" else "hash",
               kv_offload_memory=None, kv_offload_dir=None, kv_offload_disk_size=None)
    scratch = None
    if mode == "cpu":
        cfg["kv_offload_memory"] = args.kv_offload_memory or "4GiB"
    elif mode == "disk":
        scratch = None if args.kv_offload_dir else tempfile.TemporaryDirectory(prefix="kvcache-bench-")
        cfg.update(kv_offload_dir=args.kv_offload_dir or scratch.name, kv_offload_disk_size=args.kv_offload_disk_size)
    engine = LLMEngine(EngineConfig(**cfg), loaded)
    out_len = args.output_len
    outputs, ttft = [], []
    input_tokens = 0
    t = time.perf_counter()
    if args.workload == "shared-prefix":
        prompts = shared_prefix_prompts(args.num_groups, args.requests_per_group, args.prefix_len, args.suffix_len,
                                        allowed, args.seed)
        outputs, ttft = _run_batch(engine, prompts, out_len)
        input_tokens = sum(map(len, prompts))
    else:
        rng = np.random.default_rng(args.seed)
        system = _tokens(rng, allowed, args.prefix_len)
        histories = [list(system) for _ in range(args.num_conversations)]
        for _ in range(args.num_turns):
            for h in histories:
                h += _tokens(rng, allowed, args.suffix_len)
            replies, times = _run_batch(engine, histories, out_len)
            input_tokens += sum(map(len, histories))
            for h, r in zip(histories, replies):
                h += r
            outputs += replies
            ttft += times
            if engine.offload:  # a user's next message comes seconds later: the tiers' writer is done by then
                engine.offload.flush()
    elapsed = time.perf_counter() - t
    engine.check_no_leaks()
    if engine.offload:
        engine.offload.close()
    info = engine.kv_cache_info()
    out_tokens = sum(map(len, outputs))
    result = {
        "mode": mode, "elapsed_s": elapsed, "requests": len(outputs), "input_tokens": input_tokens,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + out_tokens) / elapsed,
        "prefill_tokens_computed": engine.stats.prefill_tokens_computed,
        "prefix_cache_queries": info["prefix_cache_queries"], "prefix_cache_hits": info["prefix_cache_hits"],
        "hit_rate": info["prefix_cache_hit_rate"], "cached_blocks": info["cached_blocks"],
        "evictions": info["prefix_cache_evictions"], "preemptions": info["num_preemptions"],
        "peak_used_blocks": info["peak_used_blocks"],
        "ttft_mean_s": float(np.mean(ttft)), "ttft_p90_s": float(np.percentile(ttft, 90)),
        "offload_loaded_blocks": info["offload"]["loaded_blocks"] if info["offload"] else 0,
        "outputs": outputs,
    }
    if scratch is not None:
        scratch.cleanup()
    del engine
    gc.collect()
    return result


def run(args: argparse.Namespace) -> int:
    """Run every mode of `--prefix-caching-modes`, print the table, write JSON."""
    from kvcache.models.loader import read_checkpoint
    modes = [m.strip() for m in args.prefix_caching_modes.split(",")]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--prefix-caching-modes takes distinct names from {', '.join(MODES)}, got "
                         f"{args.prefix_caching_modes!r}")
    lo, hi = parse_range(args.output_len or "64")
    if lo != hi:
        raise ValueError(f"--workload {args.workload} takes one --output-len, not a range; got {args.output_len!r}")
    args.output_len = lo
    if args.baseline != "none":
        raise ValueError("--baseline hf applies to --workload random; the baseline here is prefix caching off")
    if args.workload == "multi-turn" and min(args.num_conversations, args.num_turns, args.prefix_len,
                                             args.suffix_len) < 1:
        raise ValueError("--num-conversations, --num-turns, --prefix-len and --suffix-len must be >= 1")
    loaded = read_checkpoint(args.model)
    cfg = loaded.config
    special = {t for t in (cfg.bos_token_id, cfg.eos_token_id, getattr(cfg, "pad_token_id", None)) if isinstance(t, int)}
    allowed = np.setdiff1d(np.arange(cfg.vocab_size), np.array(sorted(special), dtype=np.int64))
    runs = {m: _run_mode(args, loaded, m, allowed) for m in modes}
    ref = runs[modes[0]]["outputs"]
    for r in runs.values():
        r["outputs_match_first_mode"] = r.pop("outputs") == ref
    results = {"workload": _describe(args), "modes": runs}
    if "off" in runs:
        off = runs["off"]
        for r in runs.values():
            r["prefill_reduction"] = 1 - r["prefill_tokens_computed"] / off["prefill_tokens_computed"]
            r["speedup_vs_off"] = r["output_tokens_per_s"] / off["output_tokens_per_s"]
    if "hash" in runs:  # a tier against none
        base = runs["hash"]
        for m in ("cpu", "disk"):
            if m in runs:
                runs[m]["speedup_vs_hash"] = runs[m]["output_tokens_per_s"] / base["output_tokens_per_s"]
                runs[m]["prefill_reduction_vs_hash"] = 1 - runs[m]["prefill_tokens_computed"] / max(
                    1, base["prefill_tokens_computed"])
    _print_table(results)
    if args.json:
        write_json(args.json, results)
    return 0


def _describe(args: argparse.Namespace) -> dict:
    out = args.output_len
    if args.workload == "shared-prefix":
        return {"name": "shared-prefix", "groups": args.num_groups, "requests_per_group": args.requests_per_group,
                "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "output_len": out, "seed": args.seed}
    return {"name": "multi-turn", "conversations": args.num_conversations, "turns": args.num_turns,
            "system_prompt_len": args.prefix_len, "user_len": args.suffix_len, "output_len": out, "seed": args.seed}


def _print_table(r: dict) -> None:
    w = r["workload"]
    print("\nworkload: " + ", ".join(f"{k} {v}" for k, v in w.items()))
    head = (f"{'prefix caching':<16}{'time s':>8}{'out tok/s':>11}{'prefill tok':>13}{'vs off':>8}{'hit rate':>10}"
            f"{'TTFT mean s':>13}{'TTFT p90 s':>12}{'evictions':>11}{'same output':>13}")
    print(head)
    print("-" * len(head))
    for m, v in r["modes"].items():
        vs = f"{-v['prefill_reduction']:+.0%}" if m != "off" and "prefill_reduction" in v else "-"
        print(f"{m:<16}{v['elapsed_s']:>8.1f}{v['output_tokens_per_s']:>11.1f}{v['prefill_tokens_computed']:>13,}"
              f"{vs:>8}{v['hit_rate']:>10.1%}{v['ttft_mean_s']:>13.2f}{v['ttft_p90_s']:>12.2f}{v['evictions']:>11,}"
              f"{'yes' if v['outputs_match_first_mode'] else 'NO':>13}")
    if "off" in r["modes"]:
        best = max((m for m in r["modes"] if m != "off"), key=lambda m: r["modes"][m]["output_tokens_per_s"],
                   default=None)
        if best:
            print(f"\nthroughput {best} / off: {r['modes'][best]['speedup_vs_off']:.2f}x; prefill tokens computed "
                  f"{r['modes'][best]['prefill_reduction']:.0%} fewer")
    for m in ("cpu", "disk"):
        v = r["modes"].get(m)
        if v and "speedup_vs_hash" in v:
            print(f"tier {m} / hash alone: {v['speedup_vs_hash']:.2f}x throughput; prefill tokens computed "
                  f"{v['prefill_reduction_vs_hash']:.0%} fewer; {v['offload_loaded_blocks']:,} blocks loaded")
