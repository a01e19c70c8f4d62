"""`kvcache eval eviction`: what each token eviction policy costs in quality and buys in memory and throughput.

Every policy (streaming, h2o, snapkv, tova, pyramidkv, random; compress/) is compared with the full cache
(no eviction) in the same run, on the same model (the SmolLM2-135M demo model unless `--model`), loaded
once; the quality and passkey parts run on one engine with a float32 cache, so that only eviction differs.
Budgets are ratios of the prompt (`--budgets`, default 0.5, 0.25, 0.125): the tokens a request keeps per
layer and KV head once its prompt is in the cache.

- quality: `--num-docs` documents of the shipped corpus (corpus.py). The first `--context-len` tokens are
  the prompt: prefilled in chunks of `--chunk-size`, then compacted to the budget (`LLMEngine.score` with
  an EvictionSpec). The next `--continuation` tokens are teacher-forced one per engine step, as decodes,
  so policies that evict while decoding (streaming, h2o, tova) keep evicting; snapkv, pyramidkv and random
  evict once, at the end of the prompt, and their cache then grows from the budget. Each continuation
  position is scored against the full cache: KL(P_full || P_policy) in nats, top-1 agreement (equal argmax
  tokens), and the perplexity of the actual next tokens with its change in percent.
- passkey retrieval (Mohtashami & Jaggi, 2023): `--passkeys-per-depth` keys at each of `--depths` in chat-
  template prompts of about `--passkey-len` tokens (as `kvcache eval kv-quality`'s). A prompt is split
  into its context (instruction, filler, key sentence, filler) and its question (" What is the pass key?",
  the end of the chat template, "The pass key is"), each tokenized alone. The expected answer is the full
  cache's greedy reply (8 tokens at most) up to the token that completes the key; a trial whose full-
  cache reply lacks the key is a baseline miss, counted and left out. A trial is correct for a policy if,
  teacher-forced over context + question + answer, the argmax at every answer position is the answer's
  token: exactly "greedy decoding reproduces the answer". Two settings:
  query-agnostic: the cache is compacted at the end of the context, before the question is seen (the
  budget is a ratio of the context); the question then runs as decodes. The compression cannot know what
  will be asked, as when one compressed document serves many questions.
  query-aware: the question is part of the compressed prompt (the budget is a ratio of context +
  question), inside SnapKV's 32-token observation window, as when a request is compressed on arrival.
  StreamingLLM keeps its 4 sink tokens and the most recent ones: it cannot retrieve a key that is in
  neither (at depth 1 the key may still sit in its recent window).
- memory and throughput, measured by the engine: `--capacity-requests` requests of
  `--capacity-prompt-len` random tokens, each generating `--capacity-max-tokens` (greedy), are all
  submitted at once to an engine with a `--capacity-memory` float32 pool, and run to the end: once
  without eviction, once per policy at `--capacity-budget`, and snapkv at each of `--budgets` (memory
  against budget). Each request still prefills its whole prompt before it is compacted, so the pool must
  hold one prompt; afterwards each holds its budget ("held tokens/request"), which frees blocks for more
  requests. Reported: the peak number of requests decoding at once, peak used blocks, wall time, output
  tokens/s, tokens evicted and blocks freed, preemptions, and the ratios of requests and throughput over
  no eviction. snapkv and pyramidkv (and random) do not evict while decoding: their cache grows from the
  budget by up to `--capacity-max-tokens`. pyramidkv's engine runs with --kv-eviction pyramidkv, so it keeps one
  block table per layer and each layer's table gives back the whole blocks its smaller budget leaves dead:
  it holds about the average of its per-layer budgets (peak memory is reported in bytes, since its blocks hold
  one layer each).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from typing import TYPE_CHECKING, Literal

from kvcache.eval.harness import (Checkpoint, Column, QualityStats, SplitTrial, Table, add_text_args,
                                  answer_tokens, build_engine, check_positive, compare_scores, each_engine,
                                  finish_axis, fmt, greedy_outputs, load_checkpoint, new_figure, parse_depths,
                                  passkey_accuracy, pool_bytes, random_prompts, report, save_figure,
                                  split_passkey_trials)

if TYPE_CHECKING:  # torch is imported where it is used: `kvcache plan` loads kvcache.eval modules torch-free
    from kvcache.compress.spec import EvictionSpec

DEFAULT_POLICIES = "streaming,h2o,snapkv,tova,pyramidkv,random"
DEFAULT_BUDGETS = "0.5,0.25,0.125"
FULL = "full cache"
SWEEP_POLICY = "snapkv"  # the policy whose memory is measured at every budget
ANSWER_MAX_TOKENS = 8  # the full cache's reply; a 5-digit key takes 6 tokens at most with the demo tokenizer
Setting = Literal["query_agnostic", "query_aware"]
SETTINGS: tuple[Setting, ...] = ("query_agnostic", "query_aware")


def held_tokens(spec: EvictionSpec, prompt_len: int, num_layers: int, block_size: int = 1) -> int:
    """KV token slots per layer a request with a `prompt_len`-token prompt holds right after its compaction: the
    budget; for pyramidkv (one block table per layer, --kv-eviction pyramidkv) the mean over layers of what each
    layer's table keeps: layer 0's budget of slots, less the whole `block_size` blocks its own smaller budget
    leaves dead at the front (those go back to the pool)."""
    from kvcache.compress.pyramidkv import layer_budgets
    if not spec.enabled:
        return prompt_len
    budget = spec.tokens(prompt_len)
    if spec.policy == "pyramidkv":
        per_layer = layer_budgets(budget, prompt_len, num_layers)
        top = per_layer[0]
        return round(sum(top - (top - b) // block_size * block_size for b in per_layer) / num_layers)
    return min(budget, prompt_len)


# ---- quality --------------------------------------------------------------------------------------------

def evaluate_quality(engine, docs: list[list[int]], context_len: int, specs: list[EvictionSpec],
                     chunk_size: int | None = None, progress: bool = False) -> tuple[QualityStats, list[QualityStats]]:
    """Score the continuation of every document with the full cache and with each spec of `specs`.

    Each document's first `context_len` tokens are the prompt (compacted to the spec's budget once
    prefilled); the rest run one per step as decodes and are scored: len(doc) - context_len positions.
    The full cache is compared with itself too (KL 0, top-1 1: a check of the metrics).
    """
    for ids in docs:
        if not 1 <= context_len < len(ids):
            raise ValueError(f"a context of {context_len:,} tokens must leave continuation tokens to score in a "
                             f"{len(ids):,}-token document")

    def scorer(spec):
        return lambda ids, start: engine.score(ids, start=start, chunk_size=chunk_size, eviction=spec)
    base, stats = compare_scores(scorer(None), {i: scorer(spec) for i, spec in enumerate(specs)}, docs,
                                 context_len - 1, progress, "quality")
    return base, [stats[i] for i in range(len(specs))]


# ---- passkey retrieval ----------------------------------------------------------------------------------

def full_cache_answers(engine, trials: list[SplitTrial], max_tokens: int = ANSWER_MAX_TOKENS) -> list[list[int] | None]:
    """Greedy replies of the full cache (all trials in one batch), cut after the key; None where the reply
    lacks the key (a baseline miss)."""
    outs = greedy_outputs(engine, [t.token_ids for t in trials], max_tokens)
    return [answer_tokens(engine.tokenizer, t.key, list(o.token_ids)) for t, o in zip(trials, outs)]


def reproduces(engine, trial: SplitTrial, answer: list[int], setting: Setting, spec: EvictionSpec | None = None,
               chunk_size: int | None = None) -> bool:
    """Whether greedy decoding reproduces `answer` after `trial`'s prompt: teacher-forced over context +
    question + answer, the argmax at every answer position is the answer's token.

    The prompt `spec` compacts is the context (query_agnostic; the question then runs as decodes) or the
    context and the question (query_aware); spec None is the full cache.
    """
    if not answer:
        raise ValueError("the expected answer is empty")
    if setting not in SETTINGS:
        raise ValueError(f"passkey setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    ids = trial.token_ids + answer
    prompt = len(trial.context_ids) if setting == "query_agnostic" else len(trial.token_ids)
    logits = engine.score(ids[:-1], start=prompt - 1, chunk_size=chunk_size, eviction=spec)
    # row r predicts ids[prompt + r]; the answer starts at len(trial.token_ids)
    return logits[len(trial.token_ids) - prompt:].argmax(-1).tolist() == answer


def evaluate_passkey(engine, trials: list[SplitTrial], answers: list[list[int] | None], specs: list[EvictionSpec],
                     chunk_size: int | None = None, progress: bool = False) -> tuple[dict, list[dict]]:
    """Accuracy of the full cache (teacher-forced: a check that it reproduces its own replies) and of each
    spec in both settings, over the trials with an answer: ({"acc", "correct", "by_depth"}, per spec
    {setting: the same})."""
    from tqdm import tqdm
    valid = [(t, a) for t, a in zip(trials, answers) if a is not None]
    bar = tqdm(total=len(valid) * (1 + 2 * len(specs)), desc="passkey", disable=not progress, file=sys.stderr)

    def accuracy(setting: Setting, spec: EvictionSpec | None) -> dict:
        correct = []
        for t, a in valid:
            correct.append(reproduces(engine, t, a, setting, spec, chunk_size))
            bar.update(1)
        return passkey_accuracy([t for t, _ in valid], correct)
    full = accuracy("query_agnostic", None)
    runs = [{setting: accuracy(setting, spec) for setting in SETTINGS} for spec in specs]
    bar.close()
    return full, runs


# ---- memory and throughput ------------------------------------------------------------------------------

def measure_throughput(engine, prompts: list[list[int]], max_tokens: int, spec: EvictionSpec | None) -> dict:
    """Submit every prompt at once (greedy, `max_tokens` each, `spec`'s eviction) to a fresh engine and
    step to the end: the peak number of requests decoding at once (whole prompt in the cache), peak used
    blocks, wall seconds, output tokens/s, and the engine's eviction and preemption counters."""
    from kvcache.engine.sampling_params import SamplingParams
    if engine.has_unfinished_requests() or engine.stats.steps:
        raise ValueError("measure_throughput needs a fresh engine: its counters are the measurement")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"capacity-{i}", p, params, eviction=spec)
    sched = engine.scheduler
    peak = 0
    t0 = time.perf_counter()
    for _ in engine.steps():
        peak = max(peak, sum(s.num_computed_tokens >= s.num_prompt_tokens for s in sched.running))
    wall = time.perf_counter() - t0
    engine.check_no_leaks()
    info = engine.kv_cache_info()
    out = engine.stats.generation_tokens
    block_bytes = info["bytes_per_token"] * info["block_size"]
    return {"concurrent_requests": peak, "peak_used_blocks": info["peak_used_blocks"],
            "peak_used_bytes": info["peak_used_blocks"] * block_bytes,
            "num_blocks": info["num_blocks"], "block_size": info["block_size"], "wall_s": wall,
            "output_tokens": out, "output_tokens_per_s": out / wall, "steps": engine.stats.steps,
            "evicted_tokens": info["evicted_tokens"], "freed_blocks": info["eviction_freed_blocks"],
            "compactions": info["eviction_compactions"], "preemptions": info["num_preemptions"]}


