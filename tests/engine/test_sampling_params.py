import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.engine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.max_tokens, p.min_tokens, p.logprobs, p.skip_special_tokens) == (False, 16, 0, None, True)
    assert not p.greedy


def test_stop_is_normalized_to_a_list_of_its_own():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    ids = [7, 8]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(9)
    assert p.stop_token_ids == [7, 8]


@pytest.mark.parametrize("temperature, greedy",
                         [(0, True), (0.0, True), (1e-6, True), (1e-5, False), (0.01, False), (2, False)])
def test_greedy_is_temperature_zero(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 129),
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1.0),
    ("top_k", -2),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", -2.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -2.01), ("frequency_penalty", 3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 2.5),
    ("max_tokens", 0), ("max_tokens", -5),
    ("min_tokens", -1), ("min_tokens", 17),  # > default max_tokens=16
    ("logprobs", -1), ("logprobs", 21),
])
def test_out_of_range_raises_value_error_naming_the_parameter(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*got {value!r}$"):
        SamplingParams(**{field: value})


def test_error_message_gives_the_allowed_range():
    with pytest.raises(ValueError, match=r"^temperature must be in \[0, 2\], got 3.0$"):
        SamplingParams(temperature=3.0)
    with pytest.raises(ValueError, match=r"^min_tokens must be in \[0, max_tokens=4\], got 5$"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("kwargs", [
    dict(n=128), dict(temperature=0), dict(temperature=2), dict(top_p=1), dict(top_p=1e-9),
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(min_p=0), dict(min_p=1),
    dict(presence_penalty=-2, frequency_penalty=2), dict(repetition_penalty=2), dict(repetition_penalty=0.01),
    dict(max_tokens=None, min_tokens=10_000), dict(max_tokens=1, min_tokens=1), dict(logprobs=0), dict(logprobs=20),
    dict(seed=0), dict(seed=2**63), dict(stop=["</s>", "\n"]), dict(stop_token_ids=[0, 2]),
])
def test_boundary_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


@pytest.mark.parametrize("field, value", [
    ("n", True), ("n", 1.0), ("top_k", 1.5), ("top_k", False), ("max_tokens", True), ("min_tokens", 1.0),
    ("logprobs", True), ("seed", 1.5), ("seed", True), ("seed", "1"),
    ("temperature", "1"), ("temperature", True), ("top_p", None), ("min_p", [0.1]),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("stop", 5), ("stop_token_ids", 5),
])
def test_wrong_types_raise_type_error_naming_the_parameter(field, value):
    with pytest.raises(TypeError, match=rf"^{field} must be"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("stop", [""]), ("stop", ["ok", 3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
])
def test_bad_list_entries_raise_value_error(field, value):
    with pytest.raises(ValueError, match=rf"^{field} entries must be"):
        SamplingParams(**{field: value})


def test_int_fields_become_int_and_float_fields_become_float():
    p = SamplingParams(temperature=1, top_p=1, presence_penalty=1)
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.presence_penalty) is float


RANGES = {
    "temperature": lambda x: 0 <= x <= 2,
    "top_p": lambda x: 0 < x <= 1,
    "min_p": lambda x: 0 <= x <= 1,
    "presence_penalty": lambda x: -2 <= x <= 2,
    "frequency_penalty": lambda x: -2 <= x <= 2,
    "repetition_penalty": lambda x: 0 < x <= 2,
}


@given(st.sampled_from(sorted(RANGES)), st.floats(allow_nan=True, allow_infinity=True))
def test_float_fields_accept_exactly_their_range(field, value):
    if RANGES[field](value):
        assert getattr(SamplingParams(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=f"^{field} must be in"):
            SamplingParams(**{field: value})


@given(st.integers(-10, 40), st.one_of(st.none(), st.integers(-3, 40)))
def test_min_tokens_against_max_tokens(min_tokens, max_tokens):
    ok_max = max_tokens is None or max_tokens >= 1
    ok_min = min_tokens >= 0 and (max_tokens is None or min_tokens <= max_tokens)
    if ok_max and ok_min:
        SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens)
    else:
        with pytest.raises(ValueError, match="^(max_tokens|min_tokens) must be"):
            SamplingParams(min_tokens=min_tokens, max_tokens=max_tokens)
