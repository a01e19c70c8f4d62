"""LLMEngine: input validation, abort, n > 1 block sharing, seeds, stop conditions, and the
block-accounting invariants under random interleavings of add / step / abort."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvcache import LLM, SamplingParams
from kvcache.engine.sequence import SequenceStatus

BLOCK = 16
POOL_BLOCKS = 16  # 256 tokens
MAX_MODEL_LEN = 384  # more than the pool holds, so "needs more blocks than the pool" is reachable
BUDGET = 32  # max_num_batched_tokens: prompts over 32 tokens are prefilled in chunks

GREEDY = dict(temperature=0, ignore_eos=True)


def make_llm(path: str, per_token: int, num_blocks: int, block_size: int, **kwargs) -> LLM:
    llm = LLM(path, kv_cache_memory=num_blocks * block_size * per_token, block_size=block_size, **kwargs)
    assert llm.kv_cache_info()["num_blocks"] == num_blocks
    return llm


@pytest.fixture(scope="module")
def per_token(tiny_llama) -> int:
    return LLM(tiny_llama, kv_cache_memory="1MiB").kv_cache_info()["bytes_per_token"]


@pytest.fixture(scope="module")
def llm(tiny_llama, per_token) -> LLM:
    return make_llm(tiny_llama, per_token, POOL_BLOCKS, BLOCK, max_model_len=MAX_MODEL_LEN,
                    max_num_batched_tokens=BUDGET)


@pytest.fixture
def engine(llm):
    """The module's engine, checked empty before and after each test, its prefix cache emptied
    so that one test's prompts are not cached hits in the next."""
    eng = llm.engine
    assert_idle(eng)
    eng.reset_prefix_cache()
    yield eng
    leftover = list(eng.requests)
    for rid in leftover:
        eng.abort_request(rid)
    assert leftover == [], f"test left requests behind: {leftover}"
    assert_idle(eng)


def assert_idle(eng) -> None:
    eng.check_no_leaks()
    pool = eng.kv.pool
    assert not eng.requests
    assert pool.num_free == pool.num_usable
    assert all(r == 0 for r in pool.ref_counts)
    assert eng.kv.block_tables == {}
    assert not eng.scheduler.waiting and not eng.scheduler.running


def prompt_of(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def drain(eng, max_steps: int = 10_000) -> dict:
    """Step until nothing is unfinished; the finished outputs by request id."""
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return done
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"still unfinished after {max_steps} steps")


def run_alone(eng, prompt: list[int], params: SamplingParams, rid: str = "alone"):
    eng.add_request(rid, prompt, params)
    return drain(eng)[rid]


def held_blocks(eng) -> int:
    return eng.kv.pool.num_usable - eng.kv.pool.num_free


# ---- bad input ------------------------------------------------------------------------------


BAD_INPUTS = [
    pytest.param(prompt_of(MAX_MODEL_LEN), SamplingParams(max_tokens=1),
                 r"prompt has 384 tokens; max_model_len is 384", id="prompt-equals-max-model-len"),
    pytest.param(prompt_of(500), SamplingParams(max_tokens=1),
                 r"prompt has 500 tokens; max_model_len is 384", id="prompt-over-max-model-len"),
    pytest.param(prompt_of(300), SamplingParams(max_tokens=100),
                 r"prompt has 300 tokens and max_tokens is 100: 400 is above max_model_len 384",
                 id="prompt-plus-max-tokens"),
    pytest.param(prompt_of(200), SamplingParams(max_tokens=100),
                 r"request needs 19 KV blocks \(300 tokens\) but the whole pool has 16", id="more-blocks-than-pool"),
    pytest.param(prompt_of(200), SamplingParams(max_tokens=57),
                 r"request needs 17 KV blocks \(257 tokens\) but the whole pool has 16", id="one-block-more-than-pool"),
    pytest.param([5, 320], None, r"ints in \[0, 320\); got \[320\]", id="token-id-equals-vocab"),
    pytest.param([5, 6, 100_000, -1], None, r"ints in \[0, 320\); got \[100000, -1\]", id="token-ids-out-of-vocab"),
    pytest.param([5, 6.0], None, r"ints in \[0, 320\)", id="token-id-not-int"),
    pytest.param([], None, r"the prompt is empty", id="empty-ids"),
    pytest.param("", None, r"the prompt is empty", id="empty-text"),
]


