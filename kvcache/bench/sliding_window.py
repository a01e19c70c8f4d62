"""`kvcache bench sliding-window`: what giving back out-of-window blocks saves, measured on the engine.

Random-weight models of two shapes, built on the spot with transformers' config classes (no model hub):
- `mistral`: every layer slides with one window (Mistral-7B-v0.1's layout): the engine gives back each block no
  future query can see, so a sequence holds its window's blocks and one more, however long it grows.
- `gemma3`: 5 local layers to 1 global (Gemma-3's layout): per-layer-group tables (memory/layer_groups.py), one
  block holding one layer; the local layers' groups give back their out-of-window blocks, the global one keeps
  every block.

Each shape runs twice in one process, with the blocks given back and as one table of every layer keeping them all
(the baseline: the engine's `release_window` cleared for Mistral, --disable-hybrid-kv-cache-manager for Gemma-3),
on the same prompts and the same KV budget in bytes (the two layouts' blocks differ in size, so memory is in bytes):
1. Memory per request against context length: one request at a time, the most KV bytes it holds at once after any
   step, against the planner's figure (`cache_capacity`: what `kvcache plan` and the start-up count).
2. Concurrency at a fixed pool: requests of 8x the window (by default 7x the window of prompt, one generated),
   all submitted at once, into a pool that holds 4 of them
   whole: how many decode at once (the most, the mean over the steps where requests wait for memory, and over
   all steps), the steps and the time to finish them all,
   the preemptions, and whether both runs gave the same greedy tokens (the exit status says so too).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from kvcache.bench.report import write_json
from kvcache.bench.throughput import positive_ints
from kvcache.memory.kv_cache_manager import blocks_for


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=64, help="sliding window (tokens) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--lengths", default="64,128,256,512,1024",
                   help="context lengths (tokens) of part 1, comma-separated (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32,
                   help="requests of 8x the window in part 2 (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens of each part-2 request (default 7x the window: long prompts, one window "
                        "generated); the rest of the 8x the window is generated")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="part 2's engine: tokens per step at most (default: %(default)s)")
    p.add_argument("--json", default="results/sliding_window.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")


def _config(shape: str, window: int, max_len: int):
    from transformers import Gemma3TextConfig, MistralConfig
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  sliding_window=window)
    if shape == "mistral":
        return MistralConfig(num_hidden_layers=4, **common)
    return Gemma3TextConfig(num_hidden_layers=6, query_pre_attn_scalar=32, **common)  # layers 0-4 local, 5 global


def _engine(path: str, args, budget: int, release: bool, max_len: int):
    """An engine with a KV budget of `budget` bytes on `path`, with or without blocks given back."""
    from kvcache.engine.llm import LLM
    llm = LLM(path, kv_cache_memory=budget, block_size=args.block_size, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256,
              disable_hybrid_kv_cache_manager=not release)
    if not release:
        llm.engine.release_window = None  # the baseline: one table keeping every block
    return llm


def _block_bytes(llm) -> int:
    c = llm.engine.capacity
    return c.bytes_per_token * c.block_size


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + 17 * i) % 500 for i in range(n)]


def _peak_per_request(llm, length: int, prompt_len: int) -> int:
    """Most KV bytes one request of `length` tokens holds at once: the engine's peak of blocks in use (taken in each
    step after its forward, before any is given back), with that request alone in the pool, times a block's bytes."""
    from kvcache.engine.sampling_params import SamplingParams
    eng = llm.engine
    eng.add_request("one", _prompt(prompt_len, 1), SamplingParams(temperature=0, max_tokens=length - prompt_len,
                                                                  ignore_eos=True))
    eng.run_to_completion()
    eng.check_no_leaks()
    return eng.stats.peak_used_blocks * _block_bytes(llm)


def _concurrency(llm, n: int, length: int, prompt_len: int) -> dict:
    """Submit `n` requests of `length` tokens at once: the most running together, the time, their tokens."""
    from kvcache.engine.sampling_params import SamplingParams
    eng = llm.engine
    for i in range(n):
        eng.add_request(str(i), _prompt(prompt_len, i), SamplingParams(temperature=0, max_tokens=length - prompt_len,
                                                                       ignore_eos=True))
    decoding, waiting, done = [], [], {}
    t = time.perf_counter()
    for outs in eng.steps():
        for o in outs:
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        decoding.append(sum(s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running))
        waiting.append(len(eng.scheduler.waiting) > 0)
    elapsed = time.perf_counter() - t
    eng.check_no_leaks()
    held_back = [d for d, w in zip(decoding, waiting) if w] or decoding
    return {"most_decoding": max(decoding), "mean_decoding": sum(decoding) / len(decoding),
            "mean_decoding_while_waiting": sum(held_back) / len(held_back), "steps_waiting": sum(waiting),
            "steps": len(decoding),
            "elapsed_s": elapsed, "preemptions": eng.kv_cache_info()["num_preemptions"],
            "tokens": [done[str(i)] for i in range(n)]}


