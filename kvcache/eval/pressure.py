"""`kvcache bench pressure`: a workload that oversubscribes the KV pool, run with --kv-pressure-policy preempt and
with the ladder at several eviction bounds, against the same workload in a pool that holds it all.

- Workload: --num-requests prompts of --prompt-len tokens of the shipped prose corpus (windows of its documents,
  round robin; --prompts random for random token ids), each generating --output-len tokens greedily, all submitted at once. The constrained pool holds
  --pool-requests of them whole (the planner's bytes); the unconstrained one holds every request.
- Speed, per run: output tokens per second, time to first token (p50, p99) and the gaps between a request's tokens
  (ITL, p50, p99), from the time each step's outputs come back; preemptions, and what the ladder evicted.
- Quality, per run, against the unconstrained engine: each request's prompt and generated tokens are scored by
  the unconstrained engine (teacher-forced, LLMEngine.score) and compared with the log probabilities the run
  returned as it generated (its top MAX_LOGPROBS). top-1: the share of generated tokens that are the unconstrained
  model's argmax given the same preceding tokens (exact). KL(P_unconstrained || P_run) in nats over the partition
  {the run's top tokens, the rest}: a lower bound on the full KL (data-processing inequality), exact where the run's
  distribution is within its top tokens. Preemption recomputes exactly, so `preempt` must read top-1 100% and KL 0
  (up to float rounding between batch shapes).
Prints a table, writes JSON and a plot of throughput against quality cost.
"""
from __future__ import annotations

import argparse
import math
import time

from kvcache.bench.throughput import positive_ints
from kvcache.engine.sampling_params import MAX_LOGPROBS


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or GGUF (default: the demo model)")
    p.add_argument("--num-requests", type=int, default=24, help="requests, all submitted at once (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=384, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=192, help="tokens each request generates (default: %(default)s)")
    p.add_argument("--pool-requests", type=int, default=6,
                   help="whole requests the constrained pool holds (default: %(default)s)")
    p.add_argument("--max-evict", default="0.25,0.5",
                   help="the ladder's --kv-pressure-max-evict values, one run each (default: %(default)s)")
    p.add_argument("--evict-rule", default="knorm", choices=["knorm", "streaming"],
                   help="the ladder's --kv-pressure-evict (default: %(default)s)")
    p.add_argument("--prompts", default="corpus", choices=["corpus", "random"],
                   help="windows of the shipped prose corpus, or uniformly random token ids (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per engine step (default: %(default)s)")
    p.add_argument("--json", default="results/pressure.json",
                   help="write the results here (default: %(default)s; '' to skip)")
    p.add_argument("--plot", default="results/pressure.png", help="plot here (default: %(default)s; '' to skip)")


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens of the corpus's documents, round robin over the documents."""
    from kvcache.bench.corpus import load_corpus
    docs = [tokenizer.encode(d.text, add_special_tokens=False) for d in load_corpus()]
    out = []
    for i in range(count):
        doc = docs[i % len(docs)]
        start = (i // len(docs)) * length
        if start + length > len(doc):
            raise ValueError(f"the corpus cannot give {count} distinct windows of {length:,} tokens "
                             f"(documents of {min(map(len, docs)):,}-{max(map(len, docs)):,} tokens); lower "
                             "--num-requests or --prompt-len")
        out.append(doc[start:start + length])
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def run_workload(engine, work: list[list[int]], output_len: int) -> dict:
    """Every request at once, streamed so that each step's tokens are timed; outputs and timings."""
    from kvcache.engine.sampling_params import SamplingParams
    engine.add_request("warmup", work[0][:16], SamplingParams(max_tokens=4))  # one-time costs out of the timing
    engine.run_to_completion()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=MAX_LOGPROBS)
    start = time.perf_counter()
    for i, p in enumerate(work):
        engine.add_request(f"p{i}", p, params, stream=True)
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    ttft, itl, finals = [], [], {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n > seen.get(o.request_id, 0):
                if o.request_id not in last:
                    ttft.append(now - start)
                else:
                    itl.extend([(now - last[o.request_id]) / (n - seen[o.request_id])] * (n - seen[o.request_id]))
                seen[o.request_id], last[o.request_id] = n, now
            if o.finished:
                finals[o.request_id] = o
    elapsed = time.perf_counter() - start
    engine.check_no_leaks()
    outs = [finals[f"p{i}"] for i in range(len(work))]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    info = engine.kv_cache_info()
    return {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "num_preemptions": info["num_preemptions"], "pressure_evictions": info["pressure_evictions"],
            "pressure_evicted_tokens": info["pressure_evicted_tokens"],
            "prefill_tokens_computed": info["prefill_tokens_computed"], "outputs": outs}


def quality(reference, work: list[list[int]], outs: list) -> dict:
    """top-1 agreement and partition KL of each request's generated tokens against `reference` (module
    docstring), per request and overall."""
    import torch
    per, agree, kl_sum, count = [], 0, 0.0, 0
    for prompt, o in zip(work, outs):
        c = o.outputs[0]
        ref = reference.score(prompt + c.token_ids[:-1], len(prompt) - 1).float().log_softmax(-1)  # [n_out, vocab]
        a, k = 0, 0.0
        for i, (tok, lps) in enumerate(zip(c.token_ids, c.logprobs)):
            a += int(ref[i].argmax().item() == tok)
            ids = torch.tensor(list(lps))
            p_run = torch.tensor(list(lps.values()), dtype=torch.float64).exp()
            p_ref = ref[i, ids].double().exp()
            rest_run, rest_ref = max(0.0, 1 - p_run.sum().item()), max(0.0, 1 - p_ref.sum().item())
            term = (p_ref * (p_ref.clamp_min(1e-300).log() - p_run.clamp_min(1e-300).log())).sum().item()
            if rest_ref > 0:
                term += rest_ref * (math.log(rest_ref) - math.log(max(rest_run, 1e-300)))
            k += max(0.0, term)
        n = len(c.token_ids)
        per.append({"top1": a / n, "kl": k / n, "kv_degradation": o.kv_degradation})
        agree, kl_sum, count = agree + a, kl_sum + k, count + n
    return {"top1": agree / count, "kl": kl_sum / count, "min_request_top1": min(r["top1"] for r in per),
            "per_request": per}


def run(args: argparse.Namespace) -> int:
    from kvcache.eval.harness import build_engine, load_checkpoint, pool_bytes, random_prompts, report
    bounds = [float(x) for x in args.max_evict.split(",")]
    positive_ints("--num-requests", str(args.num_requests))
    if args.pool_requests >= args.num_requests:
        raise SystemExit(f"--pool-requests {args.pool_requests} must be below --num-requests {args.num_requests}: "
                         "the workload must not fit")
    ckpt = load_checkpoint(args.model)
    tokens = args.prompt_len + args.output_len
    common = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.num_requests)
    reference = build_engine(ckpt.loaded, "float32", pool_bytes(ckpt.loaded, "float32", args.num_requests, tokens),
                             tokens, **common)
    work = prompts(reference.tokenizer, args.num_requests, args.prompt_len) if args.prompts == "corpus" else \
        random_prompts(reference, args.num_requests, args.prompt_len)
    small = pool_bytes(ckpt.loaded, "float32", args.pool_requests, tokens)
    runs = {"unconstrained": run_workload(reference, work, args.output_len)}
    configs = [("preempt", {})] + [(f"ladder {b:g}", dict(kv_pressure_policy="ladder", kv_pressure_max_evict=b,
                                                          kv_pressure_evict=args.evict_rule)) for b in bounds]
    for name, extra in configs:
        engine = build_engine(ckpt.loaded, "float32", small, tokens, **common, **extra)
        runs[name] = run_workload(engine, work, args.output_len)
        del engine
    for r in runs.values():
        r.update(quality(reference, work, r.pop("outputs")))
        r["throughput_vs_preempt"] = r["output_tokens_per_s"] / runs["preempt"]["output_tokens_per_s"]
        r["ttft_p99_vs_preempt"] = r["ttft_p99_s"] / runs["preempt"]["ttft_p99_s"]
    results = {"workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                            "output_len": args.output_len, "pool_requests": args.pool_requests,
                            "pool_bytes": small, "evict_rule": args.evict_rule, "model": ckpt.loaded.source},
               "runs": runs}
    return report(results, _print, args.json, _plot, args.plot)


