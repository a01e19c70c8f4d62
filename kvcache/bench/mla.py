"""`kvcache bench mla`: what DeepSeek's multi-head latent attention costs in KV memory and decode time, measured on
the engine.

A random-weight model with DeepSeek-V2-Lite's attention (16 heads, kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128; 2 layers, a small dense MLP, no model hub), built on the spot:
1. Bytes per token: what the engine's pool holds (its store's bytes over its slots) in each KV format, against the
   planner's figure (they must be equal) and against the same heads cached expanded as MHA (the planner's
   `mha_equivalent_bytes_per_token`); and the planner's two figures for the real DeepSeek-V2 and V3.
2. Decode step time against context length: `--batch` sequences of each context decode `--steps` steps with the
   absorbed form (attention reads only latents: the default) and with the expanded form (every step expands each
   sequence's cached latents into per-head K and V through kv_b_proj, then attends: the baseline), in one process,
   on the same prompts; the median step, the ratio, and whether both gave the same greedy tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kvcache.bench.report import write_json
from kvcache.bench.throughput import positive_ints

KV_FORMATS = ("float32", "bfloat16", "int8", "fp8_e4m3")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="256,1024,4096",
                   help="context lengths (tokens) of part 2, comma-separated (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4,
                   help="sequences decoding together in part 2 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5,
                   help="decode steps timed per context and form (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--json", default="results/mla.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")


def _config(max_len: int):
    from transformers import DeepseekV2Config
    return DeepseekV2Config(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=2,
                            max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _bytes_per_token(path: str, block_size: int, max_len: int) -> list[dict]:
    from kvcache.engine.llm import LLM
    from kvcache.plan.kv_bytes import kv_bytes_per_token, mha_equivalent_bytes_per_token
    from kvcache.plan.model_source import load_model_shape
    shape = load_model_shape(path)
    rows = []
    for kv in KV_FORMATS:
        eng = LLM(path, kv_cache_dtype=kv, kv_cache_memory="16MiB", block_size=block_size,
                  max_model_len=min(64, max_len)).engine
        measured = eng.store.nbytes // (eng.store.num_blocks * block_size)
        rows.append({"kv_cache_dtype": kv, "engine": measured, "planner": kv_bytes_per_token(shape, kv),
                     "mha_equivalent": mha_equivalent_bytes_per_token(shape, kv)})
    return rows


def _presets() -> list[dict]:
    from kvcache.plan.kv_bytes import kv_bytes_per_token, mha_equivalent_bytes_per_token
    from kvcache.plan.model_source import load_model_shape
    return [{"model": name, "latent": kv_bytes_per_token(s, "bfloat16"),
             "mha_equivalent": mha_equivalent_bytes_per_token(s, "bfloat16")}
            for name, s in ((n, load_model_shape(n)) for n in ("deepseek-v2-lite", "deepseek-v3"))]


def _decode(llm, context: int, args, expanded: bool) -> dict:
    """Median decode step of `args.batch` sequences of `context` tokens, attention absorbed or expanded."""
    from kvcache.engine.sampling_params import SamplingParams
    eng = llm.engine
    for layer in eng.model.layers:
        layer.expanded = expanded
    prefill_steps = -(-args.batch * context // llm.engine.config.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0, max_tokens=args.steps + prefill_steps, ignore_eos=True)
    tag = "expanded" if expanded else "absorbed"
    for i in range(args.batch):
        eng.add_request(f"{tag}-{context}-{i}", [3 + (i * 131 + 17 * j) % 1000 for j in range(context)], params)
    times, done = [], {}
    while eng.has_unfinished_requests():
        # timed: the steps in which every sequence decodes (prefill chunks, expanded in both forms, are not)
        decoding = len(eng.scheduler.running) == args.batch and not eng.scheduler.waiting and all(
            s.num_computed_tokens >= s.num_prompt_tokens for s in eng.scheduler.running)
        t = time.perf_counter()
        outs = eng.step()
        if decoding and len(times) < args.steps:
            times.append(time.perf_counter() - t)
        done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    eng.check_no_leaks()
    return {"step_s": statistics.median(times), "tokens": [done[f"{tag}-{context}-{i}"] for i in range(args.batch)]}


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.steps < 1 or args.block_size < 1:
        raise ValueError("--batch, --steps and --block-size must be positive")
    from kvcache.engine.llm import LLM
    from kvcache.models.random_checkpoint import save_random_checkpoint
    contexts = positive_ints("--contexts", args.contexts)
    max_len = max(contexts) + args.steps + 2 + -(-args.batch * max(contexts) // 2048) + 1  # decodes during prefill
    with tempfile.TemporaryDirectory() as root:
        path = save_random_checkpoint(os.path.join(root, "mla"), _config(max_len))
        memory = _bytes_per_token(path, args.block_size, max_len)
        print("DeepSeek-V2-Lite's attention (16 heads, latent 512 + rope 64), 2 layers: KV bytes per token")
        print(f"{'format':>10} {'engine':>8} {'planner':>8} {'as MHA':>8} {'saving':>7}")
        for r in memory:
            print(f"{r['kv_cache_dtype']:>10} {r['engine']:>8,} {r['planner']:>8,} {r['mha_equivalent']:>8,} "
                  f"{r['mha_equivalent'] / r['engine']:>6.1f}x")
        presets = _presets()
        for p in presets:
            print(f"{p['model']} (planner, bfloat16): {p['latent']:,} bytes/token against {p['mha_equivalent']:,} "
                  f"as MHA ({p['mha_equivalent'] / p['latent']:.1f}x)")
        llm = LLM(path, kv_cache_memory=(args.batch * (max_len + args.block_size)) * memory[0]["engine"],
                  block_size=args.block_size, max_model_len=max_len, max_num_seqs=args.batch,
                  max_num_batched_tokens=2048, enable_prefix_caching=False)
        decode = []
        print(f"\ndecode step, {args.batch} sequences (median of {args.steps} steps; backend "
              f"{llm.engine.backend}):")
        print(f"{'context':>8} {'absorbed':>10} {'expanded':>10} {'speed-up':>9} {'tokens':>10}")
        for ctx in contexts:
            a, e = _decode(llm, ctx, args, False), _decode(llm, ctx, args, True)
            row = {"context": ctx, "absorbed_step_s": a["step_s"], "expanded_step_s": e["step_s"],
                   "same_tokens": a["tokens"] == e["tokens"]}
            decode.append(row)
            print(f"{ctx:>8} {a['step_s'] * 1e3:>8.1f}ms {e['step_s'] * 1e3:>8.1f}ms "
                  f"{e['step_s'] / a['step_s']:>8.2f}x {'identical' if row['same_tokens'] else 'differ':>10}")
    write_json(args.json, {"bytes_per_token": memory, "presets": presets, "batch": args.batch, "steps": args.steps,
                           "backend": llm.engine.backend, "decode": decode})
    return 0 if all(r["engine"] == r["planner"] for r in memory) else 1
