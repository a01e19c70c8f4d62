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
import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache.bench.corpus import (PASSKEY_ANSWER, document_windows, load_corpus, passkey_keys, passkey_prompt,
                                 plain_prompt)

BASELINE = "float32"
BASELINE_NAME = "fp32 (baseline)"
CAPACITY_BASELINE = "float16"
DEFAULT_DTYPES = "float16,fp8_e4m3,fp8_e5m2,int8,int4,int2"
if TYPE_CHECKING:  # torch is imported where it is used: `kvcache plan` loads this module and stays torch-free
    import torch

_ROWS = 256  # logit rows per metric chunk: bounds the softmax temporaries to ~50 MB


# ---- metrics --------------------------------------------------------------------------------------------

def token_metrics(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int, float, float]:
    """Sums over rows of [rows, vocab] logits: KL(P_ref || P) in nats, argmax agreements, and the
    negative log-likelihood (nats) of `targets` under the reference and under `logits`."""
    import torch
    if ref_logits.shape != logits.shape or ref_logits.shape[0] != targets.shape[0]:
        raise ValueError(f"logits {tuple(ref_logits.shape)} and {tuple(logits.shape)} with {targets.shape[0]} "
                         "targets: shapes must match")
    kl = nll_ref = nll = 0.0
    top1 = 0
    for s in range(0, targets.shape[0], _ROWS):
        lp_ref = torch.log_softmax(ref_logits[s:s + _ROWS].float(), dim=-1)
        lp = torch.log_softmax(logits[s:s + _ROWS].float(), dim=-1)
        t = targets[s:s + _ROWS].unsqueeze(1)
        # p_ref * (log p_ref - log p); rows are independent, clamp the per-row float rounding at 0
        kl += (lp_ref.exp() * (lp_ref - lp)).sum(-1).clamp_min(0).double().sum().item()
        top1 += int((lp_ref.argmax(-1) == lp.argmax(-1)).sum())
        nll_ref -= lp_ref.gather(1, t).double().sum().item()
        nll -= lp.gather(1, t).double().sum().item()
    return kl, top1, nll_ref, nll


def ppl_delta_pct(ppl: float, ppl_ref: float) -> float:
    """Perplexity change in percent: (ppl / ppl_ref - 1) * 100."""
    return (ppl / ppl_ref - 1.0) * 100.0


@dataclass
class QualityStats:
    """Running sums over scored positions (tokens) of one format against the baseline."""

    positions: int = 0
    kl_sum: float = 0.0  # nats
    top1_sum: int = 0
    nll_sum: float = 0.0  # nats, of the actual next tokens under this format
    nll_ref_sum: float = 0.0  # the same under the baseline

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        kl, top1, nll_ref, nll = token_metrics(ref_logits, logits, targets)
        self.positions += targets.shape[0]
        self.kl_sum += kl
        self.top1_sum += top1
        self.nll_sum += nll
        self.nll_ref_sum += nll_ref

    @property
    def kl(self) -> float:
        """Mean KL(P_full || P_format) per position, nats."""
        return self.kl_sum / self.positions

    @property
    def top1(self) -> float:
        """Share of positions whose argmax token equals the baseline's."""
        return self.top1_sum / self.positions

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.positions)

    @property
    def ppl_ref(self) -> float:
        return math.exp(self.nll_ref_sum / self.positions)


# ---- engines --------------------------------------------------------------------------------------------

def pool_bytes(loaded, dtype: str, requests: int, tokens: int) -> int:
    """KV bytes (as the planner counts them) for `requests` requests of `tokens` tokens in `dtype`'s
    default blocks, residual blocks included, plus one spare block."""
    from kvcache.memory.kv_cache_manager import blocks_for
    from kvcache.plan.kv_bytes import default_block_size, kv_bytes_per_token, sequence_blocks
    from kvcache.plan.shape import shape_from_config
    shape = shape_from_config(loaded.config.to_dict())
    bs = default_block_size(dtype)
    blocks = requests * (blocks_for(tokens, bs) + sequence_blocks(shape, dtype, bs)) + 1
    return blocks * bs * kv_bytes_per_token(shape, dtype)


