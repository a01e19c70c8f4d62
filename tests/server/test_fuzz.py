"""Fuzzing the API: hypothesis builds completions and chat bodies from the documented schema, with values in
range, out of range, non-finite, huge and of the wrong type in every field, and raw bodies no JSON parser
likes. Whatever it sends, the answer is a 2xx or a 4xx with an OpenAI-style error body and no internals, the
keep-alive connection stays usable, and the engine is alive after every example (a normal request answers).

KVCACHE_FUZZ_EXAMPLES=2000 runs more examples, randomly; by default CI runs a fixed, reproducible set."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_server import API_KEY, MODEL, start_server
from kvcache.compress.spec import POLICIES

H = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
VOCAB = 320  # the tiny model's
MAX_MODEL_LEN = 64  # keeps the valid requests short
EXAMPLES = int(os.environ.get("KVCACHE_FUZZ_EXAMPLES", "0"))
INTERNALS = ("Traceback", "frame #", 'File "', "c10::", "THPUtils", "torch.", "int_max_str_digits", "Exceeds the limit")
RAW = "\x00raw{}\x00"  # a placeholder for a literal no json.dumps writes (a 5,000-digit integer)


class Literal(str):
    """A JSON literal written into the body as is."""


junk = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.lists(st.integers(-3, 3), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
huge_int = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -2**63 - 1, 10**30, 10**400]) | st.builds(
    lambda n: Literal("9" * n), st.sampled_from([4300, 5000]))
odd_float = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [1e-300, 5e-324, 1e-45, 1e-38, 1e308, -0.0]) | st.builds(Literal, st.sampled_from(["1e999", "-1e999", "NaN"]))
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
words = st.lists(st.integers(3, VOCAB - 1).map(lambda i: f"w{i}"), min_size=1, max_size=8).map(" ".join)
text = words | st.text(min_size=1, max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=2)})


def floats(lo: float, hi: float, **kw):
    return st.floats(lo, hi, **kw)


# Each field: (values in the documented range, hostile values). A body takes in-range values for the fields
# it sets, then hostile ones for up to two of them, so that valid requests run and each hostile value is
# met on its own as well as in company.
COMMON = {
    "model": (st.just(MODEL), st.text(max_size=4) | junk),
    "max_tokens": (st.integers(1, MAX_MODEL_LEN), st.integers(-2, 0) | huge_int | junk),
    "temperature": (floats(0, 2) | st.sampled_from([0.0, 1e-6, 1e-5, 2.0]), floats(-3, -1e-9) | odd_float | junk),
    "top_p": (floats(0, 1, exclude_min=True) | st.just(1e-46), floats(1.0001, 3) | st.just(0.0) | odd_float | junk),
    "n": (st.integers(1, 4) | st.just(128), st.integers(-2, 0) | st.just(129) | huge_int | junk),
    "stop": (text | st.lists(text, max_size=3), st.lists(st.just("x"), min_size=65, max_size=65)
             | st.just([""]) | junk),
    "stream": (st.booleans(), junk),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "presence_penalty": (floats(-2, 2), floats(2.0001, 1e9) | odd_float | junk),
    "frequency_penalty": (floats(-2, 2), floats(-1e9, -2.0001) | odd_float | junk),
    "seed": (st.integers(-2**63, 2**64 - 1 - 128), huge_int | junk),
    "user": (text, junk),
    "logit_bias": (st.just({}), st.dictionaries(st.integers(0, 5).map(str), st.integers(-100, 100), min_size=1,
                                                max_size=2) | junk),
    "top_k": (st.integers(-1, VOCAB + 10), st.integers(-10**6, -2) | huge_int | junk),
    "min_p": (floats(0, 1), floats(1.0001, 5) | odd_float | junk),
    "repetition_penalty": (floats(0, 2, exclude_min=True) | st.sampled_from([1e-300, 5e-324, 1e-40]),
                           floats(-2, 0) | floats(2.0001, 1e6) | odd_float | junk),
    "ignore_eos": (st.booleans(), junk),
    "min_tokens": (st.integers(0, 4), st.integers(-5, -1) | huge_int | junk),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB + 10), max_size=4),
                       st.lists(st.integers(-5, -1) | huge_int, min_size=1, max_size=2) | junk),
    "skip_special_tokens": (st.booleans(), junk),
    "cache_salt": (st.text(min_size=1, max_size=256), st.just("") | st.text(min_size=257, max_size=260) | junk),
    "kv_eviction": (st.sampled_from(POLICIES), st.sampled_from(["lru", ""]) | junk),
    "kv_budget": (st.integers(1, MAX_MODEL_LEN) | floats(0, 1, exclude_min=True) | st.sampled_from(["25%", "0.5"]),
                  st.integers(-3, 0) | huge_int | odd_float | st.sampled_from(["1e400", "abc", "150%", "-3"]) | junk),
}
COMPLETION = {
    "prompt": (text | ids | st.lists(text, min_size=1, max_size=3) | st.lists(ids, min_size=1, max_size=3),
               st.just("") | st.just([]) | st.lists(st.integers(-2, VOCAB + 2), min_size=1, max_size=3)
               | st.lists(st.just([5, 6]), min_size=17, max_size=17) | st.just("\ud800") | junk),
    "echo": (st.just(False), st.just(True) | junk),
    "logprobs": (st.none(), st.integers(-1, 6) | huge_int | junk),
    "suffix": (st.none(), text | junk),
    "best_of": (st.none(), st.integers(-1, 3) | junk),
}
CHAT = {
    "messages": (st.lists(message, min_size=1, max_size=3), st.just([]) | st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["robot", "tool"]) | junk, "content": text | junk}), min_size=1, max_size=2) | junk),
    "max_completion_tokens": (st.integers(1, MAX_MODEL_LEN), st.integers(-2, 0) | huge_int | junk),
    "logprobs": (st.just(False), st.just(True) | junk),
    "top_logprobs": (st.none(), st.integers(-1, 3) | junk),
    "tools": (st.none(), st.lists(junk, min_size=1, max_size=1) | junk),
    "add_generation_prompt": (st.booleans(), junk),
}
TOKENIZE = {"prompt": (text, junk), "add_special_tokens": (st.booleans(), junk), "model": COMMON["model"]}
DETOKENIZE = {"tokens": (ids, st.lists(st.integers(-2, -1) | st.integers(VOCAB, VOCAB + 2) | huge_int, min_size=1,
                                      max_size=2) | junk), "model": COMMON["model"]}


@st.composite
def body(draw, fields: dict, required: str):
    """In-range values for `required` and some other fields, then hostile ones for up to two fields."""
    optional = {k: good for k, (good, _) in fields.items() if k != required}
    value = draw(st.fixed_dictionaries({required: fields[required][0]}, optional=optional))
    if "kv_eviction" in fields and ("kv_eviction" in value) != ("kv_budget" in value):  # a policy needs a budget
        value.setdefault("kv_eviction", draw(fields["kv_eviction"][0]))
        value.setdefault("kv_budget", draw(fields["kv_budget"][0]))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        value[name] = draw(fields[name][1])
    if draw(st.sampled_from([False] * 19 + [True])):  # now and then the required field is missing
        value.pop(required)
    return value


completions = st.tuples(st.just("/v1/completions"), body({**COMMON, **COMPLETION}, "prompt"))
chats = st.tuples(st.just("/v1/chat/completions"), body({**COMMON, **CHAT}, "messages"))
raw_bodies = st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
                       st.sampled_from([b"", b"{", b"[" * 50_000, b'{"prompt": "w5"', b"\xff\xfe\x00", b"null",
                                        b"[1, 2]", b'"text"', b'{"prompt": "\\ud800"}', b'{"tokens": [1e999]}',
                                        b'{"prompt": 1e999}']))
tokenize = st.tuples(st.just("/tokenize"), body(TOKENIZE, "prompt"))
detokenize = st.tuples(st.just("/detokenize"), body(DETOKENIZE, "tokens"))


def encode(value) -> bytes:
    """JSON with NaN/Infinity allowed (Python writes them, as many clients do) and Literals written as is."""
    if isinstance(value, bytes):
        return value
    literals: list[str] = []

    def mark(v):
        if isinstance(v, Literal):
            literals.append(str(v))
            return RAW.format(len(literals) - 1)
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mark(x) for x in v]
        return v
    out = json.dumps(mark(value))
    for i, lit in enumerate(literals):
        out = out.replace(json.dumps(RAW.format(i)), lit)
    return out.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = start_server(tiny_llama, max_model_len=MAX_MODEL_LEN, max_waiting_requests=16)
    with httpx.Client(base_url=srv.url, headers=H, timeout=60) as client:
        yield srv, client
    srv.stop()


def check(client: httpx.Client, path: str, payload) -> None:
    r = client.post(path, content=encode(payload))
    assert r.status_code < 500, r.text
    assert not any(x in r.text for x in INTERNALS), r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and len(error["message"]) < 600
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), r.text
    else:
        r.json()
    assert "close" not in r.headers.get("connection", "")


def assert_alive(srv, client: httpx.Client) -> None:
    assert srv.loop.alive and client.get("/health").status_code == 200
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 1})
    assert r.status_code == 200, r.text


@settings(max_examples=EXAMPLES or 500, derandomize=not EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(request=st.one_of(completions, completions, chats, chats, raw_bodies, tokenize, detokenize))
def test_no_request_gets_a_5xx_or_stops_the_engine(server, request):
    srv, client = server
    check(client, *request)
    assert_alive(srv, client)
