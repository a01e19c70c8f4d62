"""Prefix caching in the engine: greedy tokens equal transformers' with caching off, hash and radix,
for shared prefixes, partial-block overlaps, fully cached prompts, n > 1, preemption and aborts;
random interleavings keep every block accounted for; cache_salt isolates tenants; lpm batches sharers."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_models import hf_greedy, hf_model
from kvcache import LLM, SamplingParams
from kvcache.plan.kv_bytes import kv_bytes_per_token
from kvcache.plan.model_source import load_model_shape

MODES = ["off", "hash", "radix"]
ARCHS = ["llama", "mistral-swa", "qwen3", "deepseek_v3"]  # mistral-swa: cached blocks under a 24-token sliding
# window; deepseek_v3: cached latents, hits attended in the absorbed form


def _mode(mode: str) -> dict:
    return {"enable_prefix_caching": False} if mode == "off" else {"prefix_caching_algo": mode}


def _workload() -> tuple[list[list[int]], list[int]]:
    """Three groups sharing 37-, 48- and 20-token prefixes (partial, whole and one-block-plus), a prompt that is
    exactly a cached prefix, one that diverges inside a shared block, and unrelated prompts."""
    rng = random.Random(7)
    words = lambda n: [rng.randrange(3, 320) for _ in range(n)]  # noqa: E731
    p37, p48, p20 = words(37), words(48), words(20)
    prompts = [p37 + words(5), p48 + words(12), p20 + words(30), words(9)]  # wave 1: computes the prefixes
    prompts += [p37 + words(1), p37 + words(19), p48, p48 + words(3), p48[:40] + words(10),
                p20 + words(2), p20[:16] + words(1), words(50), p37 + words(28)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    return prompts, max_tokens


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_model_dirs):
    path = tiny_model_dirs[request.param]
    prompts, max_tokens = _workload()
    model = hf_model(path)
    return path, prompts, max_tokens, [hf_greedy(model, p, n) for p, n in zip(prompts, max_tokens)]


def _params(max_tokens: list[int], n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m, n=n) for m in max_tokens]


def _generate(llm: LLM, prompts, max_tokens, n: int = 1) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(max_tokens, n), use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_waves_of_shared_prefixes_match_transformers(case, mode):
    path, prompts, max_tokens, expected = case
    llm = LLM(path, kv_cache_memory="4MiB", max_num_batched_tokens=64, **_mode(mode))
    first = _generate(llm, prompts[:4], max_tokens[:4])
    rest = _generate(llm, prompts[4:], max_tokens[4:])
    assert [o[0] for o in first + rest] == expected
    info = llm.kv_cache_info()
    if mode == "off":
        assert info["prefix_cache_hits"] == 0 and info["cached_blocks"] == 0
    else:
        # wave 2 finds 2 blocks of p37 (x3), 2 of p48 (it is the whole prompt: its last token is recomputed),
        # 3 of p48 (x1), 2 of p48[:40], 1 of p20 (x2): at least these tokens
        assert info["prefix_cache_hits"] >= 16 * (2 * 3 + 2 + 3 + 2 + 1 + 1)
        assert info["cached_blocks"] > 0
    assert llm.engine.stats.prefill_tokens_computed == sum(map(len, prompts)) - info["prefix_cache_hits"]
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_one_wave_with_preemption_and_n_samples(case, mode):
    """All at once in a pool too small for them: requests hit blocks computed a few steps earlier,
    preempted ones find their own blocks again, and n = 2 samples fork from shared blocks."""
    path, prompts, max_tokens, expected = case
    per_token = kv_bytes_per_token(load_model_shape(path), "float32")
    llm = LLM(path, kv_cache_memory=24 * 8 * per_token, block_size=8, max_num_batched_tokens=32, **_mode(mode))
    if llm.engine.release_window:  # out-of-window blocks given back: a sequence holds 8 blocks at most here
        llm = LLM(path, kv_cache_memory=10 * 8 * per_token, block_size=8, max_num_batched_tokens=32, **_mode(mode))
    outs = _generate(llm, prompts, max_tokens, n=2)
    assert [o[0] for o in outs] == expected and [o[1] for o in outs] == expected
    assert llm.kv_cache_info()["num_preemptions"] > 0
    assert llm.kv_cache_info()["prefix_cache_hits"] > 0
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("mode", MODES)
def test_aborts_in_the_middle_leave_the_others_exact(case, mode):
    path, prompts, max_tokens, expected = case
    llm = LLM(path, kv_cache_memory="4MiB", max_num_batched_tokens=48, **_mode(mode))
    _generate(llm, prompts[:4], max_tokens[:4])  # prime the cache
    eng = llm.engine
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(str(i), p, _params([m + 10])[0])
    done = {}
    for step in range(10_000):
        if step == 3:
            assert eng.abort_request("1") and eng.abort_request("6")  # one decoding, one mid-prefill or waiting
        if not eng.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for i, want in enumerate(expected):
        if str(i) not in ("1", "6"):
            assert done[str(i)].outputs[0].token_ids[:len(want)] == want
    eng.check_no_leaks()


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_cache_salt_isolates_tenants(tiny_llama, mode):
    llm = LLM(tiny_llama, kv_cache_memory="2MiB", **_mode(mode))
    prompt = {"prompt_token_ids": list(range(10, 74))}  # 4 blocks
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    base = llm.generate([dict(prompt, cache_salt="tenant-a")], params, use_tqdm=False)[0].outputs[0].token_ids
    info = llm.kv_cache_info
    assert info()["prefix_cache_hits"] == 0
    for salt in ("tenant-b", None):
        out = llm.generate([dict(prompt, cache_salt=salt)] if salt else [prompt], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == base
        assert info()["prefix_cache_hits"] == 0, f"salt {salt!r} found tenant-a's blocks"
    llm.generate([dict(prompt, cache_salt="tenant-a")], params, use_tqdm=False)
    assert info()["prefix_cache_hits"] == 48  # 3 blocks: the 4th holds the last prompt token
    assert info()["prefix_cache_queries"] == 4 * 64


@pytest.mark.parametrize("salt, message", [(42, "int"), ("", "length 0"), ("x" * 257, "length 257")])
def test_bad_cache_salt_is_refused_at_submission(tiny_llama, salt, message):
    eng = LLM(tiny_llama, kv_cache_memory="1MiB").engine
    with pytest.raises(ValueError, match=f"cache_salt must be a non-empty string.*{message}"):
        eng.add_request("r", [5, 6, 7], SamplingParams(max_tokens=1), cache_salt=salt)
    assert not eng.requests and not eng.scheduler.waiting
    eng.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=1), cache_salt="x" * 256)


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_reset_prefix_cache(tiny_llama, mode):
    llm = LLM(tiny_llama, kv_cache_memory="2MiB", **_mode(mode))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(10, 60))}], params, use_tqdm=False)
    assert llm.kv_cache_info()["cached_blocks"] == 3
    llm.engine.add_request("busy", [5, 6, 7], params)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.reset_prefix_cache()
    assert llm.kv_cache_info()["cached_blocks"] == 3
    llm.engine.abort_request("busy")
    assert llm.reset_prefix_cache() == 3
    assert llm.kv_cache_info()["cached_blocks"] == 0
    llm.generate([{"prompt_token_ids": list(range(10, 60))}], params, use_tqdm=False)
    assert llm.kv_cache_info()["prefix_cache_hits"] == 0


def test_lpm_holds_back_a_prompt_whose_prefix_is_being_computed(tiny_llama):
    """All requests at once, group by group: FCFS computes a group's prefix once per request admitted in the
    first step; lpm admits one per group, the others share its blocks a step later."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 320) for _ in range(64)] for _ in range(2)]
    prompts = [p + [rng.randrange(3, 320) for _ in range(4)] for p in prefixes for _ in range(4)]
    computed = {}
    for policy in ("fcfs", "lpm"):
        llm = LLM(tiny_llama, kv_cache_memory="4MiB", max_num_batched_tokens=512, scheduling_policy=policy)
        outs = _generate(llm, prompts, [3] * len(prompts))
        computed[policy] = ((llm.engine.stats.prefill_tokens_computed, llm.kv_cache_info()["prefix_cache_hits"]),
                            outs)
    assert computed["lpm"][1] == computed["fcfs"][1]
    assert computed["fcfs"][0] == (8 * 68, 0)  # everything admitted in the first step: no sharing
    assert computed["lpm"][0] == (2 * 68 + 6 * 4, 6 * 64)  # one prefix per group, the rest only their suffixes


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_repeating_a_request_larger_than_half_the_pool(tiny_llama, mode):
    """The repeat's blocks duplicate cached ones; they must be merged, not pinned beside them, or a request
    needing most of the pool could never fit again."""
    per_token = kv_bytes_per_token(load_model_shape(tiny_llama), "float32")
    llm = LLM(tiny_llama, kv_cache_memory=40 * 16 * per_token, **_mode(mode))
    prompt = {"prompt_token_ids": list(range(20, 120))}
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # 500 tokens: 32 of the 40 blocks
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == first
    llm.engine.check_no_leaks()