@pytest.mark.parametrize("prompt, params, message", BAD_INPUTS)
def test_bad_input_raises_and_leaves_no_state(engine, prompt, params, message):
    stats_before = (engine.stats.prompt_tokens, dict(engine.stats.requests_finished))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.requests
    assert (engine.stats.prompt_tokens, dict(engine.stats.requests_finished)) == stats_before
    assert_idle(engine)
    # The id was not taken and the engine still serves.
    out = run_alone(engine, [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY), rid="bad")
    assert len(out.outputs[0].token_ids) == 3


def test_request_that_exactly_fits_pool_and_context_is_accepted(engine):
    # 200 + 56 = 256 tokens = the whole pool (16 blocks); the prompt is prefilled in chunks of 32.
    out = run_alone(engine, prompt_of(200), SamplingParams(max_tokens=56, **GREEDY))
    assert len(out.outputs[0].token_ids) == 56
    assert engine.stats.peak_used_blocks == POOL_BLOCKS


def test_duplicate_request_id(engine):
    engine.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    waiting = list(engine.scheduler.waiting)
    with pytest.raises(ValueError, match=r"request id 'dup' is already in use"):
        engine.add_request("dup", [8, 9], SamplingParams(max_tokens=2, **GREEDY))
    assert list(engine.scheduler.waiting) == waiting and len(waiting) == 1
    done = drain(engine)
    assert list(done) == ["dup"]
    assert done["dup"].prompt_token_ids == [5, 6, 7]
    assert len(done["dup"].outputs[0].token_ids) == 4


