"""`kvcache bench spec-decode`: speculative decoding (n-gram, or a draft model) against plain decoding, in one
process.

Two engines on the same model and settings, one with `speculative_config`, run the same prompts. `--method ngram`
(prompt lookup) or `draft_model` (`--draft-model`, by default the target's own checkpoint with
`--draft-quantization int4` weights: a quantized copy of the target is the draft that shares its tokenizer and
agrees with it most, and the only one offline here). Workloads:
- `grounded`: the shipped corpus's documents (Python docstrings), each in a chat prompt asking for it back with its
  typos fixed: the output repeats spans of the input, what prompt lookup is for;
- `random`: random token ids: n-grams rarely repeat, so proposals are few (the cost of looking).
Prompts prefill in one step (`--max-num-batched-tokens`), so both engines split them alike: a different split
changes float32 rounding, which int4 weights' int8 activation rounding can turn into a different greedy token in
plain decoding too (seen at batch 32 with the default 2,048-token budget: 2 of 32 requests differ between budgets).
Each workload runs at each `--batches` size (that many requests submitted together, `--rounds` times, new
prompts each time), greedy or, with `--temperature`, sampled with a seed per request. Reported: output tokens per
second of both, their ratio, proposals and accepted tokens, the mean acceptance length, the share of the
speculating engine's time spent proposing (n-gram lookups found or not, draft forwards: a step without a proposal
costs a plain step plus its lookup), and whether the tokens are
identical (`--profile`: both engines' steps by kind, decode, verify and prefill/mixed, with their mean wall time:
what verification rows cost over a plain decode step on this machine): they must be for greedy requests and for seeded n-gram ones (speculation draws the numbers plain
decoding draws; the exit status says whether they are); a draft model's sampled proposals take numbers from the
request's generator first, so its tokens are other draws from the same distribution ("other draws").
"""
from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

from kvcache.bench.step_profile import profiling
from kvcache.bench.report import write_json
from kvcache.bench.throughput import positive_ints
from kvcache.bench.workload import random_workload
from kvcache.engine.spec_decode import mean_acceptance_length

