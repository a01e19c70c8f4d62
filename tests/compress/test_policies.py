"""Eviction policies in isolation: budgets, scores and the slots each keeps."""
from __future__ import annotations

import pytest
import torch

from kvcache.compress.h2o import H2O
from kvcache.compress.policy import EvictionState, attention_probs, group_mean, top_slots
from kvcache.compress.pyramidkv import PyramidKV, layer_budgets
from kvcache.compress.registry import POLICY_CLASSES, get_policy
from kvcache.compress.snapkv import SnapKV
from kvcache.compress.spec import POLICIES, SINK_TOKENS, WINDOW, EvictionSpec, parse_budget
from kvcache.compress.tova import TOVA

L, KVH, H, D = 3, 2, 4, 8


def _state(policy, budget, prompt_len, seed=0):
    return EvictionState(policy, budget, prompt_len, L, KVH, torch.Generator().manual_seed(seed))


def _keys(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, n, KVH, D, generator=g)
    return lambda layer, m: k[layer, :m]


# ---- spec --------------------------------------------------------------------------------------------------

def test_every_policy_is_registered_and_names_its_paper():
    assert set(POLICY_CLASSES) == set(POLICIES) - {"none"}
    for name, cls in POLICY_CLASSES.items():
        assert get_policy(name).name == name
        doc = __import__(cls.__module__, fromlist=["x"]).__doc__
        assert "20" in doc and ("arXiv" in doc or "kvpress" in doc), name  # a year and a reference


@pytest.mark.parametrize("text, value", [("512", 512), ("0.25", 0.25), ("25%", 0.25), (None, None), (64, 64)])
def test_parse_budget(text, value):
    assert parse_budget(text) == value


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="lru", budget=64), "kv_eviction 'lru' is not a policy; supported: none, streaming, h2o"),
    (dict(policy="snapkv"), "kv_budget is needed"),
    (dict(policy="h2o", budget=0), "kv_budget 0 tokens is below h2o's minimum of 2"),
    (dict(policy="h2o", budget=1.5), "(0, 1], got 1.5"),
    (dict(policy="h2o", budget=0.0), "(0, 1], got 0.0"),
    (dict(policy="h2o", budget="many"), "number of tokens or a ratio"),
])
def test_bad_specs_fail_with_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EvictionSpec(**kwargs)


def test_budget_below_the_policy_minimum_names_both_numbers():
    with pytest.raises(ValueError, match=rf"kv_budget 4 tokens is below streaming's minimum of {SINK_TOKENS + 1}"):
        EvictionSpec("streaming", 4)
    with pytest.raises(ValueError, match=rf"kv_budget 20 tokens is below snapkv's minimum of {WINDOW + 1}: its "
                                         f"{WINDOW}-token observation window"):
        EvictionSpec("snapkv", 20)
    # a ratio is floored at the minimum, so a short prompt is not refused; evaluations can insist
    assert EvictionSpec("snapkv", 0.125).tokens(200) == WINDOW + 1
    with pytest.raises(ValueError, match=r"kv_budget 0.125 of a 200-token prompt \(25 tokens\) is below snapkv's "
                                         rf"minimum of {WINDOW + 1}"):
        EvictionSpec("snapkv", 0.125).check_ratio(200)
    assert EvictionSpec("snapkv", 0.25).tokens(1000) == 250
    assert EvictionSpec("h2o", 300).tokens(1000) == 300


# ---- scoring -----------------------------------------------------------------------------------------------

def test_attention_probs_are_causal_distributions_with_gqa_grouping():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, H, D, generator=g), torch.randn(10, KVH, D, generator=g)
    slots = torch.tensor([4, 7, 9])
    p = attention_probs(q, k, slots, 0.5)
    assert p.shape == (H, 3, 10)
    torch.testing.assert_close(p.sum(-1), torch.ones(H, 3))
    assert (p[:, 0, 5:] == 0).all() and (p[:, 1, 8:] == 0).all()
    # query head 3 reads KV head 1 (4 query heads over 2 KV heads)
    ref = torch.softmax(q[1, 3] @ k[:8, 1].T * 0.5, -1)
    torch.testing.assert_close(p[3, 1, :8], ref)
    torch.testing.assert_close(group_mean(p, _state(None, 4, 10))[1], p[2:].mean(0))


def test_top_slots_keeps_forced_slots_and_sorts():
    scores = torch.tensor([[5.0, 1, 4, 0, 3, 2], [0, 1, 2, 3, 4, 5]])
    got = top_slots(scores, 3, keep_from=5)
    assert got.tolist() == [[0, 2, 5], [3, 4, 5]]


def test_streaming_keeps_sinks_and_the_most_recent():
    st = _state(get_policy("streaming"), 10, 50)
    keep = get_policy("streaming").select(st, 50, [10] * L, _keys(50), 1.0)
    assert len(keep) == L
    for k in keep:
        assert k.shape == (KVH, 10)
        assert k[0].tolist() == [0, 1, 2, 3, 44, 45, 46, 47, 48, 49]


