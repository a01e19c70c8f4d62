"""The `kvcache` command: generate, chat, bench."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from kvcache.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, one per EngineConfig field, with vLLM's names."""
    p.add_argument("--model", default=None, help="Hugging Face model directory or GGUF file (default: SmolLM2-135M demo)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB, 500MB, or 25%% of available memory (CPU default: 2GiB, "
                   "at most half of available memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from kvcache.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def print_kv_summary(engine, out=None) -> None:
    out = out or sys.stdout
    info = engine.kv_cache_info()
    st = engine.stats
    print("\n--- KV cache ---", file=out)
    print(f"per token : {info['formula']}", file=out)
    print(f"pool      : {info['num_blocks']:,} blocks x {info['block_size']} tokens = {info['num_tokens']:,} tokens, "
          f"{info['total_bytes'] / 2**30:.2f} GiB ({info['dtype']})", file=out)
    print(f"capacity  : {info['max_concurrency']:.1f} requests of max_model_len {info['max_model_len']:,} tokens", file=out)
    peak = st.peak_used_blocks
    print(f"this run  : {st.prompt_tokens:,} prompt + {st.generation_tokens:,} generated tokens; peak "
          f"{peak:,} blocks = {peak * info['block_size'] * info['bytes_per_token'] / 2**20:.2f} MiB in use; "
          f"{info['num_preemptions']} preemptions; {info['used_blocks']} blocks held now", file=out)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = sampling_params(args)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params, use_tqdm=False)
    else:
        outs = llm.generate(list(args.prompt), params, use_tqdm=False)
    for out in outs:
        if len(outs) > 1:
            print(f"=== prompt: {out.prompt!r}")
        for c in out.outputs:
            print(c.text)
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)
    print_kv_summary(llm.engine)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    engine = llm.engine
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    one_shot = args.message is not None
    if not one_shot:
        print("kvcache chat: type a message; /reset clears the history, /kv shows the cache, /exit or Ctrl-D quits.")
    turn = 0
    while True:
        if one_shot:
            text = args.message
        else:
            try:
                text = input("\n> ").strip()
            except EOFError:
                print()
                break
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = history[:1] if args.system else []
                continue
            if text == "/kv":
                print_kv_summary(engine)
                continue
            if not text:
                continue
        history.append({"role": "user", "content": text})
        prompt = llm.apply_chat_template(history)
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, prompt, params, stream=True, add_special_tokens=False)
        shown = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    full = out.outputs[0].text
                    if not full.endswith("\ufffd"):  # hold back a half-decoded character
                        print(full[len(shown):], end="", flush=True)
                        shown = full
        except KeyboardInterrupt:
            engine.abort_request(rid)
            print(" [interrupted]")
        print()
        history.append({"role": "assistant", "content": shown})
        if one_shot:
            print_kv_summary(engine)
            break
    return 0


def _make_llm(args: argparse.Namespace):
    from kvcache.engine.llm import LLM
    return LLM(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(prog="kvcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for one or more prompts")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the (first) prompt in the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with streamed tokens")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--message", default=None, help="answer this one message and exit")
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    from kvcache.bench.throughput import add_args as add_tp_args, run as run_tp
    t = bsub.add_parser("throughput", help="offline throughput against a Hugging Face transformers baseline")
    add_engine_args(t)
    add_tp_args(t)
    t.set_defaults(func=run_tp)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvcache: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
