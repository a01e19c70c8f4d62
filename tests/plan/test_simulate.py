"""The allocator simulator: the seed scenario, what each allocator wastes on a ShareGPT-like trace,
prefix sharing, invariants under random traces, and trace files."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.plan.allocators import ContiguousExact, Paged, PagedPrefixSharing, ReserveMax
from kvcache.plan.simulate import GIB, compare, format_table, plot, seed_scenario, simulate
from kvcache.plan.trace import TraceError, TraceRequest, load_trace, save_trace, synthetic_trace


def gb(nbytes: int) -> float:
    return round(nbytes / GIB, 1)


# ---- the seed scenario: 3, 2.3, 4.5 GiB; free the 2.3; ask for 7.5 ----

def test_seed_scenario_80gb_everything_fits_but_contiguous_cannot_reuse_the_hole():
    s = seed_scenario(80.0)
    contiguous, paged, reserve = s.outcomes
    assert [o.allocator for o in s.outcomes] == ["contiguous", "paged-16", "reserve-max"]
    assert [tuple(map(gb, p.range_bytes)) for p in contiguous.placements] == [
        (0.0, 3.0), (3.0, 5.3), (5.3, 9.8), (9.8, 17.3)]  # the 7.5 GiB request lands after the 4.5 GiB one
    assert contiguous.placements[1].freed
    assert [tuple(map(gb, h)) for h in contiguous.holes_bytes] == [(3.0, 5.3), (9.8, 80.0)]
    assert gb(contiguous.free_bytes) == 72.5 and gb(contiguous.largest_free_run_bytes) == 70.2
    assert contiguous.new_fits and "2.3 GiB hole" in contiguous.why
    assert paged.new_fits and paged.placements[-1].blocks == 3840 and paged.placements[-1].range_bytes is None
    assert reserve.new_fits and tuple(map(gb, reserve.placements[-1].range_bytes)) == (8.0, 16.0)
    assert "80 GiB" in s.explanation and "paged-16" in s.explanation


def test_seed_scenario_15gb_contiguous_refuses_paged_fits():
    s = seed_scenario(15.0)
    contiguous, paged, reserve = s.outcomes
    assert not contiguous.new_fits and not contiguous.placements[-1].placed
    assert gb(contiguous.free_bytes) == 7.5 and gb(contiguous.largest_free_run_bytes) == 5.2
    assert "external fragmentation" in contiguous.why and "5.2 GiB" in contiguous.why
    assert paged.new_fits and gb(paged.free_bytes) == 7.5 and paged.largest_free_run_bytes == paged.free_bytes
    assert "need not be adjacent" in paged.why
    # one 8 GiB reservation fits in 15 GiB: the 2.3 and 4.5 GiB requests are refused, so is the 7.5 GiB one
    assert [p.placed for p in reserve.placements] == [True, False, False, False]
    assert not reserve.new_fits


# ---- a ShareGPT-like trace ----

@pytest.fixture(scope="module")
def sharegpt_results():
    trace = synthetic_trace(400, seed=0, max_model_len=4096)
    return {r.name: r for r in compare(trace, 32_768, max_model_len=4096, prefix_sharing=False)}


def test_sharegpt_paged_wastes_little_reserve_max_wastes_most(sharegpt_results):
    res = sharegpt_results
    assert set(res) == {"reserve-max", "contiguous", "paged-1", "paged-16", "paged-64", "paged-256"}
    assert res["paged-16"].mean_utilization >= 0.95
    assert res["paged-1"].mean_utilization == 1.0 and res["paged-1"].internal_fragmentation == 0.0
    assert res["reserve-max"].mean_utilization < 0.5
    assert res["contiguous"].external_fragmentation > 0
    assert res["paged-16"].external_fragmentation == 0
    assert res["paged-16"].peak_concurrency > res["reserve-max"].peak_concurrency
    assert res["paged-16"].makespan_s < res["reserve-max"].makespan_s
    assert res["reserve-max"].waited > 0  # the pool is small enough that requests queue
    for r in res.values():
        assert r.finished == 400 and r.oom == 0
        assert len(r.timeline["time_s"]) <= 2000


def test_report_table_json_and_plot(sharegpt_results, tmp_path):
    results = list(sharegpt_results.values())
    table = format_table(results, 131_072)
    assert "paged-16" in table and "makespan s" in table and "131,072" in table
    body = json.dumps([r.to_json() for r in results])
    assert "timeline" not in body
    assert json.loads(json.dumps(results[0].to_json(timeline=True)))["timeline"]["time_s"]
    plot(results, str(tmp_path / "util.png"))
    assert (tmp_path / "util.png").stat().st_size > 10_000


# ---- prefix sharing ----

def test_prefix_sharing_counts_shared_tokens_once():
    a = PagedPrefixSharing(1024, 16)
    assert a.admit(0, 100, 120, prefix_group=7, prefix_tokens=64)
    assert a.admit(1, 100, 120, prefix_group=7, prefix_tokens=64)
    # 4 shared blocks of 64 tokens, then 101 - 64 = 37 private tokens each in 3 blocks
    assert a.live_tokens() == 64 + 2 * 37
    assert a.allocated_tokens() == (4 + 2 * 3) * 16
    a.release(0)
    assert a.live_tokens() == 101 and a.allocated_tokens() == 7 * 16  # still held by request 1
    a.release(1)
    assert a.allocated_tokens() == 0 and a.live_tokens() == 0


def test_prefix_sharing_beats_plain_paging_on_shared_prompts():
    trace = synthetic_trace(200, seed=1, rate=50, prefix_groups=4, prefix_len=2000, max_model_len=4096)
    assert all(r.prefix_tokens == 2000 and r.prompt_tokens > 2000 for r in trace)
    paged = simulate(trace, Paged(32_768, 16))
    shared = simulate(trace, PagedPrefixSharing(32_768, 16))
    assert shared.peak_concurrency > paged.peak_concurrency
    assert shared.makespan_s < paged.makespan_s
    assert shared.finished == paged.finished == 200


# ---- invariants under random traces and pools ----

class Checked:
    """Wraps an allocator and checks the invariants after every call."""

    def __init__(self, inner):
        self.inner, self.name, self.pool_tokens = inner, inner.name, inner.pool_tokens

    def _state(self):
        a = self.inner
        return (a.allocated_tokens(), a.live_tokens(), a.free_tokens(), a.largest_free_run(),
                a.holes() if hasattr(a, "holes") else None)

    def _check(self):
        allocated, live, free, largest, _ = self._state()
        assert 0 <= live <= allocated <= self.pool_tokens
        assert free == self.pool_tokens - allocated and 0 <= largest <= free

    def admit(self, *args):
        before = self._state()
        ok = self.inner.admit(*args)
        assert ok or self._state() == before
        self._check()
        return ok

    def grow(self, *args):
        before = self._state()
        ok = self.inner.grow(*args)
        assert ok or self._state() == before
        self._check()
        return ok

    def release(self, req_id):
        self.inner.release(req_id)
        self._check()

    def __getattr__(self, name):
        return getattr(self.inner, name)


requests = st.builds(
    lambda arrival, prompt, output, group, prefix: TraceRequest(
        arrival, prompt, output, group, min(prefix, prompt) if group is not None else 0),
    st.floats(0, 0.5), st.integers(1, 120), st.integers(1, 60), st.none() | st.integers(0, 2), st.integers(0, 80))


@settings(max_examples=60, deadline=None)
@given(trace=st.lists(requests, min_size=1, max_size=25), pool=st.integers(16, 400),
       kind=st.sampled_from(["reserve-max", "contiguous", "paged-1", "paged-16", "paged-16+prefix"]),
       max_num_seqs=st.integers(1, 8))
def test_invariants_hold_on_random_traces(trace, pool, kind, max_num_seqs):
    inner = {"reserve-max": lambda: ReserveMax(pool, 128), "contiguous": lambda: ContiguousExact(pool),
             "paged-1": lambda: Paged(pool, 1), "paged-16": lambda: Paged(pool, 16),
             "paged-16+prefix": lambda: PagedPrefixSharing(pool, 16)}[kind]()
    result = simulate(trace, Checked(inner), step_s=0.05, max_num_seqs=max_num_seqs)
    assert inner.allocated_tokens() == 0 and inner.live_tokens() == 0
    assert result.finished + result.oom == len(trace)
    assert result.peak_concurrency <= max_num_seqs
    assert 0 <= result.mean_utilization <= result.peak_utilization <= 1


def test_contiguous_coalesces_freed_neighbours():
    a = ContiguousExact(100)
    for i in range(4):
        assert a.admit(i, 19, 25)
    a.release(1)
    a.release(3)
    assert a.holes() == [(25, 50), (75, 100)]
    assert not a.admit(9, 29, 30)  # 50 free, largest run 25
    a.release(2)
    assert a.holes() == [(25, 100)] and a.admit(9, 29, 30) and a.span(9) == (25, 55)


# ---- traces ----

def test_trace_jsonl_round_trip(tmp_path):
    trace = synthetic_trace(50, seed=3, rate=10.0, prompt="uniform:10:50", output="normal:40:10",
                            prefix_groups=3, prefix_len=16, max_model_len=100)
    assert all(r.prompt_tokens + r.output_tokens <= 100 for r in trace)
    path = str(tmp_path / "t.jsonl")
    save_trace(trace, path)
    assert load_trace(path) == sorted(trace, key=lambda r: r.arrival_s)
    assert synthetic_trace(50, seed=3) == synthetic_trace(50, seed=3)


def test_fixed_lengths_clip_to_max_model_len():
    trace = synthetic_trace(3, prompt="5000", output="100", max_model_len=4096)
    assert {(r.prompt_tokens, r.output_tokens) for r in trace} == {(3996, 100)}
    assert all(r.arrival_s == 0 for r in trace)


@pytest.mark.parametrize("line,message", [
    ("not json", "not JSON"),
    ('{"arrival_s": 0, "prompt_tokens": 5}', "missing field 'output_tokens'"),
    ('{"arrival_s": 0, "prompt_tokens": "5", "output_tokens": 1}', "prompt_tokens must be an integer"),
    ('{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}', "token counts must be >= 1"),
    ('{"arrival_s": -1, "prompt_tokens": 5, "output_tokens": 1}', "arrival_s must be"),
])
def test_bad_trace_line_names_path_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0.5, "prompt_tokens": 5, "output_tokens": 2}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=f"bad.jsonl:3: {message}"):
        load_trace(str(path))


def test_empty_trace_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(str(path))


@pytest.mark.parametrize("spec", ["zipf:1", "uniform:10", "uniform:50:10", "normal:a:b", "0", "sharegpt:2"])
def test_bad_length_spec(spec):
    with pytest.raises(TraceError, match=re.escape(repr(spec))):
        synthetic_trace(5, prompt=spec)
