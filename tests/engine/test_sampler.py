import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.engine import sampler
from kvcache.engine.sampler import SamplingRow, apply_penalties, sample, truncate
from kvcache.engine.sampling_params import SamplingParams
from kvcache.models import cpu_kernels


def row(prompt=(), output=(), seed=None, **kw) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(seed=seed, **kw), gen, [*prompt, *output], len(prompt))


def draw(logits, rows, **kw):
    return sample(logits.clone(), rows, **kw).token_ids


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


@pytest.mark.parametrize("temperature", [0, 1e-6])  # vLLM: below 1e-5 is greedy
def test_greedy_equals_argmax(temperature):
    logits = torch.randn(8, 1000)
    assert draw(logits, [row(temperature=temperature) for _ in range(8)]) == logits.argmax(-1).tolist()


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 500)
    rows = [row(temperature=0) if i % 2 else row(temperature=1.0, top_p=0.9, seed=i) for i in range(6)]
    tokens = draw(logits, rows)
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


def test_fast_path_does_not_modify_logits():
    logits = torch.randn(4, 100)
    before = logits.clone()
    sample(logits, [row(temperature=0) for _ in range(4)])
    assert torch.equal(logits, before)


def test_empty_batch():
    assert sample(torch.empty(0, 10), []).token_ids == []


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0, 2.0])
def test_top_k_1_is_greedy(temperature):
    logits = torch.randn(32, 3000) * 3
    rows = [row(temperature=temperature, top_k=1, seed=i if i % 2 else None) for i in range(32)]
    for _ in range(3):
        assert draw(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = torch.randn(32, 3000) * 3
    rows = [row(temperature=temperature, top_p=1e-6) for _ in range(32)]
    assert draw(logits, rows) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 50}])
def test_min_p_1_keeps_only_the_max(extra):
    logits = torch.randn(32, 3000)
    rows = [row(temperature=2.0, min_p=1.0, **extra) for _ in range(32)]
    assert draw(logits, rows) == logits.argmax(-1).tolist()


def seeded_stream(logits, seed, steps, others, at, **kw):
    """Tokens drawn for a row seeded with seed, batched with others at position at."""
    target = row(seed=seed, **kw)
    out = []
    for _ in range(steps):
        batch = others[:at] + [target] + others[at:]
        mixed = torch.cat([logits[:at], logits[-1:], logits[at:len(others)]]) if others else logits[-1:]
        out.append(sample(mixed.clone(), batch).token_ids[at])
    return out


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.8, min_p=0.02),
    dict(temperature=1.2, top_p=0.9),
    dict(temperature=1.0, top_k=20, top_p=0.95),
])
def test_same_seed_same_tokens_whatever_the_batch(kw):
    logits = torch.randn(9, 2000) * 2
    logits[-1] = torch.randn(2000)  # the seeded row: flat, so top-p looks past the first 1024 candidates
    others = [
        row(temperature=0.7), row(seed=99, temperature=1.0, top_p=0.5), row(temperature=0),
        row(temperature=1.5, top_k=5), row(seed=3, min_p=0.1),
        row(temperature=1.0, repetition_penalty=1.3, output=[1, 2]),
        row(temperature=0.9, top_p=0.99, logprobs=2), row(temperature=1.0, min_tokens=4),
    ]
    alone = seeded_stream(logits, 42, 20, [], 0, **kw)
    assert len(set(alone)) > 5
    assert seeded_stream(logits, 42, 20, [], 0, **kw) == alone
    assert seeded_stream(logits, 42, 20, others, 3, **kw) == alone
    assert seeded_stream(logits, 42, 20, others[::-1][:5], 5, **kw) == alone


def test_seeded_rows_do_not_depend_on_the_global_rng():
    logits = torch.randn(2, 1000)
    rows = lambda: [row(seed=5, temperature=1.0), row(seed=6, temperature=1.0, top_p=0.8)]
    torch.manual_seed(0)
    a = draw(logits, rows())
    torch.manual_seed(1)
    assert draw(logits, rows()) == a


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    streams = []
    for seed in (1, 2):
        r = row(seed=seed, temperature=1.0)
        streams.append([sample(logits.clone(), [r]).token_ids[0] for _ in range(50)])
    assert streams[0] != streams[1]
    assert sum(a == b for a, b in zip(*streams)) < 5  # 1/1000 chance of a match per draw


