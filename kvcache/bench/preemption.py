"""`kvcache bench throughput --preemption-modes recompute,swap`: what a preemption costs, each way, on one workload.

The random workload runs once per mode through the same engine settings (the caller's `--kv-cache-memory` should
be too small for it, so that sequences are preempted): `recompute` frees a preempted sequence's blocks and
prefills its tokens again when it resumes; `swap` copies its blocks to the cpu tier (`--kv-offload-memory`,
default 4GiB; the disk tier when only `--kv-offload-dir` is given) and loads them back. Greedy outputs must be the
same in every mode (checked and reported); the table puts each mode's throughput against the first mode's.
"""
from __future__ import annotations

import argparse
import copy

PREEMPTION_MODES = ("recompute", "swap")


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",")]
    if not modes or any(m not in PREEMPTION_MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"--preemption-modes takes distinct names from {', '.join(PREEMPTION_MODES)}, got {text!r}")
    return modes


def run_modes(args: argparse.Namespace, work, device: str, run_kvcache) -> dict:
    """{mode: run_kvcache's result} for each of --preemption-modes, with ratios to the first and the output check."""
    runs, outputs = {}, {}
    for mode in parse_modes(args.preemption_modes):
        margs = copy.copy(args)
        margs.preemption_mode = mode
        if mode == "swap" and args.kv_offload_memory is None and args.kv_offload_dir is None:
            margs.kv_offload_memory = "4GiB"
        runs[mode] = run_kvcache(margs, work, device, keep_outputs=True)
        outputs[mode] = runs[mode].pop("outputs")
    first = next(iter(runs))
    for mode, r in runs.items():
        r["outputs_match_first_mode"] = outputs[mode] == outputs[first]
        r["speedup_vs_first_mode"] = r["output_tokens_per_s"] / runs[first]["output_tokens_per_s"]
    return runs


def print_table(runs: dict) -> None:
    head = (f"{'preemption':<12}{'time s':>8}{'out tok/s':>11}{'vs first':>10}{'preemptions':>13}{'swapped':>9}"
            f"{'fell back':>11}{'prefill tok':>13}{'same output':>13}")
    print("\n" + head)
    print("-" * len(head))
    for mode, v in runs.items():
        print(f"{mode:<12}{v['elapsed_s']:>8.1f}{v['output_tokens_per_s']:>11.1f}{v['speedup_vs_first_mode']:>9.2f}x"
              f"{v['num_preemptions']:>13,}{v['num_swapped_in']:>9,}{v['num_swap_fallbacks']:>11,}"
              f"{v['prefill_tokens_computed']:>13,}{'yes' if v['outputs_match_first_mode'] else 'NO':>13}")
    if not any(v["num_preemptions"] for v in runs.values()):
        print("no preemptions: give a --kv-cache-memory too small for the workload to compare the modes")
