"""The fused CPU decode path (cpu_kernels.attn_in / mlp, K/V stored by attn_in and the decode kernel called
directly) computes what the layer-by-op path computes: the same greedy tokens and the same KV cache contents for
float32 and int8 weights, and close logits for int4 (whose int8 activations can round a last-ulp difference into a
different code)."""
from __future__ import annotations

import pytest
import torch

import kvcache.models.decoder_layer as decoder_layer
import kvcache.models.llama as llama
from kvcache import LLM, SamplingParams


def _run(llm: LLM, fused: bool, monkeypatch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs and the KV store after them, from a fresh engine (the same blocks in both runs)."""
    monkeypatch.setattr(decoder_layer, "FUSED_MAX_ROWS", 32 if fused else 0)
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
    llm.engine.runner.model.decode_stack = None  # the layers' own fused calls (the native loop: tested below)
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


@pytest.mark.parametrize("arch, quant, kv", [("qwen2", "none", "auto"), ("llama", "int8", "auto"),
                                             ("mistral-swa", "none", "auto"), ("llama", "none", "float16"),
                                             ("qwen2", "int8", "bfloat16")])
def test_native_decode_loop_is_the_python_loop(tiny_model_dirs, arch, quant, kv, monkeypatch):
    """Decode-only steps run every layer in one native call (cpu_kernels.decode_layers) where the model is plain
    fused layers on a float32, float16 or bfloat16 cache: the same greedy tokens, and the same cache to the bit, as
    the layers' own fused forward (which also stores through attn_in: its conversion is checked against torch's in
    the next test); biases (qwen2), int8 weights and a sliding window (mistral-swa) included."""
    def make():
        return LLM(tiny_model_dirs[arch], quantization=quant, kv_cache_memory="4MiB", max_model_len=256,
                   kv_cache_dtype=kv)
    llm = make()
    model = llm.engine.runner.model
    assert model.decode_stack is not None
    calls = []
    real = model.layers[0].kernels
    class Spy:
        def __getattr__(self, name):
            if name == "decode_layers":
                return lambda *a: (calls.append(a[0].shape[0]), real.decode_layers(*a))[1]
            return getattr(real, name)
    monkeypatch.setattr(model.layers[0], "kernels", Spy())
    native_out, native_kv = _run(llm, True, monkeypatch)
    assert calls and set(calls) <= {1, 2, 3}  # decode steps of up to 3 rows; prefill steps stay in Python
    llm.engine.check_no_leaks()
    monkeypatch.setattr(llama, "NATIVE_DECODE", False)
    plain = make()
    assert plain.engine.runner.model.decode_stack is None
    plain_out, plain_kv = _run(plain, True, monkeypatch)
    assert native_out == plain_out
    assert all(torch.equal(a, b) for a, b in zip(native_kv, plain_kv))


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_attn_in_stores_a_half_cache_as_the_store_converts(tiny_model_dirs, kv, monkeypatch):
    """attn_in writing a float16/bfloat16 cache stores each K/V value as KVStore.write's `x.to(dtype)` does: every
    call's slots hold, bit for bit, the float32 values it stores into a float32 cache, converted by torch."""
    monkeypatch.setattr(llama, "NATIVE_DECODE", False)  # decode steps through the layers' fused calls (Python)
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="4MiB", max_model_len=256, kv_cache_dtype=kv)
    layer = llm.engine.runner.model.layers[0]
    real, checked = layer.kernels, []

    def rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return cache.flatten(0, 1).index_select(0, slots)

    def attn_in(*a):
        k_cache, v_cache, slots = a[-3:]
        if slots is None:
            return real.attn_in(*a)
        kf, vf = torch.zeros(k_cache.shape), torch.zeros(v_cache.shape)
        real.attn_in(a[0].clone(), *a[1:-3], kf, vf, slots)  # attn_in adds x into the residual in place
        out = real.attn_in(*a)
        for half, wide in ((k_cache, kf), (v_cache, vf)):
            assert half.dtype == getattr(torch, kv) and torch.equal(rows(half, slots), rows(wide, slots).to(half.dtype))
        checked.append(slots.numel())
        return out

    class Spy:
        def __getattr__(self, name):
            return attn_in if name == "attn_in" else getattr(real, name)
    monkeypatch.setattr(layer, "kernels", Spy())
    _run(llm, True, monkeypatch)
    assert checked, "attn_in never stored K/V"


def test_decode_layers_refuses_what_does_not_add_up(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="4MiB", max_model_len=256)
    model = llm.engine.runner.model
    weights, counts, windows = model.decode_stack
    k = model.layers[0].kernels
    x = torch.zeros(1, model.config.hidden_size)
    cos = sin = torch.zeros(1, 1, model.layers[0].head_dim)
    store = llm.engine.store
    args = dict(eps=1e-5, heads=model.layers[0].num_heads, kv_heads=model.layers[0].num_kv_heads,
                head_dim=model.layers[0].head_dim, inter=model.layers[0].gate_up.out_features // 2)
    for w, c, caches, match in ((weights[:-1], counts, store.k + store.v, "make .* weights, not"),
                                (weights + weights[:1], counts, store.k + store.v, "make .* weights, not"),
                                (weights, [0] + counts[1:], store.k + store.v, "a linear layer of 0 tensors"),
                                (weights, counts[:-1], store.k + store.v, "4 counts and 2 caches"),
                                (weights, counts, store.k, "4 counts and 2 caches")):
        with pytest.raises(RuntimeError, match=match):
            k.decode_layers(x.clone(), w, c, caches, windows, args["eps"], args["heads"], args["kv_heads"],
                            args["head_dim"], args["inter"], cos, sin, torch.zeros(1, dtype=torch.long),
                            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                            torch.empty(0, dtype=torch.long), 0.125, 128)  # refused before a kernel runs
