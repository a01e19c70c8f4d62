"""`kvcache eval kv-quality`: what each KV cache storage format costs in quality and buys in capacity.

Every format is compared with the full-precision cache (float32, the compute dtype: "fp32 (baseline)")
in the same run, on the same model (the SmolLM2-135M demo model unless `--model`), one engine per
format built from one loaded checkpoint:

- quality: the first `--context-len` tokens of `--num-docs` documents of the shipped corpus
  (corpus.py) are scored teacher-forced through the paged cache (`LLMEngine.score`, prefill chunks
  of `--chunk-size` tokens). After a warmup of `--warmup` tokens (early positions attend to few cached
  tokens, so they barely measure the cache) every position is scored: KL(P_full || P_format) in nats,
  top-1 agreement (the argmax tokens are equal), and the perplexity of the actual next tokens.
  One document's logits are held at a time (about 250 MB for 1,280 positions x 49,152 tokens), but
  every format's engine is alive meanwhile (the default run peaks at about 6.4 GB resident).
- passkey retrieval (Mohtashami & Jaggi, 2023): `--passkeys-per-depth` keys at each of `--depths`,
  in prompts of about `--passkey-len` tokens, greedy; a trial is correct if the reply contains the key.
  The demo model answers from its chat template with the reply started as "The pass key is" (10 of 10
  trials at fp32, 1,024 tokens); a plain-text prompt fails when the key sits right before the question
  (8 of 10), and the chat template alone makes it repeat the question's words for its first 8 tokens
  (0 of 10). `--passkey-prompt raw` gives the plain-text prompt.
- capacity: with the same `--capacity-memory` every format's pool is sized by the planner, and the
  engine is given more requests of `--capacity-prompt-len` random tokens (+ `--capacity-max-tokens`
  to generate) than fit; the peak number of requests whose whole prompt is in the cache at once is
  what the engine really holds. Ratios are over float16, the usual serving cache.
"""
from __future__ import annotations

import argparse
import gc

from kvcache.eval.harness import (Checkpoint, Column, PasskeyTrial, QualityStats, Table, add_text_args,
                                  build_engine, check_positive, each_engine, evaluate_engines, finish_axis,
                                  greedy_outputs, load_checkpoint, new_figure, parse_depths, passkey_accuracy,
                                  passkey_trials, pool_bytes, random_prompts, report, save_figure)

BASELINE = "float32"
BASELINE_NAME = "fp32 (baseline)"
CAPACITY_BASELINE = "float16"
DEFAULT_DTYPES = "float16,fp8_e4m3,fp8_e5m2,int8,int4,int2"
PASSKEY_MAX_TOKENS = 8  # the reply generated for each passkey prompt
TABLE = Table((Column("kv cache", 17, left=True), Column("bytes/tok", 10, ","), Column("resid blk", 10),
               Column("KL nats", 11, ".2e"), Column("top-1", 8, ".2%"), Column("ppl", 9, ".3f"),
               Column("ppl Δ%", 9, "+.2f"), Column("passkey", 9, ".0%"), Column("pool tok", 10, ","),
               Column("requests", 10, "d"), Column("x tok", 7, ".2f"), Column("x req", 7, ".2f")))
TABLE_KEYS = ("bytes_per_token", "residual_blocks_per_request", "kl", "top1", "ppl", "ppl_delta_pct", "passkey_acc",
              "pool_tokens", "concurrent_requests", "capacity_ratio_tokens", "capacity_ratio_requests")


# ---- passkey retrieval ----------------------------------------------------------------------------------

def run_passkey(engine, trials: list[PasskeyTrial], max_tokens: int = PASSKEY_MAX_TOKENS) -> dict:
    """Generate greedily for every trial in one batch; accuracy overall and by depth, and the replies."""
    replies = [o.text for o in greedy_outputs(engine, [t.token_ids for t in trials], max_tokens)]
    correct = [str(t.key) in r for t, r in zip(trials, replies)]
    return {**passkey_accuracy(trials, correct), "trials": len(trials), "replies": replies}


# ---- capacity -------------------------------------------------------------------------------------------