def test_h2o_accumulates_attention_and_keeps_heavy_hitters_plus_recent():
    pol = H2O()
    n = 40
    k = torch.zeros(L, n, KVH, D)
    k[:, 7, :, 0] = 10.0  # token 7 draws most of the attention of queries with q[0] > 0
    keys = lambda layer, m: k[layer, :m]  # noqa: E731
    st = _state(pol, 8, n)
    q = torch.zeros(n, H, D)
    q[:, :, 0] = 1.0
    pol.observe(st, [q] * L, torch.arange(n), keys, 1.0)
    # every query's probabilities sum to 1, so the scores of a KV head sum to the number of queries
    torch.testing.assert_close(st.scores[:, :, :n].sum(-1), torch.full((L, KVH), float(n)))
    keep = pol.select(st, n, [8] * L, keys, 1.0)
    for kk in keep:
        assert 7 in kk[0].tolist() and 7 in kk[1].tolist()
        assert kk[0].tolist()[-4:] == [36, 37, 38, 39]  # the recent half of the budget


def test_snapkv_scores_only_the_observation_window_and_keeps_it():
    pol = SnapKV()
    P = 100
    st = _state(pol, WINDOW + 4, P)
    assert pol.capture(st, 0, 64, True) == range(0)  # slots 0..63 lie before the window
    assert pol.capture(st, 64, 36, True) == range(P - WINDOW - 64, 36)
    k = torch.zeros(L, P, KVH, D)
    k[:, 20, 0, 0] = 8.0  # KV head 0 looks at token 20, KV head 1 at token 50
    k[:, 50, 1, 1] = 8.0
    keys = lambda layer, m: k[layer, :m]  # noqa: E731
    q = torch.zeros(WINDOW, H, D)
    q[:, :, :2] = 1.0
    pol.observe(st, [q] * L, torch.arange(P - WINDOW, P), keys, 1.0)
    keep = pol.select(st, P, [WINDOW + 4] * L, keys, 1.0)
    for kk in keep:
        assert kk.shape == (KVH, WINDOW + 4)
        assert set(range(P - WINDOW, P)) <= set(kk[0].tolist()) and set(range(P - WINDOW, P)) <= set(kk[1].tolist())
        assert 20 in kk[0].tolist() and 50 in kk[1].tolist()
        assert kk[0].tolist() != kk[1].tolist()  # per KV head
    assert st.queries == []  # scored once


def test_tova_uses_the_newest_query_for_every_head():
    pol = TOVA()
    n = 30
    st = _state(pol, 10, n)
    keys = _keys(n)
    q = torch.randn(n, H, D, generator=torch.Generator().manual_seed(3))
    assert pol.capture(st, 0, n, True) == range(n - 1, n)
    pol.observe(st, [q[-1:]] * L, torch.tensor([n - 1]), keys, 1.0)
    keep = pol.select(st, n, [10] * L, keys, 1.0)
    for layer, kk in enumerate(keep):
        p = attention_probs(q[-1:], keys(layer, n), torch.tensor([n - 1]), 1.0)[:, 0].mean(0)
        assert kk[0].tolist() == kk[1].tolist() == sorted(p.topk(10).indices.tolist())


def test_random_is_seeded_per_request():
    pol = get_policy("random")
    a = pol.select(_state(pol, 10, 50, seed=1), 50, [10] * L, _keys(50), 1.0)
    b = pol.select(_state(pol, 10, 50, seed=1), 50, [10] * L, _keys(50), 1.0)
    c = pol.select(_state(pol, 10, 50, seed=2), 50, [10] * L, _keys(50), 1.0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


# ---- PyramidKV's budgets -----------------------------------------------------------------------------------

def test_pyramid_budgets_shrink_with_depth_and_average_the_budget():
    got = layer_budgets(256, 1024, 30)
    assert got == sorted(got, reverse=True) and got[0] > 256 > got[-1] >= WINDOW
    assert abs(sum(got) / 30 - 256) <= 0.5  # rounding only
    assert got[0] == 2 * (256 - WINDOW) - (256 - WINDOW) // 20 + WINDOW  # the reference's lowest layer


def test_pyramid_falls_back_to_uniform_for_short_prompts_and_one_layer():
    assert layer_budgets(256, 300, 30) == [256] * 30  # prompt under 2 x (budget - window) + window
    assert layer_budgets(256, 200, 30) == [200] * 30  # nothing to evict
    assert layer_budgets(256, 4096, 1) == [256]  # no ZeroDivisionError
    st = _state(PyramidKV(), 64, 400)
    assert PyramidKV().budgets(st, 400) == layer_budgets(64, 400, L)


def test_a_late_compaction_keeps_every_token_after_the_prompt():
    """A compaction put off while decoding (no free block) must not drop the window or what was decoded since."""
    P, n = 100, 120
    k = _keys(n)
    for pol in (SnapKV(), PyramidKV(), get_policy("random")):
        st = _state(pol, WINDOW + 8, P)
        if pol.name != "random":
            pol.observe(st, [torch.randn(WINDOW, H, D)] * L, torch.arange(P - WINDOW, P), k, 1.0)
        counts = pol.budgets(st, n)
        keep = pol.select(st, n, counts, k, 1.0)
        first = P - WINDOW if pol.name != "random" else P
        for c, kk in zip(counts, keep):
            assert kk.shape[1] == c >= n - first
            assert all(set(range(first, n)) <= set(row.tolist()) for row in kk)
