"""The `kvcache` command: generate, chat, serve, top, plan, simulate, bench, eval."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import fields

from kvcache.compress.spec import POLICIES
from kvcache.config import WEIGHT_QUANTIZATIONS, EngineConfig
from kvcache.plan.cli import add_commands as add_plan_commands


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags, one per EngineConfig field, with vLLM's names, in four groups of the help."""
    _add_model_args(p.add_argument_group("model"))
    _add_scheduler_args(p.add_argument_group("scheduler"))
    _add_kv_args(p.add_argument_group("KV cache"))
    _add_tier_args(p.add_argument_group("offload tiers and KV events"))


def _add_model_args(p) -> None:
    """The model, its dtype and weights' format, where it runs and how (attention, ranks, graphs)."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or GGUF file (default: the SmolLM2-135M demo model)")
    p.add_argument("--dtype", default="auto", help="compute and weight dtype: auto (float32 on CPU, bfloat16 on CUDA), "
                   "float32, bfloat16, float16 (aliases fp32, bf16, fp16, half) (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=list(WEIGHT_QUANTIZATIONS),
                   help="weights: " + "; ".join(f"{k}: {v}" for k, v in WEIGHT_QUANTIZATIONS.items()) +
                        " (the quantized formats run on the CPU: a quarter, or a sixth, of float32's bytes per step) "
                        "(default: %(default)s)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs; auto: the KVCACHE_DEVICE environment variable if set, else CUDA where "
                        "torch sees a GPU, else the CPU (default: %(default)s)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch", "cpu"],
                   help="auto: triton kernels on CUDA, the C++ decode kernel on CPU, where they can run; torch: the "
                        "portable PyTorch path; cpu: the C++ decode kernel (default: %(default)s)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (processes the engine starts: gloo on CPU, a core "
                        "each; NCCL on GPUs), KV heads split across them (see docs/parallelism.md) "
                        "(default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eager instead of replaying the decode steps' CUDA graphs captured at "
                        "start-up (batch sizes 1, 2, 4, 8, then every 8 up to --max-num-seqs)")
    p.add_argument("--seed", type=int, default=0,
                   help="the engine's seed, not the sampler's: it seeds --kv-eviction random's choice of tokens for "
                        "requests that have no sampling seed (bench throughput: also its random prompts); token "
                        "sampling is seeded by --sample-seed (default: %(default)s)")


def _add_scheduler_args(p) -> None:
    """What a step holds, how prompts are admitted and chunked, preemption and speculation."""
    p.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="requests (sequences) in one engine step at most (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens,
                   help="tokens in one engine step at most, prefill chunks and decodes together "
                        "(default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="tokens of one request at most, prompt and output together (default: the model's context "
                        "length, max_position_embeddings, else 2048)")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                   help="prefill each prompt in one step, refusing prompts over --max-num-batched-tokens, instead of "
                        "in chunks spread over steps beside the decodes (default: chunked prefill on)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "lpm"],
                   help="fcfs, or lpm: longest cached prefix first (FCFS above 128 waiting) (default: %(default)s)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="recompute: a preempted request's KV is freed and prefilled again when it resumes; swap: it "
                        "goes to the cpu tier (--kv-offload-memory), else the disk tier, and comes back (recompute "
                        "when the tier is full) (default: %(default)s)")
    p.add_argument("--kv-pressure-policy", default="preempt", choices=["preempt", "ladder"],
                   help="when a step's KV blocks do not fit: preempt the last admitted request; or ladder: swap it "
                        "out (with --preemption-mode swap), else evict tokens of the longest running request (its "
                        "first 4 and last 64 kept), then preempt; a request with kv_pressure \"exact\" is never "
                        "evicted from (default: %(default)s)")
    p.add_argument("--kv-pressure-max-evict", type=float, default=0.5,
                   help="the ladder evicts at most this share of a request's tokens, in (0, 0.9] (default: "
                        "%(default)s)")
    p.add_argument("--kv-pressure-evict", default="knorm", choices=["knorm", "streaming"],
                   help="which tokens the ladder evicts: knorm, those with the largest key norms per KV head (Devoto "
                        "et al. 2024), or streaming, the oldest after the sinks (default: %(default)s)")
    p.add_argument("--kv-pin-prefix", default=None,
                   help="a prefix (a system prompt, as the text a prompt starts with) prefilled at start-up and kept in "
                        "the prefix cache for good: its full blocks are never evicted (default: none)")
    p.add_argument("--kv-pin-max-fraction", type=float, default=0.25,
                   help="the share of the KV pool pinned prefixes may take; a longer one is refused (default: "
                        "%(default)s)")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, vLLM\'s fields: \'{"method": "ngram", "num_speculative_tokens": '
                        '4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": '
                        'PATH, "num_speculative_tokens": 4, "quantization": "int4"}\' (see docs/spec-decode.md; '
                        'default: off)')


def _add_kv_args(p) -> None:
    """The KV cache's size, blocks, storage format, prefix caching and token eviction."""
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB, 500MB, or 25%% (of the GPU's "
                   "memory on CUDA, of available RAM on CPU). Default: on CUDA, what --gpu-memory-utilization "
                   "leaves after the weights and a profiled forward; on CPU 2GiB, at most half of the RAM available "
                   "after the weights")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the device's memory, a fraction in (0, 1], for weights, activations and the "
                        "KV cache (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 16; 64 for the int4/int2 KV cache)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache storage: auto (the compute dtype), float32, float16, bfloat16, fp8_e4m3, fp8_e5m2, "
                        "int8, int4, int2 (fp8/int8 with a scale per token and head; int4/int2 KIVI) "
                        "(default: %(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the KV of equal prompt prefixes between requests (default: on)")
    p.add_argument("--prefix-caching-algo", default="hash", choices=["hash", "radix"],
                   help="hash: vLLM's hash-chained blocks; radix: SGLang's radix tree (default: %(default)s)")
    p.add_argument("--mamba-block-size", type=int, default=None,
                   help="models with linear-attention / SSM layers, with prefix caching: tokens between snapshots of "
                        "their state, a multiple of --block-size (default: 4 blocks)")
    p.add_argument("--num-state-snapshots", type=int, default=None,
                   help="models with linear-attention / SSM layers, with prefix caching: slots for state snapshots, "
                        "taken from the KV budget (default: --max-num-seqs)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="models mixing full and sliding-window layers (Gemma-2/3): one block table of every layer, "
                        "every block kept, instead of a table per layer group whose sliding groups give blocks back")
    p.add_argument("--kv-eviction", default="none", choices=list(POLICIES),
                   help="token eviction policy: streaming (StreamingLLM), h2o, snapkv, tova, pyramidkv, random; "
                        "compacted tokens' blocks go back to the pool (default: %(default)s)")
    p.add_argument("--kv-budget", default=None,
                   help="KV tokens a request keeps under --kv-eviction: tokens (512), or a ratio of its prompt "
                        "(0.25 or 25%%); needed with a policy (default: none)")