def _print(results: dict) -> None:
    from kvcache.eval.harness import Column, Table
    w = results["workload"]
    print(f"\n{w['num_requests']} requests of {w['prompt_len']} + {w['output_len']} tokens; the constrained pool holds "
          f"{w['pool_requests']} ({w['pool_bytes'] / 2**20:.1f} MiB); ladder evicts by {w['evict_rule']}")
    table = Table((Column("run", 14, left=True), Column("out tok/s", 10, ".1f"), Column("vs preempt", 11, ".2f",
                   suffix="x"), Column("TTFT p50", 9, ".2f"), Column("TTFT p99", 9, ".2f"), Column("ITL p50", 9, ".3f"),
                   Column("ITL p99", 9, ".3f"), Column("preempt", 8, "d"), Column("evicted", 9, ","),
                   Column("top-1", 8, ".2%"), Column("min top-1", 10, ".2%"), Column("KL nats", 10, ".2e")))
    table.print([[name, r["output_tokens_per_s"], r["throughput_vs_preempt"], r["ttft_p50_s"], r["ttft_p99_s"],
                  r["itl_p50_s"], r["itl_p99_s"], r["num_preemptions"], r["pressure_evicted_tokens"], r["top1"],
                  r["min_request_top1"], r["kl"]] for name, r in results["runs"].items()])
    print("times in seconds; top-1 and KL against the unconstrained engine, teacher-forced on each run's tokens")


def _plot(results: dict, path: str) -> None:
    from kvcache.eval.harness import new_figure, save_figure
    plt, fig, ax = new_figure(path, 1, 1, (6.5, 4.5))
    for name, r in results["runs"].items():
        ax.scatter(1 - r["top1"], r["output_tokens_per_s"], s=40)
        ax.annotate(name, (1 - r["top1"], r["output_tokens_per_s"]), textcoords="offset points", xytext=(5, 4))
    ax.margins(x=0.25, y=0.1)  # room for the labels
    ax.set_xlabel("quality cost: 1 - top-1 agreement with the unconstrained run")
    ax.set_ylabel("output tokens/s")
    ax.grid(True, alpha=0.3)
    w = results["workload"]
    save_figure(plt, fig, path, f"{w['num_requests']} requests in a pool for {w['pool_requests']}: throughput "
                f"against quality")