def build_engine(loaded, dtype: str, kv_cache_memory: int, max_model_len: int, **config):
    """An engine over the loaded checkpoint, computing in float32 and storing its KV cache as `dtype`
    in a pool of `kv_cache_memory` bytes; `config` sets other EngineConfig fields."""
    from kvcache.config import EngineConfig
    from kvcache.engine.llm_engine import LLMEngine
    cfg = EngineConfig(model=loaded.source, kv_cache_dtype=dtype, dtype="float32", kv_cache_memory=kv_cache_memory,
                       max_model_len=max_model_len, **config)
    return LLMEngine(cfg, loaded)


def compare_scores(reference, candidates: dict, docs: list[list[int]], start: int, progress: bool = False,
                   desc: str = "scoring") -> tuple[QualityStats, dict]:
    """Teacher-forced logits of each document from `reference` and from each of `candidates` (name -> a
    function (token_ids, start) -> logits, as LLMEngine.score), scored at positions start .. len - 2
    against the next tokens. The reference is compared with itself too (KL 0, top-1 1: a check of the
    metrics). One document's logits are held at a time."""
    import torch
    from tqdm import tqdm
    base = QualityStats()
    stats = {name: QualityStats() for name in candidates}
    bar = tqdm(total=len(docs) * (1 + len(candidates)), desc=desc, disable=not progress, file=sys.stderr)
    for ids in docs:
        targets = torch.tensor(ids[start + 1:])
        ref = reference(ids[:-1], start)
        base.add(ref, ref, targets)
        bar.update(1)
        for name, score in candidates.items():
            stats[name].add(ref, score(ids[:-1], start), targets)
            bar.update(1)
        del ref
    bar.close()
    return base, stats


def evaluate_quality(baseline, engines: dict, docs: list[list[int]], warmup: int,
                     chunk_size: int | None = None, progress: bool = False) -> tuple[QualityStats, dict[str, QualityStats]]:
    """Score every document through the baseline engine and each engine of `engines` (format -> engine).

    Positions `warmup` .. len - 2 of each document are scored (the last token has no next token).
    The baseline is compared with itself too (KL 0, top-1 1: a check of the metrics).
    """
    for ids in docs:
        if not 0 <= warmup < len(ids) - 1:
            raise ValueError(f"warmup {warmup} must leave positions to score in a {len(ids)}-token document")

    def scorer(engine):
        return lambda ids, start: engine.score(ids, start=start, chunk_size=chunk_size)
    return compare_scores(scorer(baseline), {name: scorer(e) for name, e in engines.items()}, docs, warmup, progress)


# ---- passkey retrieval ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PasskeyTrial:
    """One passkey prompt: its key, the depth of the key (0..1) and the prompt's token ids."""

    depth: float
    key: int
    token_ids: list[int]


def chat_wrap(tokenizer):
    """text -> the chat template with `text` as the user's message and the reply begun as "The pass key is"."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use --passkey-prompt raw")

    def wrap(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False) + PASSKEY_ANSWER
    return wrap


def greedy_outputs(engine, prompts: list[list[int]], max_tokens: int) -> list:
    """Each prompt's CompletionOutput, generated greedily in one batch (ignoring EOS); checks for leaks."""
    from kvcache.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"greedy-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    done = engine.run_to_completion()
    engine.check_no_leaks()
    return [done[rid].outputs[0] for rid in ids]


def passkey_trials(tokenizer, depths: list[float], per_depth: int, length: int, prompt: str = "chat",
                   seed: int = 0) -> list[PasskeyTrial]:
    """The passkey prompts, `per_depth` keys at each depth, about `length` tokens each.

    `prompt`: "chat" puts the text in a user message of the chat template and starts the
    assistant's reply with "The pass key is"; "raw" ends the plain text with it.
    """
    if prompt not in ("chat", "raw"):
        raise ValueError(f"passkey prompt must be chat or raw, got {prompt!r}")
    wrap = chat_wrap(tokenizer) if prompt == "chat" else plain_prompt

    def encode(text: str) -> list[int]:  # the template writes its special tokens itself
        return tokenizer.encode(text, add_special_tokens=prompt == "raw")

    return [PasskeyTrial(d, k, encode(passkey_prompt(k, d, length, lambda s: len(encode(s)), wrap)))
            for d, k in passkey_keys(depths, per_depth, seed)]


