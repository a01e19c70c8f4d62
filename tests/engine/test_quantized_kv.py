"""Quantized KV storage in the engine: every format runs the mixed-length workload batched, with chunked
prefill, with preemption and with prefix caching, gives the same greedy tokens as one request at a
time (a token sees the same stored K/V however its request is scheduled), and leaks nothing.

Under bfloat16 and float16 compute, "the same" cannot be exact: attention kernels round differently for other
query and context lengths, so a step whose top two logits tie (bf16 ties outright on these tiny models) may go
either way. There a run must equal one-at-a-time up to its first difference, and that difference must fall on a
step whose top-2 margin (in the one-at-a-time run) is within 4 x eps(dtype): two units in the last place of the
tiny models' logits, which stay below 2.

Under float32 compute the KIVI formats (int4, int2) get the same rule with a margin of 1e-3: a preempted request's
recompute runs its keys through a 48-row GEMM where one at a time ran a 1-row one, and BLAS libraries (MKL on Intel
CPUs) round those differently in the last bit; a key that lands on a 4-bit (2-bit) rounding edge then moves to the
next step of the grid, which moves the tiny models' logits by ~1e-4 (seen: a top-2 margin of 1.3e-4 on an Intel
Xeon). The per-token formats keep exact equality in float32."""
from __future__ import annotations

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.config import EngineConfig
from kvcache.plan.kv_bytes import kv_bytes_per_token, residual_bytes_per_seq

from engine.test_greedy_parity import _workload

DTYPES = ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"]
# (arch, KV format, compute dtype). Every format on llama (GQA, head_dim 16) in float32; one per-token and one KIVI
# format on a sliding window of 24 and on head_dim 32; and the formats under bfloat16 and float16 compute.
CASES = ([("llama", d, "float32") for d in DTYPES] + [(a, d, "float32") for a in ("mistral-swa", "qwen3")
                                                       for d in ("int8", "int4")]
         + [("llama", d, "bfloat16") for d in ("bfloat16", "fp8_e4m3", "int8", "int4")]
         + [("llama", "float16", "float16"), ("qwen3", "int8", "float16"), ("mistral-swa", "int4", "bfloat16")]
         # MLA latents quantized per token (one scale for the latent and its RoPE key): V2's and V3's layers
         + [("deepseek_v2", "int8", "float32"), ("deepseek_v3", "fp8_e4m3", "float32"),
            ("deepseek_v3", "bfloat16", "bfloat16")])


def _greedy(max_tokens, logprobs=None):
    return [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, logprobs=logprobs) for n in max_tokens]


def _run(llm, prompts, max_tokens, logprobs=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens, logprobs), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == max_tokens
    eng = llm.engine
    eng.check_no_leaks()
    assert eng.kv.num_free_blocks == eng.kv.pool.num_usable and not eng.kv.private_blocks
    return [o.outputs[0] for o in outs] if logprobs else [o.outputs[0].token_ids for o in outs]


class Expected:
    """One-at-a-time greedy tokens, and in half precision each step's top-2 margin (see the module docstring)."""

    def __init__(self, llm, prompts, max_tokens, compute: str, kv_dtype: str) -> None:
        half = compute != "float32"
        near = half or kv_dtype in ("int4", "int2")  # differences allowed at near-ties (module docstring)
        outs = [_run(llm, [p], [n], logprobs=2 if near else None)[0] for p, n in zip(prompts, max_tokens)]
        self.tokens = [o.token_ids for o in outs] if near else outs
        self.margins = [[m[0] - m[1] for m in (sorted(d.values(), reverse=True) for d in o.logprobs)]
                        for o in outs] if near else None
        self.tol = 4 * torch.finfo(getattr(torch, compute)).eps if half else 1e-3 if near else 0.0

    def check(self, got: list[list[int]], subset: list[int] | None = None) -> None:
        for i, tokens in zip(subset or range(len(self.tokens)), got):
            want = self.tokens[i]
            if self.margins is None or tokens == want:
                assert tokens == want, i
                continue
            first = next(j for j, (a, b) in enumerate(zip(tokens, want)) if a != b)
            assert self.margins[i][first] <= self.tol, (i, first, self.margins[i][first])


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}" + ("" if p[2] == "float32" else f"-{p[2]}"))
def case(request, tiny_model_dirs):
    arch, dtype, compute = request.param
    path = tiny_model_dirs[arch]
    prompts, max_tokens = _workload(seed=1)
    alone = LLM(path, dtype=compute, kv_cache_dtype=dtype, kv_cache_memory="8MiB", enable_prefix_caching=False)
    return path, dict(dtype=compute, kv_cache_dtype=dtype), prompts, max_tokens, Expected(alone, prompts, max_tokens,
                                                                                       compute, dtype)


def test_batched_and_chunked_equal_one_at_a_time(case):
    path, fmt, prompts, max_tokens, expected = case
    llm = LLM(path, **fmt, kv_cache_memory="8MiB", max_num_batched_tokens=32)
    expected.check(_run(llm, prompts, max_tokens))


