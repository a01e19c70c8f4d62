"""`kvcache plan` and `kvcache simulate`: their flags and handlers, beside the planner and simulator they drive.

Like the rest of plan/, this imports only kvcache.plan and the standard library, so both commands run without
torch. Sizes such as 4GiB or 25% are read by plan/sizes.py's `parse_bytes`, as the engine's flags are."""
from __future__ import annotations

import argparse
import os

from kvcache.plan.capacity import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from kvcache.plan.sizes import parse_bytes


def add_commands(sub) -> None:
    """The `plan` and `simulate` subcommands on the subparsers `sub`."""
    pl = sub.add_parser("plan", help="KV bytes per token, cache size and capacity for a model (no torch)")
    add_plan_args(pl)
    pl.set_defaults(func=cmd_plan)
    sm = sub.add_parser("simulate", help="replay a request trace through KV allocators and measure the waste")
    add_simulate_args(sm)
    sm.set_defaults(func=cmd_simulate)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The flags of `kvcache plan`."""
    p.add_argument("model", nargs="?", default=None,
                   help="preset name (see --list), config.json, Hugging Face model directory or GGUF file "
                        "(default: the SmolLM2-135M demo model)")
    p.add_argument("--list", action="store_true", help="list the model and GPU presets")
    p.add_argument("--batch", type=int, default=1, help="concurrent requests (B) (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per request (L) (default: the model's context)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the weights' dtype, --dtype; bfloat16 for float32 checkpoints), float32, bfloat16, "
                        "float16, fp8_e4m3, fp8_e5m2, int8, int4, int2 (default: %(default)s)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print JSON instead of text, or write it to PATH (default: text only)")
    p.add_argument("--gpu", default=None, help="GPU preset (see --list) (default: none)")
    p.add_argument("--memory", default=None, help="device memory per GPU in bytes, e.g. 80GB, 24GiB (default: none; "
                   "without --gpu, --memory or --kv-cache-memory only the bytes per token are planned)")
    p.add_argument("--kv-cache-memory", default=None, help="KV budget per GPU given directly (skips weights and "
                   "activations), as kvcache's engine takes it: bytes (e.g. 40GiB) or a share of --gpu/--memory "
                   "(25%%) (default: from the device memory)")
    p.add_argument("--num-gpus", type=int, default=1,
                   help="GPUs in all: --tensor-parallel-size per pipeline stage, the rest as pipeline stages "
                        "(default: %(default)s)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="GPUs splitting each layer's KV heads "
                   "(default: --num-gpus)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU's memory, a fraction in (0, 1], for weights, activations and the KV cache "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="weight dtype: auto (the checkpoint's; bfloat16 for float32), "
                   "float32, bfloat16, float16, fp8, int8, int4 (default: %(default)s)")
    p.add_argument("--num-parameters", type=float, default=None,
                   help="override the parameter count (default: the model's)")
    p.add_argument("--activation-reserve", default=None,
                   help="bytes per GPU kept for activations, e.g. 2GiB (default: estimated from --max-num-seqs and "
                        "--max-num-batched-tokens)")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default: 16; 64 for int4/int2)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help="the engine's requests per step at most, for the activation estimate (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   help="the engine's tokens per step at most, for the activation estimate (default: %(default)s)")


def cmd_plan(args: argparse.Namespace) -> int:
    import dataclasses

    from kvcache.plan.capacity import plan_device, weight_dtype
    from kvcache.plan.kv_bytes import check_latent_format, default_block_size, heads_per_gpu
    from kvcache.plan.model_source import demo_model_path, load_model_shape
    from kvcache.plan.presets import GPU_PRESETS, MODEL_PRESETS
    from kvcache.plan.report import build_report, format_report, human

    if args.list:
        print("models:")
        for name, (repo, params, _) in MODEL_PRESETS.items():
            print(f"  {name:<20} {params / 1e9:>7.2f}B  {repo}")
        print("gpus:")
        for name, mem in GPU_PRESETS.items():
            print(f"  {name:<20} {mem:>18,} bytes ({human(mem)})")
        return 0
    for name in ("batch", "seq_len", "num_gpus", "tensor_parallel_size", "block_size", "max_num_seqs",
                 "max_num_batched_tokens", "num_parameters"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v:g}")
    if args.gpu is not None and args.gpu not in GPU_PRESETS:
        raise ValueError(f"unknown GPU {args.gpu!r}; presets: {', '.join(GPU_PRESETS)} (or give --memory BYTES)")
    if args.gpu is not None and args.memory is not None:
        raise ValueError(f"give one of --gpu ({args.gpu}: {GPU_PRESETS[args.gpu]:,} bytes) and --memory "
                         f"({args.memory}), not both")
    shape = load_model_shape(args.model or demo_model_path())
    if args.num_parameters is not None:
        shape = dataclasses.replace(shape, num_parameters=int(args.num_parameters))
    if args.kv_cache_dtype != "auto":
        kv = args.kv_cache_dtype
    else:  # the compute dtype: float weights' own, else (fp8, int8, int4 weights) the checkpoint's float dtype
        kv = weight_dtype(args.dtype if args.dtype in ("float32", "bfloat16", "float16") else "auto", shape)
    if shape.attention_kind == "MLA":
        check_latent_format(kv)  # as the engine refuses it
    block_size = args.block_size or default_block_size(kv)
    seq_len = args.seq_len or shape.max_position_embeddings or 4096
    tp = args.tensor_parallel_size or args.num_gpus
    heads_per_gpu(shape.num_kv_heads, tp)  # a tensor-parallel size that cannot split the KV heads is refused
    device = None
    memory = GPU_PRESETS[args.gpu] if args.gpu else (parse_bytes(args.memory) if args.memory else None)
    if memory is not None or args.kv_cache_memory is not None:
        device = plan_device(
            shape, kv, memory_per_gpu=memory,
            # a share is of the GPU's memory when one is named, as the engine takes it on CUDA
            kv_cache_memory=parse_bytes(args.kv_cache_memory, of=memory) if args.kv_cache_memory else None,
            num_gpus=args.num_gpus, tensor_parallel_size=tp, gpu_memory_utilization=args.gpu_memory_utilization,
            weights=args.dtype,
            activation_bytes=parse_bytes(args.activation_reserve, allow_zero=True) if args.activation_reserve else None,
            block_size=block_size, seq_len=seq_len, batch=args.batch, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens)
    report = build_report(shape, kv, args.batch, seq_len, device)
    _emit(report, format_report(report), args.json)
    return 0


def _make_parent(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _emit(data: dict, text: str, json_path: str | None) -> None:
    """Print the text, or the JSON with `--json`; `--json PATH` writes the JSON there and prints the text."""
    import json

    if json_path == "-":
        print(json.dumps(data, indent=2))
        return
    print(text)
    if json_path:
        _make_parent(json_path)
        with open(json_path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {json_path}")


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    """The flags of `kvcache simulate`."""
    p.add_argument("--trace", default=None, help="JSONL trace: {arrival_s, prompt_tokens, output_tokens"
                   "[, prefix_group, prefix_tokens]} per line (default: a synthetic trace)")
    p.add_argument("--num-requests", type=int, default=1000,
                   help="requests in the synthetic trace (default: %(default)s)")
    p.add_argument("--rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (default: %(default)s, all at once)")
    p.add_argument("--prompt-len", default="sharegpt",
                   help="prompt tokens: uniform:LO:HI, normal:MEAN:STD, sharegpt, or a fixed N (default: %(default)s)")
    p.add_argument("--output-len", default="sharegpt",
                   help="output tokens, same forms as --prompt-len (default: %(default)s)")
    p.add_argument("--prefix-groups", type=int, default=0,
                   help="groups of requests sharing a prefix (default: %(default)s, none)")
    p.add_argument("--prefix-len", type=int, default=0, help="tokens of the shared prefix (also for --trace files "
                   "whose lines have prefix_group but no prefix_tokens) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the synthetic trace: its lengths and arrival times (default: %(default)s)")
    p.add_argument("--save-trace", default=None, help="write the trace used as JSONL (default: not written)")
    p.add_argument("--model", default="llama-3-8b",
                   help="model whose bytes/token turn token slots into bytes (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV dtype for the bytes/token: auto (the weights' dtype; bfloat16 for float32 checkpoints), "
                        "float32, bfloat16, float16, fp8_e4m3, fp8_e5m2, int8, int4, int2 (default: %(default)s)")
    p.add_argument("--kv-cache-memory", default=None, help="the KV pool in bytes, e.g. 4GiB, 80GB (default: 4GiB; "
                   "80GiB for --scenario seed)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="tokens reserve-max reserves per request (default: %(default)s)")
    p.add_argument("--block-sizes", default="1,16,64,256",
                   help="paged allocators to run, tokens per block, comma-separated (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests running at once at most (default: %(default)s)")
    p.add_argument("--step-ms", type=float, default=20.0,
                   help="milliseconds of one decode iteration (default: %(default)s)")
    p.add_argument("--scenario", choices=["seed"], default=None,
                   help="seed: 3, 2.3 and 4.5 GiB requests, free the 2.3, then ask for 7.5 GiB (default: none)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print JSON instead of the table, or write it to PATH (default: the table only)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw utilization over time for every allocator (default: no plot)")


def cmd_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    from kvcache.plan.capacity import weight_dtype
    from kvcache.plan.kv_bytes import kv_bytes_per_token
    from kvcache.plan.model_source import load_model_shape
    from kvcache.plan.simulate import compare, format_table, plot, seed_scenario
    from kvcache.plan.trace import load_trace, save_trace, synthetic_trace

    shape = load_model_shape(args.model)
    kv = weight_dtype("auto", shape) if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    per_token = kv_bytes_per_token(shape, kv)
    if args.scenario == "seed":
        s = seed_scenario(parse_bytes(args.kv_cache_memory or "80GiB") / 2**30, bytes_per_token=per_token)
        _emit(dataclasses.asdict(s), s.explanation, args.json)
        return 0
    for name in ("num_requests", "max_model_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    try:
        block_sizes = tuple(int(b) for b in args.block_sizes.split(","))
    except ValueError:
        block_sizes = ()
    if not block_sizes or min(block_sizes) < 1:
        raise ValueError(f"--block-sizes takes positive integers separated by commas, got {args.block_sizes!r}")
    if args.trace:
        trace = load_trace(args.trace)
        if args.prefix_len:
            trace = [dataclasses.replace(r, prefix_tokens=min(r.prompt_tokens, args.prefix_len))
                     if r.prefix_group is not None and not r.prefix_tokens else r for r in trace]
    else:
        trace = synthetic_trace(args.num_requests, seed=args.seed, rate=args.rate, prompt=args.prompt_len,
                                output=args.output_len, max_model_len=args.max_model_len,
                                prefix_groups=args.prefix_groups, prefix_len=args.prefix_len)
    if args.save_trace:
        save_trace(trace, args.save_trace)
    pool_tokens = parse_bytes(args.kv_cache_memory or "4GiB") // per_token
    if pool_tokens < max(block_sizes, default=1):
        raise ValueError(f"--kv-cache-memory {args.kv_cache_memory} holds {pool_tokens:,} tokens of {per_token:,} "
                         f"bytes: not one block of {max(block_sizes)} tokens")
    sharing = any(r.prefix_group is not None and r.prefix_tokens for r in trace)
    results = compare(trace, pool_tokens, block_sizes=block_sizes, max_model_len=args.max_model_len,
                      step_s=args.step_ms / 1000, max_num_seqs=args.max_num_seqs, prefix_sharing=sharing)
    if args.plot:
        _make_parent(args.plot)
        plot(results, args.plot)
    n_prompt = sum(r.prompt_tokens for r in trace)
    n_out = sum(r.output_tokens for r in trace)
    head = (f"trace: {len(trace):,} requests, {n_prompt:,} prompt + {n_out:,} output tokens"
            f" ({args.trace or f'synthetic, seed {args.seed}'}); {shape.name}, {kv}: {per_token:,} bytes/token")
    data = {"trace": {"requests": len(trace), "prompt_tokens": n_prompt, "output_tokens": n_out,
                      "source": args.trace or "synthetic"},
            "model": shape.name, "kv_cache_dtype": kv, "bytes_per_token": per_token, "pool_tokens": pool_tokens,
            "pool_bytes": pool_tokens * per_token, "allocators": {r.name: r.to_json() for r in results}}
    _emit(data, head + "\n" + format_table(results, per_token) + (f"\nwrote {args.plot}" if args.plot else ""),
          args.json)
    return 0
