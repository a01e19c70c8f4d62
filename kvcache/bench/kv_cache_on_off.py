"""`kvcache bench kv-cache-on-off`: why a KV cache exists, measured.

One request generates `--max-tokens` tokens greedily, with the paged KV cache (each step runs one new token against
the cached keys and values) and without any cache (each step runs the whole sequence again: the same model code
through `LLMEngine.score`, a prefill of every token so far, nothing kept). The cached run times every step; the
uncached one times steps at `--points` lengths (running all N would take O(N^2) token-forwards) and its total is
the sum over every length of a power law fitted to them.

The seeds' derivation: a step with the cache costs O(weights + N) (attention reads N cached tokens), so N steps cost
O(N^2) at most; without it a step recomputes N tokens, O(N weights + N^2), and N steps O(N^3). At these sizes the
weights dominate, so the measured exponents sit below those bounds: about 0 and 1 per step, 1 and 2 in total.
"""
from __future__ import annotations

import argparse
import math
import time

from kvcache.bench.report import write_json


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory or GGUF file (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens to generate (N) (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default: %(default)s)")
    p.add_argument("--points", default=None, help="comma-separated lengths at which the uncached step is timed "
                   "(default: 8 points from the prompt to N, evenly spaced in log)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timings of each uncached step (the best is kept) (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="the model's compute dtype: float32, bfloat16, float16 "
                   "(default: %(default)s)")
    p.add_argument("--json", default="results/kv_cache_on_off.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")
    p.add_argument("--plot", default="results/kv_cache_on_off.png",
                   help="PNG of time per step and in total (default: %(default)s; '' to skip)")


def fit_power(ns: list[float], ts: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line log t = log a + b log n."""
    xs, ys = [math.log(n) for n in ns], [math.log(t) for t in ts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b


def run(args: argparse.Namespace) -> int:
    from kvcache.engine.llm import LLM
    from kvcache.engine.sampling_params import SamplingParams
    n_max, p = args.max_tokens, args.prompt_len
    if n_max < 4 or p < 1:
        raise ValueError(f"--max-tokens must be at least 4 and --prompt-len positive, got {n_max} and {p}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    points = ([int(x) for x in args.points.split(",")] if args.points else
              sorted({round(p * (n_max / p) ** (i / 7)) for i in range(8)}))
    if min(points) < 1 or max(points) > p + n_max:
        raise ValueError(f"--points must lie in [1, {p + n_max}], got {points}")
    llm = LLM(args.model, dtype=args.dtype, max_model_len=p + n_max + 1, kv_cache_memory=None,
              max_num_batched_tokens=p + n_max + 1)
    eng = llm.engine
    prompt = [(31 * i) % 1000 + 100 for i in range(p)]
    eng.add_request("cached", prompt, SamplingParams(temperature=0, max_tokens=n_max, ignore_eos=True))
    steps, tokens = [], []
    t = time.perf_counter()
    for outs in eng.steps():  # each step timed from the end of the one before
        steps.append(time.perf_counter() - t)
        for out in outs:
            tokens = out.outputs[0].token_ids
        t = time.perf_counter()
    seq = prompt + tokens
    uncached, agree = {}, 0
    for n in points:
        best = math.inf
        for _ in range(args.repeats):
            t = time.perf_counter()
            logits = eng.score(seq[:n], start=n - 1)
            best = min(best, time.perf_counter() - t)
        uncached[n] = best
        agree += int(n < p or n >= len(seq) or int(logits[-1].argmax()) == seq[n])  # the same greedy token
    decode = steps[1:]  # step 0 is the prompt's prefill, the same work in both
    a_on, b_on = fit_power([p + i for i in range(1, len(decode) + 1)], decode)
    a_off, b_off = fit_power(list(uncached), list(uncached.values()))
    total_on = [sum(decode[:i]) for i in range(1, len(decode) + 1)]  # after i generated tokens
    total_off = []
    acc = 0.0
    for i in range(1, len(decode) + 1):
        acc += a_off * (p + i) ** b_off
        total_off.append(acc)
    _, tb_on = fit_power(list(range(1, len(total_on) + 1)), total_on)
    _, tb_off = fit_power(list(range(1, len(total_off) + 1)), total_off)
    marks = sorted({n - p for n in points if n > p} | {len(decode)})
    result = {"model": eng.shape.name, "dtype": args.dtype, "prompt_len": p, "max_tokens": n_max,
              "cached_step_s": decode, "uncached_step_s": {str(n): t for n, t in uncached.items()},
              "uncached_same_token": f"{agree}/{len(points)}",
              "step_exponent": {"cached": b_on, "uncached": b_off},
              "total_exponent": {"cached": tb_on, "uncached": tb_off},
              "at": [{"generated": m, "cached_total_s": total_on[m - 1], "uncached_total_s": total_off[m - 1],
                      "speedup": total_off[m - 1] / total_on[m - 1]} for m in marks]}
    _print(result)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        _plot(result, args.plot)
    return 0


def _print(r: dict) -> None:
    print(f"\n{r['model']}, {r['dtype']}: {r['max_tokens']:,} tokens after a {r['prompt_len']}-token prompt, greedy; "
          f"uncached steps re-derive the cached run's token at {r['uncached_same_token']} timed lengths")
    print(f"time per step grows as N^{r['step_exponent']['cached']:.2f} with the cache, "
          f"N^{r['step_exponent']['uncached']:.2f} without; in total N^{r['total_exponent']['cached']:.2f} and "
          f"N^{r['total_exponent']['uncached']:.2f}")
    head = f"{'generated':>10}{'with cache s':>14}{'without s':>12}{'speedup':>9}"
    print(head)
    print("-" * len(head))
    for x in r["at"]:
        print(f"{x['generated']:>10,}{x['cached_total_s']:>14.2f}{x['uncached_total_s']:>12.2f}{x['speedup']:>8.1f}x")


def _plot(r: dict, path: str) -> None:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    p = r["prompt_len"]
    on = r["cached_step_s"]
    off = {int(n): t for n, t in r["uncached_step_s"].items()}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.loglog([p + i for i in range(1, len(on) + 1)], [t * 1e3 for t in on], label="with the KV cache")
    ax1.loglog(list(off), [t * 1e3 for t in off.values()], "o-", label="without (whole sequence again)")
    ax1.set(xlabel="sequence length", ylabel="ms per step", title="one decode step")
    gen = [x["generated"] for x in r["at"]]
    ax2.loglog(gen, [x["cached_total_s"] for x in r["at"]], "o-", label="with the KV cache")
    ax2.loglog(gen, [x["uncached_total_s"] for x in r["at"]], "o-", label="without")
    ax2.set(xlabel="tokens generated", ylabel="seconds in total", title="generating N tokens")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
