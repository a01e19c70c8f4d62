"""`kvcache bench tensor-parallel`: the same workload on 1 rank and on N ranks (--tensor-parallel-size), side by side.

On a CPU the point is correctness and memory per rank, not speed: N ranks of cores/N threads each against one rank
with every core (the machine's cores are shared out, not added). Each row: output tok/s and its ratio to one rank,
the KV bytes per token a rank holds (measured from its store) against `kvcache plan`'s per-GPU figure, the pool's
bytes per rank, and whether the greedy tokens equal one rank's. Two workloads: a batch of seeded random prompts, and
one request at a time (single stream).

The default model is a random-weight Llama of the demo's size whose heads split over 2 ranks (the demo's 9 query and
3 KV heads do not: `--tensor-parallel-size 2` refuses it with the numbers): 30 layers, hidden 576, 8 query and 2 KV
heads of 64, intermediate 1,536, a 49,152-token vocabulary, float32. `--model` takes any checkpoint instead.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

from kvcache.bench.report import write_json
from kvcache.bench.workload import parse_range, random_workload
from kvcache.parallel.host import usable_cores


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a checkpoint (default: the demo-sized random Llama, see above)")
    p.add_argument("--tensor-parallel-sizes", default="1,2",
                   help="sizes to run, comma-separated, 1 first (the baseline) (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=16,
                   help="requests of the batch workload (default: %(default)s)")
    p.add_argument("--input-len", default="64:256",
                   help="batch workload: prompt length range A:B (tokens) (default: %(default)s)")
    p.add_argument("--output-len", default="32:128",
                   help="batch workload: output length range A:B (tokens) (default: %(default)s)")
    p.add_argument("--single-stream", type=int, default=2,
                   help="requests run one at a time (0: skip that workload) (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="256MiB",
                   help="KV cache per rank, bytes, e.g. 256MiB (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=512,
                   help="tokens of one request at most (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workloads' random prompts and lengths "
                   "(default: %(default)s)")
    p.add_argument("--json", default="results/tensor_parallel.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")


def demo_sized_model(directory: str) -> str:
    from transformers import LlamaConfig

    from kvcache.models.random_checkpoint import save_random_checkpoint
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return save_random_checkpoint(directory, cfg)


def _run_one(path: str, size: int, args, work, one_at_a_time: bool) -> dict:
    from kvcache import LLM, SamplingParams
    llm = LLM(path, tensor_parallel_size=size, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
              max_num_seqs=1 if one_at_a_time else 128)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in work.output_lens]
        llm.generate([work.prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        info = llm.kv_cache_info()
        store = llm.engine.store
        return {"tensor_parallel_size": size, "elapsed_s": elapsed, "output_tokens_per_s": work.output_tokens / elapsed,
                "kv_bytes_per_token_per_rank": store.nbytes // (store.num_blocks * store.block_size),
                "kv_pool_bytes_per_rank": store.nbytes, "num_blocks": info["num_blocks"],
                "threads_per_rank": llm.engine.tp.threads if llm.engine.tp else None,
                "outputs": [o.outputs[0].token_ids for o in outs]}
    finally:
        llm.engine.close()
        del llm
        gc.collect()


def run(args: argparse.Namespace) -> int:
    from kvcache.plan.kv_bytes import kv_bytes_per_token
    from kvcache.plan.model_source import load_model_shape
    sizes = [int(s) for s in args.tensor_parallel_sizes.split(",")]
    if not sizes or sizes[0] != 1:
        raise ValueError(f"--tensor-parallel-sizes must start with 1 (the baseline), got {args.tensor_parallel_sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or demo_sized_model(os.path.join(tmp, "model"))
        shape = load_model_shape(path)
        vocab = shape.vocab_size
        workloads = {"batch": random_workload(args.num_prompts, parse_range(args.input_len),
                                              parse_range(args.output_len), vocab, args.seed)}
        if args.single_stream:
            workloads["single stream"] = random_workload(args.single_stream, (64, 64), (128, 128), vocab, args.seed + 1)
        results = {"model": args.model or "demo-sized random Llama (8 heads, 2 KV heads)", "cores": usable_cores(),
                   "workloads": {}}
        for name, work in workloads.items():
            rows = []
            for size in sizes:
                r = _run_one(path, size, args, work, name == "single stream")
                r["planner_kv_bytes_per_token_per_gpu"] = kv_bytes_per_token(shape, "float32", size)
                rows.append(r)
            base = rows[0]
            for r in rows:
                r["speedup_vs_1"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
                r["same_tokens_as_1"] = r["outputs"] == base["outputs"]
            for r in rows:
                del r["outputs"]
            results["workloads"][name] = {"num_prompts": len(work.prompts), "output_tokens": work.output_tokens,
                                          "rows": rows}
    _print(results)
    write_json(args.json, results)
    return 0


def _print(results: dict) -> None:
    print(f"\n{results['model']}, {results['cores']} cores")
    print(f"{'workload':<14} {'TP':>3} {'threads/rank':>12} {'out tok/s':>10} {'vs 1':>6} {'KV B/token/rank':>16} "
          f"{'planner':>8} {'pool MiB/rank':>14} {'same tokens':>12}")
    for name, w in results["workloads"].items():
        for r in w["rows"]:
            print(f"{name:<14} {r['tensor_parallel_size']:>3} {r['threads_per_rank'] or results['cores']:>12} "
                  f"{r['output_tokens_per_s']:>10.1f} {r['speedup_vs_1']:>5.2f}x {r['kv_bytes_per_token_per_rank']:>16,} "
                  f"{r['planner_kv_bytes_per_token_per_gpu']:>8,} {r['kv_pool_bytes_per_rank'] / 2**20:>14.1f} "
                  f"{str(r['same_tokens_as_1']):>12}")