def measure_capacity(engine, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """Run more requests of `prompt_len` random tokens than the pool holds; the peak number whose whole
    prompt is in the cache at once (`concurrent_requests`), and the pool's size in tokens.

    Steps until the first request finishes, or until every running request is decoding and none
    more can be admitted (free blocks only shrink from then on); then aborts everything.
    """
    from kvcache.engine.sampling_params import SamplingParams
    from kvcache.memory.kv_cache_manager import blocks_for
    info = engine.kv_cache_info()
    per_request = blocks_for(prompt_len + max_tokens, info["block_size"]) + info["seq_blocks"]
    n = info["num_blocks"] // per_request + 3
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"capacity-{i}" for i in range(n)]
    for rid, prompt in zip(ids, random_prompts(engine, n, prompt_len, seed)):
        engine.add_request(rid, prompt, params)
    sched = engine.scheduler
    peak_running = peak_held = steps = 0
    finished = False
    try:
        waiting = len(sched.waiting)
        for outs in engine.steps():
            finished = any(out.finished for out in outs)
            steps += 1
            held = sum(s.num_computed_tokens >= s.num_prompt_tokens for s in sched.running)
            peak_running = max(peak_running, len(sched.running))
            peak_held = max(peak_held, held)
            stalled = sched.waiting and held == len(sched.running) and len(sched.waiting) >= waiting
            if finished or stalled:
                break
            waiting = len(sched.waiting)  # before the next step
    finally:
        for rid in ids:
            engine.abort_request(rid)
    engine.check_no_leaks()
    return {"pool_tokens": info["num_tokens"], "concurrent_requests": peak_held, "peak_running": peak_running,
            "submitted": n, "steps": steps, "preemptions": engine.scheduler.num_preemptions,
            "all_admitted": peak_held == n}


