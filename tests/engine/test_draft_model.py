"""Speculative decoding with a draft model: greedy outputs token-identical to plain decoding (batched, chunked
prefill, preemption, KV formats), sampled ones with plain decoding's seeded draws and its distribution, the draft's
own KV cache rolled back and given back, and the checkpoint checked against the target before anything loads."""
from __future__ import annotations

import json
import random
import shutil

import pytest
from test_spec_decode import (DISTRIBUTIONS, _chi_square_threshold, _greedy, _two_sample_chi_square, _workload,
                              interleaved_workload, step_with_aborts)

from kvcache import LLM, SamplingParams
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def other_llama(tmp_path_factory) -> str:
    """A second random llama with the same tokenizer: it proposes, and is almost always wrong."""
    return make_tiny_model(str(tmp_path_factory.mktemp("other_llama")), "llama", seed=1)


def _draft(model: str, k: int = 3, **kw) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **kw}


def _with_draft_cache(kw: dict) -> dict:
    """`kw` with twice its KV budget: the draft (of the target's shape) takes half, so the target's pool is as big
    as the plain engine's."""
    from kvcache.plan.sizes import parse_bytes
    return {**kw, "kv_cache_memory": 2 * parse_bytes(kw["kv_cache_memory"])}


CASES = {
    "batched": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=24),
    "preemption": dict(kv_cache_memory=48 * 8 * 512, block_size=8),
    "int8": dict(kv_cache_dtype="int8"),
    "radix": dict(prefix_caching_algo="radix"),
    "int4-weights": dict(quantization="int4"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_equal_plain_decoding(tiny_llama, other_llama, case):
    """The target as its own draft proposes what it will accept (nearly every token); another model proposes
    wrongly; the outputs are plain decoding's either way, and neither pool keeps a block."""
    kw = {"kv_cache_memory": "8MiB", **CASES[case]}
    prompts, max_tokens = _workload(seed=len(case), outputs=(40, 100) if case == "preemption" else (1, 60))
    plain = _greedy(LLM(tiny_llama, **kw), prompts, max_tokens)
    for draft in (tiny_llama, other_llama):
        llm = LLM(tiny_llama, speculative_config=_draft(draft), **_with_draft_cache(kw))
        assert _greedy(llm, prompts, max_tokens) == plain, draft
        info = llm.kv_cache_info()
        proposed, accepted = info["spec_decode_num_draft_tokens"], info["spec_decode_num_accepted_tokens"]
        assert proposed > 0
        if draft == tiny_llama:
            assert accepted >= 0.9 * proposed and llm.engine.stats.steps < sum(max_tokens) // 2
        else:
            assert accepted < 0.1 * proposed
        assert info["draft_model"]["used_blocks"] == 0
        if case == "preemption":
            assert info["num_preemptions"] > 0


def test_seeded_sampled_requests_are_reproducible(sharp_llama):
    """A seeded request draws its proposals and the rejection rule's numbers from its generator: the same seeds
    give the same tokens again (not plain decoding's draws: the draft's draws come first)."""
    prompts, _ = _workload(seed=4, n=8)
    params = [SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.1, seed=i, max_tokens=30,
                             ignore_eos=True, logprobs=2) for i in range(len(prompts))]
    llm = LLM(sharp_llama, kv_cache_memory="8MiB", speculative_config=_draft(sharp_llama))
    runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False) for _ in range(2)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    for o in runs[0]:
        c = o.outputs[0]
        assert len(c.token_ids) == len(c.logprobs) == 30 and all(t in lp for t, lp in zip(c.token_ids, c.logprobs))
    info = llm.kv_cache_info()
    assert 0.5 * info["spec_decode_num_draft_tokens"] < info["spec_decode_num_accepted_tokens"]
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("case", list(DISTRIBUTIONS))
@pytest.mark.parametrize("draft", ["self", "blunt", "other"])
def test_sampled_outputs_follow_the_target_distribution(sharp_llama, blunt_llama, other_llama, case, draft):
    """2,000 unseeded 4-token samples with a draft model and without: two-sample chi-square below the 0.1% point
    at each position. Drafts: the target itself (q = p up to rounding: nearly every proposal accepted), the same
    weights at 4x the temperature (q overlaps p: a third to half of the proposals rejected and the residual
    max(0, p - q) drawn from), and a random other model (q far from p: nearly all rejected). Drawing from p
    instead of the residual, or accepting with min(1, 2p/q), fails the `blunt` cases."""
    import torch
    prompt = _workload(seed=3, n=1)[0][0]
    params = SamplingParams(max_tokens=4, ignore_eos=True, **DISTRIBUTIONS[case])
    samples = []
    drafts = {"self": sharp_llama, "blunt": blunt_llama, "other": other_llama}
    for kw in ({}, {"speculative_config": _draft(drafts[draft])}):
        llm = LLM(sharp_llama, kv_cache_memory="8MiB", max_num_seqs=256, **kw)
        torch.manual_seed(0)
        samples.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": prompt}] * 2000, params,
                                                                     use_tqdm=False)])
        llm.engine.check_no_leaks()
    info = llm.kv_cache_info()
    proposed, accepted = info["spec_decode_num_draft_tokens"], info["spec_decode_num_accepted_tokens"]
    share = accepted / proposed
    assert proposed >= 2000 and {"self": share > 0.9, "blunt": 0.15 < share < 0.8, "other": share < 0.15}[draft], share
    for pos in range(4):
        stat, df = _two_sample_chi_square([s[pos] for s in samples[0]], [s[pos] for s in samples[1]])
        assert df >= 1 and stat < _chi_square_threshold(df), (pos, stat, df)