def expected_probs(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """Reference: the distribution sample() should draw from, for one row, computed the slow way."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    probs = torch.where(keep, probs, 0)
    probs /= probs.sum()
    if top_p < 1:
        mass, kept = 0.0, torch.zeros_like(keep)
        for i in order.tolist():
            if mass >= top_p:
                break
            kept[i] = True
            mass += probs[i].item()
        probs = torch.where(kept, probs, 0)
    probs = torch.where(probs < min_p * probs.max(), 0, probs)
    return probs / probs.sum()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.8),
    dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8), dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.3, top_k=4, top_p=0.9), dict(temperature=1.0, top_p=0.9, seed=7),
])
def test_sampling_frequencies_match_the_distribution(kw):
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.7])
    n = 20_000
    if kw.get("seed") is None:
        counts = torch.bincount(torch.tensor(draw(logits.expand(n, 5), [row(**kw) for _ in range(n)])), minlength=5)
    else:
        r, tokens = row(**kw), []
        for _ in range(n // 100):  # one seeded row per call is slow; repeat it within the batch instead
            batch = [r] * 100
            tokens += draw(logits.expand(100, 5), batch)
        counts = torch.bincount(torch.tensor(tokens), minlength=5)
    want = expected_probs(logits, **{k: v for k, v in kw.items() if k != "seed"}) * n
    assert torch.all(counts[want == 0] == 0)
    chi2 = (((counts - want) ** 2 / want)[want > 0]).sum().item()
    assert chi2 < 20.5, (counts.tolist(), want.tolist())  # p = 0.0004 at 4 degrees of freedom


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 1.0], [2.0, -2.0, 4.0, -4.0, 1.0]])
    rows = [row(prompt=[0, 1, 1], output=[3], repetition_penalty=2.0), row(prompt=[0, 1], repetition_penalty=1.0)]
    out = apply_penalties(logits.clone(), rows)
    assert out[0].tolist() == [1.0, -4.0, 4.0, -8.0, 1.0]
    assert out[1].tolist() == logits[1].tolist()


def test_frequency_and_presence_penalties_use_output_counts_only():
    logits = torch.zeros(2, 6)
    rows = [
        row(prompt=[5, 5], output=[4, 4, 4, 1], frequency_penalty=0.5, presence_penalty=0.25),
        row(output=[2], presence_penalty=-1.0),
    ]
    out = apply_penalties(logits, rows)
    assert out[0].tolist() == [0.0, -0.75, 0.0, 0.0, -1.75, 0.0]
    assert out[1].tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_penalties_apply_repetition_then_frequency_and_presence():
    logits = torch.tensor([[3.0, -3.0]])
    rows = [row(prompt=[0], output=[1, 1], repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)]
    out = apply_penalties(logits, rows)[0].tolist()
    assert out == pytest.approx([2.0, -3.0 * 1.5 - 2.0 - 0.5])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_penalties_match_a_per_token_reference(data):
    vocab = data.draw(st.integers(1, 30))
    n = data.draw(st.integers(1, 5))
    tokens = st.lists(st.integers(0, vocab - 1), max_size=20)
    rows = [row(prompt=data.draw(tokens), output=data.draw(tokens),
                repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
                frequency_penalty=data.draw(st.sampled_from([0.0, 0.4, -1.5])),
                presence_penalty=data.draw(st.sampled_from([0.0, 0.7, -2.0]))) for _ in range(n)]
    logits = torch.randn(n, vocab)
    want = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            want[i, t] = want[i, t] / p.repetition_penalty if want[i, t] > 0 else want[i, t] * p.repetition_penalty
        for t in set(r.output_token_ids):
            want[i, t] -= p.frequency_penalty * r.output_token_ids.count(t)
            want[i, t] -= p.presence_penalty
    torch.testing.assert_close(apply_penalties(logits.clone(), rows), want)


def test_penalties_reject_out_of_vocab_tokens():
    with pytest.raises(ValueError, match="token ids must be in"):
        apply_penalties(torch.zeros(1, 4), [row(prompt=[4], repetition_penalty=1.2)])


def test_penalties_steer_greedy_sampling():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert draw(logits, [row(output=[0], temperature=0)]) == [0]
    assert draw(logits, [row(output=[0], temperature=0, presence_penalty=1.5)]) == [1]


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_min_tokens_masks_eos_and_stop_tokens(temperature):
    logits = torch.zeros(1, 10)
    logits[0, 2] = 50.0  # EOS
    logits[0, 7] = 40.0  # a stop token
    kw = dict(temperature=temperature, min_tokens=3, stop_token_ids=[7])
    for _ in range(20):
        assert draw(logits, [row(output=[1, 1], **kw)], eos_token_id=2)[0] not in (2, 7)
    assert draw(logits, [row(output=[1, 1, 1], **kw)], eos_token_id=2) == [2]
    assert draw(logits, [row(output=[1, 1], **kw)]) == [2]  # no EOS id given: only stop ids are masked
    logits[0, 2] = 0.0
    assert draw(logits, [row(output=[1], temperature=0, min_tokens=3)], eos_token_id=2) == [7]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, 200)
    rows = [
        row(temperature=0.5, logprobs=5, repetition_penalty=1.7, output=[0, 1, 2]),
        row(temperature=0, logprobs=0),
        row(temperature=1.0),
    ]
    result = sample(logits.clone(), rows)
    lp = torch.log_softmax(logits, -1)
    top = lp[0].topk(5).indices.tolist()
    d = result.logprobs[0]
    assert set(d) == set(top) | {result.token_ids[0]}
    assert len(d) in (5, 6)
    for t, v in d.items():
        assert v == pytest.approx(lp[0, t].item(), abs=1e-6)
    assert result.logprobs[1] == {result.token_ids[1]: pytest.approx(lp[1].max().item(), abs=1e-6)}
    assert result.logprobs[2] is None


def test_logprobs_include_the_sampled_token_when_outside_the_top():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    r = row(temperature=0, logprobs=1, presence_penalty=2.0, frequency_penalty=2.0, output=[0, 0, 1, 1])
    result = sample(logits.clone(), [r])
    assert result.token_ids == [2]
    lp = torch.log_softmax(logits[0], -1)
    assert result.logprobs[0] == {2: pytest.approx(lp[2].item()), 0: pytest.approx(lp[0].item())}


def kept(weights: torch.Tensor, ids: torch.Tensor) -> set[int]:
    return set(ids[weights > 0].tolist())


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_top_p_keeps_the_smallest_most_likely_set(data):
    vocab = data.draw(st.integers(1, 150))  # above 64 exercises the widening to the full vocabulary
    scale = data.draw(st.sampled_from([0.0, 0.1, 1.0, 5.0]))
    top_p = data.draw(st.floats(1e-3, 1.0))
    top_k = data.draw(st.sampled_from([0, 0, 1, 5, 70, 200]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    probs = torch.softmax(torch.randn(vocab, generator=gen) * scale, -1).double()
    weights, ids = truncate(probs[None], [SamplingParams(top_p=top_p, top_k=top_k)])
    k = top_k if 0 < top_k < vocab else vocab
    head = probs.argsort(descending=True, stable=True)[:k]
    in_k = probs[head]
    keep = sorted(kept(weights[0], ids[0]))
    assert keep, "always keeps at least one token"
    mass = probs[keep].sum() / in_k.sum()
    assert len(keep) <= k
    assert probs[keep].min() >= in_k[len(keep) - 1] - 1e-12  # the most likely tokens of the top-k
    assert mass >= top_p - 1e-6
    assert mass - probs[keep].min() / in_k.sum() < top_p + 1e-6  # minus any one of them falls short


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 3000), st.floats(0.0, 1.0), st.integers(0, 10**6))
def test_min_p_drops_exactly_the_tokens_below_min_p_times_the_max(vocab, min_p, seed):
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3, -1)
    weights, ids = truncate(probs[None], [SamplingParams(min_p=min_p)])
    threshold = torch.tensor(min_p) * probs.max()
    assert kept(weights[0], ids[0]) == set(torch.nonzero((probs >= threshold) & (probs > 0)).flatten().tolist())


def test_truncate_widens_rows_whose_kept_set_is_past_the_head():
    vocab = 5000
    logits = torch.randn(6, vocab)
    logits[:3] *= 8  # peaky rows: decided within the first candidates
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(top_k=3000),
              SamplingParams(top_p=0.95), SamplingParams(top_k=100, top_p=0.9), SamplingParams(top_k=2000, top_p=0.5)]
    probs = logits.softmax(-1)
    weights, ids = truncate(probs, params)
    for i, p in enumerate(params):
        want = expected_probs(logits[i], top_k=p.top_k, top_p=p.top_p)
        assert kept(weights[i], ids[i]) == set(torch.nonzero(want).flatten().tolist()), i
        got = torch.zeros(vocab, dtype=torch.float64).index_add_(0, ids[i], weights[i].double())
        torch.testing.assert_close(got / got.sum(), want, atol=1e-6, rtol=1e-4)


def test_unseeded_rows_are_sampled_in_one_vectorized_draw(monkeypatch):
    calls = []
    real_rand = torch.rand
    monkeypatch.setattr(sampler.torch, "rand", lambda *a, **k: calls.append(k.get("generator")) or real_rand(*a, **k))
    sample(torch.randn(64, 100), [row(temperature=1.0) for _ in range(64)])
    assert calls == [None]


def test_greedy_without_extras_is_one_argmax(monkeypatch):
    monkeypatch.setattr(sampler, "apply_penalties", lambda *a: pytest.fail("penalty stage ran"))
    monkeypatch.setattr(sampler, "_sample_random", lambda *a: pytest.fail("random stage ran"))
    logits = torch.randn(16, 100)
    assert sample(logits, [row(temperature=0) for _ in range(16)]).token_ids == logits.argmax(-1).tolist()


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 5), [row()])


def test_probabilities_of_dropped_tokens_are_never_drawn():
    logits = torch.arange(10, dtype=torch.float32).expand(5000, 10)
    tokens = draw(logits, [row(temperature=2.0, top_k=3) for _ in range(5000)])
    assert set(tokens) == {7, 8, 9}


# ---- whatever the logits, an id in the vocabulary or an error ---------------------------------------


def test_rows_with_non_finite_logits_get_an_error_and_the_others_their_tokens():
    logits = torch.randn(5, 300)
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    rows = [row(temperature=0), row(temperature=1.0, seed=1), row(temperature=0), row(temperature=0.5, top_p=0.9),
            row(temperature=1.0, seed=2, logprobs=2)]
    result = sample(logits, rows)
    assert sorted(result.errors) == [1, 2, 3] and all("non-finite" in e for e in result.errors.values())
    assert [result.token_ids[i] for i in (1, 2, 3)] == [-1, -1, -1]
    assert result.token_ids[0] == logits[0].argmax().item()
    alone = sample(logits[4:5], [row(temperature=1.0, seed=2, logprobs=2)])
    assert result.token_ids[4] == alone.token_ids[0] and result.logprobs[4] == alone.logprobs[0]


@pytest.mark.parametrize("temperature", [1.0, 1e-4])
def test_a_repetition_penalty_that_underflows_float32_still_draws_a_seen_token(temperature):
    """1e-300 is 0.0 in float32: a positive seen logit divided by it is inf; saturated, it wins the draw."""
    logits = torch.randn(1, 500)
    seen = [3, 40, 41, 250]
    logits[0, seen] = torch.tensor([2.0, 1.0, -1.0, 0.5])
    tokens = {sample(logits, [row(prompt=seen, repetition_penalty=1e-300, temperature=temperature)]).token_ids[0]
              for _ in range(20)}
    assert tokens and tokens <= {3, 40, 250}  # the seen tokens whose logits were positive


def test_sampling_leaves_the_callers_logits_alone():
    logits = torch.randn(3, 200)
    before = logits.clone()
    sample(logits, [row(prompt=[1, 2], repetition_penalty=1.5, temperature=0.7, top_k=20, min_tokens=2),
                    row(temperature=1.0, seed=3), row(output=[5], frequency_penalty=1.0, temperature=0)], eos_token_id=2)
    assert torch.equal(logits, before)


EXTREME = st.sampled_from([0.0, 1.0, -1.0, 1e30, -1e30, 3.4e38, -3.4e38, 1e-45, float("inf"), float("-inf"),
                           float("nan")])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_sampled_id_is_in_the_vocabulary(data):
    vocab = data.draw(st.integers(2, 80))
    n = data.draw(st.integers(1, 5))
    logits = torch.randn(n, vocab) * data.draw(st.sampled_from([1.0, 1e3, 1e30]))
    for _ in range(data.draw(st.integers(0, 6))):
        logits[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, vocab - 1))] = data.draw(EXTREME)
    ids = st.lists(st.integers(0, vocab - 1), max_size=6)
    rows = [row(prompt=data.draw(ids), output=data.draw(ids), seed=data.draw(st.none() | st.integers(0, 99)),
                temperature=data.draw(st.sampled_from([0.0, 1e-5, 0.01, 1.0, 2.0])),
                top_p=data.draw(st.sampled_from([1.0, 0.5, 1e-46])), top_k=data.draw(st.sampled_from([0, 1, 5])),
                min_p=data.draw(st.sampled_from([0.0, 0.5, 1.0])),
                repetition_penalty=data.draw(st.sampled_from([1.0, 2.0, 1e-300, 1e-40])),
                frequency_penalty=data.draw(st.sampled_from([0.0, 2.0, -2.0])),
                presence_penalty=data.draw(st.sampled_from([0.0, -2.0])))
            for _ in range(n)]
    result = sample(logits, rows)
    finite = torch.isfinite(logits).all(-1).tolist()
    for i, t in enumerate(result.token_ids):
        if finite[i]:
            assert i not in result.errors and 0 <= t < vocab
        else:
            assert i in result.errors and t == -1


# ---- one read of the device per step ------------------------------------------------------------------------------


class _Tracked(torch.Tensor):
    """Logits whose derived tensors count the reads that would make the host wait on a GPU."""

    reads = 0

    def _read(self, name, *args):
        _Tracked.reads += 1
        return getattr(torch.Tensor, name)(self.as_subclass(torch.Tensor), *args)

    def tolist(self):
        return self._read("tolist")

    def item(self):
        return self._read("item")

    def __bool__(self):
        return self._read("__bool__")

    def __int__(self):
        return self._read("__int__")

    def __float__(self):
        return self._read("__float__")


@pytest.mark.parametrize("kw", [
    dict(temperature=0), dict(temperature=0.8), dict(temperature=0.8, seed=5), dict(temperature=1.0, top_k=5),
    dict(temperature=1.0, min_p=0.2), dict(temperature=0.7, top_k=40, top_p=0.9),
    dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, min_tokens=3),
    dict(temperature=0.9, frequency_penalty=-0.5, seed=2)], ids=str)
def test_a_batch_is_read_from_the_device_once(kw, monkeypatch):
    """Sampled ids and the finiteness of every row come back in one transfer (issue 14: one host sync per step),
    a NaN row included; only logprobs, and top-p without top-k widening past its first candidates, read more. The
    path counted is a GPU's (torch's ops): the CPU's C++ pass returns plain tensors, and a CPU has no sync to save."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    logits = torch.randn(4, 3000)
    logits[2, 17] = float("nan")
    rows = lambda: [row(prompt=[1, 2, 3], output=[4, 4, 9], **kw) for _ in range(4)]  # noqa: E731 (fresh generators)
    _Tracked.reads = 0
    result = sample(logits.as_subclass(_Tracked), rows(), eos_token_id=2)
    assert _Tracked.reads == 1
    assert list(result.errors) == [2] and result.token_ids[2] == -1
    plain = sample(logits, rows(), eos_token_id=2)
    if "seed" in kw or kw["temperature"] == 0:  # reproducible rows: the counted run drew the same tokens
        assert result.token_ids == plain.token_ids


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), vocab=st.integers(1, 300), levels=st.integers(0, 4), data=st.data())
def test_greedy_ids_are_torch_argmax_and_non_finite_rows_are_named(kernel, n, vocab, levels, data):
    """The greedy rows' one pass over the logits (the CPU kernel: argmax and finiteness together) picks torch's
    argmax, the first maximum among ties (few distinct values make many), in a mixed batch too, and names every row
    holding a NaN or an infinity, wherever it sits (in the vector part or the tail of a row)."""
    logits = torch.randint(0, levels + 1, (n, vocab)).float() if levels else torch.randn(n, vocab)
    bad = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, vocab - 1),
                                       st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=3))
    for r, c, value in bad:
        logits[r, c] = value
    finite = torch.isfinite(logits).all(-1).tolist()
    expected = logits.argmax(-1).tolist()
    load = cpu_kernels.load
    for mixed in (False, True):
        rows = [row(temperature=0.8 if mixed and i % 2 else 0.0, seed=i) for i in range(n)]
        cpu_kernels.load = load if kernel else (lambda: None)
        try:
            result = sample(logits, rows)
        finally:
            cpu_kernels.load = load
        assert sorted(result.errors) == [i for i in range(n) if not finite[i]]
        for i in range(n):
            if finite[i] and rows[i].params.greedy:
                assert result.token_ids[i] == expected[i]


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.2), dict(temperature=1.3, top_k=4, top_p=0.9), dict(temperature=0),
])
def test_probabilities_are_the_distribution_sample_draws_from(kw):
    """sampler.probabilities (what speculative sampling's rule compares) is the slow reference's distribution,
    row by row in a mixed batch, and the logits are left as they were."""
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 1.7], [0.3, -0.2, 2.5, 2.4, 0.0]])
    before = logits.clone()
    got = sampler.probabilities(logits, [row(**kw), row(**kw)])
    assert torch.equal(logits, before)
    for i in range(2):
        want = torch.nn.functional.one_hot(logits[i].argmax(), 5).double() if kw["temperature"] == 0 else \
            expected_probs(logits[i], **kw)
        torch.testing.assert_close(got[i].double(), want, atol=1e-6, rtol=1e-5)


