"""Token eviction in the engine: compaction frees real blocks, positions continue, prefix-cache blocks are never
written, budgets hold, and nothing leaks (tiny random-weight Llama; transformers as the oracle for StreamingLLM)."""
from __future__ import annotations

import random

import pytest
import torch

from kvcache import SamplingParams
from kvcache.compress.pyramidkv import layer_budgets
from kvcache.compress.spec import SINK_TOKENS, WINDOW, EvictionSpec
from kvcache.config import EngineConfig
from kvcache.engine.llm_engine import LLMEngine
from kvcache.memory.kv_cache_manager import blocks_for

from tiny_models import hf_model

POLICIES = ["streaming", "h2o", "snapkv", "tova", "pyramidkv", "random"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"kv_cache_memory": "4MiB", "max_num_batched_tokens": 64, **kw}))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return _engine(tiny_llama)


def _run(eng: LLMEngine, prompts, max_tokens, spec=None) -> list[list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY), eviction=spec)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    eng.check_no_leaks()
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_budget_covering_the_sequence_changes_nothing(engine, policy):
    toks = _tokens(200)
    before = engine.evictor.stats.compactions
    torch.testing.assert_close(engine.score(toks, 99, eviction=EvictionSpec(policy, 200)), engine.score(toks, 99),
                               atol=1e-5, rtol=0)
    prompts = [_tokens(120, 1), _tokens(70, 2)]
    assert _run(engine, prompts, 30, EvictionSpec(policy, 150)) == _run(engine, prompts, 30)
    assert engine.evictor.stats.compactions == before


def test_streaming_equals_transformers_with_the_evicted_tokens_masked(engine, tiny_llama):
    P, K, B = 100, 12, 40  # K < one block: the prompt's compaction is the only one
    toks = _tokens(P + K, 3)
    ours = engine.score(toks, P - 1, eviction=EvictionSpec("streaming", B))
    kept = set(range(SINK_TOKENS)) | set(range(P - (B - SINK_TOKENS), P))
    T = P + K
    mask = torch.full((1, 1, T, T), float("-inf"))
    for q in range(T):
        for k in range(q + 1):
            if q < P or k in kept or k >= P:
                mask[0, 0, q, k] = 0.0
    with torch.no_grad():
        ref = hf_model(tiny_llama)(torch.tensor([toks]), attention_mask=mask).logits[0, P - 1:]
    torch.testing.assert_close(ours[:K], ref[:K], atol=1e-4, rtol=0)
    full = engine.score(toks, P - 1)
    assert (ours - full).abs().max() > 1e-2  # the oracle can tell eviction from no eviction


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "h2o", "random"])
def test_per_head_and_per_layer_compaction_equals_transformers_masking(engine, tiny_llama, monkeypatch, policy):
    """Each KV head (and, for pyramidkv, each layer, with its dead leading blocks) attends to exactly the
    tokens its policy kept: transformers with those tokens masked per layer and head gives the same logits."""
    from transformers import AutoModelForCausalLM

    from kvcache.compress.registry import POLICY_CLASSES
    cls, kept = POLICY_CLASSES[policy], []
    select = cls.select

    def recording(self, *args):
        out = select(self, *args)
        kept.append([k.clone() for k in out])
        return out
    monkeypatch.setattr(cls, "select", recording)
    P, K, B = 100, 12, 48  # K < one block: one compaction, at the end of the prompt
    toks = _tokens(P + K, 3)
    ours = engine.score(toks, P - 1, eviction=EvictionSpec(policy, B))
    assert len(kept) == 1
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="eager").eval()
    T, H = P + K, hf.config.num_attention_heads
    group = H // hf.config.num_key_value_heads
    causal = torch.ones(T, T).tril().bool()
    masks = []
    for slots in kept[0]:  # per layer: [kv_heads, kept]
        ok = causal.clone().expand(H, T, T).clone()
        for h in range(H):
            visible = torch.zeros(T, dtype=torch.bool)
            visible[slots[h // group]] = True
            visible[P:] = True
            ok[h, P:] &= visible
        masks.append(torch.zeros(1, H, T, T).masked_fill(~ok, float("-inf")))
    assert policy != "pyramidkv" or kept[0][0].shape[1] > kept[0][1].shape[1]  # layers keep different counts
    for layer, mask in zip(hf.model.layers, masks):
        forward = layer.self_attn.forward
        monkeypatch.setattr(layer.self_attn, "forward",
                            lambda *a, _f=forward, _m=mask, **kw: _f(*a, **{**kw, "attention_mask": _m}))
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0, P - 1:]
    torch.testing.assert_close(ours[:K], ref[:K], atol=1e-4, rtol=0)
    assert (ours - engine.score(toks, P - 1)).abs().max() > 1e-3


def _prefill(eng: LLMEngine, rid: str, prompt: list[int], spec: EvictionSpec, max_tokens: int = 40):
    eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), eviction=spec)
    seq = eng.requests[rid].seqs[0]
    while seq.num_computed_tokens < len(prompt):
        eng.step()
    return seq