def _shape(shape: str, args, root: str) -> dict:
    from kvcache.models.random_checkpoint import save_random_checkpoint
    from kvcache.plan.kv_bytes import cache_capacity, kv_bytes_per_token
    from kvcache.plan.model_source import load_model_shape
    lengths = positive_ints("--lengths", args.lengths, least=2)  # a prompt of one token at least, then one more
    long = 8 * args.window
    max_len = max(lengths + [long]) + 1
    path = save_random_checkpoint(os.path.join(root, shape), _config(shape, args.window, max_len))
    model_shape = load_model_shape(path)
    per_block = kv_bytes_per_token(model_shape, "float32") * args.block_size  # every layer's
    prompt_len = min(32, min(lengths) - 1)
    rows = []
    for length in lengths:
        c = cache_capacity(model_shape, "float32", 2**30, args.block_size, length)
        row = {"length": length, "all_bytes": blocks_for(length, args.block_size) * per_block,
               "planner_bytes": c.blocks_per_request * c.bytes_per_token * args.block_size}
        for release, key in ((True, "given_back_bytes"), (False, "one_table_bytes")):
            row[key] = _peak_per_request(_engine(path, args, 4096 * per_block, release, max_len), length, prompt_len)
        rows.append(row)
    pool = 4 * blocks_for(long, args.block_size) * per_block
    prompt_len2 = 7 * args.window if args.prompt_len is None else args.prompt_len
    runs = {key: _concurrency(_engine(path, args, pool, release, max_len), args.requests, long, prompt_len2)
            for release, key in ((True, "given_back"), (False, "one_table"))}
    same = runs["given_back"]["tokens"] == runs["one_table"]["tokens"]
    for r in runs.values():
        del r["tokens"]
    return {"shape": shape, "window": args.window, "block_size": args.block_size, "per_request": rows,
            "concurrency": {"pool_bytes": pool, "request_tokens": long, "prompt_tokens": prompt_len2,
                            "requests": args.requests, **runs,
                            "same_tokens": same}}


def run(args: argparse.Namespace) -> int:
    if args.window < 1 or args.block_size < 1 or args.requests < 1:
        raise ValueError("--window, --block-size and --requests must be positive")
    if args.prompt_len is not None and not 1 <= args.prompt_len < 8 * args.window:
        raise ValueError(f"--prompt-len must be from 1 to {8 * args.window - 1} (requests are 8x the window, "
                         f"{8 * args.window} tokens), got {args.prompt_len}")
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for shape in ("mistral", "gemma3"):
            results[shape] = r = _shape(shape, args, root)
            print(f"\n{shape}-shaped (window {args.window}, block {args.block_size}): KiB of KV one request holds "
                  "at most")
            print(f"{'tokens':>7} {'all':>8} {'given back':>11} {'one table':>10} {'planner':>8} {'saving':>7}")
            for row in r["per_request"]:
                kib = {k: row[k] / 1024 for k in ("all_bytes", "given_back_bytes", "one_table_bytes", "planner_bytes")}
                print(f"{row['length']:>7} {kib['all_bytes']:>8,.0f} {kib['given_back_bytes']:>11,.0f} "
                      f"{kib['one_table_bytes']:>10,.0f} {kib['planner_bytes']:>8,.0f} "
                      f"{row['one_table_bytes'] / row['given_back_bytes']:>6.2f}x")
            c = r["concurrency"]
            g, o = c["given_back"], c["one_table"]
            print(f"{c['requests']} requests of {c['request_tokens']} tokens ({c['prompt_tokens']} prompt), pool of {c['pool_bytes'] / 1024:,.0f} KiB: "
                  f"at most {g['most_decoding']} decoding at once against {o['most_decoding']} "
                  f"({g['most_decoding'] / o['most_decoding']:.2f}x), {g['mean_decoding_while_waiting']:.1f} against "
                  f"{o['mean_decoding_while_waiting']:.1f} on average while requests wait to be admitted ({g['steps_waiting']} "
                  f"and {o['steps_waiting']} such steps; over all steps where none waited) "
                  f"({g['mean_decoding_while_waiting'] / o['mean_decoding_while_waiting']:.2f}x; "
                  f"{g['mean_decoding']:.1f} and {o['mean_decoding']:.1f} over all steps), {g['steps']} steps against {o['steps']}, {g['elapsed_s']:.1f} s against "
                  f"{o['elapsed_s']:.1f} s ({o['elapsed_s'] / g['elapsed_s']:.2f}x), preemptions {g['preemptions']} "
                  f"against {o['preemptions']}; greedy tokens {'identical' if c['same_tokens'] else 'DIFFER'}")
    write_json(args.json, results)
    return 0 if all(r["concurrency"]["same_tokens"] for r in results.values()) else 1