INSTRUCTION = "Repeat the following text, fixing only its typos:\n\n"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or GGUF file (default: the demo model)")
    p.add_argument("--quantization", default="int4", help="weights (default int4: the fast CPU single stream)")
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram",
                   help="ngram: proposals looked up in the prompt and output; draft_model: proposed by a smaller "
                        "model (default: %(default)s)")
    p.add_argument("--draft-model", default=None, help="draft_model: the draft checkpoint (default: the target's)")
    p.add_argument("--draft-quantization", default="int4", help="draft_model: the draft's weights (default int4)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="tokens proposed per step (default: %(default)s)")
    p.add_argument("--prompt-lookup-max", type=int, default=4,
                   help="ngram: longest n-gram matched, tokens (default: %(default)s)")
    p.add_argument("--prompt-lookup-min", type=int, default=2,
                   help="ngram: shortest n-gram matched, tokens (default: %(default)s)")
    p.add_argument("--batches", default="1,8",
                   help="requests submitted together, comma-separated sizes (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="batches of new prompts per size (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="output tokens per request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above: sampled, seeded per request (default: %(default)s)")
    p.add_argument("--doc-chars", type=int, default=1200,
                   help="characters of each document in a grounded prompt (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="KV cache of each engine, bytes, e.g. 1GiB (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384,
                   help="tokens per step (default: %(default)s: every batch's prompts prefill in one step; a "
                        "smaller budget splits them where verification rows leave room, and under int4 weights a "
                        "different split alone can change a greedy token, plain decoding included)")
    p.add_argument("--profile", action="store_true",
                   help="time each kind of step of both engines (decode, verify: a step in which sequences verify "
                        "a proposal, prefill/mixed): what a verification row costs over a plain decode here")
    p.add_argument("--json", default="results/spec_decode.json",
                   help="write the results here (default: %(default)s; \'\' to skip)")


def _prompts(llm, workload: str, n: int, offset: int, chars: int) -> list[list[int]]:
    if workload == "random":
        length = min(300, llm.engine.max_model_len // 2)
        special = set(llm.engine.tokenizer.all_special_ids)
        return random_workload(n, (length, length), (1, 1), llm.engine.model.config.vocab_size, offset, special).prompts
    from kvcache.bench.corpus import load_corpus
    docs = load_corpus()
    tok = llm.engine.tokenizer
    out = []
    for i in range(offset, offset + n):
        text = docs[i % len(docs)].text[:chars]
        ids = tok.apply_chat_template([{"role": "user", "content": INSTRUCTION + text}], add_generation_prompt=True,
                                      tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _run(llm, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, seed: int = 0
         ) -> tuple[float, int, list[list[int]]]:
    from kvcache.engine.sampling_params import SamplingParams
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    return elapsed, sum(map(len, tokens)), tokens


def run(args: argparse.Namespace) -> int:
    from kvcache.engine.llm import LLM
    from kvcache.engine.sampling_params import SamplingParams
    batches = positive_ints("--batches", args.batches)
    if args.rounds < 1 or args.max_tokens < 1 or args.doc_chars < 1:
        raise ValueError(f"--rounds, --max-tokens and --doc-chars must be positive, got {args.rounds}, "
                         f"{args.max_tokens} and {args.doc_chars}")
    SamplingParams(temperature=args.temperature)  # a bad temperature is refused before the models load
    spec = {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens}
    if args.method == "ngram":
        spec.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
    else:
        from kvcache.models.loader import demo_model_path
        spec.update(model=args.draft_model or args.model or demo_model_path(), quantization=args.draft_quantization)
    kw = dict(kv_cache_memory=args.kv_cache_memory, quantization=args.quantization, max_num_seqs=max(batches),
              max_num_batched_tokens=args.max_num_batched_tokens)
    engines = {"plain": LLM(args.model, **kw), "spec": LLM(args.model, speculative_config=spec, **kw)}
    warm = _prompts(engines["plain"], "random", 1, 999, 0)
    for llm in engines.values():
        _run(llm, warm, 8)
    rows, offset = [], 0
    # greedy tokens are plain decoding's, and so are seeded n-gram draws; a sampled draft-model proposal is drawn
    # from the request's generator first, so its tokens are other draws from the same distribution
    must_match = args.temperature == 0 or args.method == "ngram"
    how = f"temperature {args.temperature:g}, seeded" if args.temperature else "greedy"
    print(f"speculation {spec} against plain decoding, {how}, {args.quantization} weights, "
          f"{args.max_tokens} tokens per request")
    print(f"{'workload':>9} {'batch':>6} {'plain tok/s':>12} {'spec tok/s':>12} {'ratio':>7} {'accepted':>14} "
          f"{'mean len':>9} {'proposing':>10} {'tokens':>11}")
    for workload in ("grounded", "random"):
        for batch in batches:
            row = {"workload": workload, "batch": batch}
            tokens = {}
            for name, llm in engines.items():
                before = llm.kv_cache_info()
                elapsed = produced = 0
                tokens[name] = []
                with profiling(llm.engine) if args.profile else nullcontext() as prof:
                    for r in range(args.rounds):
                        prompts = _prompts(llm, workload, batch, offset + r * batch, args.doc_chars)
                        e, n, t = _run(llm, prompts, args.max_tokens, args.temperature, offset + r * batch)
                        elapsed, produced = elapsed + e, produced + n
                        tokens[name] += t
                if prof is not None:
                    row[f"{name}_profile"] = prof.table()
                after = llm.kv_cache_info()
                row[f"{name}_tok_s"] = produced / elapsed
                if name == "spec":
                    for key in ("drafts", "draft_tokens", "accepted_tokens"):
                        row[key] = after[f"spec_decode_num_{key}"] - before[f"spec_decode_num_{key}"]
                    # what looking costs, found or not: a step without a proposal is a plain step plus this
                    row["propose_share"] = (after["spec_decode_propose_seconds"]
                                            - before["spec_decode_propose_seconds"]) / elapsed
            offset += args.rounds * batch
            row["ratio"] = row["spec_tok_s"] / row["plain_tok_s"]
            row["same_tokens"] = tokens["plain"] == tokens["spec"]
            row["tokens_must_match"] = must_match
            row["mean_acceptance_length"] = mean_acceptance_length(row["drafts"], row["accepted_tokens"])
            rows.append(row)
            print(f"{workload:>9} {batch:>6} {row['plain_tok_s']:>12.1f} {row['spec_tok_s']:>12.1f} "
                  f"{row['ratio']:>6.2f}x {row['accepted_tokens']:>6}/{row['draft_tokens']:<7} "
                  f"{row['mean_acceptance_length']:>9.2f} {row['propose_share']:>10.1%} "
                  f"{'identical' if row['same_tokens'] else 'DIFFER' if must_match else 'other draws':>11}")
    if args.profile:
        _print_profiles(rows)
    write_json(args.json, {"speculative_config": spec, "quantization": args.quantization, "temperature": args.temperature,
                           "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows})
    return 0 if all(r["same_tokens"] or not r["tokens_must_match"] for r in rows) else 1


def _print_profiles(rows: list[dict]) -> None:
    """Each row's steps by kind, both engines: count x mean wall time."""
    print("\nsteps by kind (--profile): count x ms per step")
    for row in rows:
        for name in ("plain", "spec"):
            kinds = ", ".join(f"{kind} {int(r['steps'])} x {r['ms_per_step']:.1f}"
                              for kind, r in row[f"{name}_profile"].items())
            print(f"{row['workload']:>9} {row['batch']:>6} {name:>6}: {kinds}")
