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
from kvcache.eval.kv_quality import _fmt, evaluate_quality, ppl_delta_pct

BASELINE = "none:float32"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model directory or GGUF file (default: SmolLM2-135M demo)")
    p.add_argument("--variants", default="int8,int4,none:bfloat16,int8:bfloat16",
                   help="comma-separated QUANTIZATION[:DTYPE] (quantization none, int8 or int4, dtype float32 by "
                        "default)")
    p.add_argument("--num-docs", type=int, default=4, help="corpus documents to score")
    p.add_argument("--context-len", type=int, default=1024, help="tokens of each document scored")
    p.add_argument("--warmup", type=int, default=16, help="first positions not scored")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (tokens) when scoring")
    p.add_argument("--corpus", default=None, help="a corpus file of '=== title ===' documents (default: the shipped one)")
    p.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of the single-stream decode run")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated in the single-stream run")
    p.add_argument("--json", default="results/weights.json", help="write the results here ('' to skip)")


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
    import torch

    from kvcache.bench.report import write_json
    from kvcache.config import EngineConfig
    from kvcache.engine.llm_engine import LLMEngine
    from kvcache.bench.corpus import document_windows, load_corpus
    from kvcache.models.loader import read_checkpoint
    variants = _variants(args.variants)
    loaded = read_checkpoint(args.model)
    docs = document_windows(lambda s: loaded.tokenizer.encode(s), args.num_docs, args.context_len,
                            load_corpus(args.corpus) if args.corpus else None)
    max_len = max(args.context_len, args.decode_prompt + args.decode_tokens) + 1

    def engine(quant: str, dtype: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=loaded.source, quantization=quant, dtype=dtype, kv_cache_dtype="float32",
                                      kv_cache_memory=2**28, max_model_len=max_len,
                                      device="cpu"), loaded)
    base = engine("none", "float32")
    rows = {BASELINE: {"quantization": "none", "dtype": "float32", "weight_bytes": base.model.weight_bytes,
                       "decode_tok_s": decode_speed(base, args.decode_prompt, args.decode_tokens)}}
    engines = {}
    for quant, dtype in variants:
        name = f"{quant}:{dtype}"
        e = engines[name] = engine(quant, dtype)
        rows[name] = {"quantization": quant, "dtype": dtype, "weight_bytes": e.model.weight_bytes,
                      "decode_tok_s": decode_speed(e, args.decode_prompt, args.decode_tokens)}
    ref, stats = evaluate_quality(base, engines, docs, args.warmup, args.chunk_size, progress=True)
    rows[BASELINE].update(kl=ref.kl, top1=ref.top1, ppl=ref.ppl, ppl_delta_pct=0.0)
    for name, s in stats.items():
        rows[name].update(kl=s.kl, top1=s.top1, ppl=s.ppl, ppl_delta_pct=ppl_delta_pct(s.ppl, ref.ppl))
    for r in rows.values():
        r["speedup"] = r["decode_tok_s"] / rows[BASELINE]["decode_tok_s"]
    results = {"settings": {"model": loaded.source, "num_docs": args.num_docs, "context_len": args.context_len,
                            "warmup": args.warmup, "scored_positions": ref.positions, "torch": torch.__version__,
                            "decode_prompt": args.decode_prompt, "decode_tokens": args.decode_tokens},
               "variants": rows}
    _print(results)
    if args.json:
        write_json(args.json, results)
    return 0


def _print(results: dict) -> None:
    s = results["settings"]
    print(f"\nmodel: {s['model']}; quality: {s['num_docs']} documents x {s['context_len']:,} tokens "
          f"({s['scored_positions']:,} positions scored) against float32 weights and compute; speed: one request "
          f"decoding {s['decode_tokens']} tokens after a {s['decode_prompt']}-token prompt")
    head = f"{'weights:compute':<20}{'weight MiB':>11}{'KL nats':>11}{'top-1':>8}{'ppl':>9}{'ppl Δ%':>9}{'tok/s':>8}{'speedup':>9}"
    print(head)
    print("-" * len(head))
    for name, r in results["variants"].items():
        print(f"{name:<20}{r['weight_bytes'] / 2**20:>11.1f}{r['kl']:>11.2e}{r['top1']:>8.2%}{r['ppl']:>9.3f}"
              f"{r['ppl_delta_pct']:>+9.2f}{r['decode_tok_s']:>8.1f}{_fmt(r['speedup'], '.2f'):>8}x")
