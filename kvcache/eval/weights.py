"""`kvcache eval weights`: what each weight format and compute dtype costs in quality and buys in decode speed.

Every variant (`--quantization` x `--dtype`, e.g. `int8` or `bfloat16` or `int8:bfloat16`) runs against float32
weights and compute (the baseline) in the same run, on the same loaded checkpoint and the same KV format
(float32), through the kv-quality harness: the first `--context-len` tokens of `--num-docs` corpus documents
scored teacher-forced, KL(P_fp32 || P_variant), top-1 agreement and the perplexity change. Its speed is one
request decoding alone (a `--decode-prompt`-token prompt, `--decode-tokens` tokens out, greedy, EOS ignored):
what a single user chatting gets, the figure bound by reading the weights every step.
"""
from __future__ import annotations

import argparse
import time

from kvcache.config import WEIGHT_QUANTIZATIONS
from kvcache.eval.harness import MODEL_HELP, Column, Table, evaluate_engines, load_checkpoint, report

BASELINE = "none:float32"
TABLE = Table((Column("weights:compute", 20, left=True), Column("weight MiB", 11, ".1f"), Column("KL nats", 11, ".2e"),
               Column("top-1", 8, ".2%"), Column("ppl", 9, ".3f"), Column("ppl Δ%", 9, "+.2f"),
               Column("tok/s", 8, ".1f"), Column("speedup", 9, ".2f", suffix="x")))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--variants", default="int8,int4,none:bfloat16,int8:bfloat16",
                   help="comma-separated QUANTIZATION[:DTYPE] (quantization none, int8 or int4, dtype float32 by "
                        "default)")
    p.add_argument("--num-docs", type=int, default=4, help="corpus documents to score (default: %(default)s)")
    p.add_argument("--context-len", type=int, default=1024, help="tokens of each document scored (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=16, help="first positions not scored (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (tokens) when scoring (default: %(default)s)")
    p.add_argument("--corpus", default=None,
                   help="a corpus file of '=== title ===' documents (default: the shipped one)")
    p.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of the single-stream decode run (default: %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated in the single-stream run (default: %(default)s)")
    p.add_argument("--json", default="results/weights.json", help="write the results here ('' to skip) (default: %(default)s)")


def _variants(spec: str) -> list[tuple[str, str]]:
    out = []
    for v in filter(None, spec.split(",")):
        quant, _, dtype = v.partition(":")
        if quant not in WEIGHT_QUANTIZATIONS or dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"--variants entries are QUANTIZATION[:DTYPE] with quantization "
                             f"{', '.join(WEIGHT_QUANTIZATIONS)} and dtype "
                             f"float32, bfloat16 or float16; got {v!r}")
        out.append((quant, dtype or "float32"))
    if not out:
        raise ValueError("--variants names no variant")
    return out


def decode_speed(engine, prompt_len: int, tokens: int) -> float:
    """Tokens per second of one request decoding alone (its prefill step not counted)."""
    from kvcache.engine.sampling_params import SamplingParams
    prompt = [(7 * i) % 1000 + 100 for i in range(prompt_len)]
    engine.add_request("decode-speed", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prefill
    t = time.perf_counter()
    steps = sum(1 for _ in engine.steps())
    return steps / (time.perf_counter() - t)


def run(args: argparse.Namespace) -> int:
    """Quality and single-stream decode speed of every variant against float32 weights and compute: table, JSON."""
    import torch

    from kvcache.config import EngineConfig
    from kvcache.engine.llm_engine import LLMEngine
    variants = _variants(args.variants)
    ckpt = load_checkpoint(args.model)
    docs = ckpt.documents(args.num_docs, args.context_len, args.corpus)
    max_len = max(args.context_len, args.decode_prompt + args.decode_tokens) + 1

    def engine(quant: str, dtype: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ckpt.loaded.source, quantization=quant, dtype=dtype,
                                      kv_cache_dtype="float32", kv_cache_memory=2**28, max_model_len=max_len,
                                      device="cpu"), ckpt.loaded)

    def row(e: LLMEngine, quant: str, dtype: str) -> dict:
        return {"quantization": quant, "dtype": dtype, "weight_bytes": e.model.weight_bytes,
                "decode_tok_s": decode_speed(e, args.decode_prompt, args.decode_tokens)}
    base = engine("none", "float32")
    rows = {BASELINE: row(base, "none", "float32")}
    engines = {}
    for quant, dtype in variants:
        name = f"{quant}:{dtype}"
        engines[name] = engine(quant, dtype)
        rows[name] = row(engines[name], quant, dtype)
    ref, stats = evaluate_engines(base, engines, docs, args.warmup, args.chunk_size, progress=True)
    for name, s in [(BASELINE, ref)] + list(stats.items()):
        rows[name].update(s.summary(ref.ppl))
    for r in rows.values():
        r["speedup"] = r["decode_tok_s"] / rows[BASELINE]["decode_tok_s"]
    results = {"settings": {"model": ckpt.loaded.source, "num_docs": args.num_docs, "context_len": args.context_len,
                            "warmup": args.warmup, "scored_positions": ref.positions, "torch": torch.__version__,
                            "decode_prompt": args.decode_prompt, "decode_tokens": args.decode_tokens},
               "variants": rows}
    return report(results, print_table, args.json)


def print_table(results: dict) -> None:
    """The results as a table on stdout, the float32 baseline first."""
    s = results["settings"]
    print(f"\nmodel: {s['model']}; quality: {s['num_docs']} documents x {s['context_len']:,} tokens "
          f"({s['scored_positions']:,} positions scored) against float32 weights and compute; speed: one request "
          f"decoding {s['decode_tokens']} tokens after a {s['decode_prompt']}-token prompt")
    TABLE.print([name, r["weight_bytes"] / 2**20, r["kl"], r["top1"], r["ppl"], r["ppl_delta_pct"], r["decode_tok_s"],
                 r["speedup"]] for name, r in results["variants"].items())
