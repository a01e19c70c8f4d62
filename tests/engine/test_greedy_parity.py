"""Greedy outputs equal transformers' `generate`, alone, batched, with chunked prefill and after preemption.

The oracle runs one prompt at a time (no padding) with EOS disabled, so that it and the
engine (ignore_eos) both produce exactly max_tokens tokens.
"""
from __future__ import annotations

import random

import pytest

from tiny_models import hf_greedy, hf_model
from kvcache import LLM, SamplingParams

# mistral-swa: window of 24; gemmas: local + global; deepseeks: MLA latents (absorbed for decode and cached
# prefixes), MoE
ARCHS = ["llama", "mistral-swa", "qwen3", "gemma2", "gemma3", "deepseek_v2", "deepseek_v3"]
BLOCK_SIZE = 16
SMALL_BLOCK = 8  # finer blocks let a small pool admit more, so growth must preempt
NUM_REQUESTS = 16


def _workload(seed: int) -> tuple[list[list[int]], list[int]]:
    """16 prompts of 3..120 tokens (several far longer than the sliding window) and 1..64 output tokens."""
    rng = random.Random(seed)
    # Short prompts with long outputs grow after admission: with a small pool they must preempt.
    lengths = [3, 5, 9, 4, 120, 25, 64] + [rng.randint(3, 120) for _ in range(NUM_REQUESTS - 7)]
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]
    max_tokens = [64, 64, 60, 56, 1, 33, 17] + [rng.randint(1, 40) for _ in range(NUM_REQUESTS - 7)]
    return prompts, max_tokens


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_model_dirs):
    """(arch, model dir, prompts, max_tokens, transformers' greedy tokens for each prompt)."""
    arch = request.param
    path = tiny_model_dirs[arch]
    prompts, max_tokens = _workload(seed=0)  # same lengths, so the same schedule, for every arch
    model = hf_model(path)
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    return arch, path, prompts, max_tokens, expected


def _params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in max_tokens]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(max_tokens), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for o, n in zip(outs, max_tokens):
        assert o.finished and len(o.outputs) == 1
        assert o.outputs[0].finish_reason == "length"
        assert len(o.outputs[0].token_ids) == n
    _assert_all_blocks_back(llm)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_back(llm: LLM) -> None:
    engine = llm.engine
    engine.check_no_leaks()
    pool = engine.kv.pool
    assert pool.num_free == pool.num_usable
    assert engine.kv.block_tables == {}
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running


def _spy_schedule(llm: LLM) -> list[list[tuple[int, int, int]]]:
    """Record every step's chunks as (tokens cached before, tokens of the sequence, tokens this step)."""
    sched = llm.engine.scheduler
    steps: list[list[tuple[int, int, int]]] = []
    original = sched.schedule

    def schedule():
        out = original()
        steps.append([(s.num_computed_tokens, s.num_tokens, n) for s, n in out.chunks])
        return out

    sched.schedule = schedule
    return steps


def _diff(got: list[list[int]], expected: list[list[int]]) -> list[int]:
    return [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]


def test_one_request(case):
    arch, path, prompts, max_tokens, expected = case
    llm = LLM(path, kv_cache_memory="8MiB", block_size=BLOCK_SIZE)
    # A 3-token prompt decoding 64 tokens (well past the sliding window), then a 64-token prompt.
    for i in (0, 6):
        assert _run(llm, [prompts[i]], [max_tokens[i]]) == [expected[i]]


def test_sixteen_requests_together(case):
    arch, path, prompts, max_tokens, expected = case
    llm = LLM(path, kv_cache_memory="8MiB", block_size=BLOCK_SIZE)
    steps = _spy_schedule(llm)
    got = _run(llm, prompts, max_tokens)
    assert _diff(got, expected) == []
    assert max(len(s) for s in steps) == NUM_REQUESTS  # they really ran in one batch
    assert llm.kv_cache_info()["num_preemptions"] == 0