def run_passkey(engine, trials: list[PasskeyTrial], max_tokens: int = 8) -> dict:
    """Generate greedily for every trial in one batch; accuracy overall and by depth, and the replies."""
    replies = [o.text for o in greedy_outputs(engine, [t.token_ids for t in trials], max_tokens)]
    correct = [str(t.key) in r for t, r in zip(trials, replies)]
    by_depth: dict[str, list[bool]] = {}
    for t, ok in zip(trials, correct):
        by_depth.setdefault(f"{t.depth:g}", []).append(ok)
    return {"acc": sum(correct) / len(trials), "correct": sum(correct), "trials": len(trials),
            "by_depth": {d: sum(v) / len(v) for d, v in by_depth.items()},
            "replies": replies}


# ---- capacity -------------------------------------------------------------------------------------------

def measure_capacity(engine, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """Run more requests of `prompt_len` random tokens than the pool holds; the peak number whose whole
    prompt is in the cache at once (`concurrent_requests`), and the pool's size in tokens.

    Steps until the first request finishes, or until every running request is decoding and none
    more can be admitted (free blocks only shrink from then on); then aborts everything.
    """
    import numpy as np

    from kvcache.engine.sampling_params import SamplingParams
    from kvcache.memory.kv_cache_manager import blocks_for
    info = engine.kv_cache_info()
    per_request = blocks_for(prompt_len + max_tokens, info["block_size"]) + info["seq_blocks"]
    n = info["num_blocks"] // per_request + 3
    vocab = engine.model.config.vocab_size
    special = set(getattr(engine.tokenizer, "all_special_ids", []) or []) | engine.eos_token_ids
    allowed = np.setdiff1d(np.arange(vocab), np.array(sorted(special), dtype=np.int64))
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"capacity-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(rid, allowed[rng.integers(0, len(allowed), prompt_len)].tolist(), params)
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

def add_text_args(p: argparse.ArgumentParser, num_docs: int, depths: str, passkeys_per_depth: int) -> None:
    """The arguments both evaluations take for the model, the corpus and the passkey prompts."""
    p.add_argument("--model", default=None, help="Hugging Face model directory or GGUF file (default: SmolLM2-135M demo)")
    p.add_argument("--num-docs", type=int, default=num_docs, help="corpus documents to score")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (tokens) when scoring")
    p.add_argument("--corpus", default=None, help="a corpus file of '=== title ===' documents (default: the shipped "
                   "Python docstrings)")
    p.add_argument("--depths", default=depths, help="passkey depths, fractions of the filler")
    p.add_argument("--passkeys-per-depth", type=int, default=passkeys_per_depth)
    p.add_argument("--passkey-len", type=int, default=1024, help="tokens of each passkey prompt (about)")
    p.add_argument("--skip-passkey", action="store_true")
    p.add_argument("--skip-capacity", action="store_true")


def parse_depths(text: str) -> list[float]:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]: passkey depths in [0, 1]; ValueError otherwise."""
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--depths takes fractions separated by commas, got {text!r}") from None
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must lie in [0, 1], got {text!r}")
    return depths


def check_positive(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """ValueError naming the first of the integer options `names` that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")


def add_args(p: argparse.ArgumentParser) -> None:
    add_text_args(p, num_docs=4, depths="0,0.25,0.5,0.75,1.0", passkeys_per_depth=2)
    p.add_argument("--kv-cache-dtypes", default=DEFAULT_DTYPES,
                   help=f"formats to compare with the float32 cache (default {DEFAULT_DTYPES})")
    p.add_argument("--context-len", type=int, default=1536, help="tokens of each document scored")
    p.add_argument("--warmup", type=int, default=256, help="first positions not scored (they barely use the cache)")
    p.add_argument("--passkey-prompt", choices=["chat", "raw"], default="chat",
                   help="chat: the chat template with the reply started (default); raw: plain text")
    p.add_argument("--capacity-memory", default="96MiB", help="KV pool of every format in the capacity test")
    p.add_argument("--capacity-prompt-len", type=int, default=1000, help="prompt tokens of each capacity request")
    p.add_argument("--capacity-max-tokens", type=int, default=24, help="tokens each capacity request generates")
    p.add_argument("--seed", type=int, default=0, help="passkeys and capacity prompts")
    p.add_argument("--json", default="results/kv_quality.json", help="write the results here ('' to skip)")
    p.add_argument("--plot", default="results/kv_quality.png", help="draw quality against bytes per token here "
                   "('' to skip)")


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