def _add_tier_args(p) -> None:
    """Where blocks beyond the pool are kept, and the KV events published for routers."""
    p.add_argument("--kv-offload-memory", default=None,
                   help="keep prefix blocks beyond the pool in this much host memory, e.g. 8GiB (the cpu tier; "
                        "default: no cpu tier)")
    p.add_argument("--kv-offload-dir", default=None,
                   help="keep prefix blocks in this directory too (the disk tier; processes may share it; default: no "
                        "disk tier)")
    p.add_argument("--kv-offload-disk-size", default=None, help="the disk tier's size in bytes, e.g. 10GiB "
                   "(default: 10GiB)")
    p.add_argument("--kv-remote", default=None, help="a Redis or Valkey server, redis://host:port/db, shared by "
                   "every engine that uses it (the redis tier, below cpu and disk; default: none)")
    p.add_argument("--kv-remote-timeout", type=float, default=0.5,
                   help="seconds for each call to --kv-remote (default: %(default)s)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV cache events (vLLM's BlockStored/BlockRemoved/AllBlocksCleared, msgpack over "
                        "ZeroMQ PUB) for KV-aware routers: tcp://*:5557 binds; tcp://host:port connects "
                        "(default: no events)")
    p.add_argument("--kv-events-topic", default="", help="the ZeroMQ topic of the KV events (default: none)")
    p.add_argument("--kv-events-replay-endpoint", default=None,
                   help="bind a ZeroMQ ROUTER here (tcp://*:5558, ipc://path) that replays the KV event batches a "
                        "subscriber missed (vLLM's replay_endpoint: send [b'', start_seq as 8 bytes]; default: none)")
    p.add_argument("--kv-events-buffer-steps", type=int, default=10_000,
                   help="KV event batches kept for replay (default: %(default)s)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags, one per SamplingParams field they set; the same for every prompt of the command."""
    p.add_argument("--max-tokens", type=int, default=256,
                   help="output tokens to generate at most per request (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="logits are divided by it before sampling, in [0, 2]; 0 is greedy, argmax "
                        "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the fewest most likely tokens whose probabilities sum to at least "
                        "this, in (0, 1] (default: %(default)s, off)")
    p.add_argument("--top-k", type=int, default=0,
                   help="keep the k most likely tokens; 0 or -1: all (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this fraction of the most likely one's probability, in [0, 1] "
                        "(default: %(default)s, off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the positive logits (multiplies the negative ones) of tokens already in the prompt "
                        "or output; above 1 discourages them (default: %(default)s, off)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="logit units subtracted once from every token already in the output, in [-2, 2] "
                        "(default: %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="logit units subtracted from a token's logit per time it is in the output, in [-2, 2] "
                        "(default: %(default)s)")
    p.add_argument("--sample-seed", type=int, default=None,
                   help="the sampler's seed: each request samples from a generator of its own seeded with it, so "
                        "its tokens at --temperature above 0 are the same from run to run whatever else is in the "
                        "batch; it also takes --seed's place for --kv-eviction random (default: none: sampling draws "
                        "from torch's global generator, which --seed does not seed)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, left out of the output (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace):
    from kvcache.engine.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def print_kv_summary(engine, out=None) -> None:
    from kvcache.plan.kv_bytes import pool_tokens
    from kvcache.plan.report import human
    out = out or sys.stdout
    info = engine.kv_cache_info()
    st = engine.stats
    print("\n--- KV cache ---", file=out)
    print(f"per token : {info['formula']}", file=out)
    pool = pool_tokens(info['num_blocks'], info['block_size'], info['layers_per_block'], info['kv_layers'])
    print(f"pool      : {pool}, "
          f"{human(info['total_bytes'])} ({info['dtype']})", file=out)
    if info["seq_blocks"]:
        print(f"residual  : {info['residual_bytes_per_seq']:,} bytes of fp16 keys per request (their 64-token group "
              f"is not complete yet), held in {info['seq_blocks']} pool blocks per request", file=out)
    if info["state_slots"]:
        print(f"state     : {info['state_bytes_per_seq']:,} bytes per sequence in {info['state_layers']} linear-attention"
              f" / SSM layers, {info['state_slots']} slots = {human(info['state_bytes'])} beside the blocks", file=out)
    print(f"capacity  : {info['max_concurrency']:.1f} requests of max_model_len {info['max_model_len']:,} tokens",
          file=out)
    peak = st.peak_used_blocks
    print(f"this run  : {st.prompt_tokens:,} prompt + {st.generation_tokens:,} generated tokens; peak "
          f"{peak:,} blocks = {peak * info['block_size'] * info['bytes_per_token'] / 2**20:.2f} MiB in use; "
          f"{info['num_preemptions']} preemptions; {info['used_blocks']} blocks held now", file=out)
    if info["prefix_caching"]:
        print(f"prefix    : {info['prefix_caching']}; {info['prefix_cache_hits']:,} of "
              f"{info['prefix_cache_queries']:,} "
              f"prompt tokens found cached ({info['prefix_cache_hit_rate']:.0%}); {info['cached_blocks']:,} blocks "
              f"cached, {info['prefix_cache_evictions']:,} evicted", file=out)
    if info["kv_eviction"] != "none" or info["evicted_tokens"]:
        print(f"eviction  : {info['kv_eviction']} (budget {info['kv_budget']}); {info['evicted_tokens']:,} tokens "
              f"evicted in {info['eviction_compactions']:,} compactions, {info['eviction_freed_blocks']:,} blocks "
              "returned to the pool", file=out)
    if info["offload"]:
        o = info["offload"]
        for t in o["tiers"]:
            errors = sum(t["errors"].values())
            print(f"{'tier ' + t['tier']:<10}: {t['blocks']:,} blocks, {t['used_bytes'] / 2**20:.1f} of "
                  f"{t['capacity_bytes'] / 2**20:,.0f} MiB; {t['hits']:,} hits, {t['misses']:,} misses "
                  f"({t['hit_rate']:.0%}); {t['stored_blocks']:,} stored" + (f"; {errors} errors {t['errors']}"
                                                                           if errors else ""), file=out)
        print(f"offload   : {o['loaded_blocks']:,} blocks loaded into the pool instead of recomputed, in "
              f"{o['load_seconds'] * 1e3:.1f} ms", file=out)
    if info["preemption_mode"] == "swap":
        print(f"swap      : {info['num_swapped_out']:,} preemptions swapped out to the {info['offload']['swap_tier']} "
              f"tier, {info['num_swapped_in']:,} resumed from it, {info['num_swap_fallbacks']:,} recomputed instead",
              file=out)
    if info["kv_events"]:
        e = info["kv_events"]
        print(f"kv events : {e['published_events']:,} events in {e['published_batches']:,} batches to {e['endpoint']}"
              + (f"; {e['failed_batches']} batches failed" if e["failed_batches"] else "")
              + (f"; {e['replays']} replays answered at {e['replay_endpoint']}" if e["replay_endpoint"] else ""),
              file=out)
    if info["speculative_config"]:
        drafts, proposed, accepted = (info[f"spec_decode_num_{k}"]
                                      for k in ("drafts", "draft_tokens", "accepted_tokens"))
        from kvcache.engine.spec_decode import mean_acceptance_length
        mean = mean_acceptance_length(drafts, accepted)
        print(f"speculate : {drafts:,} proposals of {proposed:,} tokens, {accepted:,} accepted "
              f"({accepted / proposed if proposed else 0:.0%}); mean acceptance length {mean:.2f} tokens per "
              "verifying step", file=out)
        if info.get("draft_model"):
            d = info["draft_model"]
            print(f"draft     : {d['model']}: {d['weight_bytes'] / 2**30:.2f} GiB of weights, its KV cache "
                  f"{d['num_blocks']:,} blocks = {d['kv_bytes'] / 2**30:.2f} GiB (as many blocks as the pool's, "
                  "from the same budget)", file=out)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcache.engine.outputs import RequestFailedError
    llm = _make_llm(args)
    params = sampling_params(args)
    try:
        if args.chat:
            outs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params, use_tqdm=False)
        else:
            outs = llm.generate(list(args.prompt), params, use_tqdm=False)
    except RequestFailedError as e:
        outs = e.outputs
    for out in outs:
        if len(outs) > 1:
            print(f"=== prompt: {out.prompt!r}")
        for c in out.outputs:
            print(c.text)
            print(f"[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]", file=sys.stderr)
        if out.error:
            print(f"kvcache: error: {out.error}", file=sys.stderr)
    print_kv_summary(llm.engine)
    return 1 if any(out.error for out in outs) else 0


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
            for outs in engine.steps():
                for out in outs:
                    full = out.outputs[0].text
                    if out.error:
                        print(f" [error: {out.error}]", end="")
                    elif not full.endswith("\ufffd"):  # hold back a half-decoded character
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


def cmd_serve(args: argparse.Namespace) -> int:
    from kvcache.server.serve import check_args
    check_args(args)
    if args.replicas != 1:  # Ray Serve replicas behind a router: the router's layer starts them
        from kvcache.router.replicas import serve_replicas
        config = engine_config(args)
        if args.served_model:
            config.model = args.served_model
        return serve_replicas(args, config)
    from kvcache.server.serve import run
    return run(args, engine_config(args))


def _make_llm(args: argparse.Namespace):
    from kvcache.engine.llm import LLM
    return LLM(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _command(sub, name: str, help: str, module: str, engine_args: bool = False) -> None:
    """Subcommand `name` whose flags and runner are `module`'s add_args and run (with the engine's flags first)."""
    mod = importlib.import_module(module)
    p = sub.add_parser(name, help=help)
    if engine_args:
        add_engine_args(p)
    mod.add_args(p)
    p.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    """The `kvcache` parser with every subcommand, each with its handler as `func`."""
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
    c.add_argument("--system", default=None, help="system prompt (default: none)")
    c.add_argument("--message", default=None,
                   help="answer this one message and exit (default: read messages from the terminal)")
    c.set_defaults(func=cmd_chat)

    add_plan_commands(sub)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server with Prometheus metrics")
    add_engine_args(sv)
    from kvcache.server.serve import add_args as add_serve_args
    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)

    _command(sub, "top", "live view of a server's KV cache figures, with warnings", "kvcache.server.top")

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    _command(bsub, "throughput", "offline throughput against a Hugging Face transformers baseline",
             "kvcache.bench.throughput", engine_args=True)
    _command(bsub, "attention", "decode attention alone: time per call, GB/s and the fraction of the device's "
             "measured bandwidth, each backend against the portable torch path", "kvcache.bench.attention")
    _command(bsub, "linear", "a model's float32 linear layers alone on the CPU, weights from memory: each layout "
             "(the C++ kernels' panels, oneDNN's, dense) against oneDNN's", "kvcache.bench.linear")
    _command(bsub, "kv-cache-on-off", "generate N tokens with the KV cache and with none: time per step, total time "
             "and their growth exponents", "kvcache.bench.kv_cache_on_off")
    _command(bsub, "serve", "load an OpenAI-compatible server: TTFT, TPOT, ITL, throughput", "kvcache.bench.serve")
    _command(bsub, "sliding-window", "blocks per request and concurrency with out-of-window blocks given back, "
             "against one table keeping them all", "kvcache.bench.sliding_window")
    _command(bsub, "state-memory", "bytes per sequence against context length for attention, sliding-window, MLA, "
             "hybrid and Mamba-2 layers: the planner's curves and the engine's pool use", "kvcache.bench.state_memory")
    _command(bsub, "spec-decode", "speculative decoding (n-gram or a draft model) against plain decoding on "
             "input-grounded and random prompts, by batch size", "kvcache.bench.spec_decode")
    _command(bsub, "pressure", "a workload that oversubscribes the KV pool, with --kv-pressure-policy preempt and "
             "with the ladder at several bounds: throughput, TTFT, ITL, preemptions, and top-1/KL against the "
             "unconstrained run", "kvcache.eval.pressure")
    _command(bsub, "mla", "MLA's latent KV bytes per token against MHA, and decode step time of absorbed against "
             "expanded attention", "kvcache.bench.mla")
    _command(bsub, "tensor-parallel", "the same workload on 1 rank and on --tensor-parallel-size ranks: tok/s, KV "
             "bytes per rank against the planner's, same tokens", "kvcache.bench.tensor_parallel")
    _command(bsub, "replicas", "K replicas on Ray Serve, KV-aware routing against round-robin: prefix-cache hit "
             "rate and TTFT on shared-prefix and multi-turn workloads", "kvcache.bench.replicas")
    _command(bsub, "soak", "kvcache serve under a seeded mixed workload for a set time while faults are injected "
             "(Redis killed, the disk tier read-only, a replica killed), then SIGTERM: 5xx, RSS, fds, threads, "
             "blocks held, TTFT/ITL per window", "kvcache.bench.soak")
    _command(bsub, "kv-page", "the live KV page's cost: the snapshot on a 100k-block pool, and serving throughput "
             "with viewers against none", "kvcache.bench.kv_page")

    ev = sub.add_parser("eval", help="quality evaluations")
    evsub = ev.add_subparsers(dest="eval", required=True)
    _command(evsub, "kv-quality", "KL, top-1, perplexity, passkey retrieval and capacity of each KV cache dtype "
             "against the float32 cache", "kvcache.eval.kv_quality")
    _command(evsub, "weights", "KL, top-1, perplexity and single-stream decode speed of each weight format and "
             "compute dtype against float32", "kvcache.eval.weights")
    _command(evsub, "eviction", "KL, top-1, perplexity, passkey retrieval, memory and throughput of each KV eviction "
             "policy and budget against the full cache", "kvcache.eval.eviction")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into `head`: stop quietly, as other command-line tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as e:  # bad input or an unreadable/unwritable path: one line, no traceback
        print(f"kvcache: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
