"""The Triton kernels (the CUDA backend) against the float64 reference, run on CPU tensors by Triton's interpreter
(TRITON_INTERPRET=1) where there is no GPU: paged decode (GQA, split-K, windows, every full-precision and per-token
quantized store), prefill over a cached prefix, and the quantizing KV write (the same bytes as the torch codec)."""
from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined, so before the import

from kvcache.attention import triton_attention as ta  # noqa: E402
from kvcache.store.quantized_store import make_store  # noqa: E402

from test_paged_attention import reference  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Each new shape compiles the kernels anew on a GPU: the GPU check asks for fewer examples.
EXAMPLES = int(os.environ.get("KVCACHE_KERNEL_EXAMPLES", "40"))
STORES = ["float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"]
COMPUTE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def filled_store(kv: str, compute: torch.dtype, lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                 seed: int):
    """A one-layer store holding K/V for sequences of `lens` tokens in scattered blocks, through the store's own
    write (so quantized blocks hold the codec's bytes); the tables and every sequence's dequantized K/V."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(need) + 2
    perm = list(range(1, num_blocks))
    rng.shuffle(perm)
    store = make_store(1, num_blocks, block_size, kv_heads, head_dim, kv, compute, DEVICE)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    for table, n in zip(tables, lens):
        k = (torch.randn(n, kv_heads, head_dim, generator=g) * 2).to(compute).to(DEVICE)
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(compute).to(DEVICE)
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(n)], device=DEVICE)
        store.write(0, slots, k, v)
    kvs = []
    for table, n in zip(tables, lens):
        k, v = store.gather(0, torch.tensor(table, device=DEVICE))
        kvs.append((k.flatten(0, 1)[:n].float().cpu(), v.flatten(0, 1)[:n].float().cpu()))
    return store, tables, kvs


def tolerance(compute: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}[compute]


def rel_tolerance(compute: torch.dtype) -> float:
    """Half precision rounds the output and the softmax weights by its own ulp: an output near 2 in bfloat16 is a
    step of 0.016 from its neighbours, so an absolute bound alone fails on large outputs (hypothesis found 0.0207)."""
    return {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 2e-3}[compute]


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


SHAPES = st.fixed_dictionaries({
    "block_size": st.sampled_from([4, 16]), "kv_heads": st.sampled_from([1, 2]), "group": st.sampled_from([1, 2, 3]),
    "head_dim": st.sampled_from([16, 24]), "kv": st.sampled_from(STORES), "compute": st.sampled_from(list(COMPUTE)),
    "window": st.sampled_from([None, 5, 21]), "seed": st.integers(0, 10**6),
    "softcap": st.sampled_from([None, None, 1.5]),  # Gemma-2's attn_logit_softcapping
})


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=SHAPES, lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), splits=st.sampled_from([1, 3]))
def test_decode_matches_the_float64_reference(shape, lens, splits):
    compute = COMPUTE[shape["compute"]]
    if shape["kv"] in ("float32",) and compute != torch.float32:
        compute = torch.float32  # a float32 store under half compute is not a configuration the engine makes
    H = shape["kv_heads"] * shape["group"]
    store, tables, kvs = filled_store(shape["kv"], compute, lens, shape["block_size"], shape["kv_heads"],
                                      shape["head_dim"], shape["seed"])
    g = torch.Generator().manual_seed(shape["seed"] + 1)
    q = torch.randn(len(lens), H, shape["head_dim"], generator=g).to(compute).to(DEVICE)
    out = torch.empty_like(q)
    scale = shape["head_dim"] ** -0.5
    ta.paged_decode(out, q, store, 0, padded(tables), torch.tensor(lens, device=DEVICE), scale, shape["window"],
                    num_splits=splits, softcap=shape["softcap"])
    for b, (n, (k, v)) in enumerate(zip(lens, kvs)):
        ref = reference(q[b:b + 1].cpu(), k, v, n - 1, scale, shape["window"], shape["softcap"])[0]
        torch.testing.assert_close(out[b].float().cpu(), ref.float(), atol=tolerance(compute),
                                   rtol=rel_tolerance(compute))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=SHAPES, cached=st.integers(0, 40), n=st.integers(1, 20))
def test_prefill_over_a_cached_prefix_matches_the_float64_reference(shape, cached, n):
    compute = COMPUTE[shape["compute"]]
    if shape["kv"] == "float32":
        compute = torch.float32
    H = shape["kv_heads"] * shape["group"]
    total = cached + n
    store, (table,), ((k, v),) = filled_store(shape["kv"], compute, [total], shape["block_size"], shape["kv_heads"],
                                              shape["head_dim"], shape["seed"])
    g = torch.Generator().manual_seed(shape["seed"] + 2)
    rows = 3  # the chunk sits at rows [3, 3 + n) of the step's batch
    q = torch.randn(rows + n + 2, H, shape["head_dim"], generator=g).to(compute).to(DEVICE)
    out = torch.zeros_like(q)
    scale = shape["head_dim"] ** -0.5
    ta.paged_prefill(out, q, store, 0, torch.tensor(table, device=DEVICE), rows, n, total, scale, shape["window"],
                     shape["softcap"])
    ref = reference(q[rows:rows + n].cpu(), k, v, cached, scale, shape["window"], shape["softcap"])
    torch.testing.assert_close(out[rows:rows + n].float().cpu(), ref.float(), atol=tolerance(compute),
                               rtol=rel_tolerance(compute))
    assert not out[:rows].any() and not out[rows + n:].any()  # no other row written


# Triton's interpreter converts float32 to fp8 wrongly near powers of two (31.9 -> 16 instead of 32, triton 3.9),
# so the fp8 writes are compared on a GPU only; the int8 one everywhere.
@pytest.mark.parametrize("kv", [pytest.param("fp8_e4m3", marks=pytest.mark.cuda),
                                pytest.param("fp8_e5m2", marks=pytest.mark.cuda), "int8"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_quantizing_write_stores_the_codecs_bytes(kv, compute):
    """The fused kernel and the torch codec write the same codes and scales, byte for byte."""
    g = torch.Generator().manual_seed(3)
    T, KVH, D, bs = 37, 2, 24, 16
    k = (torch.randn(T, KVH, D, generator=g) * torch.logspace(-3, 3, T)[:, None, None]).to(compute).to(DEVICE)
    v = torch.randn(T, KVH, D, generator=g).to(compute).to(DEVICE)
    k[5] = 0  # an all-zero token: the scale floor
    slots = torch.randperm(4 * bs, generator=g)[:T].to(DEVICE) + bs  # scattered, none in the null block
    a = make_store(1, 6, bs, KVH, D, kv, compute, DEVICE)
    b = make_store(1, 6, bs, KVH, D, kv, compute, DEVICE)
    a.write(0, slots, k, v)
    ta.write_quantized(b, 0, slots, k, v)
    assert torch.equal(a.raw[0], b.raw[0])


def test_the_kernels_leave_no_partial_result_behind_when_splitting():
    """Split-K parts whose range lies wholly before the window are empty: the reduction must weigh them 0."""
    store, tables, kvs = filled_store("bfloat16", torch.bfloat16, [200], 4, 1, 16, 7)
    q = torch.randn(1, 2, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    out = torch.empty_like(q)
    ta.paged_decode(out, q, store, 0, padded(tables), torch.tensor([200], device=DEVICE), 0.25, 6, num_splits=5)
    ref = reference(q.cpu(), *kvs[0], 199, 0.25, 6)[0]
    torch.testing.assert_close(out[0].float().cpu(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("arch, kv", [("qwen3", "auto"), ("qwen3", "int8"), ("llama", "auto"), ("gemma2", "auto"),
                                      ("deepseek_v3", "auto"), ("deepseek_v3", "int8")])
def test_the_engine_on_the_triton_backend_matches_the_torch_backend(tiny_model_dirs, arch, kv):
    """The whole engine through the Triton kernels (decode, prefill over cached prefixes, the quantizing write):
    teacher-forced logits in chunks and greedy tokens of a mixed batch as on the portable path (float32); qwen3:
    GQA 2:1 with head_dim 32; llama: its queries a strided view of the q/k/v product (the prefill kernel once read
    them as if contiguous: only qwen3's q norm had hidden that); gemma2: soft-capped scores, a window of 24;
    deepseek_v3: MLA's absorbed queries over latents of 48 values (not a power of two), V read as K."""
    from kvcache import LLM, SamplingParams
    path = tiny_model_dirs[arch]
    kw = dict(kv_cache_dtype=kv, kv_cache_memory="2MiB", max_model_len=128, max_num_batched_tokens=24,
              device=DEVICE, dtype="float32")  # auto would be bfloat16 on a GPU
    tri, ref = LLM(path, attention_backend="triton", **kw), LLM(path, attention_backend="torch", **kw)
    assert tri.kv_cache_info()["attention_backend"] == "triton"
    ids = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    # float32 attention in another order differs by ~1e-6; an int8 cache can turn that into one code's step
    atol = 1e-4 if kv == "auto" else 1e-3
    torch.testing.assert_close(tri.engine.score(ids, 0, 16), ref.engine.score(ids, 0, 16), atol=atol, rtol=0)
    prompts = [ids[:n] for n in (5, 40, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in tri.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    tri.engine.check_no_leaks()


@pytest.mark.parametrize("kv", ["fp8_e5m2", "int8"])
def test_half_precision_decode_on_the_tensor_core_path_over_a_long_quantized_context(kv, monkeypatch):
    """float16 compute takes tl.dot in float16 (the interpreter's tests otherwise take the float32 path). One key
    scores 8 above the 1,499 others, whose unnormalised weights (e^-8, 3e-4 each) carry a third of the output:
    times fp8_e5m2's per-token scales (6e-5) they underflow float16, had V's scales been folded into the weights
    instead of V."""
    monkeypatch.setattr(ta, "INTERPRETED", False)  # the interpreter's float16 products are right (bfloat16's are not)
    n, bs, d = 1500, 16, 16
    store = make_store(1, 2 + n // bs, bs, 1, d, kv, torch.float16, DEVICE)
    k = torch.ones(n, 1, d)
    k[700] *= 5
    v = torch.randn(n, 1, d, generator=torch.Generator().manual_seed(6)) * 0.5 + 1  # the others' V do not cancel
    table = list(range(1, 1 + -(-n // bs)))
    store.write(0, torch.arange(bs, bs + n, device=DEVICE), k.half().to(DEVICE), v.half().to(DEVICE))
    kq, vq = store.gather(0, torch.tensor(table, device=DEVICE))
    kq, vq = kq.flatten(0, 1)[:n].float().cpu(), vq.flatten(0, 1)[:n].float().cpu()
    q = torch.full((1, 2, d), 0.5).half().to(DEVICE)
    out = torch.empty_like(q)
    ta.paged_decode(out, q, store, 0, padded([table]), torch.tensor([n], device=DEVICE), 0.25, None, num_splits=2)
    ref = reference(q.cpu(), kq, vq, n - 1, 0.25, None)[0]
    torch.testing.assert_close(out[0].float().cpu(), ref.float(), atol=tolerance(torch.float16),
                               rtol=rel_tolerance(torch.float16))


def test_decode_reads_only_each_sequences_own_blocks_of_a_wide_table():
    """A CUDA graph's table is as wide as a max_model_len sequence, its unused entries left from earlier steps: each
    sequence's blocks split among the split-K programs by its own length give the tight table's result."""
    lens = [3, 70, 33]
    store, tables, kvs = filled_store("bfloat16", torch.bfloat16, lens, 4, 2, 16, 11)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    tight = torch.empty_like(q)
    ta.paged_decode(tight, q, store, 0, padded(tables), torch.tensor(lens, device=DEVICE), 0.25, None, num_splits=1)
    junk = [t + [b % 5 + 1 for b in range(64 - len(t))] for t in tables]  # stale ids past each table's end
    for splits in (1, 4, 7):
        wide = torch.empty_like(q)
        ta.paged_decode(wide, q, store, 0, torch.tensor(junk, device=DEVICE), torch.tensor(lens, device=DEVICE), 0.25,
                        None, num_splits=splits)
        torch.testing.assert_close(wide.float(), tight.float(), atol=2e-2, rtol=1e-2)
        for b, (n, (k, v)) in enumerate(zip(lens, kvs)):
            ref = reference(q[b:b + 1].cpu(), k, v, n - 1, 0.25, None)[0]
            torch.testing.assert_close(wide[b].float().cpu(), ref.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_decode_graphs_over_the_triton_kernels_give_the_eager_tokens(tiny_model_dirs, kv):
    """The engine's decode steps through the CUDA graphs' static buffers (emulated here: Replay.EMULATE; captured for
    real by the GPU check) over the Triton kernels: tables max_model_len wide, steps padded to the ladder's sizes,
    the quantizing write into the null block for padding rows; the eager engine's greedy tokens."""
    from kvcache import LLM, SamplingParams
    from kvcache.engine.cuda_graphs import Replay
    path = tiny_model_dirs["qwen3"]
    kw = dict(kv_cache_dtype=kv, kv_cache_memory="2MiB", max_model_len=128, max_num_batched_tokens=24,
              max_num_seqs=3, device=DEVICE, attention_backend="triton")
    llm, eager = LLM(path, **kw), LLM(path, **kw)
    e = llm.engine
    e.runner.graphs = e.graphs.capture(e.store, e.capacity.num_blocks + 1, Replay.EMULATE)
    ids = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    prompts = [ids[:n] for n in (5, 40, 23)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 6, 3)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert e.runner.graphs.replays >= 5  # the steps after the prompts are in
    e.check_no_leaks()