@pytest.mark.parametrize("policy", POLICIES)
def test_kept_tokens_equal_the_budget(engine, policy):
    P, B, bs = 150, 48, engine.config.block_size
    seq = _prefill(engine, "kept", _tokens(P, 4), EvictionSpec(policy, B))
    top = layer_budgets(B, P, 2)[0] if policy == "pyramidkv" else B
    slots = seq.num_computed_tokens - seq.num_evicted
    assert slots == top and seq.num_evicted == P - top
    assert len(engine.kv.block_tables[seq.seq_id]) == blocks_for(top, bs)
    if policy == "pyramidkv":  # layer 1 keeps fewer tokens: its first blocks are dead and skipped
        assert seq.eviction.layer_start == [0, (top - layer_budgets(B, P, 2)[1]) // bs * bs]
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            most = max(most, seq.num_computed_tokens - seq.num_evicted)
    if seq.eviction.policy.decode:
        assert B < most <= B + bs  # grows one block past the budget, then is compacted back
    else:
        assert most == top + 38  # prefill-time policies keep every token generated (the last one never runs)
    engine.check_no_leaks()


def test_freed_blocks_return_to_the_pool_and_serve_another_request(tiny_llama):
    # 12 blocks: the 160-token prompt takes 10, so a 100-token request (7 blocks) fits only after eviction
    eng = _engine(tiny_llama, enable_prefix_caching=False, kv_cache_memory=12 * 16 * 512)
    assert eng.kv.pool.num_usable == 12
    seq = _prefill(eng, "a", _tokens(160, 5), EvictionSpec("streaming", 32), max_tokens=8)
    # the prompt's 10 blocks were compacted to 2 within the step that finished the prompt
    table = list(eng.kv.block_tables[seq.seq_id])
    assert len(table) == 2 and eng.evictor.stats.freed_blocks == 8
    assert eng.kv.num_free_blocks == 10 and eng.stats.peak_used_blocks == 10  # the peak counts the whole prompt
    eng.add_request("b", _tokens(100, 6), SamplingParams(max_tokens=2, **GREEDY))
    b = eng.requests["b"].seqs[0]
    while b.num_computed_tokens < 100:
        eng.step()
    assert not seq.is_finished and eng.scheduler.num_preemptions == 0  # both ran at once
    reused = set(eng.kv.block_tables[b.seq_id])
    assert len(reused) == 7 and not reused & set(table)
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_no_leaks()


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_prefix_cache_blocks_are_never_written(tiny_llama, algo):
    eng = _engine(tiny_llama, prefix_caching_algo=algo)
    prompt = _tokens(128, 7)
    _run(eng, [prompt], 2)  # caches the prompt's first 7 full blocks
    cached = eng.kv.find_prefix(999, prompt + [5])
    assert len(cached) == 8
    ids = torch.tensor(cached)
    k0, v0 = eng.store.k[0][ids].clone(), eng.store.v[1][ids].clone()
    spec = EvictionSpec("streaming", 40)
    got = _run(eng, [prompt + _tokens(20, 8)], 20, spec)
    assert eng.kv.stats.hits >= 8 * 16  # the second request took the cached prefix
    assert torch.equal(eng.store.k[0][ids], k0) and torch.equal(eng.store.v[1][ids], v0)
    assert eng.kv.find_prefix(1000, prompt + [5]) == cached  # still findable
    fresh = _engine(tiny_llama, enable_prefix_caching=False)
    assert got == _run(fresh, [prompt + _tokens(20, 8)], 20, spec)


@pytest.mark.parametrize("policy, cacheable", [("h2o", 0), ("snapkv", (148 - WINDOW) // 16 * 16),
                                               ("streaming", 144)])
def test_prefix_hits_stop_where_the_policy_needs_queries(tiny_llama, policy, cacheable):
    eng = _engine(tiny_llama)
    prompt = _tokens(148, 9)
    _run(eng, [prompt], 1)
    hits = eng.kv.stats.hits
    _run(eng, [prompt], 1, EvictionSpec(policy, 64))
    assert eng.kv.stats.hits - hits == cacheable


def test_radix_needs_room_for_the_survivors_beside_the_cached_prompt(tiny_llama):
    """Under radix caching the prompt's blocks stay in the tree, so survivors go to fresh blocks: a request is
    admitted only if its prompt and its budget fit side by side (else it could wait for blocks forever)."""
    P, spec, params = 200, EvictionSpec("h2o", 48), SamplingParams(max_tokens=8, **GREEDY)  # 13 + 3 blocks
    small = _engine(tiny_llama, prefix_caching_algo="radix", kv_cache_memory=15 * 16 * 512)
    with pytest.raises(ValueError, match="request needs 16 KV blocks"):
        small.add_request("a", _tokens(P, 13), params, eviction=spec)
    hashed = _engine(tiny_llama, kv_cache_memory=13 * 16 * 512)  # hash: own cached blocks are rewritten in place
    radix = _engine(tiny_llama, prefix_caching_algo="radix", kv_cache_memory=16 * 16 * 512)
    outs = [_run(eng, [_tokens(P, 13)], 8, spec) for eng in (hashed, radix)]
    assert outs[0] == outs[1]
    for eng in (hashed, radix):
        assert eng.evictor.stats.compactions >= 1 and eng.evictor.stats.deferred == 0
        assert eng.scheduler.num_preemptions == 0


def test_int8_compaction_moves_scales_with_codes(tiny_llama):
    toks = _tokens(160, 10)
    spec = EvictionSpec("snapkv", 48)
    fp32 = _engine(tiny_llama).score(toks, 119, eviction=spec)
    int8 = _engine(tiny_llama, kv_cache_dtype="int8").score(toks, 119, eviction=spec)
    assert (int8 - fp32).abs().max() < 0.05  # a lost or mismatched scale would be far off


def test_mixed_workload_with_eviction_leaks_nothing(tiny_llama):
    eng = _engine(tiny_llama, kv_cache_memory=24 * 16 * 512, max_num_batched_tokens=32, block_size=16)
    assert eng.kv.pool.num_usable == 24
    rng = random.Random(0)
    specs = [None] + [EvictionSpec(p, b) for p in POLICIES for b in (0.5, 64)]
    n = 0
    for step in range(400):
        if n < 40 and rng.random() < 0.3:
            P = rng.randint(70, 200)
            eng.add_request(f"m{n}", _tokens(P, 100 + n),
                            SamplingParams(max_tokens=rng.randint(1, 40), **GREEDY), eviction=rng.choice(specs))
            n += 1
        if eng.requests and rng.random() < 0.05:
            eng.abort_request(rng.choice(list(eng.requests)))
        if eng.has_unfinished_requests():
            eng.step()
        kv = eng.kv
        held = {b for t in kv.block_tables.values() for b in t}
        assert kv.num_free_blocks + len(held) <= kv.pool.num_usable
        assert all(kv.pool.ref_counts[b] >= 1 for b in held)
        for rid, req in eng.requests.items():
            for s in req.seqs:
                if s.seq_id in kv.block_tables:
                    assert blocks_for(s.num_computed_tokens - s.num_evicted, 16) <= len(kv.block_tables[s.seq_id])
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_no_leaks()
    assert eng.scheduler.num_preemptions > 0 and eng.evictor.stats.compactions > 20


def test_bad_settings_fail_at_submission_and_change_nothing(engine, tiny_model_dirs):
    before = dict(engine.kv_cache_info())
    for spec, params, message in [
        (EvictionSpec("h2o", 64), SamplingParams(n=2), "n must be 1 with kv_eviction h2o, got 2"),
        (EvictionSpec("streaming", 0.5), SamplingParams(max_tokens=600), "above max_model_len"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", _tokens(100), params, eviction=spec)
        assert not engine.requests and engine.kv_cache_info() == before
    with pytest.raises(ValueError, match="kv_budget 20 tokens is below snapkv's minimum of 33"):
        EngineConfig(kv_eviction="snapkv", kv_budget=20)
    with pytest.raises(ValueError, match="kv_eviction 'lru' is not a policy"):
        EngineConfig(kv_eviction="lru", kv_budget=64)
    with pytest.raises(ValueError, match=r"kv_budget as a ratio of the prompt must be in \(0, 1\], got 2.5"):
        EngineConfig(kv_eviction="h2o", kv_budget="2.5")
    with pytest.raises(ValueError, match="sliding-window layers"):
        _engine(tiny_model_dirs["mistral-swa"], kv_eviction="streaming", kv_budget=64)
    with pytest.raises(ValueError, match="cannot be combined with kv_cache_dtype int4"):
        _engine(tiny_model_dirs["llama"], kv_eviction="snapkv", kv_budget=0.5, kv_cache_dtype="int4")


def test_a_ratio_is_floored_at_the_policy_minimum_so_short_prompts_run(engine):
    before = engine.evictor.stats.compactions
    assert _run(engine, [_tokens(20, 12)], 5, EvictionSpec("snapkv", 0.25)) == _run(engine, [_tokens(20, 12)], 5)
    assert engine.evictor.stats.compactions == before  # 33 tokens kept of 20: nothing to evict


def test_per_request_override_of_the_engine_default(tiny_llama):
    eng = _engine(tiny_llama, kv_eviction="streaming", kv_budget=32)
    prompt = _tokens(120, 11)
    _run(eng, [prompt], 2, EvictionSpec("none"))
    assert eng.evictor.stats.compactions == 0
    _run(eng, [prompt], 2)
    assert eng.evictor.stats.compactions == 1 and eng.evictor.stats.evicted_tokens == 120 - 32
