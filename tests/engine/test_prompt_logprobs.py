"""SamplingParams.prompt_logprobs: every prompt token's log probability given the tokens before it, against
transformers' teacher-forced log-softmax on the same weights, whatever the chunking, the prefix cache, a
preemption or the other requests of the step; and each prompt token's rank."""
from __future__ import annotations

import random

import pytest
import torch

from tiny_models import hf_model
from kvcache import LLM, SamplingParams
from kvcache.engine import prompt_logprobs

K = 3


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = hf_model(tiny_llama)

    def entries(ids: list[int]) -> list[dict[int, float] | None]:
        """Entry i: {ids[i]: logprob, the K most likely ids: theirs} after ids[:i]; None for the first."""
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        out = [None]
        for i in range(1, len(ids)):
            top = lp[i - 1].topk(K)
            out.append({ids[i]: lp[i - 1, ids[i]].item(), **dict(zip(top.indices.tolist(), top.values.tolist()))})
        return out
    return entries


@pytest.fixture(scope="module")
def ranks(tiny_llama):
    """(lowest, highest) rank of each prompt token after the ones before it, None for the first: 1 + how many ids
    transformers finds more likely, with float ties either way."""
    model = hf_model(tiny_llama)

    def of(ids: list[int]) -> list[tuple[int, int] | None]:
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return [None] + [(int((lp[i - 1] > lp[i - 1, ids[i]] + 1e-5).sum()) + 1,
                          int((lp[i - 1] > lp[i - 1, ids[i]] - 1e-5).sum())) for i in range(1, len(ids))]
    return of


def _assert_ranks(got, want) -> None:
    assert len(got) == len(want) and got[0] is None
    assert all(lo <= g <= hi for g, (lo, hi) in zip(got[1:], want[1:])), (got, want)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _assert_entries(got, want) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-4)


def test_prompt_logprobs_in_chunks_beside_other_requests(tiny_llama, reference, ranks, monkeypatch):
    """Chunks of 16 tokens (log-softmax 5 rows at a time), with requests that do not ask for them in the same steps:
    every entry matches, and every request's tokens are those of a run where nobody asked (the sampling rows are the
    right ones)."""
    monkeypatch.setattr(prompt_logprobs, "SLICE", 5)
    prompts = [_prompt(n, seed) for seed, n in enumerate((45, 9, 30, 2))]
    plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=K)
    kw = dict(kv_cache_memory="4MiB", max_model_len=512, max_num_batched_tokens=16, enable_prefix_caching=False)
    base = LLM(tiny_llama, **kw).generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    outs = LLM(tiny_llama, **kw).generate([{"prompt_token_ids": p} for p in prompts],
                                          [asked, plain, asked, asked], use_tqdm=False)
    for p, b, o, params in zip(prompts, base, outs, [asked, plain, asked, asked]):
        assert o.outputs[0].token_ids == b.outputs[0].token_ids
        if params.prompt_logprobs is None:
            assert o.prompt_logprobs is None and o.prompt_logprob_ranks is None
        else:
            _assert_entries(o.prompt_logprobs, reference(p))
            _assert_ranks(o.prompt_logprob_ranks, ranks(p))


def test_a_cached_prefix_is_computed_again_for_them(tiny_llama, reference):
    llm = LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=512, block_size=8)
    p = _prompt(40, 7)
    llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1), use_tqdm=False)  # now cached
    hits = llm.engine.kv.stats.hits
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, prompt_logprobs=K, n=2, seed=0),
                       use_tqdm=False)[0]
    _assert_entries(out.prompt_logprobs, reference(p))
    assert llm.engine.kv.stats.hits == hits and len(out.outputs) == 2
    again = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.prompt_logprobs is None and llm.engine.kv.stats.hits > hits  # others still take the prefix


def test_preempted_sequences_record_each_entry_once(tiny_llama, reference, ranks):
    """A pool too small for all of them: sequences are preempted mid-prompt and recomputed; the entries are still
    one per prompt token and the reference's."""
    prompts = [_prompt(60, 20 + i) for i in range(6)]
    llm = LLM(tiny_llama, kv_cache_memory="160KiB", max_model_len=128, block_size=8, max_num_batched_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        want = [None] + [{t: d[t]} for t, d in zip(p[1:], reference(p)[1:])]
        _assert_entries(o.prompt_logprobs, want)
        _assert_ranks(o.prompt_logprob_ranks, ranks(p))


def test_a_step_takes_at_most_max_num_seqs_prompt_rows_through_the_lm_head(tiny_llama, reference, monkeypatch):
    """The activations start-up sizes count max_num_seqs rows of logits: prompts whose every row needs them are
    cut to that many rows a step (together), the others are not, and every entry still matches."""
    from kvcache.engine import model_runner
    rows = []
    real = model_runner.ModelRunner._forward

    def spy(self, specs, *a, **k):
        rows.append(sum(c.num_logits for c in specs if c.needs_logits and c.num_logits > 1))
        return real(self, specs, *a, **k)
    monkeypatch.setattr(model_runner.ModelRunner, "_forward", spy)
    llm = LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    prompts = [_prompt(30, 40 + i) for i in range(3)]
    plain = _prompt(50, 50)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + [plain]],
                        [SamplingParams(max_tokens=2, prompt_logprobs=1)] * 3 + [SamplingParams(max_tokens=2)],
                        use_tqdm=False)
    assert max(rows) == 8 and len([r for r in rows if r]) >= 3 * 30 // 8
    for p, o in zip(prompts, outs):  # each prompt token's own logprob (K of the reference's top entries aside)
        assert len(o.prompt_logprobs) == len(p)
        _assert_entries([None] + [{t: e[t]} for t, e in zip(p[1:], o.prompt_logprobs[1:])],
                        [None] + [{t: d[t]} for t, d in zip(p[1:], reference(p)[1:])])
    assert outs[3].prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 1.5, "3"])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises((ValueError, TypeError), match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
