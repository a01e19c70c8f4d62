"""The memory-pressure ladder (--kv-pressure-policy ladder, engine/pressure.py): under a pool too small for the
workload it evicts tokens instead of preempting, within each request's bound, never from a request that asked for
"exact", with each compaction equal to transformers with the evicted tokens masked; with a swap tier it offloads
first; every count adds up; bad settings are refused with the field. Tiny random-weight Llama."""
from __future__ import annotations

import pytest
import torch

from kvcache import SamplingParams
from kvcache.compress.pressure import RECENT_TOKENS, PressureEviction
from kvcache.compress.spec import SINK_TOKENS
from kvcache.config import EngineConfig
from kvcache.engine.llm_engine import LLMEngine

from tiny_models import make_tiny_model

PROMPT, OUTPUT = 150, 120
SMALL_POOL = "320KiB"  # 40 blocks of 16 tokens (512 bytes a token): 6 requests of 270 tokens need 102


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"kv_cache_memory": SMALL_POOL, "max_num_batched_tokens": 64,
                                                 "block_size": 16, **kw}))


def _run(eng: LLMEngine, exact: tuple[int, ...] = (), n: int = 6, logprobs: int | None = None) -> dict:
    for i in range(n):
        eng.add_request(f"r{i}", _tokens(PROMPT, i), SamplingParams(
            max_tokens=OUTPUT, temperature=0.0, ignore_eos=True, logprobs=logprobs,
            kv_pressure="exact" if i in exact else "degrade"))
    done = {o.request_id: o for o in eng.run_to_completion().values()}
    eng.check_no_leaks()
    return done


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The unconstrained run: a pool that holds everything."""
    return _run(_engine(tiny_llama, kv_cache_memory="8MiB"))


def test_the_ladder_evicts_instead_of_preempting_within_each_requests_bound(tiny_llama, reference):
    preempt = _engine(tiny_llama)
    _run(preempt)
    assert preempt.scheduler.num_preemptions >= 3  # the workload oversubscribes the pool
    eng = _engine(tiny_llama, kv_pressure_policy="ladder", kv_pressure_max_evict=0.4)
    out = _run(eng)
    st, info = eng.scheduler.pressure.stats, eng.kv_cache_info()
    assert st.evictions > 0 and st.freed_blocks > 0 and st.failed == 0
    assert eng.scheduler.num_preemptions < preempt.scheduler.num_preemptions
    deg = [o.kv_degradation for o in out.values()]
    assert sum(d["evicted_tokens"] for d in deg) == st.evicted_tokens == info["pressure_evicted_tokens"]
    assert sum(d["evictions"] for d in deg) == st.evictions
    assert sum(d["preemptions"] for d in deg) == eng.scheduler.num_preemptions
    for o in out.values():
        assert o.kv_degradation["evicted_tokens"] <= 0.4 * (PROMPT + OUTPUT)
        assert len(o.outputs[0].token_ids) == OUTPUT
    untouched = [k for k, o in out.items() if not o.kv_degradation["evicted_tokens"]]
    for k in untouched:  # no eviction and no preemption changes a request's tokens
        assert out[k].outputs[0].token_ids == reference[k].outputs[0].token_ids
    assert len(untouched) < len(out)
    assert all(v == 0 for k, v in _engine(tiny_llama).kv_cache_info().items() if k.startswith("pressure_"))


def test_exact_requests_are_never_degraded(tiny_llama, reference):
    eng = _engine(tiny_llama, kv_pressure_policy="ladder")
    out = _run(eng, exact=(0, 2, 4))
    assert eng.scheduler.pressure.stats.evictions > 0
    for k in ("r0", "r2", "r4"):
        assert out[k].kv_degradation["evicted_tokens"] == 0
        assert out[k].outputs[0].token_ids == reference[k].outputs[0].token_ids
    assert all(out[k].kv_degradation["evicted_tokens"] > 0 for k in ("r1", "r3", "r5"))


def test_all_exact_is_preemption_only(tiny_llama, reference):
    eng = _engine(tiny_llama, kv_pressure_policy="ladder")
    out = _run(eng, exact=tuple(range(6)))
    assert eng.scheduler.pressure.stats.evictions == 0 and eng.scheduler.num_preemptions > 0
    assert {k: o.outputs[0].token_ids for k, o in out.items()} == \
        {k: o.outputs[0].token_ids for k, o in reference.items()}


def _masked_logprobs(path: str, toks: list[int], compactions: list[tuple[int, int, list[torch.Tensor]]],
                     monkeypatch) -> torch.Tensor:
    """transformers' log probabilities of `toks` with the ladder's compactions as masks. A compaction (N, n, slots):
    made when N tokens were computed, its n cache slots cut to `slots` (per layer, [kv_heads, kept]); a query at
    position q >= N (until the next compaction) sees the positions those slots held, and N..q."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    H = hf.config.num_attention_heads
    kvh, T = hf.config.num_key_value_heads, len(toks)
    for layer_index, layer in enumerate(hf.model.layers):
        ok = torch.ones(T, T).tril().bool().expand(H, T, T).clone()
        for kv in range(kvh):
            alive, since = [], 0  # positions in the cache slots before the next compaction, and appended ones from
            for j, (N, n, slots) in enumerate(compactions):
                positions = alive + list(range(since, N))
                assert len(positions) == n, (j, len(positions), n)  # the bookkeeping matches the engine's
                alive, since = [positions[s] for s in slots[layer_index][kv].tolist()], N
                end = compactions[j + 1][0] if j + 1 < len(compactions) else T
                visible = torch.zeros(T, dtype=torch.bool)
                visible[alive] = True
                visible[N:] = True
                for h in range(kv * (H // kvh), (kv + 1) * (H // kvh)):
                    ok[h, N:end] &= visible
        mask = torch.zeros(1, H, T, T).masked_fill(~ok, float("-inf"))
        forward = layer.self_attn.forward
        monkeypatch.setattr(layer.self_attn, "forward",
                            lambda *a, _f=forward, _m=mask, **kw: _f(*a, **{**kw, "attention_mask": _m}))
    with torch.no_grad():
        return hf(torch.tensor([toks])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("rule", ["knorm", "streaming"])
def test_compacted_sequences_equal_transformers_with_the_evicted_tokens_masked(tiny_llama, monkeypatch, rule):
    """Each compaction the ladder makes is recorded (its request, the tokens computed then, the slots each layer
    and KV head keeps); a request compacted (once or more, never preempted) gets from its first compaction on the
    tokens and log probabilities transformers gives with the evicted tokens masked for the later queries, head by
    head."""
    from kvcache.engine.pressure import PressureLadder
    kept, owners = [], []
    select, compact = PressureEviction.select, PressureLadder._compact

    def recording_select(self, state, n, counts, keys, scale):
        out = select(self, state, n, counts, keys, scale)
        kept.append((n, [k.clone() for k in out]))
        return out

    def recording_compact(self, seq, keep):
        computed = seq.num_computed_tokens
        done = compact(self, seq, keep)
        if done:
            owners.append((seq.request_id, computed))
        return done
    monkeypatch.setattr(PressureEviction, "select", recording_select)
    monkeypatch.setattr(PressureLadder, "_compact", recording_compact)
    eng = _engine(tiny_llama, kv_pressure_policy="ladder", kv_pressure_evict=rule)
    out = _run(eng, logprobs=0)
    assert len(kept) == len(owners) == eng.scheduler.pressure.stats.evictions > 0
    checked = 0
    for rid, o in out.items():
        history = [(N, *kept[i]) for i, (r, N) in enumerate(owners) if r == rid]
        if not history or o.kv_degradation["preemptions"]:
            continue
        c = o.outputs[0]
        ref = _masked_logprobs(tiny_llama, o.prompt_token_ids + c.token_ids, history, monkeypatch)
        start = history[0][0] - PROMPT  # the output token whose query first ran after a compaction
        for i in range(start, OUTPUT):
            assert abs(c.logprobs[i][c.token_ids[i]] - ref[PROMPT + i - 1, c.token_ids[i]].item()) < 1e-4, (rid, i)
        assert c.token_ids[start:] == ref[PROMPT + start - 1:PROMPT + OUTPUT - 1].argmax(-1).tolist()
        checked += 1
    assert checked >= 2


def test_the_rules_keep_the_sinks_and_the_recent_window():
    from kvcache.compress.policy import EvictionState
    n, keep, kvh = 200, 100, 3
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(n, kvh, 8, generator=g)
    keys[SINK_TOKENS:34] *= 0.01  # 30 small norms: knorm keeps them with its 32 free places
    for rule in ("knorm", "streaming"):
        policy = PressureEviction(rule)
        state = EvictionState(policy, keep, n, 2, kvh)
        for slots in policy.select(state, n, [keep, keep], lambda layer, m: keys[:m], 1.0):
            assert slots.shape == (kvh, keep)
            for row in slots.tolist():
                assert set(range(SINK_TOKENS)) | set(range(n - RECENT_TOKENS, n)) <= set(row)
                assert row == sorted(row)
                if rule == "knorm":
                    assert set(range(SINK_TOKENS, 34)) <= set(row)  # the smallest norms stay
                else:
                    assert row == list(range(SINK_TOKENS)) + list(range(n - keep + SINK_TOKENS, n))
    with pytest.raises(ValueError, match="at least the 4 leading and 64 recent"):
        PressureEviction("knorm").select(EvictionState(PressureEviction("knorm"), 10, n, 1, kvh), n, [10],
                                         lambda layer, m: keys[:m], 1.0)


def test_with_a_swap_tier_the_ladder_offloads_first(tiny_llama, reference):
    """A sequence that cannot grow gets its victim swapped out (no quality lost) while the tier has room, and
    nothing is evicted; swapped requests get the reference's tokens. With a tier too small, the ladder evicts."""
    roomy = _engine(tiny_llama, kv_pressure_policy="ladder", preemption_mode="swap", kv_offload_memory="64MiB")
    out = _run(roomy)
    sched = roomy.scheduler
    assert sched.num_swapped_out > 0 and sched.num_swap_fallbacks == 0 and sched.pressure.stats.evictions == 0
    assert sched.num_preemptions == sched.num_swapped_out  # every preemption was a swap
    assert sum(o.kv_degradation["swapped_out"] for o in out.values()) == sched.num_swapped_out
    assert {k: o.outputs[0].token_ids for k, o in out.items()} == \
        {k: o.outputs[0].token_ids for k, o in reference.items()}  # swapping loses nothing
    cramped = _engine(tiny_llama, kv_pressure_policy="ladder", preemption_mode="swap", kv_offload_memory="16KiB")
    _run(cramped)  # a tier that holds no sequence: the ladder evicts instead
    assert cramped.scheduler.pressure.stats.evictions > 0 and cramped.scheduler.num_swapped_out == 0


@pytest.mark.parametrize("field,value,match", [
    ("kv_pressure_policy", "degrade", "kv_pressure_policy must be one of preempt, ladder"),
    ("kv_pressure_max_evict", 0, r"kv_pressure_max_evict .* must be in \(0, 0.9\]"),
    ("kv_pressure_max_evict", 0.95, r"must be in \(0, 0.9\]; got 0.95"),
    ("kv_pressure_max_evict", True, r"must be in \(0, 0.9\]; got True"),
    ("kv_pressure_evict", "h2o", "kv_pressure_evict must be one of knorm, streaming"),
])
def test_bad_settings_are_refused_with_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{field: value})


def test_bad_kv_pressure_in_a_request_is_refused():
    with pytest.raises(ValueError, match="kv_pressure must be one of 'degrade', 'exact', got 'lossy'"):
        SamplingParams(kv_pressure="lossy")


def test_the_ladder_is_refused_where_tokens_cannot_be_evicted(tmp_path):
    with pytest.raises(ValueError, match="speculative_config cannot be combined with kv_pressure_policy ladder"):
        EngineConfig(kv_pressure_policy="ladder", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="tensor_parallel_size 2 cannot be combined with kv_pressure_policy ladder"):
        EngineConfig(kv_pressure_policy="ladder", tensor_parallel_size=2)
    for arch, why in (("gemma2", "sliding-window"), ("deepseek_v3", "MLA latent"), ("bamba", "recurrent layers")):
        path = make_tiny_model(str(tmp_path / arch), arch)
        with pytest.raises(ValueError, match=f"kv_pressure_policy ladder .* cannot: .*{why}"):
            LLMEngine(EngineConfig(model=path, kv_cache_memory="4MiB", kv_pressure_policy="ladder"))


def test_sequences_sharing_a_prefix_are_compacted_around_it(tiny_llama, monkeypatch):
    """Requests that share their first 64 tokens (4 blocks held by all of them) are compacted without a fresh block:
    the shared blocks stay in place, kept whole, and unchanged, so a request with that prefix afterwards finds
    them cached and gets the unconstrained output."""
    kept = []
    select = PressureEviction.select

    def recording(self, state, n, counts, keys, scale):
        out = select(self, state, n, counts, keys, scale)
        kept.append((state.fixed, out))
        return out
    monkeypatch.setattr(PressureEviction, "select", recording)
    common = _tokens(64, 100)
    prompts = [common + _tokens(PROMPT - 64, i) for i in range(6)]

    def run(eng):
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=OUTPUT, temperature=0.0, ignore_eos=True))
        eng.run_to_completion()
        eng.add_request("after", common + _tokens(40, 77), SamplingParams(max_tokens=30, temperature=0.0,
                                                                          ignore_eos=True))
        hits = eng.kv.stats.hits
        out = eng.run_to_completion()["after"].outputs[0].token_ids
        eng.check_no_leaks()
        return out, eng.kv.stats.hits - hits
    eng = _engine(tiny_llama, kv_pressure_policy="ladder")
    after, hits = run(eng)
    st = eng.scheduler.pressure.stats
    assert st.evictions > 0 and st.failed == 0
    assert kept and all(fixed == 64 for fixed, _ in kept)
    for _, slots in kept:
        for layer in slots:
            assert (layer[:, :64] == torch.arange(64)).all()  # the shared blocks' tokens, in place
    ref_after, _ = run(_engine(tiny_llama, kv_cache_memory="8MiB"))
    assert hits == 64 and after == ref_after


def test_a_tier_that_fails_mid_ladder_is_skipped_and_counted(tiny_llama, tmp_path, monkeypatch):
    """A disk tier whose writes fail (a full disk) cannot take the swap: the ladder evicts instead, the tier counts
    the errors, every request completes, and no block is lost."""
    import errno
    import tempfile
    eng = _engine(tiny_llama, kv_pressure_policy="ladder", preemption_mode="swap", kv_offload_dir=str(tmp_path))

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tempfile, "mkstemp", full)
    out = _run(eng)  # checks no block is held afterwards
    tier = eng.offload.swap_tier
    assert tier.stats.errors.get("disk_full", 0) > 0 and eng.scheduler.num_swapped_out == 0
    assert eng.scheduler.pressure.stats.evictions > 0
    assert all(len(o.outputs[0].token_ids) == OUTPUT for o in out.values())