# ---- the command ----------------------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    add_text_args(p, num_docs=4, depths="0,0.25,0.5,0.75,1.0", passkeys_per_depth=2)
    p.add_argument("--kv-cache-dtypes", default=DEFAULT_DTYPES,
                   help=f"formats to compare with the float32 cache (default {DEFAULT_DTYPES})")
    p.add_argument("--context-len", type=int, default=1536, help="tokens of each document scored (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=256, help="first positions not scored (they barely use the cache) (default: %(default)s)")
    p.add_argument("--passkey-prompt", choices=["chat", "raw"], default="chat",
                   help="chat: the chat template with the reply started (default); raw: plain text")
    p.add_argument("--capacity-memory", default="96MiB", help="KV pool of every format in the capacity test (default: %(default)s)")
    p.add_argument("--capacity-prompt-len", type=int, default=1000, help="prompt tokens of each capacity request (default: %(default)s)")
    p.add_argument("--capacity-max-tokens", type=int, default=24, help="tokens each capacity request generates (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="passkeys and capacity prompts (default: %(default)s)")
    p.add_argument("--json", default="results/kv_quality.json", help="write the results here ('' to skip) (default: %(default)s)")
    p.add_argument("--plot", default="results/kv_quality.png", help="draw quality against bytes per token here "
                   "('' to skip) (default: %(default)s)")


def _parse_args(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    from kvcache.plan.kv_bytes import kv_dtype
    dtypes = []
    for d in (x.strip() for x in args.kv_cache_dtypes.split(",")):
        name = kv_dtype(d).name  # raises with the supported list
        if name in dtypes:
            raise ValueError(f"--kv-cache-dtypes names {name} twice")
        dtypes.append(name)
    if not dtypes:
        raise ValueError("--kv-cache-dtypes is empty")
    depths = parse_depths(args.depths)
    check_positive(args, ("num_docs", "passkeys_per_depth", "passkey_len", "chunk_size", "capacity_prompt_len",
                          "capacity_max_tokens"))
    if not 0 <= args.warmup < args.context_len - 1:
        raise ValueError(f"--warmup {args.warmup} must be below --context-len {args.context_len} - 1, so that "
                         "positions are left to score")
    return dtypes, depths


def _quality(loaded, names: list[str], docs: list[list[int]], args: argparse.Namespace,
             rows: dict[str, dict]) -> QualityStats:
    """Every format's layout and its quality against the baseline, into `rows`; the baseline's own figures.
    Every engine is alive at once, one document's logits at a time."""
    engines = {d: build_engine(loaded, d, pool_bytes(loaded, d, 1, args.context_len), args.context_len)
               for d in names}
    for d, e in engines.items():
        info = e.kv_cache_info()
        rows[d].update(bytes_per_token=info["bytes_per_token"], block_size=info["block_size"],
                       residual_blocks_per_request=info["seq_blocks"],
                       residual_bytes_per_seq=info["residual_bytes_per_seq"])
    base, stats = evaluate_engines(engines[BASELINE], {d: engines[d] for d in names[1:]}, docs, args.warmup,
                                   args.chunk_size, progress=True)
    for d in names:
        rows[d].update((base if d == BASELINE else stats[d]).summary(base.ppl))
    del engines, e  # the loop variable holds one engine too
    gc.collect()
    return base


def _passkey(ckpt: Checkpoint, names: list[str], depths: list[float], args: argparse.Namespace,
             rows: dict[str, dict]) -> dict:
    """Passkey accuracy of every format (one engine at a time), into `rows`; the trials' sizes (tokens)."""
    loaded = ckpt.loaded
    trials = passkey_trials(ckpt.tokenizer, depths, args.passkeys_per_depth, args.passkey_len, args.passkey_prompt,
                            args.seed)
    longest = max(len(t.token_ids) for t in trials) + PASSKEY_MAX_TOKENS

    def build(d: str):
        return build_engine(loaded, d, pool_bytes(loaded, d, len(trials), longest), min(ckpt.model_len, longest))
    for d, r in zip(names, each_engine(names, build, lambda e, _: run_passkey(e, trials), "passkey")):
        rows[d].update(passkey_acc=r["acc"], passkey_by_depth=r["by_depth"], passkey_replies=r["replies"])
    return {"trials": len(trials), "prompt_tokens": [len(t.token_ids) for t in trials]}


def _capacity(ckpt: Checkpoint, names: list[str], memory: int, args: argparse.Namespace,
              rows: dict[str, dict]) -> dict:
    """Requests each format's pool of `memory` bytes really holds, into `rows` with the ratios over float16 (measured
    even where not asked for); the settings and float16's figures."""
    need = args.capacity_prompt_len + args.capacity_max_tokens
    cap_names = names if CAPACITY_BASELINE in names else names + [CAPACITY_BASELINE]

    def build(d: str):
        return build_engine(ckpt.loaded, d, memory, min(ckpt.model_len, need), max_num_seqs=256,
                            enable_prefix_caching=False)

    def measure(e, _):
        return measure_capacity(e, args.capacity_prompt_len, args.capacity_max_tokens, args.seed)
    measured = dict(zip(cap_names, each_engine(cap_names, build, measure, "capacity")))
    ref = measured[CAPACITY_BASELINE]
    for d in names:
        m = measured[d]
        rows[d].update(pool_tokens=m["pool_tokens"], concurrent_requests=m["concurrent_requests"],
                       capacity_ratio_tokens=m["pool_tokens"] / ref["pool_tokens"],
                       capacity_ratio_requests=(m["concurrent_requests"] / ref["concurrent_requests"]
                                                if ref["concurrent_requests"] else None),
                       capacity_detail={k: m[k] for k in ("peak_running", "submitted", "steps", "preemptions")})
    return {"memory_bytes": memory, "prompt_len": args.capacity_prompt_len,
            "max_tokens": args.capacity_max_tokens, "baseline_dtype": CAPACITY_BASELINE,
            "baseline_pool_tokens": ref["pool_tokens"], "baseline_concurrent_requests": ref["concurrent_requests"]}


def run(args: argparse.Namespace) -> int:
    """Quality, passkey retrieval and capacity of every format against the float32 cache: table, JSON, plot."""
    from kvcache.plan.sizes import parse_bytes
    dtypes, depths = _parse_args(args)
    capacity_memory = parse_bytes(args.capacity_memory)
    ckpt = load_checkpoint(args.model)
    docs = ckpt.documents(args.num_docs, args.context_len, args.corpus)
    names = [BASELINE] + [d for d in dtypes if d != BASELINE]
    rows: dict[str, dict] = {d: {"kv_cache_dtype": d} for d in names}
    base = _quality(ckpt.loaded, names, docs, args, rows)
    passkey = None if args.skip_passkey else _passkey(ckpt, names, depths, args, rows)
    capacity = None if args.skip_capacity else _capacity(ckpt, names, capacity_memory, args, rows)
    for r in rows.values():
        for k in ("passkey_acc", "pool_tokens", "concurrent_requests", "capacity_ratio_tokens",
                  "capacity_ratio_requests"):
            r.setdefault(k, None)
    results = {
        "baseline": {"name": BASELINE_NAME, **rows[BASELINE]},
        "dtypes": {d: rows[d] for d in names[1:]},
        "settings": {
            "model": ckpt.loaded.source, "num_docs": len(docs), "context_len": args.context_len,
            "warmup": args.warmup, "chunk_size": args.chunk_size, "scored_positions": base.positions,
            "corpus": args.corpus or "shipped",
            "passkey": None if passkey is None else {
                "depths": depths, "per_depth": args.passkeys_per_depth, "target_len": args.passkey_len,
                "prompt": args.passkey_prompt, "seed": args.seed, **passkey},
            "capacity": capacity, "wall_s": ckpt.wall_s(),
        },
    }
    return report(results, print_table, args.json, plot, args.plot)


def print_table(results: dict) -> None:
    """The results as a table on stdout, baseline first."""
    s = results["settings"]
    print(f"\nmodel: {s['model']}")
    print(f"quality: {s['num_docs']} documents x {s['context_len']:,} tokens, positions after the first "
          f"{s['warmup']} scored ({s['scored_positions']:,} in all; early positions barely use the cache), "
          f"prefill chunks of {s['chunk_size']}")
    if s["passkey"]:
        p = s["passkey"]
        depths = ", ".join(f"{d:g}" for d in p["depths"])
        print(f"passkey: {p['trials']} trials ({p['per_depth']} keys at depths {depths}), "
              f"{min(p['prompt_tokens']):,}-{max(p['prompt_tokens']):,} prompt tokens, {p['prompt']} prompt, greedy")
    if s["capacity"]:
        c = s["capacity"]
        print(f"capacity: {c['memory_bytes'] / 2**20:g} MiB pool each; requests of {c['prompt_len']:,} + "
              f"{c['max_tokens']} tokens; ratios over {c['baseline_dtype']} ({c['baseline_pool_tokens']:,} tokens, "
              f"{c['baseline_concurrent_requests']} requests)")
    TABLE.print([name] + [r[k] for k in TABLE_KEYS]
                for name, r in [(BASELINE_NAME, results["baseline"])] + list(results["dtypes"].items()))


def plot(results: dict, path: str) -> None:
    """KL and perplexity change against bytes per token, one labelled point per format (PNG)."""
    import os
    plt, fig, axes = new_figure(path, 1, 2, (12, 4.8))
    points = [(BASELINE_NAME, results["baseline"])] + list(results["dtypes"].items())
    sizes = sorted({r["bytes_per_token"] for _, r in points})
    # symlog: the baseline sits at 0 and the formats span decades (float16's KL is ~1e-7 nats)
    for ax, key, label, lin in ((axes[0], "kl", "mean KL(P_fp32 || P_format), nats", 1e-7),
                                (axes[1], "ppl_delta_pct", "perplexity change vs fp32 cache, %", 1e-3)):
        for i, (name, r) in enumerate(points):
            x, y = r["bytes_per_token"], r[key]
            color = "black" if name == BASELINE_NAME else plt.cm.tab10(i % 10)
            ax.scatter([x], [y], color=color, label=name, zorder=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color=color)
        finish_axis(ax, sizes, [f"{b:,}" for b in sizes], "KV cache bytes per token (scales included)", label,
                    tick_style={"rotation": 30, "fontsize": 8}, yscale={"value": "symlog", "linthresh": lin})
    axes[0].set_ylim(bottom=0)  # KL is never negative
    axes[1].legend(fontsize=8, loc="upper right")
    s = results["settings"]
    save_figure(plt, fig, path, f"KV cache format: quality vs memory ({os.path.basename(s['model'])}, "
                f"{s['num_docs']} docs x {s['context_len']} tokens)")