def test_preemption_equals_one_at_a_time(case):
    path, fmt, prompts, max_tokens, expected = case
    if fmt["kv_cache_dtype"] in ("int4", "int2"):
        _kivi_preemption(path, fmt)
        return
    bs = 8  # small blocks: a small pool admits more, so growth preempts
    probe = LLM(path, **fmt, kv_cache_memory="1MiB", block_size=bs, max_num_batched_tokens=48)
    info = probe.kv_cache_info()
    # what a request holds at once (a sliding window's blocks are given back: its window behind a chunk)
    largest = max(probe.engine.peak_blocks(len(p) + n) for p, n in zip(prompts, max_tokens)) + info["seq_blocks"]
    num_blocks = largest * 3 // 2
    llm = LLM(path, **fmt, kv_cache_memory=num_blocks * bs * info["bytes_per_token"],
              max_num_batched_tokens=48, block_size=bs)
    assert llm.kv_cache_info()["num_blocks"] == num_blocks
    expected.check(_run(llm, prompts, max_tokens))
    assert llm.kv_cache_info()["num_preemptions"] > 0


def _kivi_preemption(path, fmt):
    """Short prompts that grow by 4 blocks of 64 each, in a 10-block pool: two are admitted (1 block + 2 private
    each), their growth cannot fit, so one is preempted and recomputed, residual included."""
    prompts = [list(range(3 + i, 13 + 2 * i)) for i in range(4)]
    max_tokens = [250] * 4
    alone = LLM(path, **fmt, kv_cache_memory="8MiB")
    expected = Expected(alone, prompts, max_tokens, fmt["dtype"], fmt["kv_cache_dtype"])
    per_block = 64 * alone.kv_cache_info()["bytes_per_token"]
    llm = LLM(path, **fmt, kv_cache_memory=10 * per_block, max_num_batched_tokens=48)
    assert llm.kv_cache_info()["num_blocks"] == 10
    expected.check(_run(llm, prompts, max_tokens))
    # A sliding window of 24 gives back each 64-token block soon after the next one starts: a sequence holds 2 +
    # 2 private blocks at most, so admission's reserve covers every growth (5 to 10 blocks: no preemption at all)
    assert llm.kv_cache_info()["num_preemptions"] > 0 or alone.engine.release_window


def test_prefix_cache_shares_quantized_blocks(case):
    path, fmt, prompts, max_tokens, expected = case
    llm = LLM(path, **fmt, kv_cache_memory="8MiB")
    long = [i for i, p in enumerate(prompts) if len(p) > llm.kv_cache_info()["block_size"]]
    assert long
    first = _run(llm, [prompts[i] for i in long], [max_tokens[i] for i in long])
    again = _run(llm, [prompts[i] for i in long], [max_tokens[i] for i in long])
    expected.check(first, long)
    expected.check(again, long)
    info = llm.kv_cache_info()
    assert info["prefix_cache_hits"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_is_sized_by_the_planners_bytes(tiny_llama, dtype):
    llm = LLM(tiny_llama, kv_cache_dtype=dtype, kv_cache_memory="4MiB")
    eng, info = llm.engine, llm.kv_cache_info()
    assert info["dtype"] == dtype and info["bytes_per_token"] == kv_bytes_per_token(eng.shape, dtype)
    # the store's tensors are exactly the blocks the budget bought plus the null block
    assert eng.store.nbytes == (info["num_blocks"] + 1) * info["block_size"] * info["bytes_per_token"]
    assert info["total_bytes"] <= 4 * 2**20
    resid = residual_bytes_per_seq(eng.shape, dtype)
    assert info["seq_blocks"] == -(-resid // (info["block_size"] * info["bytes_per_token"]))
    assert (resid > 0) == (dtype in ("int4", "int2"))


def test_fork_copies_the_residual(tiny_llama):
    """n > 1 samples fork after the prompt: each child gets its own residual copy and the same greedy tokens."""
    llm = LLM(tiny_llama, kv_cache_dtype="int4", kv_cache_memory="4MiB")
    prompt = list(range(3, 103))  # 100 tokens: a complete group and 36 tokens in the residual
    one = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=3, temperature=0, max_tokens=30,
                                                                        ignore_eos=True), use_tqdm=False)[0].outputs
    assert [o.token_ids for o in outs] == [one] * 3
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_dtype="int3"), "supported: auto, float32"),
    (dict(kv_cache_dtype="int4", block_size=16), "multiple of 64"),
    (dict(kv_cache_dtype="fp4"), "int4, int2"),
])
def test_bad_formats_fail_before_anything_is_allocated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_aliases_and_default_block_sizes():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert EngineConfig(kv_cache_dtype="fp16").kv_cache_dtype == "float16"
    assert EngineConfig(kv_cache_dtype="int4").block_size == 64
    assert EngineConfig(kv_cache_dtype="int8").block_size == 16
    assert EngineConfig(kv_cache_dtype="int2", block_size=128).block_size == 128


def test_score_is_the_same_chunked_or_not(tiny_llama):
    llm = LLM(tiny_llama, kv_cache_dtype="int4", kv_cache_memory="4MiB")
    ids = torch.randint(3, 320, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = llm.engine.score(ids, 0, 300)
    parts = llm.engine.score(ids, 100, 37)
    assert whole.shape == (300, 320) and parts.shape == (200, 320)
    torch.testing.assert_close(whole[100:], parts, atol=1e-5, rtol=1e-5)
    llm.engine.check_no_leaks()
    with pytest.raises(ValueError, match="start"):
        llm.engine.score(ids, 300)