def test_aborts_preemptions_and_a_full_draft_pool_leak_nothing(tiny_llama, monkeypatch):
    """Stepped by hand with aborts, a pool small enough to preempt, and a draft pool that refuses some
    allocations (those sequences decode plainly that step): every greedy output that finishes is plain decoding's
    and both pools get every block back."""
    prompts, params, plain = interleaved_workload(tiny_llama)
    eng = LLM(tiny_llama, kv_cache_memory=2 * 48 * 8 * 512, block_size=8, max_num_batched_tokens=64,
              speculative_config=_draft(tiny_llama)).engine
    rng = random.Random(2)
    allocate = eng.drafter.kv.allocate
    refused = []

    def flaky(seq_id, num_tokens, prefix=()):
        if rng.random() < 0.2:
            refused.append(seq_id)
            return False
        return allocate(seq_id, num_tokens, prefix)
    monkeypatch.setattr(eng.drafter.kv, "allocate", flaky)
    done = step_with_aborts(eng, prompts, params, rng, 0.08)
    assert refused and eng.kv_cache_info()["num_preemptions"] > 0
    checked = [i for i in range(len(prompts)) if f"r{i}" in done]
    assert len(checked) >= 6
    for i in checked:  # sampled ones draw the draft's tokens first: their length only
        assert done[f"r{i}"] == plain[i] if i % 3 != 2 else len(done[f"r{i}"]) == params[i].max_tokens, i


def _copy(src: str, dst, edit_config=None, edit_tokenizer=None) -> str:
    shutil.copytree(src, dst)
    for name, edit in (("config.json", edit_config), ("tokenizer.json", edit_tokenizer)):
        if edit:
            path = dst / name
            data = json.loads(path.read_text())
            edit(data)
            path.write_text(json.dumps(data))
    return str(dst)


