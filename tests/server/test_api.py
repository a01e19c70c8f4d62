"""The OpenAI-compatible API through the official `openai` client against a live loopback server:
completions, chat, streaming, n > 1, stop strings, usage that matches the tokenizer, token-id prompts,
tokenize/detokenize; then every kind of bad input, and auth."""
from __future__ import annotations

import httpx
import openai
import pytest

from live_server import API_KEY, MODEL, start_server
from kvcache import LLM, SamplingParams

PROMPT = "w5 w6 w7 w8 w9"


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The same model offline: the reference for what the server must return."""
    return LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=512)


def _ref(offline, prompt, **params):
    return offline.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_models(client, live):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-4"):
        client.models.retrieve("gpt-4")


def test_completion_matches_the_offline_engine_and_counts_usage(client, offline):
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={
        "ignore_eos": True})
    ref = _ref(offline, PROMPT, max_tokens=7, temperature=0, ignore_eos=True)
    assert got.object == "text_completion" and got.model == MODEL and got.id.startswith("cmpl-")
    assert got.choices[0].text == ref.outputs[0].text and got.choices[0].finish_reason == "length"
    n_prompt = len(offline.get_tokenizer().encode(PROMPT))
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (n_prompt, 7, n_prompt + 7)


def test_default_completion_is_16_tokens(client):
    got = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 16


def test_chat_applies_the_template(client, offline):
    messages = [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w12 w13 w14"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    ref = offline.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(ref.prompt_token_ids) and got.usage.completion_tokens == 6


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # it really streamed


def test_streamed_chat(client):
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_samples_with_a_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=11, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 24
    streamed = list(client.completions.create(**kw, stream=True))
    for i in range(3):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) == a.choices[i].text


def test_stop_strings_whole_and_streamed(client, offline):
    ref = _ref(offline, PROMPT, max_tokens=12, temperature=0, ignore_eos=True).outputs[0].text
    words = ref.split()
    assert len(words) > 3
    stop = " ".join(words[2:4])
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "stop" and got.choices[0].text == ref[:ref.index(stop)]
    assert stop not in got.choices[0].text
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text


def test_token_id_prompts_and_several_prompts(client, offline):
    ids = offline.get_tokenizer().encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=MODEL, prompt=[PROMPT, "w30 w31"], max_tokens=5, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == by_text.choices[0].text


def test_per_request_eviction(client, offline):
    """kv_eviction / kv_budget in the body: a budget covering the request changes nothing; a small one evicts."""
    prompt = " ".join(f"w{i}" for i in range(5, 105))
    ref = _ref(offline, prompt, max_tokens=8, temperature=0, ignore_eos=True)
    same = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True, "kv_eviction": "snapkv", "kv_budget": 1.0})
    assert same.choices[0].text == ref.outputs[0].text
    small = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={
        "ignore_eos": True, "kv_eviction": "streaming", "kv_budget": "16"})
    assert small.usage.completion_tokens == 8


def test_tokenize_detokenize(live, offline):
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{live.url}/tokenize", json={"prompt": PROMPT}, headers=h).json()
    assert r["tokens"] == offline.get_tokenizer().encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": r["tokens"]}, headers=h).json()
    assert back["prompt"] == offline.get_tokenizer().decode(r["tokens"]) and "w5 w6" in back["prompt"]
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": [{"role": "user", "content": "w9"}]}, headers=h).json()
    assert chat["count"] > 1


# ---- bad input ----------------------------------------------------------------------------------------

def _post(live, path, body=None, *, content=None, key=API_KEY, **headers):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers)
    return httpx.post(f"{live.url}{path}", json=body, content=content, headers=h, timeout=30)


def _assert_error(r, status, *words, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    if param:
        assert err["param"] == param
    assert "Traceback" not in r.text


BAD = [
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 3}, 400, ["temperature"], "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "top_p": 0}, 400, ["top_p"], "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 1000}, 400, ["n must be"], "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5 " * 600}, 400, ["max_model_len is 512"], None),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, 400, ["max_tokens"], "max_tokens"),
    ("/v1/completions", {"model": MODEL}, 400, ["prompt"], "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, ["empty"], None),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 10**9]}, 400, ["token ids"], None),
    ("/v1/completions", {"model": "gpt-4", "prompt": PROMPT}, 404, ["gpt-4", MODEL], "model"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "suffix": "w9"}, 400, ["suffix"], "suffix"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, 400, ["json_object"], "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "cache_salt": ""}, 400, ["cache_salt"], "cache_salt"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_eviction": "lru", "kv_budget": 4}, 400,
     ["kv_eviction 'lru' is not a policy", "snapkv"], "kv_eviction"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_eviction": "h2o", "kv_budget": 1.5}, 400,
     ["(0, 1], got 1.5"], "kv_budget"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_eviction": "snapkv", "kv_budget": 20}, 400,
     ["below snapkv's minimum of 33"], "kv_budget"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_eviction": "h2o"}, 400, ["kv_budget is needed"],
     "kv_budget"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_pressure": "lossy"}, 400,
     ["kv_pressure must be one of 'degrade', 'exact'"], "kv_pressure"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_retention": {"priority": 101}}, 400,
     ["kv_retention.priority must be an int in [0, 100], got 101"], "kv_retention"),
    ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "kv_retention": {"ttl_s": -1}}, 400,
     ["kv_retention.ttl_s must be a positive number"], "kv_retention"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, ["messages"], "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, ["role"], None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, ["messages"], "messages"),
    ("/detokenize", {"tokens": [-1]}, 400, ["token ids"], "tokens"),
    ("/tokenize", {}, 400, ["prompt"], None),
]


@pytest.mark.parametrize("path, body, status, words, param", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(live, client, path, body, status, words, param):
    _assert_error(_post(live, path, body), status, *words, param=param)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.completion_tokens == 1


def test_malformed_json_and_non_object_bodies(live):
    _assert_error(_post(live, "/v1/completions", content=b"{not json", **{"Content-Type": "application/json"}),
                  400, "not valid JSON")
    _assert_error(_post(live, "/v1/completions", [1, 2]), 400, "JSON object")


def test_body_size_limit(live):
    huge = {"model": MODEL, "prompt": "w5 " * 2_000_000}
    _assert_error(_post(live, "/v1/completions", huge), 413, "limit")


def test_unknown_route_and_method(live):
    _assert_error(_post(live, "/v1/embeddings", {"input": "x"}), 404, "no route")
    r = httpx.get(f"{live.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    _assert_error(r, 405, "not allowed")


def test_auth(live):
    _assert_error(_post(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT}, key=None), 401, "API key")
    _assert_error(_post(live, "/v1/completions", {"model": MODEL, "prompt": PROMPT}, key="wrong"), 401, "API key")
    assert httpx.get(f"{live.url}/v1/models").status_code == 401
    assert httpx.get(f"{live.url}/health").status_code == 200  # open: load balancers probe it
    assert httpx.get(f"{live.url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_dead_engine_answers_503(tiny_llama):
    srv = start_server(tiny_llama)
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        srv.loop.stop()
        assert httpx.get(f"{srv.url}/health").status_code == 503
        _assert_error(_post(srv, "/v1/completions", {"model": MODEL, "prompt": PROMPT}), 503, "engine")
    finally:
        srv.stop()


def test_usage_counts_the_prompt_tokens_found_cached(client, offline):
    """usage.prompt_tokens_details.cached_tokens: 0 for a prompt seen the first time; a prompt that shares 4 full
    blocks (16 tokens each) with it finds 64 tokens cached, on completions, chat and a streamed usage alike."""
    shared = " ".join(f"w{i}" for i in range(30, 30 + 70))
    first = client.completions.create(model=MODEL, prompt=shared + " w3", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=shared + " w4 w5", max_tokens=2, temperature=0)
    n_shared = len(offline.get_tokenizer().encode(shared))
    assert again.usage.prompt_tokens_details.cached_tokens == n_shared // 16 * 16 == 64
    chunks = list(client.completions.create(model=MODEL, prompt=shared + " w6", max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    messages = [{"role": "user", "content": shared}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages + [
        {"role": "assistant", "content": "w7"}, {"role": "user", "content": "w8"}], max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 64
    assert chat.usage.prompt_tokens_details.cached_tokens % 16 == 0


def test_responses_say_what_the_pressure_ladder_did(client):
    """kv_degradation (tokens evicted, evictions, preemptions, swaps) on a whole response and on a stream's usage
    chunk; kv_pressure "exact" is accepted. This server preempts only (the ladder's own figures: tests/engine/
    test_pressure.py and the metrics test), so every count is 0."""
    zero = {"evicted_tokens": 0, "evictions": 0, "preemptions": 0, "swapped_out": 0}
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={
        "kv_pressure": "exact", "kv_retention": {"priority": 80, "ttl_s": 60}})
    assert got.model_extra["kv_degradation"] == zero
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].model_extra["kv_degradation"] == zero