def test_llm_generate_with_one_bad_prompt_submits_nothing(llm, engine):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=r"max_model_len is 384"):
        llm.generate([good, good, {"prompt_token_ids": prompt_of(400)}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert_idle(engine)
    outs = llm.generate([good, good], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_building_an_engine_leaves_the_process_float_mode_alone(tiny_llama):
    """An engine is a library object: it must not switch the whole process to flush-to-zero floats,
    which silently changes user code (numpy, Python floats) and breaks hypothesis' float strategies."""
    smallest_normal = 2.2250738585072014e-308
    torch.set_flush_denormal(False)
    assert smallest_normal / 2 > 0
    try:
        LLM(tiny_llama, kv_cache_memory="1MiB")
        assert smallest_normal / 2 > 0, "LLM(...) turned on flush-to-zero for the calling thread"
    finally:
        torch.set_flush_denormal(False)


# ---- abort ----------------------------------------------------------------------------------


def test_abort_while_waiting(engine):
    aborted_before = engine.stats.requests_finished.get("abort", 0)
    engine.add_request("w", prompt_of(20), SamplingParams(max_tokens=5))
    assert engine.has_unfinished_requests()
    assert engine.abort_request("w") is True
    assert engine.abort_request("w") is False
    assert engine.abort_request("never-added") is False
    assert engine.stats.requests_finished["abort"] == aborted_before + 1
    assert engine.step() == []
    assert_idle(engine)


def test_abort_mid_prefill(engine):
    engine.add_request("p", prompt_of(100), SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    (seq,) = engine.requests["p"].seqs
    assert 0 < seq.num_computed_tokens < 100  # only a chunk of the prompt is in the cache
    assert seq.num_output_tokens == 0
    assert held_blocks(engine) == len(engine.kv.block_tables[seq.seq_id]) > 0
    assert engine.abort_request("p")
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    assert_idle(engine)


def test_abort_mid_decode_leaves_the_other_request_intact(engine):
    a_prompt, b_prompt = prompt_of(40, 1), prompt_of(23, 2)
    params = SamplingParams(max_tokens=30, **GREEDY)
    b_alone = run_alone(engine, b_prompt, params).outputs[0].token_ids

    engine.add_request("a", a_prompt, params)
    engine.add_request("b", b_prompt, params)
    a_seq = engine.requests["a"].seqs[0]
    while a_seq.num_output_tokens < 5:
        assert engine.step() == []
    assert held_blocks(engine) > 0
    assert engine.abort_request("a")
    assert a_seq.seq_id not in engine.kv.block_tables
    done = drain(engine)
    assert list(done) == ["b"]
    assert done["b"].outputs[0].token_ids == b_alone
    assert_idle(engine)


def test_abort_streaming_request_mid_decode(engine):
    engine.add_request("s", prompt_of(10), SamplingParams(max_tokens=50, **GREEDY), stream=True)
    seen = []
    while len(seen) < 4:
        for out in engine.step():
            assert out.request_id == "s" and not out.finished
            seen.append(list(out.outputs[0].token_ids))
    assert [len(s) for s in seen] == [1, 2, 3, 4]
    assert all(seen[i] == seen[-1][:i + 1] for i in range(4))
    assert engine.abort_request("s")
    assert engine.step() == []
    assert_idle(engine)


def test_abort_n_gt_1_with_shared_blocks(engine):
    engine.add_request("n", prompt_of(40), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=20))
    req = engine.requests["n"]
    while not (len(req.seqs) == 3 and all(s.num_output_tokens >= 3 for s in req.seqs)):
        engine.step()
    assert max(engine.kv.pool.ref_counts) == 3
    assert engine.abort_request("n")
    assert all(s.finish_reason == "abort" for s in req.seqs)
    assert_idle(engine)


# ---- n > 1 and seeds ---------------------------------------------------------------------------


def test_n_samples_share_the_prompts_full_blocks(engine):
    prompt = prompt_of(40)  # 2 full blocks + 8 tokens in a third
    engine.add_request("n", prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True))
    req = engine.requests["n"]
    while len(req.seqs) < 3:
        engine.step()
    tables = [engine.kv.block_tables[s.seq_id] for s in req.seqs]
    refs = engine.kv.pool.ref_counts
    full = tables[0][:2]
    assert all(t[:2] == full for t in tables)
    assert [refs[b] for b in full] == [3, 3]
    # The partly filled block is not shared: each sample writes its own next tokens there.
    partial = [t[2] for t in tables]
    assert len(set(partial)) == 3 and all(refs[b] == 1 for b in partial)
    assert held_blocks(engine) == 2 + 3

    out = drain(engine)["n"]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # independent samples
    assert_idle(engine)


@pytest.mark.parametrize("prompt_len", [40, 48, 5])  # partial last block, exactly full blocks, one partial block
def test_greedy_n_samples_equal_the_single_greedy_output(engine, prompt_len):
    """All n greedy samples read the shared and the copied prompt K/V: any corruption shows."""
    prompt = prompt_of(prompt_len, prompt_len)
    single = run_alone(engine, prompt, SamplingParams(max_tokens=20, **GREEDY)).outputs[0].token_ids
    out = run_alone(engine, prompt, SamplingParams(n=4, max_tokens=20, **GREEDY))
    assert [c.token_ids for c in out.outputs] == [single] * 4


def test_same_seed_same_outputs_different_seed_different_outputs(llm, engine):
    prompts = [{"prompt_token_ids": prompt_of(30, 1)}, {"prompt_token_ids": prompt_of(9, 2)}]

    def run(seed):
        outs = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        assert all(len(o.outputs) == 2 for o in outs)
        return [[c.token_ids for c in o.outputs] for o in outs]

    first = run(7)
    assert run(7) == first
    assert run(1000) != first
    assert all(o[0] != o[1] for o in first)  # the n samples of one request differ
    assert_idle(engine)


def test_seeded_request_does_not_depend_on_the_batch(llm, engine):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    target = {"prompt_token_ids": prompt_of(25, 5)}
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": prompt_of(n, n)} for n in (3, 50, 17, 70)]
    batch = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 2 + [seeded]
                         + [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)] * 2, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone


# ---- stop conditions ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(llm):
    """A prompt and its first 24 greedy tokens (ignoring EOS)."""
    prompt = prompt_of(12, 99)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0]
    return prompt, out.outputs[0].token_ids