def run(args: argparse.Namespace) -> int:
    """Quality, passkey retrieval and capacity of every format against the float32 cache: table, JSON, plot."""
    from tqdm import tqdm

    from kvcache.config import parse_bytes
    from kvcache.models.loader import read_checkpoint
    dtypes, depths = _parse_args(args)
    capacity_memory = parse_bytes(args.capacity_memory)
    t0 = time.perf_counter()
    loaded = read_checkpoint(args.model)
    tok = loaded.tokenizer
    model_len = getattr(loaded.config, "max_position_embeddings", None) or 2048
    docs = document_windows(lambda s: tok.encode(s), args.num_docs, args.context_len,
                            load_corpus(args.corpus) if args.corpus else None)
    names = [BASELINE] + [d for d in dtypes if d != BASELINE]
    rows: dict[str, dict] = {d: {"kv_cache_dtype": d} for d in names}

    # Quality: every engine alive at once, one document's logits at a time.
    engines = {d: build_engine(loaded, d, pool_bytes(loaded, d, 1, args.context_len), args.context_len)
               for d in names}
    for d, e in engines.items():
        info = e.kv_cache_info()
        rows[d].update(bytes_per_token=info["bytes_per_token"], block_size=info["block_size"],
                       residual_blocks_per_request=info["seq_blocks"],
                       residual_bytes_per_seq=info["residual_bytes_per_seq"])
    base, stats = evaluate_quality(engines[BASELINE], {d: engines[d] for d in names[1:]}, docs, args.warmup,
                                   args.chunk_size, progress=True)
    ppl_full = base.ppl
    for d in names:
        s = base if d == BASELINE else stats[d]
        rows[d].update(kl=s.kl, top1=s.top1, ppl=s.ppl, ppl_delta_pct=ppl_delta_pct(s.ppl, ppl_full))
    del engines, e  # the loop variable holds one engine too
    gc.collect()

    passkey = None
    if not args.skip_passkey:
        trials = passkey_trials(tok, depths, args.passkeys_per_depth, args.passkey_len, args.passkey_prompt, args.seed)
        longest = max(len(t.token_ids) for t in trials) + 8
        passkey = {"trials": len(trials), "prompt_tokens": [len(t.token_ids) for t in trials]}
        for d in tqdm(names, desc="passkey", file=sys.stderr):
            e = build_engine(loaded, d, pool_bytes(loaded, d, len(trials), longest), min(model_len, longest))
            r = run_passkey(e, trials, 8)
            rows[d].update(passkey_acc=r["acc"], passkey_by_depth=r["by_depth"], passkey_replies=r["replies"])
            del e
            gc.collect()

    capacity = None
    if not args.skip_capacity:
        need = args.capacity_prompt_len + args.capacity_max_tokens
        cap_names = names if CAPACITY_BASELINE in names else names + [CAPACITY_BASELINE]
        measured = {}
        for d in tqdm(cap_names, desc="capacity", file=sys.stderr):
            e = build_engine(loaded, d, capacity_memory, min(model_len, need), max_num_seqs=256,
                             enable_prefix_caching=False)
            measured[d] = measure_capacity(e, args.capacity_prompt_len, args.capacity_max_tokens, args.seed)
            del e
            gc.collect()
        ref = measured[CAPACITY_BASELINE]
        for d in names:
            m = measured[d]
            rows[d].update(pool_tokens=m["pool_tokens"], concurrent_requests=m["concurrent_requests"],
                           capacity_ratio_tokens=m["pool_tokens"] / ref["pool_tokens"],
                           capacity_ratio_requests=(m["concurrent_requests"] / ref["concurrent_requests"]
                                                    if ref["concurrent_requests"] else None),
                           capacity_detail={k: m[k] for k in ("peak_running", "submitted", "steps", "preemptions")})
        capacity = {"memory_bytes": capacity_memory, "prompt_len": args.capacity_prompt_len,
                    "max_tokens": args.capacity_max_tokens, "baseline_dtype": CAPACITY_BASELINE,
                    "baseline_pool_tokens": ref["pool_tokens"],
                    "baseline_concurrent_requests": ref["concurrent_requests"]}

    for r in rows.values():
        for k in ("passkey_acc", "pool_tokens", "concurrent_requests", "capacity_ratio_tokens",
                  "capacity_ratio_requests"):
            r.setdefault(k, None)
    results = {
        "baseline": {"name": BASELINE_NAME, **rows[BASELINE]},
        "dtypes": {d: rows[d] for d in names[1:]},
        "settings": {
            "model": loaded.source, "num_docs": len(docs), "context_len": args.context_len, "warmup": args.warmup,
            "chunk_size": args.chunk_size, "scored_positions": base.positions, "corpus": args.corpus or "shipped",
            "passkey": None if passkey is None else {
                "depths": depths, "per_depth": args.passkeys_per_depth, "target_len": args.passkey_len,
                "prompt": args.passkey_prompt, "seed": args.seed, **passkey},
            "capacity": capacity, "wall_s": time.perf_counter() - t0,
        },
    }
    print_table(results)
    if args.json:
        from kvcache.bench.report import write_json
        write_json(args.json, results)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def print_table(results: dict) -> None:
    """The results as a table on stdout, baseline first."""
    s = results["settings"]
    print(f"\nmodel: {s['model']}")
    print(f"quality: {s['num_docs']} documents x {s['context_len']:,} tokens, positions after the first "
          f"{s['warmup']} scored ({s['scored_positions']:,} in all; early positions barely use the cache), "
          f"prefill chunks of {s['chunk_size']}")
    if s["passkey"]:
        p = s["passkey"]
        print(f"passkey: {p['trials']} trials ({p['per_depth']} keys at depths {', '.join(f'{d:g}' for d in p['depths'])})"
              f", {min(p['prompt_tokens']):,}-{max(p['prompt_tokens']):,} prompt tokens, {p['prompt']} prompt, greedy")
    if s["capacity"]:
        c = s["capacity"]
        print(f"capacity: {c['memory_bytes'] / 2**20:g} MiB pool each; requests of {c['prompt_len']:,} + "
              f"{c['max_tokens']} tokens; ratios over {c['baseline_dtype']} ({c['baseline_pool_tokens']:,} tokens, "
              f"{c['baseline_concurrent_requests']} requests)")
    head = (f"{'kv cache':<17}{'bytes/tok':>10}{'resid blk':>10}{'KL nats':>11}{'top-1':>8}{'ppl':>9}{'ppl Δ%':>9}"
            f"{'passkey':>9}{'pool tok':>10}{'requests':>10}{'x tok':>7}{'x req':>7}")
    print(head)
    print("-" * len(head))
    for name, r in [(BASELINE_NAME, results["baseline"])] + list(results["dtypes"].items()):
        print(f"{name:<17}{r['bytes_per_token']:>10,}{r['residual_blocks_per_request']:>10}{r['kl']:>11.2e}"
              f"{r['top1']:>8.2%}{r['ppl']:>9.3f}{r['ppl_delta_pct']:>+9.2f}{_fmt(r['passkey_acc'], '.0%'):>9}"
              f"{_fmt(r['pool_tokens'], ','):>10}{_fmt(r['concurrent_requests'], 'd'):>10}"
              f"{_fmt(r['capacity_ratio_tokens'], '.2f'):>7}{_fmt(r['capacity_ratio_requests'], '.2f'):>7}")