def test_a_draft_that_cannot_propose_for_the_target_is_refused(tiny_llama, tmp_path):
    def swap_two_tokens(t):
        vocab = t["model"]["vocab"]
        vocab["w3"], vocab["w4"] = vocab["w4"], vocab["w3"]
    cases = [
        (_copy(tiny_llama, tmp_path / "vocab", edit_config=lambda c: c.update(vocab_size=384)),
         "vocabulary of 384 tokens, the target 320"),
        (_copy(tiny_llama, tmp_path / "tokenizer", edit_tokenizer=swap_two_tokens), "another tokenizer than the target"),
        (_copy(tiny_llama, tmp_path / "context", edit_config=lambda c: c.update(max_position_embeddings=128)),
         "context of 128 tokens, below the target's max_model_len 512"),
        (str(tmp_path / "missing"), "does not exist"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama, kv_cache_memory="8MiB", speculative_config=_draft(path))
    # a shorter max_model_len fits the short draft
    LLM(tiny_llama, kv_cache_memory="8MiB", max_model_len=128, speculative_config=_draft(cases[2][0]))


def test_one_budget_holds_both_caches_with_as_many_blocks_each(tiny_llama, tiny_model_dirs):
    """vLLM's split: the KV budget pays for the target's blocks and the draft's, the same count in both; a draft
    with a smaller cache per token leaves the target the larger share."""
    budget = 4 * 2**20
    same = LLM(tiny_llama, kv_cache_memory=budget, speculative_config=_draft(tiny_llama)).kv_cache_info()
    alone = LLM(tiny_llama, kv_cache_memory=budget).kv_cache_info()
    assert same["num_blocks"] == same["draft_model"]["num_blocks"] == alone["num_blocks"] // 2
    mqa = tiny_model_dirs["llama-mqa-tied"]  # 1 KV head against the target's 2: half the bytes per token
    small = LLM(tiny_llama, kv_cache_memory=budget, speculative_config=_draft(mqa)).kv_cache_info()
    assert small["num_blocks"] == small["draft_model"]["num_blocks"] == alone["num_blocks"] * 2 // 3
    for info in (same, small):
        assert info["total_bytes"] + info["draft_model"]["kv_bytes"] <= budget + 2 * 16 * 512  # + the null blocks


def test_a_budget_that_holds_no_block_of_both_is_refused_with_the_numbers(tiny_llama):
    with pytest.raises(ValueError, match=r"holds no block of the target and the draft model together \(16 tokens x "
                                         r"\(512 \+ 512\) bytes = 16,384 bytes\)"):
        LLM(tiny_llama, kv_cache_memory=12_000, speculative_config=_draft(tiny_llama))


def test_a_failing_draft_forward_costs_a_step_its_proposals_not_the_requests(tiny_llama, monkeypatch):
    prompts, max_tokens = _workload(seed=5, n=4)
    plain = _greedy(LLM(tiny_llama, kv_cache_memory="8MiB"), prompts, max_tokens)
    llm = LLM(tiny_llama, kv_cache_memory="16MiB", speculative_config=_draft(tiny_llama))
    forward, calls = llm.engine.drafter.runner.forward, []

    def failing(specs):
        calls.append(len(specs))
        if len(calls) % 3 == 0:
            raise RuntimeError("injected draft failure")
        return forward(specs)
    monkeypatch.setattr(llm.engine.drafter.runner, "forward", failing)
    assert _greedy(llm, prompts, max_tokens) == plain
    assert len(calls) >= 6 and llm.kv_cache_info()["spec_decode_num_accepted_tokens"] > 0
    llm.engine.drafter.check_no_leaks()


def test_the_drafts_catch_up_is_chunked_at_the_token_budget(tiny_llama, monkeypatch):
    """Long prompts' draft prefill runs in forwards of at most max_num_batched_tokens tokens, as the target's does;
    the outputs stay plain decoding's."""
    prompts, _ = _workload(seed=12, n=4)
    prompts = [(p * 20)[:400] for p in prompts]
    kw = dict(kv_cache_memory="16MiB", max_num_batched_tokens=64)
    plain = _greedy(LLM(tiny_llama, **kw), prompts, [20] * 4)
    llm = LLM(tiny_llama, speculative_config=_draft(tiny_llama), **_with_draft_cache(kw))
    forward, sizes = llm.engine.drafter.runner.forward, []

    def counted(specs):
        sizes.append(sum(len(c.token_ids) for c in specs))
        return forward(specs)
    monkeypatch.setattr(llm.engine.drafter.runner, "forward", counted)
    assert _greedy(llm, prompts, [20] * 4) == plain
    assert max(sizes) <= 64 + 4 and sum(s > 32 for s in sizes) >= 4  # chunks of the prompts, none above the budget
    llm.engine.drafter.check_no_leaks()