def test_max_tokens_finishes_with_length(llm, engine, reference):
    prompt, tokens = reference
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=7, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == tokens[:7]
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    assert c.text == llm.get_tokenizer().decode(tokens[:7])


@pytest.mark.parametrize("span", [(4, 5), (6, 8), (0, 1)])
def test_stop_string_truncates_text(llm, engine, reference, span):
    prompt, tokens = reference
    tok = llm.get_tokenizer()
    stop = tok.decode(tokens[span[0]:span[1]])  # the text of one or two output tokens
    # The engine must stop at the first token after which the text contains the stop string.
    k = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k]))
    full = tok.decode(tokens[:k])
    expected_text = full[:full.index(stop)]
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, stop=["never", stop], **GREEDY),
                     use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == expected_text
    assert stop not in c.text
    assert c.token_ids == tokens[:k]


def test_stop_string_that_never_appears(llm, engine, reference):
    prompt, tokens = reference
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, stop="zzz", **GREEDY),
                     use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("length", None, tokens)


def test_stop_token_ids(llm, engine, reference):
    prompt, tokens = reference
    stop_id = tokens[5]
    j = tokens.index(stop_id)
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, stop_token_ids=[1, stop_id], **GREEDY),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == tokens[:j + 1]  # the stop token is kept
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)


@pytest.fixture(scope="module")
def eos_case(llm):
    """A prompt whose greedy continuation (ignoring EOS) contains EOS, and that continuation."""
    eos = llm.get_tokenizer().eos_token_id
    assert eos == 2
    prompts = [prompt_of(random.Random(i).randint(3, 12), 1000 + i) for i in range(256)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=40, **GREEDY),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        if eos in o.outputs[0].token_ids[1:-1]:
            return p, o.outputs[0].token_ids, eos
    pytest.fail("no greedy continuation of 256 random prompts contains EOS; widen the search")


def test_eos_stops_unless_ignore_eos(llm, engine, eos_case):
    prompt, tokens, eos = eos_case
    j = tokens.index(eos)
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == tokens[:j + 1]
    assert c.finish_reason == "stop"
    assert c.stop_reason is None
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == tokens and c.finish_reason == "length"


def test_min_tokens_holds_back_eos(llm, engine, eos_case):
    prompt, tokens, eos = eos_case
    j = tokens.index(eos)
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, min_tokens=j + 2),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids[:j] == tokens[:j]
    assert eos not in c.token_ids[:j + 2]
    assert len(c.token_ids) >= j + 2


# ---- invariants under random interleavings -------------------------------------------------------

H_BLOCK, H_POOL, H_LEN, H_BUDGET = 4, 12, 40, 8  # 48 tokens of cache, 8 tokens per step


# The random-interleaving test runs on the fp32 cache (48 tokens in 4-token blocks) and on int4 (KIVI: 64-token
# blocks, each sequence also holding 2 private blocks for its key residual; 8 blocks hold 2 sequences at most).
H_FORMATS = {"float32": (H_POOL, H_BLOCK), "int4": (8, 64)}


@pytest.fixture(scope="module", params=list(H_FORMATS))
def kv_format(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def small(tiny_llama, kv_format) -> LLM:
    pool, block = H_FORMATS[kv_format]
    per_token = LLM(tiny_llama, kv_cache_memory="1MiB", kv_cache_dtype=kv_format).kv_cache_info()["bytes_per_token"]
    return make_llm(tiny_llama, per_token, pool, block, max_model_len=H_LEN, max_num_batched_tokens=H_BUDGET,
                    max_num_seqs=4, kv_cache_dtype=kv_format)


@pytest.fixture(scope="module")
def oracle(tiny_llama, kv_format):
    """Greedy outputs of a prompt run alone on a roomy engine with the same cache format, memoized."""
    ref = LLM(tiny_llama, kv_cache_memory="2MiB", max_model_len=H_LEN, kv_cache_dtype=kv_format)
    memo: dict[tuple, list[int]] = {}

    def greedy(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = ref.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, **GREEDY),
                                     use_tqdm=False)[0].outputs[0].token_ids
        return memo[key]

    return greedy


