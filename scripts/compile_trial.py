"""torch.compile on the decoder's MLP half, against eager PyTorch and kvcache's fused C++ call, on this machine.

    python scripts/compile_trial.py [--threads N] [--json results/compile_trial.json]

The MLP half of every layer of the demo model (output projection, residual add, RMSNorm, gate/up, SiLU x up,
down) in float32, at 1 row (single-stream decode) and 64 rows (a batched decode step), best of 10 passes over all
30 layers. torch.compile (Inductor, static shapes) compiles the same function eager runs; the fused call is what
`_forward_fused` uses. Issue 18 asked to keep compile only where it wins: it did not here (see the README), so the
engine does not use it; this script is how to check again on another machine or torch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp(attn, residual, wo, norm, wgu, wd, eps: float):
    import torch.nn.functional as F
    residual = residual + attn @ wo
    h = F.rms_norm(residual, (residual.shape[-1],), norm, eps)
    gate, up = (h @ wgu).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ wd, residual


def best_ms(fn, repeats: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default="results/compile_trial.json")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    # eager and compiled runs read the dense [in, out] weights: keep them (the engine packs them for oneDNN otherwise,
    # and the fused call then runs oneDNN's linear, not the GEMM the other two use)
    os.environ["KVCACHE_PACKED_WEIGHTS"] = "0"
    import torch

    from kvcache import LLM
    from kvcache.bench.report import write_json
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = LLM().engine.runner.model.layers
    if layers[0].fused is None:
        raise SystemExit("the fused C++ kernels are not available here (no compiler or no AVX-512)")
    compiled = torch.compile(mlp, dynamic=False)
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": {}}
    for rows in (1, 64):
        attn, resid = torch.randn(rows, layers[0].o_proj.in_features), torch.randn(rows, layers[0].o_proj.out_features)

        def run(fn):
            return lambda: [fn(attn, resid, lay.o_proj.weight, lay.post_norm, lay.gate_up.weight, lay.down.weight,
                               lay.eps) for lay in layers]

        def fused():
            for lay in layers:
                lay.kernels.mlp(resid.clone(), attn, lay.fused[1], lay.post_norm, lay.eps, lay.fused[2], lay.fused[3],
                                lay.gate_up.out_features // 2)

        with torch.inference_mode():
            t = time.perf_counter()
            run(compiled)()
            compile_s = time.perf_counter() - t
            results["rows"][rows] = {"eager_ms": best_ms(run(mlp)), "compiled_ms": best_ms(run(compiled)),
                                     "fused_ms": best_ms(fused), "compile_s": compile_s}
    print(f"\nMLP half of {len(layers)} layers, float32, {results['threads']} threads, torch {results['torch']}")
    print(f"{'rows':>5}{'eager ms':>10}{'compiled ms':>13}{'fused C++ ms':>14}{'compile s':>11}{'compiled/eager':>16}")
    for rows, r in results["rows"].items():
        print(f"{rows:>5}{r['eager_ms']:>10.1f}{r['compiled_ms']:>13.1f}{r['fused_ms']:>14.1f}{r['compile_s']:>11.1f}"
              f"{r['eager_ms'] / r['compiled_ms']:>15.2f}x")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