# ---- block accounting under random interleavings --------------------------------------------------

_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 40), st.integers(1, 12), st.integers(1, 2)),
    st.tuples(st.just("add"), st.integers(0, 1), st.just(40), st.integers(1, 4), st.just(1)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=6, max_size=40)


def _check_blocks(eng) -> None:
    """Every reference has a holder, no free block is referenced, and the pool adds up."""
    kv, pool = eng.kv, eng.kv.pool
    holders = [0] * pool.num_blocks
    for table in kv.block_tables.values():
        for b in table:
            holders[b] += 1
    if kv.radix:
        for node in kv.radix._nodes():
            for b in node.blocks:
                holders[b] += 1
    assert holders == pool.ref_counts
    free = set(pool._free)
    assert all(pool.ref_counts[b] == 0 for b in free)
    assert len(free) + sum(1 for r in pool.ref_counts if r) == pool.num_usable
    assert pool.ref_counts[0] == 0 and 0 not in free


@pytest.mark.parametrize("mode, policy", [("hash", "fcfs"), ("radix", "fcfs"), ("hash", "lpm"), ("radix", "lpm")])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops)
def test_random_interleavings_keep_blocks_accounted(tiny_llama, mode, policy, ops):
    llm = _small_engine(tiny_llama, mode, policy)
    eng = llm.engine
    prefixes = [list(range(20 + 40 * g, 60 + 40 * g)) for g in range(4)]  # 40 tokens each
    ids = []
    for op in ops:
        if op[0] == "add":
            _, g, cut, suffix, n = op
            rid = str(len(ids))
            prompt = prefixes[g][:max(1, cut)] + [300 + (len(ids) + k) % 19 for k in range(suffix)]
            eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1 + 5 * suffix % 37, n=n,
                                                        ignore_eos=True))
            ids.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                eng.step()
                _check_blocks(eng)
        elif ids:
            eng.abort_request(ids[op[1] % len(ids)])
        _check_blocks(eng)
    while eng.has_unfinished_requests():
        eng.step()
        _check_blocks(eng)
    eng.check_no_leaks()
    eng.reset_prefix_cache()
    assert eng.kv.pool.num_free == eng.kv.pool.num_usable and sum(eng.kv.pool.ref_counts) == 0


