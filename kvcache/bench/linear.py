"""`kvcache bench linear`: a model's float32 linear layers alone on the CPU, in each weight layout the engine can
use, at the row counts of decode and prefill steps.

A decode step of B sequences multiplies B rows by every weight once, and the weights (hundreds of MB) come from
memory, not from a cache: so each call here reads the next of enough copies of the weight that together they are
larger than the last-level cache. Layouts: `panels` (the default, Dense.pack with the C++ kernels: panels of 32
output channels for cpu_kernels' panel_linear), `onednn` (oneDNN's linear on its own packed layout, what the engine
used before, and still uses without the C++ kernels) and `dense` (torch.matmul on the [in, out] weight, MKL). Each
is compared with oneDNN's, as a ratio.
"""
from __future__ import annotations

import argparse
import time

from kvcache.bench.report import write_json

COLD_BYTES, MAX_COPIES = 256 * 2**20, 64  # weights cycled through per layer and layout
LAYOUTS = ("panels", "onednn", "dense")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="preset name, config.json or model directory: the layer "
                   "shapes (default: the demo model, SmolLM2-135M)")
    p.add_argument("--rows", default="1,8,32,64,256,2048",
                   help="rows per call (a step's tokens), comma-separated (default: %(default)s)")
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"weight layouts to time, comma-separated, of {', '.join(LAYOUTS)} (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=0.3,
                   help="timing budget per layer, row count and layout, in seconds (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the results here (default: not written)")


def layer_shapes(shape) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each linear layer of a Llama-style decoder layer, and of the LM head."""
    h, hd = shape.hidden_size, shape.head_dim
    heads, kv = shape.num_attention_heads or shape.num_kv_heads, shape.num_kv_heads
    return {"qkv": (h, (heads + 2 * kv) * hd), "o_proj": (heads * hd, h), "gate_up": (h, 2 * shape.intermediate_size),
            "down": (shape.intermediate_size, h), "lm_head": (h, shape.vocab_size)}


def _layout(name: str, w):
    """(pack one [out, in] weight, call(x, packed)) for layout `name`, or a ValueError saying why it cannot run."""
    import torch

    from kvcache.models import cpu_kernels
    from kvcache.models.linear import pack_weight, packed_linear, panel_linear
    if name == "panels":
        kernels = cpu_kernels.load()
        if kernels is None:
            raise ValueError("the C++ kernels did not build here (see the warning above)")
        return (lambda t: cpu_kernels.pack_panels(t, kernels)), lambda x, p: panel_linear(x, p, w.shape[0])
    if name == "onednn":
        if not torch.backends.mkldnn.is_available():
            raise ValueError("this torch has no oneDNN")
        return pack_weight, packed_linear
    if name == "dense":
        return (lambda t: t.t().contiguous()), torch.matmul
    raise ValueError(f"unknown layout {name!r}: use {', '.join(LAYOUTS)}")


def _rate(call, copies: list, x, seconds: float) -> float:
    """Best seconds per call over `seconds` of calls, each on the next copy (at least 3 timings of a full cycle)."""
    for p in copies[:2]:
        call(x, p)
    best, end, timings = float("inf"), time.perf_counter() + seconds, 0
    while timings < 3 or time.perf_counter() < end:
        t = time.perf_counter()
        for p in copies:
            call(x, p)
        best = min(best, (time.perf_counter() - t) / len(copies))
        timings += 1
    return best


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.plan.model_source import load_model_shape
    shape = load_model_shape(args.model)
    rows = [int(r) for r in args.rows.split(",")]
    layouts = args.layouts.split(",")
    if min(rows) < 1 or any(name not in LAYOUTS for name in layouts):
        raise ValueError(f"--rows must be positive and --layouts of {', '.join(LAYOUTS)}; got {args.rows!r}, "
                         f"{args.layouts!r}")
    g = torch.Generator().manual_seed(0)
    results = []
    for layer, (n_in, n_out) in layer_shapes(shape).items():
        w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
        count = max(1, min(MAX_COPIES, -(-COLD_BYTES // w.nbytes)))
        xs = {m: torch.randn(m, n_in, generator=g) for m in rows}
        for name in layouts:
            pack, call = _layout(name, w)
            copies = [pack(w.clone()) for _ in range(count)]
            for m in rows:
                t = _rate(call, copies, xs[m], args.seconds)
                results.append({"layer": layer, "in": n_in, "out": n_out, "rows": m, "layout": name, "copies": count,
                                "ms": t * 1e3, "gflops": 2 * m * n_in * n_out / t / 1e9,
                                "weight_gbs": w.nbytes / t / 1e9})
            del copies
    for r in results:  # against oneDNN's layout at the same layer and rows
        base = next((b for b in results if b["layout"] == "onednn" and b["layer"] == r["layer"]
                     and b["rows"] == r["rows"]), None)
        r["vs_onednn"] = base["ms"] / r["ms"] if base else None
    out = {"model": shape.name, "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows,
           "layouts": layouts, "results": results}
    _print(out)
    if args.json:
        write_json(args.json, out)
    return 0


def _print(r: dict) -> None:
    print(f"\nfloat32 linear layers of {r['model']} on the CPU ({r['threads']} threads), weights read from memory each "
          "call: GFLOP/s (and the weights' GB/s)")
    head = f"{'layer':<9}{'in x out':>14}{'rows':>6}" + "".join(f"{name:>18}" for name in r["layouts"])
    if "onednn" in r["layouts"] and "panels" in r["layouts"]:
        head += f"{'panels/onednn':>15}"
    print(head)
    print("-" * len(head))
    by = {(x["layer"], x["rows"], x["layout"]): x for x in r["results"]}
    for x in r["results"]:
        if x["layout"] != r["layouts"][0]:
            continue
        line = f"{x['layer']:<9}{x['in']:>6,} x {x['out']:<6,}{x['rows']:>6}"
        for name in r["layouts"]:
            y = by[(x["layer"], x["rows"], name)]
            line += f"{y['gflops']:>10.1f} ({y['weight_gbs']:>4.1f})"
        if "onednn" in r["layouts"] and "panels" in r["layouts"]:
            line += f"{by[(x['layer'], x['rows'], 'panels')]['vs_onednn']:>14.2f}x"
        print(line)