def plot(results: dict, path: str) -> None:
    """KL and perplexity change against bytes per token, one labelled point per format (PNG)."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    points = [(BASELINE_NAME, results["baseline"])] + list(results["dtypes"].items())
    sizes = sorted({r["bytes_per_token"] for _, r in points})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    # symlog: the baseline sits at 0 and the formats span decades (float16's KL is ~1e-7 nats)
    for ax, key, label, lin in ((axes[0], "kl", "mean KL(P_fp32 || P_format), nats", 1e-7),
                                (axes[1], "ppl_delta_pct", "perplexity change vs fp32 cache, %", 1e-3)):
        for i, (name, r) in enumerate(points):
            x, y = r["bytes_per_token"], r[key]
            color = "black" if name == BASELINE_NAME else plt.cm.tab10(i % 10)
            ax.scatter([x], [y], color=color, label=name, zorder=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8, color=color)
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{b:,}" for b in sizes], rotation=30, fontsize=8)
        ax.minorticks_off()
        ax.set_yscale("symlog", linthresh=lin)
        ax.set_xlabel("KV cache bytes per token (scales included)")
        ax.set_ylabel(label)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylim(bottom=0)  # KL is never negative
    axes[1].legend(fontsize=8, loc="upper right")
    s = results["settings"]
    fig.suptitle(f"KV cache format: quality vs memory ({os.path.basename(s['model'])}, {s['num_docs']} docs x "
                 f"{s['context_len']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