def test_chunked_prefill_mixed_with_decodes(case):
    arch, path, prompts, max_tokens, expected = case
    llm = LLM(path, kv_cache_memory="8MiB", block_size=BLOCK_SIZE, max_num_batched_tokens=32)
    steps = _spy_schedule(llm)
    got = _run(llm, prompts, max_tokens)
    assert _diff(got, expected) == []
    assert all(sum(n for *_, n in s) <= 32 for s in steps)
    # Some step continued a prompt from the middle (a chunk after the first) while others decoded.
    mixed = [s for s in steps
             if any(done > 0 and n > 1 for done, _, n in s) and any(done > 0 and n == 1 for done, _, n in s)]
    assert mixed, "no step mixed a later prefill chunk with decodes"


def _small_pool_llm(path: str, prompts: list[list[int]], max_tokens: list[int], **kwargs) -> LLM:
    """An engine whose pool holds about 1.5 of the workload's largest requests (8-token blocks, counted as the
    engine counts them: every layer group's table); where the engine gives back out-of-window blocks (mistral-swa,
    and the sliding groups of gemma2/gemma3), one more block than the largest request."""
    probe = LLM(path, kv_cache_memory="1MiB", block_size=SMALL_BLOCK, **kwargs)
    per_token = probe.kv_cache_info()["bytes_per_token"]  # of the layers one block holds
    largest = max(probe.engine.peak_blocks(len(p) + n) for p, n in zip(prompts, max_tokens))
    num_blocks = largest * 3 // 2
    if probe.engine.release_window or probe.engine.layer_groups:
        num_blocks = largest + 1
    llm = LLM(path, kv_cache_memory=num_blocks * SMALL_BLOCK * per_token, block_size=SMALL_BLOCK, **kwargs)
    assert llm.kv_cache_info()["num_blocks"] == num_blocks
    return llm


def test_preemption(case):
    arch, path, prompts, max_tokens, expected = case
    llm = _small_pool_llm(path, prompts, max_tokens)
    got = _run(llm, prompts, max_tokens)
    assert _diff(got, expected) == []
    # Where out-of-window blocks are given back, a pool that admits the largest request whole (its unchunked
    # recompute needs it) leaves room for everyone's window: the chunked variant below preempts those
    assert llm.kv_cache_info()["num_preemptions"] > 0 or llm.engine.release_window or llm.engine.layer_groups


def test_preemption_with_chunked_prefill(case):
    arch, path, prompts, max_tokens, expected = case
    llm = _small_pool_llm(path, prompts, max_tokens, max_num_batched_tokens=32)
    got = _run(llm, prompts, max_tokens)
    assert _diff(got, expected) == []
    assert llm.kv_cache_info()["num_preemptions"] > 0


def test_same_engine_reused_gives_same_tokens(case):
    """A second run on an engine whose blocks were all used before (stale K/V in them) changes nothing."""
    arch, path, prompts, max_tokens, expected = case
    llm = LLM(path, kv_cache_memory="8MiB", block_size=BLOCK_SIZE, max_num_batched_tokens=48)
    assert _diff(_run(llm, prompts[::-1], max_tokens[::-1]), expected[::-1]) == []
    assert _diff(_run(llm, prompts, max_tokens), expected) == []


@pytest.mark.parametrize("kv", ["float32", "int8", "fp8"])
def test_soft_capped_attention_is_the_same_on_the_cpu_kernel_and_the_portable_path(tiny_model_dirs, kv):
    """Gemma-2's scores are soft-capped in the C++ decode kernel as on the portable path, over a quantized cache
    too: the same greedy tokens; in float32 transformers' own (the Triton kernels: test_triton_attention.py)."""
    path = tiny_model_dirs["gemma2"]
    prompts, max_tokens = _workload(seed=3)
    prompts, max_tokens = prompts[:6], max_tokens[:6]
    runs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(path, kv_cache_memory="8MiB", block_size=BLOCK_SIZE, kv_cache_dtype=kv, attention_backend=backend)
        assert llm.engine.backend == backend
        runs[backend] = _run(llm, prompts, max_tokens)
    assert runs["cpu"] == runs["torch"]
    if kv == "float32":
        model = hf_model(path)
        assert runs["cpu"] == [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]
    assert LLM(path, kv_cache_memory="8MiB").engine.backend == "cpu"  # auto: the kernel, soft cap and all
