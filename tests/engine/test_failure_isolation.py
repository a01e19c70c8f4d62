"""Failure isolation in the engine step: a fault in one request's path (sampling, non-finite logits, eviction,
stop checks, detokenizing) fails that request alone, with finish_reason "error" and its blocks freed, while the
others produce exactly what they produce without the fault; a failed forward fails its batch and the engine
carries on; MAX_CONSECUTIVE_FAILURES failed steps in a row end it."""
from __future__ import annotations

import pytest

from kvcache import LLM, RequestFailedError, SamplingParams
from kvcache.compress.spec import EvictionSpec
from kvcache.engine import sampling_step
from kvcache.engine.llm_engine import MAX_CONSECUTIVE_FAILURES, EngineDeadError
from kvcache.engine.model_runner import ModelRunner

BAD_SEED = 4242  # the request a fault is injected into is told apart by its seed


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=256, max_num_batched_tokens=64)


@pytest.fixture
def engine(llm):
    eng = llm.engine
    yield eng
    for rid in list(eng.requests):
        eng.abort_request(rid)
    eng._consecutive_failures = 0
    eng.check_no_leaks()
    assert not eng.requests and not eng.scheduler.running and not eng.scheduler.waiting


def workload() -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy, seeded and n > 1 requests, one with a prompt long enough to be prefilled in chunks."""
    return {
        "greedy": ([5, 9, 17, 33, 65, 129], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        "seeded": ([7, 8, 9] * 30, SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)),
        "forks": ([11, 12, 13, 14], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10, ignore_eos=True)),
        "stops": ([20, 21, 22], SamplingParams(temperature=0.7, seed=9, max_tokens=12, stop=["w1"], ignore_eos=True)),
    }


BAD = ([30, 31, 32, 33], SamplingParams(temperature=0.8, seed=BAD_SEED, max_tokens=12, ignore_eos=True))


def run(eng, requests: dict) -> dict:
    """Add every request, step until all are done; the finished outputs by request id."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    done = {}
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            return done
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("the engine did not finish")


def tokens(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def assert_others_unharmed(clean: dict, faulty: dict) -> None:
    for rid, out in clean.items():
        assert faulty[rid].error is None
        assert tokens(faulty[rid]) == tokens(out), rid
        assert [c.finish_reason for c in faulty[rid].outputs] == [c.finish_reason for c in out.outputs]


def assert_failed(out, words: str) -> None:
    assert out.finished and all(c.finish_reason == "error" for c in out.outputs)
    assert words in out.error


def test_a_sampler_that_raises_for_one_request_fails_only_it(engine, monkeypatch):
    clean = run(engine, workload())
    real = sampling_step.sample

    def faulty(logits, rows, eos):
        result = real(logits, rows, eos)  # the seeded generators have drawn already: a retry must rewind them
        if any(r.params.seed == BAD_SEED for r in rows):
            raise RuntimeError("injected sampler fault")
        return result
    monkeypatch.setattr(sampling_step, "sample", faulty)
    out = run(engine, {**workload(), "bad": BAD})
    assert_failed(out["bad"], "sampling")
    assert_others_unharmed(clean, out)
    assert engine.stats.requests_finished["error"] >= 1


def test_non_finite_logits_fail_their_request_and_never_reach_the_model(engine, monkeypatch):
    clean = run(engine, workload())
    real = ModelRunner.execute

    def nan_for_bad(self, chunks):
        sampled, logits, specs = real(self, chunks)
        for i, seq in enumerate(sampled):
            if seq.params.seed == BAD_SEED:
                logits[i, ::7] = float("nan")
        return sampled, logits, specs
    monkeypatch.setattr(ModelRunner, "execute", nan_for_bad)
    out = run(engine, {**workload(), "bad": BAD})
    assert_failed(out["bad"], "non-finite logits")
    assert out["bad"].outputs[0].token_ids == []
    assert_others_unharmed(clean, out)


@pytest.mark.parametrize("where", ["stop check", "detokenize"])
def test_a_stop_check_or_detokenizer_fault_fails_only_its_request(engine, monkeypatch, where):
    clean = run(engine, workload())
    stop = engine.stop
    name = "stop_reason" if where == "stop check" else "detokenize"
    real = getattr(stop, name)

    def faulty(seq, *args):
        if seq.params.seed == BAD_SEED:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seq, *args)
    monkeypatch.setattr(stop, name, faulty)
    out = run(engine, {**workload(), "bad": BAD})
    assert_failed(out["bad"], "stop conditions" if where == "stop check" else "detokenizing")
    assert_others_unharmed(clean, out)


