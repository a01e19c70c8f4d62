"""`kvcache bench state-memory`: bytes a sequence takes against its context length, for attention, sliding-window,
MLA, hybrid (Mamba-2 + attention) and pure Mamba-2 layers of one size, from the planner and measured on the engine.

Random-weight models built on the spot with transformers' config classes (no model hub), all 8 layers of hidden
size --hidden:
- `llama`: full attention in every layer (4 heads, 2 KV heads);
- `mistral`: every layer slides with a window of --window tokens (the engine gives back out-of-window blocks);
- `deepseek_v2`: multi-head latent attention (a latent of --hidden / 2 and a RoPE key of 16 per token and layer);
- `bamba`: Mamba-2 mixers with attention at 2 of the 8 layers (IBM Bamba-9B: 3 of 32);
- `mamba2`: every layer a Mamba-2 mixer.

1. The planner's bytes per sequence at each of --plan-lengths (`planned`: the blocks the engine's pool holds for one
   sequence, as `kvcache plan` and the start-up count them, and its state), printed and plotted: attention grows with the context, a sliding
   window stops at its window, MLA grows at a fraction of the slope, a hybrid grows at the slope of its few
   attention layers above a constant state, and a pure SSM stays flat.
2. The engine's measured use at each of --lengths: one request of that many tokens alone in the pool, the most
   blocks it held at once (after any step) times a block's bytes, plus its state slot's bytes, against the
   planner's figure for that length.
"""
from __future__ import annotations

import argparse
import os
import tempfile

from kvcache.bench.report import write_json
from kvcache.bench.throughput import positive_ints

SHAPES = ("llama", "mistral", "deepseek_v2", "bamba", "mamba2")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,8192,32768",
                   help="context lengths (tokens) measured on the engine, comma-separated (default: %(default)s)")
    p.add_argument("--plan-lengths", default="512,1024,2048,4096,8192,16384,32768,65536,131072",
                   help="context lengths (tokens) of the planner's curves, comma-separated (default: %(default)s)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)} (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of every model (default: %(default)s)")
    p.add_argument("--window", type=int, default=512, help="mistral's sliding window (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="the engine's tokens per step at most: prompts are prefilled in chunks of this many "
                        "(default: %(default)s)")
    p.add_argument("--json", default="results/state_memory.json",
                   help="write the results here (default: %(default)s; '' to skip)")
    p.add_argument("--plot", default="results/state_memory.png",
                   help="plot the planner's curves and the engine's points here (default: %(default)s; '' to skip)")