def check_invariants(eng) -> None:
    kv, pool = eng.kv, eng.kv.pool
    refs = pool.ref_counts
    assert refs[0] == 0, "the null block is never handed out"
    held = sum(1 for r in refs[1:] if r > 0)
    assert pool.num_free + held == pool.num_usable
    assert all(r >= 0 for r in refs)
    in_tables = Counter(b for t in kv.block_tables.values() for b in t)
    private = Counter(b for p in kv.private_blocks.values() for b in p)
    assert set(kv.private_blocks) <= set(kv.block_tables)
    assert all(len(p) == kv.seq_blocks for p in kv.private_blocks.values())
    assert all(refs[b] == 1 and b not in in_tables for b in private), "a private block is shared"
    assert 0 not in in_tables
    # Every reference is a table entry and every table entry a reference.
    for b, count in in_tables.items():
        assert refs[b] == count >= 1, f"block {b}: ref count {refs[b]}, in {count} tables"
    assert sum(refs) == sum(in_tables.values()) + sum(private.values())
    live = {s.seq_id: s for r in eng.requests.values() for s in r.seqs if not s.is_finished}
    assert set(kv.block_tables) <= set(live), "a finished or unknown sequence still holds a table"
    for s in eng.scheduler.running:
        assert s.seq_id in live and s.status is SequenceStatus.RUNNING
        assert len(kv.block_tables.get(s.seq_id, ())) * kv.block_size >= s.num_computed_tokens
    for s in eng.scheduler.waiting:
        assert s.status is SequenceStatus.WAITING


def _spy_shared_writes(eng) -> list:
    """Record (block, ref count) for any K/V write into a block that is not held by exactly one sequence.

    Installed once per engine; returns the engine's record (the caller clears it per example)."""
    store = eng.store
    if not hasattr(store, "_violations"):
        write = store.write
        store._violations, store._writes = [], 0

        def check(slot_mapping, plan=None):
            store._writes += 1
            refs = eng.kv.pool.ref_counts
            blocks = [slot // store.block_size for slot in slot_mapping.tolist()]
            if plan is not None:  # KIVI: key groups quantized into blocks, residual keys into private blocks
                blocks += plan.group_blocks.tolist() + (plan.resid_write * plan.resid_unit // store.row_elems).tolist()
            for block in blocks:
                if refs[block] != 1:
                    store._violations.append((block, refs[block]))

        def checked(layer, slot_mapping, k, v, plan=None):
            check(slot_mapping, plan)
            return write(layer, slot_mapping, k, v, plan)

        store.write = checked
        if hasattr(store, "native_write"):  # the fused CPU decode path's kernel writes where this says
            native = store.native_write

            def checked_native(layer, slot_mapping):
                check(slot_mapping)
                return native(layer, slot_mapping)

            store.native_write = checked_native
    return store._violations


_add = st.tuples(st.just("add"), st.integers(1, 36), st.integers(1, 12), st.integers(1, 3),
                 st.sampled_from(["greedy", "seeded"]), st.integers(0, 2**16))
_step = st.tuples(st.just("step"), st.integers(1, 4))
_abort = st.tuples(st.just("abort"), st.integers(0, 50))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.one_of(_add, _step, _step, _abort), max_size=24))
def test_random_interleavings_keep_blocks_consistent(small, oracle, ops):
    eng = small.engine
    for rid in list(eng.requests):  # a previous failing example may have left some behind
        eng.abort_request(rid)
    violations = _spy_shared_writes(eng)
    violations.clear()
    preemptions_before = eng.scheduler.num_preemptions
    steps_before, writes_before = eng.stats.steps, eng.store._writes
    live: dict[str, SamplingParams] = {}
    submitted: dict[str, tuple[list[int], SamplingParams]] = {}
    done: dict = {}
    counter = 0

    def absorb(outs):
        for out in outs:
            if out.finished:
                done[out.request_id] = out
                assert len(out.outputs) == live.pop(out.request_id).n

    for op in ops:
        if op[0] == "add":
            _, n_prompt, max_tokens, n, kind, seed = op
            prompt = prompt_of(n_prompt, seed)
            params = (SamplingParams(n=n, max_tokens=max_tokens, **GREEDY) if kind == "greedy" else
                      SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True))
            rid = f"r{counter}"
            counter += 1
            if n_prompt + max_tokens > H_LEN:
                with pytest.raises(ValueError):
                    eng.add_request(rid, prompt, params)
            else:
                eng.add_request(rid, prompt, params)
                live[rid] = params
                submitted[rid] = (prompt, params)
        elif op[0] == "step":
            for _ in range(op[1]):
                absorb(eng.step())
        else:
            if live:
                rid = sorted(live)[op[1] % len(live)]
                assert eng.abort_request(rid)
                del live[rid]
        assert set(eng.requests) == set(live)
        check_invariants(eng)
        assert violations == [], f"wrote into shared blocks (block, refs): {violations[:5]}"

    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        absorb(eng.step())
        check_invariants(eng)
    assert live == {}
    assert violations == [], f"wrote into shared blocks (block, refs): {violations[:5]}"
    eng.check_no_leaks()
    assert eng.kv.pool.num_free == eng.kv.pool.num_usable and eng.kv.block_tables == {}

    # The spy sees the model's K/V writes (else the shared-block check above proves nothing).
    assert eng.stats.steps == steps_before or eng.store._writes > writes_before
    event(f"preempted: {eng.scheduler.num_preemptions > preemptions_before}")
    event(f"n > 1 finished: {any(len(o.outputs) > 1 for o in done.values())}")
    for rid, out in done.items():
        prompt, params = submitted[rid]
        assert out.prompt_token_ids == prompt
        assert all(c.finish_reason == "length" and len(c.token_ids) == params.max_tokens for c in out.outputs)
        if params.greedy:  # whatever the interleaving, preemption or fork: the tokens of the prompt alone
            expected = oracle(prompt, params.max_tokens)
            assert [c.token_ids for c in out.outputs] == [expected] * params.n, rid


