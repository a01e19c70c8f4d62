"""The fused CPU decode path (cpu_kernels.attn_in / mlp, K/V stored by attn_in and the decode kernel called
directly) computes what the layer-by-op path computes: the same greedy tokens and the same KV cache contents for
float32 and int8 weights, and close logits for int4 (whose int8 activations can round a last-ulp difference into a
different code)."""
from __future__ import annotations

import pytest
import torch

import kvcache.models.llama as llama
from kvcache import LLM, SamplingParams


def _run(llm: LLM, fused: bool, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs and the KV store after them, from a fresh engine (the same blocks in both runs)."""
    monkeypatch.setattr(llama, "FUSED_MAX_ROWS", 32 if fused else 0)
    store = llm.engine.store
    prompts = [list(range(3 + i, 30 + 5 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs, [t.clone() for t in store.k + store.v]


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_fused_decode_matches_the_op_by_op_path(tiny_model_dirs, quant, monkeypatch):
    def make():
        return LLM(tiny_model_dirs["qwen2"], quantization=quant, kv_cache_memory="4MiB", max_model_len=256)  # biases
    llm = make()
    layer = llm.engine.runner.model.layers[0]
    assert layer.fused is not None
    calls = []
    real = layer.kernels
    class Spy:  # the fused path ran, storing K/V itself
        def __getattr__(self, name):
            if name == "attn_in":
                return lambda *a: (calls.append(a[-1] is not None), real.attn_in(*a))[1]
            return getattr(real, name)
    monkeypatch.setattr(layer, "kernels", Spy())
    fused_out, fused_kv = _run(llm, True, monkeypatch)
    assert calls and any(calls)
    llm.engine.check_no_leaks()
    plain_out, plain_kv = _run(make(), False, monkeypatch)
    assert fused_out == plain_out
    for a, b in zip(fused_kv, plain_kv):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fused_int4_stays_close(tiny_model_dirs, monkeypatch):
    def make():
        return LLM(tiny_model_dirs["llama"], quantization="int4", kv_cache_memory="4MiB", max_model_len=256)
    fused_out, fused_kv = _run(make(), True, monkeypatch)
    plain_out, plain_kv = _run(make(), False, monkeypatch)
    assert sum(a == b for x, y in zip(fused_out, plain_out) for a, b in zip(x, y)) >= 0.8 * sum(map(len, plain_out))
    if fused_out == plain_out:  # then every K/V written agrees, to int8 activation rounding at most
        assert all((a - b).abs().max() <= 0.02 * b.abs().max() + 1e-6 for a, b in zip(fused_kv, plain_kv))