def config(shape: str, hidden: int, window: int, max_len: int):
    """The transformers config of `shape` at hidden size `hidden` (8 layers)."""
    from transformers import BambaConfig, DeepseekV2Config, LlamaConfig, Mamba2Config, MistralConfig
    heads = max(1, hidden // 16)
    common = dict(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_len,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    mamba = dict(n_heads=heads * 2, d_head=16, n_groups=1, d_state=16, d_conv=4, expand=2, chunk_size=64)
    if shape == "llama":
        return LlamaConfig(**common)
    if shape == "mistral":
        return MistralConfig(sliding_window=window, **common)
    if shape == "deepseek_v2":
        return DeepseekV2Config(**{**common, "num_key_value_heads": heads}, kv_lora_rank=hidden // 2, q_lora_rank=None,
                                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=8)
    if shape == "bamba":
        return BambaConfig(**common, attn_layer_indices=[3, 7], **{f"mamba_{k}": v for k, v in mamba.items()})
    return Mamba2Config(**{k: v for k, v in common.items() if "heads" not in k and k != "intermediate_size"},
                        num_heads=mamba["n_heads"], head_dim=16, n_groups=1, state_size=16, conv_kernel=4,
                        chunk_size=64, expand=2)


def _measured(path: str, length: int, args) -> int:
    """The most pool bytes one request of `length` tokens holds (its blocks' and its state slot's)."""
    from kvcache.engine.llm import LLM
    from kvcache.engine.sampling_params import SamplingParams
    llm = LLM(path, block_size=args.block_size, max_model_len=length, max_num_seqs=1, enable_prefix_caching=False,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=256 * 2**20)
    eng = llm.engine
    prompt = [3 + (17 * i) % 500 for i in range(length - 1)]
    eng.add_request("one", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    eng.run_to_completion()
    eng.check_no_leaks()
    info = llm.kv_cache_info()
    return eng.stats.peak_used_blocks * info["bytes_per_token"] * info["block_size"] + info["state_bytes_per_seq"]


def planned(model, length: int, block_size: int) -> int:
    """The planner's bytes for one sequence of `length` tokens in the engine's pool: the most blocks it holds
    (cache_capacity's blocks_per_request: whole blocks, a window's and one more where every layer slides) times a
    block's bytes, plus its state (float32)."""
    from kvcache.plan.kv_bytes import cache_capacity, state_bytes_per_seq
    state = state_bytes_per_seq(model, "float32")
    c = cache_capacity(model, "float32", 2**40, block_size, length, state_dtype="float32",
                       state_slots=1 if state else 0)
    return c.blocks_per_request * c.bytes_per_token * block_size + state


def _shape(shape: str, args, root: str, lengths: list[int], plan_lengths: list[int]) -> dict:
    from kvcache.models.random_checkpoint import save_random_checkpoint
    from kvcache.plan.model_source import load_model_shape
    max_len = max(lengths + plan_lengths)
    path = save_random_checkpoint(os.path.join(root, shape), config(shape, args.hidden, args.window, max_len))
    model = load_model_shape(path)
    curve = {n: planned(model, n, args.block_size) for n in plan_lengths}
    rows = []
    for n in lengths:
        want = planned(model, n, args.block_size)
        got = _measured(path, n, args)
        rows.append({"length": n, "planner_bytes": want, "engine_bytes": got, "ratio": got / want})
    return {"shape": shape, "layer_kinds": list(model.layer_kinds), "planner": curve, "engine": rows}


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape, r in results["shapes"].items():
        xs = sorted(r["planner"])
        line, = ax.plot(xs, [r["planner"][x] / 2**20 for x in xs], label=shape)
        ax.scatter([e["length"] for e in r["engine"]], [e["engine_bytes"] / 2**20 for e in r["engine"]],
                   color=line.get_color(), marker="o", zorder=3)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("bytes per sequence (MiB, float32)")
    ax.set_title(f"One sequence's cache: planner (lines), engine (points); hidden {results['hidden']}, 8 layers")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    lengths = positive_ints("--lengths", args.lengths, least=2)
    plan_lengths = positive_ints("--plan-lengths", args.plan_lengths)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown or not shapes:
        raise ValueError(f"--shapes takes {', '.join(SHAPES)}; got {args.shapes!r}")
    results = {"hidden": args.hidden, "window": args.window, "block_size": args.block_size, "shapes": {}}
    with tempfile.TemporaryDirectory() as root:
        for shape in shapes:
            results["shapes"][shape] = _shape(shape, args, root, lengths, plan_lengths)
    print(f"\nbytes one sequence takes (float32, hidden {args.hidden}, 8 layers): planner, and the engine's pool")
    print(f"{'shape':<12} {'tokens':>8} {'planner KiB':>12} {'engine KiB':>11} {'engine/planner':>15}")
    for shape, r in results["shapes"].items():
        for e in r["engine"]:
            print(f"{shape:<12} {e['length']:>8,} {e['planner_bytes'] / 1024:>12,.1f} {e['engine_bytes'] / 1024:>11,.1f} "
                  f"{e['ratio']:>14.3f}x")
    longest = max(plan_lengths)
    print(f"\nthe planner at {longest:,} tokens: " + ", ".join(
        f"{s} {r['planner'][longest] / 2**20:,.2f} MiB" for s, r in results["shapes"].items()))
    write_json(args.json, results)
    if args.plot:
        _plot(results, args.plot)
    worst = max(abs(e["ratio"] - 1) for r in results["shapes"].values() for e in r["engine"])
    return 0 if worst <= 0.05 else 1