def test_kv_cache_memory_accepts_sizes_and_shares():
    from kvcache.config import EngineConfig
    from kvcache.plan.sizes import parse_bytes
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes(1024) == 1024
    assert 0 < parse_bytes("10%") < parse_bytes("20%")
    for bad in ("0%", "150%", "x%", "-1GiB", "12 parsecs", 0, "1e400", "1e300GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert EngineConfig(kv_cache_memory="1MiB").kv_cache_memory == 2**20


def test_sampler_rows_read_each_sequence_s_tokens_without_copying_them(engine, monkeypatch):
    """A step builds one sampler row per running sequence: the row holds the sequence's own token list (a copy of
    every prompt and output each step cost ~1 ms at 128 rows of ~400 tokens), and still sees its prompt and its
    output apart, as the penalties and min_tokens need."""
    from kvcache.engine import sampling_step
    seen = []
    real = sampling_step.sample

    def spy(logits, rows, eos=None):
        seen.append([(r.token_ids, r.prompt_token_ids, r.output_token_ids, r.num_output_tokens) for r in rows])
        return real(logits, rows, eos)

    monkeypatch.setattr(sampling_step, "sample", spy)
    prompts = {"a": prompt_of(9, 1), "b": prompt_of(21, 2)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.3, min_tokens=2))
    seqs = {rid: engine.requests[rid].seqs[0] for rid in prompts}
    done = drain(engine)
    assert len(seen) >= 4 and all(len(step) >= 1 for step in seen)
    by_list = {id(s.token_ids): (rid, s) for rid, s in seqs.items()}
    for step in seen:
        for tokens, prompt, output, num_output in step:
            rid, seq = by_list[id(tokens)]  # the sequence's list itself
            assert tokens is seq.token_ids
            assert prompt == prompts[rid] and num_output == len(output)
    for rid in prompts:  # each step's view of the output was the output so far, which ended as the request's
        assert done[rid].outputs[0].token_ids == seqs[rid].output_token_ids