_SMALL = {}


def _small_engine(path: str, mode: str, policy: str) -> LLM:
    """One engine per mode and policy for all examples (loading is the slow part); 12 blocks of 8 tokens force
    preemption."""
    if (mode, policy) not in _SMALL:
        per_token = 2 * 2 * 2 * 16 * 4
        _SMALL[mode, policy] = LLM(path, kv_cache_memory=12 * 8 * per_token, block_size=8, max_num_batched_tokens=24,
                                   max_model_len=96, scheduling_policy=policy, **_mode(mode))
    llm = _SMALL[mode, policy]
    llm.engine.check_no_leaks()
    return llm


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_lpm_looks_up_again_after_an_earlier_admission_evicted_blocks(mode):
    """lpm sorts by the prefixes it finds first; admitting the first request can evict blocks of the second's
    prefix, which must then be looked up afresh (taking the stale blocks crashed the engine or shared
    another request's blocks)."""
    from kvcache.config import EngineConfig
    from kvcache.engine.scheduler import Scheduler
    from kvcache.engine.sequence import Sequence
    from kvcache.memory.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(8, 4, mode)  # 7 usable blocks of 4 tokens
    sched = Scheduler(EngineConfig(block_size=4, scheduling_policy="lpm", max_num_batched_tokens=512), kv)
    sched.watermark = 0
    p_a, p_b, p_c = list(range(100, 108)), list(range(200, 208)), list(range(500, 508))
    for seq_id, p in ((91, p_b), (92, p_c), (90, p_a)):  # three cached 2-block prefixes, b's the oldest
        assert kv.allocate(seq_id, len(p) + 1)
        kv.cache_blocks(seq_id, p + [1], len(p) + 1)
        kv.free(seq_id)
    params = SamplingParams(max_tokens=1)
    a = Sequence(1, "a", 0, p_a + [300], 9, params, 1)
    b = Sequence(2, "b", 0, p_b + [400], 9, params, 1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a's new block evicts the oldest idle cached block: one of b's
    assert {s.request_id for s, _ in out.chunks} == {"a", "b"}
    table_a, table_b = kv.block_tables[1], kv.block_tables[2]
    assert not set(table_a) & set(table_b)
    assert b.num_computed_tokens == 4 * len(kv.find_prefix(99, p_b + [400]))  # what is left of b's prefix
    if mode == "hash":  # a's allocation evicted b's cached blocks (radix: the lookups while sorting touched b's path)
        assert b.num_computed_tokens < 8