def test_probabilities_apply_penalties_and_min_tokens():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 1.7]])
    r = row(output=[1, 1], frequency_penalty=0.5, min_tokens=3, temperature=1.0)
    got = sampler.probabilities(logits, [r], eos_token_id=4)
    want = torch.tensor([1.0, 2.0 - 1.0, 0.5, -1.0, float("-inf")]).softmax(-1)  # id 1 seen twice; EOS masked
    torch.testing.assert_close(got[0], want)


@pytest.mark.parametrize("seed", range(3))
def test_rejection_sampling_keeps_the_target_distribution(seed):
    """Speculative sampling's rule on one position: tokens proposed from q and verified against p come out with
    p's frequencies (chi-square at 4 degrees of freedom below its 0.04% point), and the acceptance rate is
    sum(min(p, q))."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(5, generator=g).softmax(-1) ** 3
    p /= p.sum()
    q = torch.rand(5, generator=g).softmax(-1)
    n, counts, accepted = 6000, torch.zeros(5), 0
    proposals = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    for d in proposals:
        tokens, a = sampler.rejection_sample(torch.stack([p, p]), q[None], [d], g)
        counts[tokens[0]] += 1
        accepted += a
    want = p * n
    chi2 = ((counts - want) ** 2 / want).sum().item()
    assert chi2 < 20.5, (counts.tolist(), want.tolist())
    rate = torch.minimum(p, q).sum().item()
    assert abs(accepted / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5


def test_probabilities_of_rows_decided_at_different_widths_keep_token_0():
    """truncate pads a row decided among the 64 most likely tokens with id 0 and weight 0 when another row needs
    the whole vocabulary: token 0's probability must survive that padding."""
    vocab = 5000
    peaked = torch.full((vocab,), -10.0)
    peaked[0], peaked[1], peaked[2] = 5.0, 5.0, 4.0
    flat = torch.zeros(vocab)
    alone = sampler.probabilities(peaked[None], [row(temperature=1.0, top_p=0.9)])
    both = sampler.probabilities(torch.stack([peaked, flat]), [row(temperature=1.0, top_p=0.9)] * 2)
    assert alone[0, 0] > 0.4
    torch.testing.assert_close(both[0], alone[0])
    torch.testing.assert_close(both.sum(-1), torch.ones(2))