def test_an_eviction_fault_fails_only_its_request(engine, monkeypatch):
    spec = EvictionSpec("h2o", 16)
    requests = {"greedy": workload()["greedy"], "evicting": ([40 + i % 50 for i in range(60)],
                                                             SamplingParams(temperature=0, max_tokens=8))}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, eviction=spec)
    clean = run(engine, {})
    real = engine.evictor.apply

    def faulty(work, state, queries):
        if state.prompt_len == 61:
            raise IndexError("injected eviction fault")
        return real(work, state, queries)
    monkeypatch.setattr(engine.evictor, "apply", faulty)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params, eviction=spec)
    engine.add_request("bad", [40 + i % 50 for i in range(61)], SamplingParams(temperature=0, max_tokens=8),
                       eviction=spec)
    out = run(engine, {})
    assert_failed(out["bad"], "evicting")
    assert_others_unharmed(clean, out)


def test_a_failed_forward_fails_its_batch_and_the_engine_carries_on(engine, monkeypatch):
    real = ModelRunner.execute
    calls = {"n": 0}

    def fails_once(self, chunks):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step: every request is in the batch
            raise RuntimeError("injected forward fault")
        return real(self, chunks)
    monkeypatch.setattr(ModelRunner, "execute", fails_once)
    out = run(engine, workload())
    for rid in workload():
        assert_failed(out[rid], "batch")
    assert engine._consecutive_failures == 1
    again = run(engine, workload())
    assert all(o.error is None for o in again.values())
    assert engine._consecutive_failures == 0  # a successful step resets the count


def test_failed_steps_in_a_row_end_the_engine(tiny_llama, monkeypatch):
    eng = LLM(tiny_llama, kv_cache_memory="1MiB", max_model_len=64).engine

    def broken(self, chunks):
        raise RuntimeError("injected: the device is gone")
    monkeypatch.setattr(ModelRunner, "execute", broken)
    for i in range(MAX_CONSECUTIVE_FAILURES - 1):
        eng.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2))
        (out,) = eng.step()
        assert_failed(out, "batch")
    eng.add_request("last", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError, match=f"{MAX_CONSECUTIVE_FAILURES} steps in a row.*the device is gone"):
        eng.step()
    assert not eng.requests and eng.kv.block_tables == {}  # even the last batch's blocks were freed


def test_a_request_that_cannot_get_blocks_with_the_pool_idle_fails_instead_of_spinning(engine):
    foreign = 10**9  # blocks held outside any request (as score() holds them), leaving too few for the prompt
    pool = engine.kv.pool
    engine.kv.allocate(foreign, (pool.num_usable - 1) * engine.config.block_size)
    try:
        engine.add_request("starved", list(range(5, 5 + 3 * engine.config.block_size)), SamplingParams(max_tokens=2))
        (out,) = engine.step()
        assert_failed(out, "cannot be scheduled")
    finally:
        engine.kv.free(foreign)


def test_the_offline_api_raises_with_every_output_once_all_are_done(llm, engine, monkeypatch):
    real = sampling_step.sample

    def faulty(logits, rows, eos):
        if any(r.params.seed == BAD_SEED for r in rows):
            raise RuntimeError("injected")
        return real(logits, rows, eos)
    monkeypatch.setattr(sampling_step, "sample", faulty)
    with pytest.raises(RequestFailedError, match="1 of 2 requests failed; the first, prompt 1: .*sampling") as e:
        llm.generate([[5, 6, 7], BAD[0]], [SamplingParams(max_tokens=4, temperature=0), BAD[1]], use_tqdm=False)
    outs = e.value.outputs
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    assert_failed(outs[1], "sampling")


@pytest.mark.parametrize("params, words", [
    (SamplingParams(max_tokens=10**4000), "max_tokens 1000"),  # no int-to-str limit error in the message
    (SamplingParams(max_tokens=None, min_tokens=10**4000), "min_tokens 1000"),
    (SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=list(range(320))), "every token of the vocabulary"),
])
def test_requests_the_sampler_could_not_serve_are_refused_up_front(engine, params, words):
    with pytest.raises(ValueError, match=words) as e:
        engine.add_request("r", [5, 6, 7], params)
    assert len(str(e.value)) < 300
    assert not engine.requests