# ---- the command ----------------------------------------------------------------------------------------

def add_args(p: argparse.ArgumentParser) -> None:
    add_text_args(p, num_docs=2, depths="0,0.25,0.5,0.75,1", passkeys_per_depth=1)
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"eviction policies to compare with the full cache "
                   f"(default {DEFAULT_POLICIES})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="KV budgets, ratios of the prompt in (0, 1] "
                   f"(default {DEFAULT_BUDGETS})")
    p.add_argument("--context-len", type=int, default=1024, help="prompt tokens of each document (compacted) (default: %(default)s)")
    p.add_argument("--continuation", type=int, default=128, help="tokens after the prompt, teacher-forced and scored (default: %(default)s)")
    p.add_argument("--capacity-memory", default="96MiB", help="float32 KV pool of the memory/throughput runs (default: %(default)s)")
    p.add_argument("--capacity-requests", type=int, default=12, help="requests submitted at once per run (default: %(default)s)")
    p.add_argument("--capacity-prompt-len", type=int, default=1024, help="random prompt tokens of each request (default: %(default)s)")
    p.add_argument("--capacity-max-tokens", type=int, default=64, help="tokens each request generates (default: %(default)s)")
    p.add_argument("--capacity-budget", type=float, default=0.125, help="the budget every policy runs at in the "
                   "memory/throughput runs (snapkv runs at each of --budgets too) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="passkeys, capacity prompts and random eviction (default: %(default)s)")
    p.add_argument("--json", default="results/kv_eviction.json", help="write the results here ('' to skip) (default: %(default)s)")
    p.add_argument("--plot", default="results/kv_eviction.png", help="draw quality against budget here ('' to skip) (default: %(default)s)")


def parse_policies(text: str) -> list[str]:
    """'h2o, snapkv' -> ['h2o', 'snapkv']; ValueError naming the supported policies."""
    from kvcache.compress.spec import POLICIES
    supported = [p for p in POLICIES if p != "none"]
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise ValueError(f"--policies is empty; supported: {', '.join(supported)}")
    for n in names:
        if n not in supported:
            raise ValueError(f"unknown eviction policy {n!r} in --policies; supported: {', '.join(supported)}")
        if names.count(n) > 1:
            raise ValueError(f"--policies names {n} twice")
    return names


def parse_budgets(text: str) -> list[float]:
    """'0.5,0.25' -> [0.5, 0.25]: ratios of the prompt in (0, 1]."""
    try:
        budgets = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--budgets takes ratios of the prompt separated by commas, got {text!r}") from None
    bad = [b for b in budgets if not 0 < b <= 1]
    if bad:
        raise ValueError(f"--budgets are ratios of the prompt in (0, 1]; got {', '.join(f'{b:g}' for b in bad)}")
    if len(set(budgets)) < len(budgets):
        raise ValueError(f"--budgets names a budget twice: {text!r}")
    return budgets


def check_budgets(policies: list[str], budgets: list[float], prompt_len: int, what: str) -> None:
    """ValueError (with the numbers) if a policy cannot work with a budget on `prompt_len`-token prompts."""
    from kvcache.compress.spec import EvictionSpec
    for p in policies:
        for b in budgets:
            try:
                EvictionSpec(p, b).check_ratio(prompt_len)
            except ValueError as e:
                raise ValueError(f"{what}: {e}; raise the prompt length or the budget") from None


def _parse_args(args: argparse.Namespace) -> tuple[list[str], list[float], list[float]]:
    policies = parse_policies(args.policies)
    budgets = parse_budgets(args.budgets)
    depths = parse_depths(args.depths)
    check_positive(args, ("num_docs", "context_len", "continuation", "chunk_size", "passkeys_per_depth", "passkey_len",
                          "capacity_requests", "capacity_prompt_len", "capacity_max_tokens"))
    if not 0 < args.capacity_budget <= 1:
        raise ValueError(f"--capacity-budget is a ratio of the prompt in (0, 1], got {args.capacity_budget:g}")
    check_budgets(policies, budgets, args.context_len, f"--context-len {args.context_len:,}")
    if not args.skip_capacity:
        check_budgets(policies, [args.capacity_budget], args.capacity_prompt_len,
                      f"--capacity-prompt-len {args.capacity_prompt_len:,}")
        check_budgets([_sweep_policy(policies)], budgets, args.capacity_prompt_len,
                      f"--capacity-prompt-len {args.capacity_prompt_len:,}")
    return policies, budgets, depths


def _sweep_policy(policies: list[str]) -> str:
    return SWEEP_POLICY if SWEEP_POLICY in policies else policies[0]


def _check_lengths(args: argparse.Namespace, model_len: int) -> None:
    """ValueError (with the numbers) where a document or a capacity request is longer than the model's context."""
    if args.context_len + args.continuation > model_len:
        raise ValueError(f"--context-len {args.context_len:,} + --continuation {args.continuation:,} is above the "
                         f"model's context length {model_len:,}")
    if not args.skip_capacity and args.capacity_prompt_len + args.capacity_max_tokens > model_len:
        raise ValueError(f"--capacity-prompt-len {args.capacity_prompt_len:,} + --capacity-max-tokens "
                         f"{args.capacity_max_tokens:,} is above the model's context length {model_len:,}")


def _passkey_trials(ckpt: Checkpoint, args: argparse.Namespace, policies: list[str], budgets: list[float],
                    depths: list[float]) -> list[SplitTrial]:
    """The split passkey trials, checked against every budget and the model's context length."""
    trials = split_passkey_trials(ckpt.tokenizer, depths, args.passkeys_per_depth, args.passkey_len, args.seed)
    shortest = min(len(t.context_ids) for t in trials)
    check_budgets(policies, budgets, shortest, f"a passkey context of {shortest:,} tokens (--passkey-len "
                  f"{args.passkey_len:,})")
    if max(len(t.token_ids) for t in trials) + ANSWER_MAX_TOKENS > ckpt.model_len:
        raise ValueError(f"--passkey-len {args.passkey_len:,} leaves no room for the answer in the model's "
                         f"context length {ckpt.model_len:,}")
    return trials


def _quality(engine, docs: list[list[int]], args: argparse.Namespace, pairs: list[tuple[str, float]],
             specs: list[EvictionSpec], num_layers: int) -> tuple[QualityStats, dict]:
    """The full cache's figures, and the quality part of the results: the full cache and one run per pair."""
    base, stats = evaluate_quality(engine, docs, args.context_len, specs, args.chunk_size, progress=True)
    return base, {"full": base.summary(base.ppl),
                  "runs": [{"policy": p, "budget": b, "budget_tokens": spec.tokens(args.context_len),
                            "held_tokens": held_tokens(spec, args.context_len, num_layers), **s.summary(base.ppl)}
                           for (p, b), spec, s in zip(pairs, specs, stats)]}


def _passkey(engine, trials: list[SplitTrial], pairs: list[tuple[str, float]], specs: list[EvictionSpec],
             args: argparse.Namespace) -> dict:
    """The passkey part of the results: the full cache's answers, then every pair in both settings."""
    answers = full_cache_answers(engine, trials)
    full, runs = evaluate_passkey(engine, trials, answers, specs, args.chunk_size, progress=True)
    return {"trials": len(trials), "baseline_misses": sum(a is None for a in answers),
            "scored_trials": sum(a is not None for a in answers),
            "context_tokens": [len(t.context_ids) for t in trials],
            "question_tokens": [len(t.question_ids) for t in trials],
            "answer_tokens": [None if a is None else len(a) for a in answers],
            "answers": [None if a is None else engine.tokenizer.decode(a) for a in answers],
            "split_differs": sum(not t.joint for t in trials), "full": full,
            "runs": [{"policy": p, "budget": b, **r} for (p, b), r in zip(pairs, runs)]}


def _capacity(ckpt: Checkpoint, policies: list[str], budgets: list[float], memory: int,
              args: argparse.Namespace) -> dict:
    """The memory/throughput part of the results: no eviction, every policy at --capacity-budget and the sweep
    policy at every budget, each on a fresh engine with a pool of `memory` bytes and the same prompts."""
    from kvcache.compress.spec import EvictionSpec
    sweep = _sweep_policy(policies)
    configs = ([("none", None)] + [(p, args.capacity_budget) for p in policies]
               + [(sweep, b) for b in budgets if b != args.capacity_budget])
    num_layers = ckpt.loaded.config.num_hidden_layers
    prompts: list[list[int]] = []  # drawn once, from the first engine's vocabulary

    def build(config: tuple[str, float | None]):
        p, b = config
        # pyramidkv as the engine's policy: its layout is then one block table per layer (per-layer memory)
        own = {"kv_eviction": p, "kv_budget": b} if p == "pyramidkv" else {}
        return build_engine(ckpt.loaded, "float32", memory, args.capacity_prompt_len + args.capacity_max_tokens,
                            max_num_seqs=256, enable_prefix_caching=False, seed=args.seed, **own)

    def measure(e, config: tuple[str, float | None]) -> dict:
        p, b = config
        prompts[:] = prompts or random_prompts(e, args.capacity_requests, args.capacity_prompt_len, args.seed)
        spec = EvictionSpec(p, b)
        m = measure_throughput(e, prompts, args.capacity_max_tokens, spec if spec.enabled else None)
        return {"policy": p, "budget": b,
                "held_tokens": held_tokens(spec, args.capacity_prompt_len, num_layers, e.config.block_size), **m}
    runs = each_engine(configs, build, measure, "capacity")
    ref = runs[0]
    for r in runs:
        r["requests_ratio"] = (r["concurrent_requests"] / ref["concurrent_requests"]
                               if ref["concurrent_requests"] else None)
        r["throughput_ratio"] = r["output_tokens_per_s"] / ref["output_tokens_per_s"]
    return {"memory_bytes": memory, "pool_tokens": ref["num_blocks"] * ref["block_size"],
            "requests": args.capacity_requests, "prompt_len": args.capacity_prompt_len,
            "max_tokens": args.capacity_max_tokens, "budget": args.capacity_budget, "sweep_policy": sweep, "runs": runs}


def run(args: argparse.Namespace) -> int:
    """Quality, passkey retrieval, memory and throughput of every policy and budget against the full cache:
    tables, JSON, plot."""
    from kvcache.compress.spec import EvictionSpec
    from kvcache.plan.sizes import parse_bytes
    policies, budgets, depths = _parse_args(args)
    capacity_memory = parse_bytes(args.capacity_memory)
    ckpt = load_checkpoint(args.model)
    _check_lengths(args, ckpt.model_len)
    doc_len = args.context_len + args.continuation
    docs = ckpt.documents(args.num_docs, doc_len, args.corpus)
    pairs = [(p, b) for p in policies for b in budgets]
    specs = [EvictionSpec(p, b) for p, b in pairs]
    trials = [] if args.skip_passkey else _passkey_trials(ckpt, args, policies, budgets, depths)
    # one float32 engine for quality and passkey: only eviction differs between the runs
    longest = max([len(t.token_ids) + ANSWER_MAX_TOKENS for t in trials] + [doc_len])
    loaded = ckpt.loaded
    engine = build_engine(loaded, "float32", max(pool_bytes(loaded, "float32", 1, doc_len),
                                                 pool_bytes(loaded, "float32", max(1, len(trials)), longest)),
                          longest, seed=args.seed)
    base, quality = _quality(engine, docs, args, pairs, specs, loaded.config.num_hidden_layers)
    passkey = _passkey(engine, trials, pairs, specs, args) if trials else None
    engine.check_no_leaks()
    del engine
    gc.collect()
    capacity = None if args.skip_capacity else _capacity(ckpt, policies, budgets, capacity_memory, args)
    results = {
        "quality": quality, "passkey": passkey, "capacity": capacity,
        "settings": {"model": loaded.source, "policies": policies, "budgets": budgets, "num_docs": len(docs),
                     "context_len": args.context_len, "continuation": args.continuation,
                     "scored_positions": base.positions, "chunk_size": args.chunk_size,
                     "corpus": args.corpus or "shipped", "kv_cache_dtype": "float32", "seed": args.seed,
                     "passkey": None if passkey is None else {
                         "depths": depths, "per_depth": args.passkeys_per_depth, "target_len": args.passkey_len},
                     "wall_s": ckpt.wall_s()},
    }
    return report(results, print_tables, args.json, plot, args.plot)


QUALITY_TABLE = Table((Column("policy", 12, left=True), Column("budget", 8, "g"), Column("held tok", 10, ","),
                       Column("KL nats", 11, ".2e"), Column("top-1", 8, ".2%"), Column("ppl", 9, ".3f"),
                       Column("ppl Δ%", 10, "+.2f")))
CAPACITY_TABLE = Table((Column("policy", 12, left=True), Column("budget", 8, "g"), Column("held tok/req", 13, ","),
                        Column("decoding", 10), Column("x req", 7, ".2f"), Column("peak MiB", 10, ".2f"),
                        Column("tok/s", 8, ".1f"), Column("x tok/s", 8, ".2f"), Column("wall s", 8, ".1f"),
                        Column("evicted", 9, ","), Column("freed blk", 10, ","), Column("preempt", 9)))


def passkey_table(depths: list[str]) -> Table:
    """The passkey table: accuracy in both settings, then one agnostic/aware column per depth."""
    return Table((Column("policy", 12, left=True), Column("budget", 8, "g"), Column("agnostic", 10, ".0%"),
                  Column("aware", 8, ".0%"))
                 + tuple(Column("d" + d, 9, ".0%", gap="  " if i == 0 else " ") for i, d in enumerate(depths)),
                 note="   (by depth: agnostic/aware)")


def _print_passkey(p: dict) -> None:
    print(f"\npasskey: {p['trials']} trials, context {min(p['context_tokens']):,}-{max(p['context_tokens']):,} "
          f"+ question {min(p['question_tokens'])}-{max(p['question_tokens'])} tokens; {p['baseline_misses']} "
          f"baseline misses left out; query-agnostic compacts the context, query-aware context + question")
    if not p["scored_trials"]:
        print("no trial scored: the full cache's reply never contained the key")
        return
    full = p["full"]
    depths = list(full["by_depth"])
    rows = [[FULL, None, full["acc"], full["acc"]] + [full["by_depth"][d] for d in depths]]
    for r in p["runs"]:
        ag, aw = r["query_agnostic"], r["query_aware"]
        rows.append([r["policy"], r["budget"], ag["acc"], aw["acc"]]
                    + [f"{fmt(ag['by_depth'].get(d), '.0%')}/{fmt(aw['by_depth'].get(d), '.0%')}" for d in depths])
    passkey_table(depths).print(rows)


def print_tables(results: dict) -> None:
    """The results as one table per part on stdout, the full cache first."""
    s, q = results["settings"], results["quality"]
    print(f"\nmodel: {s['model']}; float32 KV cache; budgets are ratios of the prompt")
    print(f"\nquality: {s['num_docs']} documents, prompt {s['context_len']:,} tokens (compacted), next "
          f"{s['continuation']} tokens teacher-forced as decodes and scored ({s['scored_positions']:,} positions)")
    f = q["full"]
    QUALITY_TABLE.print([[FULL, None, s["context_len"], f["kl"], f["top1"], f["ppl"], f["ppl_delta_pct"]]]
                        + [[r["policy"], r["budget"], r["held_tokens"], r["kl"], r["top1"], r["ppl"],
                            r["ppl_delta_pct"]] for r in q["runs"]])
    if results["passkey"]:
        _print_passkey(results["passkey"])
    c = results["capacity"]
    if c:
        print(f"\nmemory and throughput: {c['memory_bytes'] / 2**20:g} MiB float32 pool ({c['pool_tokens']:,} "
              f"tokens); {c['requests']} requests of {c['prompt_len']:,} random tokens + {c['max_tokens']} "
              f"generated, all submitted at once; ratios over no eviction")
        CAPACITY_TABLE.print([
            ["none" if r["budget"] is None else r["policy"], r["budget"], r["held_tokens"], r["concurrent_requests"],
             r["requests_ratio"], r["peak_used_bytes"] / 2**20, r["output_tokens_per_s"], r["throughput_ratio"],
             r["wall_s"], r["evicted_tokens"], r["freed_blocks"], r["preemptions"]] for r in c["runs"]])


def plot(results: dict, path: str) -> None:
    """Quality against budget, one curve per policy (PNG): KL, perplexity change, passkey accuracy in the
    query-agnostic and the query-aware setting."""
    import os
    plt, fig, axes = new_figure(path, 2, 2, (12, 9))
    s = results["settings"]
    budgets = sorted(s["budgets"])
    p = results["passkey"]
    panels = [(axes[0, 0], results["quality"]["runs"], lambda r: r["kl"], "mean KL(P_full || P_policy), nats"),
              (axes[0, 1], results["quality"]["runs"], lambda r: r["ppl_delta_pct"],
               "perplexity change vs full cache, %"),
              (axes[1, 0], p["runs"] if p else [], lambda r: r["query_agnostic"]["acc"],
               "passkey accuracy, query-agnostic"),
              (axes[1, 1], p["runs"] if p else [], lambda r: r["query_aware"]["acc"], "passkey accuracy, query-aware")]
    for i, (ax, runs, value, label) in enumerate(panels):
        for j, policy in enumerate(s["policies"]):
            pts = sorted((r["budget"], value(r)) for r in runs if r["policy"] == policy and value(r) is not None)
            if i >= 2:  # accuracies often coincide: shift each policy's curve a little to keep it visible
                pts = [(x, y + 0.012 * (j - (len(s["policies"]) - 1) / 2)) for x, y in pts]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=plt.cm.tab10(j % 10),
                        label=policy)
        if i >= 2:
            if p and p["full"]["acc"] is not None:
                ax.axhline(p["full"]["acc"], color="black", linestyle="--", linewidth=1, label=FULL)
            ax.set_ylim(-0.05, 1.05)
            if not runs or p["full"]["acc"] is None:
                ax.text(0.5, 0.5, "no passkey trials scored", transform=ax.transAxes, ha="center", va="center")
        elif i == 0:
            ax.set_yscale("log")
        else:
            ax.axhline(0, color="black", linestyle="--", linewidth=1, label=FULL)
            ax.set_yscale("symlog", linthresh=1)
        finish_axis(ax, budgets, [f"{b:g}" for b in budgets], "KV budget, ratio of the prompt", label, base=2)
    axes[0, 1].legend(fontsize=8)
    save_figure(plt, fig, path, f"KV eviction: quality vs budget ({os.path.basename(s['model'])}, {s['num_docs']} "
                f"docs x {s['context_len']} + {s['continuation']} tokens)")
