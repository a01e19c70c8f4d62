"""Where a step's time goes (`kvcache bench throughput --profile`): each engine step's wall time split into the
model's kernels (linear layers, the attention kernel, the fused native layer calls), the rest of the forward (the
Python around them and small ops) and the step outside the forward (scheduling, batch metadata, sampling, outputs),
grouped by the kind of step. CPU steps are synchronous, so wall clocks around the calls measure them; the timers
themselves add about a microsecond per call (~130 calls a step on the demo model)."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

BUCKETS = ((1, 1), (2, 8), (9, 32), (33, 64), (65, 1 << 30))


def bucket(chunks: list[tuple[object, int]]) -> str:
    """'decode N-M' by the number of sequences for a step of decodes only, 'verify N-M' for one where some of them
    verify a speculative proposal (1 + k rows for k proposed tokens), else 'prefill/mixed'."""
    drafts = [len(getattr(seq, "draft", ())) for seq, _ in chunks]
    if any(n != 1 + d for (_, n), d in zip(chunks, drafts)):
        return "prefill/mixed"
    b = len(chunks)
    lo, hi = next((lo, hi) for lo, hi in BUCKETS if lo <= b <= hi)
    kind = "verify" if any(drafts) else "decode"
    return f"{kind} {lo}" if lo == hi else f"{kind} {lo}-{hi if hi < 1 << 30 else ''}".rstrip("-")


class StepProfile:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._kernel = 0.0
        self._forward = 0.0
        self._kind = "prefill/mixed"

    def timed(self, fn, slot: str):
        """fn, adding its wall time to `slot`; a timed call inside another of the same slot is not counted twice."""
        depth = f"{slot}_depth"

        def wrapper(*a, **k):
            if getattr(self, depth, 0):
                return fn(*a, **k)
            setattr(self, depth, 1)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, slot, getattr(self, slot) + time.perf_counter() - t)
                setattr(self, depth, 0)
        return wrapper

    def step(self, fn):
        def wrapper(*a, **k):
            self._kernel = self._forward = 0.0
            t = time.perf_counter()
            out = fn(*a, **k)
            total = time.perf_counter() - t
            r = self.rows[self._kind]
            r["steps"] += 1
            r["total_s"] += total
            r["kernels_s"] += self._kernel
            r["forward_other_s"] += self._forward - self._kernel
            r["outside_s"] += total - self._forward
            return out
        return wrapper

    def execute(self, fn):
        def wrapper(chunks):
            self._kind = bucket(chunks)
            return fn(chunks)
        return wrapper

    def table(self) -> dict:
        out = {}
        for kind, r in sorted(self.rows.items(), key=lambda kv: (kv[0] == "prefill/mixed", len(kv[0]), kv[0])):
            n, total = r["steps"], r["total_s"]
            out[kind] = {"steps": int(n), "ms_per_step": 1e3 * total / n, "kernels": r["kernels_s"] / total,
                         "forward_other": r["forward_other_s"] / total, "outside_forward": r["outside_s"] / total}
        return out


class _TimedKernels:
    """The native kernels module with its fused layer calls timed."""

    def __init__(self, kernels, prof: StepProfile) -> None:
        self._k = kernels
        self.attn_in = prof.timed(kernels.attn_in, "_kernel")
        self.mlp = prof.timed(kernels.mlp, "_kernel")
        self.decode_layers = prof.timed(kernels.decode_layers, "_kernel")  # a decode step's layers, natively

    def __getattr__(self, name):
        return getattr(self._k, name)


@contextmanager
def profiling(engine):
    """Time `engine`'s steps while the block runs; yields the StepProfile."""
    from kvcache.attention import cpu_kernel
    from kvcache.models import decoder_layer
    from kvcache.models.linear import Dense
    from kvcache.models.quant_linear import Int4Dense, Int8Dense
    prof = StepProfile()
    saved_decode = cpu_kernel.paged_decode
    saved = [(cls, cls.forward) for cls in (Dense, Int8Dense, Int4Dense)]
    saved_attention = decoder_layer.paged_attention
    layers = engine.runner.model.layers
    saved_kernels = [layer.kernels for layer in layers]
    runner = engine.runner
    try:
        for cls, fwd in saved:
            cls.forward = prof.timed(fwd, "_kernel")
        decoder_layer.paged_attention = prof.timed(saved_attention, "_kernel")
        cpu_kernel.paged_decode = prof.timed(saved_decode, "_kernel")  # the fused path calls it directly
        for layer in layers:
            if layer.kernels is not None:
                layer.kernels = _TimedKernels(layer.kernels, prof)
        runner._forward = prof.timed(runner._forward, "_forward")
        runner.run_chunk = prof.timed(runner.run_chunk, "_forward")
        runner.execute = prof.execute(runner.execute)
        engine.step = prof.step(engine.step)
        yield prof
    finally:
        for cls, fwd in saved:
            cls.forward = fwd
        decoder_layer.paged_attention = saved_attention
        cpu_kernel.paged_decode = saved_decode
        for layer, k in zip(layers, saved_kernels):
            layer.kernels = k
        for name in ("_forward", "run_chunk", "execute"):
            runner.__dict__.pop(name, None)
        engine.__dict__.pop("step", None)


def print_table(rows: dict) -> None:
    head = f"{'step':<16}{'steps':>7}{'ms/step':>9}{'kernels':>9}{'rest of forward':>17}{'outside forward':>17}"
    print("\nwhere the time goes (--profile): kernels = linear layers, attention, fused layer calls")
    print(head)
    print("-" * len(head))
    for kind, r in rows.items():
        print(f"{kind:<16}{r['steps']:>7}{r['ms_per_step']:>9.1f}{r['kernels']:>9.0%}{r['forward_other']:>17.0%}"
              f"{r['outside_forward']:>17.0%}")
