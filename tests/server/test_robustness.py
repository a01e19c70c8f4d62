"""Requests that once broke the server (found in review): each must get a clean answer and leave the
engine alive and idle. Uses a tiny model whose tokenizer cleans up spaces and has a 40-dash token."""
from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from live_server import API_KEY, MODEL, start_server
from kvcache.engine.sampling_params import MAX_STOP_STRINGS

H = {"Authorization": f"Bearer {API_KEY}"}
DASHES = "-" * 40


@pytest.fixture(scope="module")
def odd(tiny_llama, tmp_path_factory):
    """A server on the tiny model with another tokenizer: its decode is not prefix-stable
    (clean_up_tokenization_spaces) and it has punctuation and a 40-character token."""
    d = str(tmp_path_factory.mktemp("odd") / "model")
    shutil.copytree(tiny_llama, d)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "'": 3, ".": 4, DASHES: 5} | {f"w{i}": i for i in range(6, 320)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>", clean_up_tokenization_spaces=True)
    fast.save_pretrained(d)
    assert not fast.decode([8, 3, 9]).startswith(fast.decode([8, 3]))  # clean-up rewrites earlier text
    srv = start_server(d, max_waiting_requests=8)
    yield srv
    srv.stop()


def _post(srv, body):
    """JSON with ASCII escapes, so that a lone surrogate reaches the server as the escape '\\ud800'."""
    return httpx.post(f"{srv.url}/v1/completions", content=json.dumps({"model": MODEL, **body}),
                      headers={**H, "Content-Type": "application/json"}, timeout=120)


def _assert_alive_and_idle(srv) -> None:
    for _ in range(200):
        if not srv.loop.engine.has_unfinished_requests():
            break
        time.sleep(0.05)
    assert not srv.loop.engine.has_unfinished_requests()
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert _post(srv, {"prompt": "w8 w9", "max_tokens": 2}).status_code == 200


def test_streamed_text_equals_the_whole_text(odd):
    body = {"prompt": "w8 w9", "max_tokens": 60, "n": 16, "seed": 1, "ignore_eos": True, "temperature": 1.0}
    whole = {c["index"]: c["text"] for c in _post(odd, body).json()["choices"]}
    streamed: dict[int, str] = {}
    with httpx.stream("POST", f"{odd.url}/v1/completions", json={"model": MODEL, **body, "stream": True},
                      headers=H, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert streamed == whole
    assert any("'" in t or "." in t for t in whole.values())  # the punctuation the clean-up would rewrite


def test_stop_string_inside_a_long_token_is_cut(odd):
    r = _post(odd, {"prompt": "w8 w9", "max_tokens": 60, "n": 16, "seed": 3, "ignore_eos": True, "stop": ["--"]})
    choices = r.json()["choices"]
    assert all("--" not in c["text"] for c in choices)
    assert any(c["finish_reason"] == "stop" for c in choices)


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": "w8 w9", "max_tokens": 3, "top_p": 1e-46}, 200, []),  # underflows to 0 in float32
    ({"prompt": "w8 w9", "max_tokens": 3, "n": 2, "seed": 2**64 - 1}, 400, ["seed"]),
    ({"prompt": ["w8 w9", "w7", "\ud800"], "max_tokens": 400}, 400, ["cannot be tokenized"]),
    ({"prompt": "w8", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400, ["stop takes at most"]),
    ({"prompt": [[5, 6, 7]] * 50}, 400, ["queues at most 8"]),  # can never be admitted: not a 503
])
def test_hostile_requests_get_clean_answers(odd, body, status, words):
    r = _post(odd, body)
    assert r.status_code == status, r.text
    for w in words:
        assert w in r.json()["error"]["message"]
    _assert_alive_and_idle(odd)


def test_nested_json_and_chunked_bodies(odd):
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    r = httpx.post(f"{odd.url}/v1/completions", content=deep, headers=H)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"

    def chunks():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(6):
            yield b"w5 " * 300_000
        yield b'"}'
    r = httpx.post(f"{odd.url}/v1/completions", content=chunks(), headers=H)
    assert r.status_code == 413
    _assert_alive_and_idle(odd)


@pytest.mark.parametrize("field", ["n", "stream", "presence_penalty", "frequency_penalty", "echo", "temperature",
                                   "max_tokens", "stop", "seed"])
def test_an_explicit_null_means_the_default(odd, field):
    """OpenAI's schema makes these nullable, and clients send null for options they leave unset."""
    r = _post(odd, {"prompt": "w8 w9", "max_tokens": 2, "ignore_eos": True, field: None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == (16 if field == "max_tokens"
                                                                                        else 2)


def test_null_in_a_required_field_or_a_chat_field():
    from pydantic import ValidationError

    from kvcache.server.protocol import ChatCompletionRequest, CompletionRequest
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "logprobs": None,
                                                 "n": None, "stream": None, "min_p": None})
    assert (chat.logprobs, chat.n, chat.stream, chat.min_p) == (False, 1, False, 0.0)
    for body in ({"prompt": None}, {"messages": None}):
        with pytest.raises(ValidationError):
            (CompletionRequest if "prompt" in body else ChatCompletionRequest).model_validate(body)


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "w8 " * 9000, "max_tokens": 1}, "prompt"),  # above max_model_len
    ({"prompt": "w8", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "w8", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
])
def test_a_refusal_names_the_field(odd, body, param):
    r = _post(odd, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_pool_refusal_names_max_tokens():
    """The engine's message for a request larger than the whole pool (tests/engine/test_engine.py makes it)."""
    from kvcache.server.request_params import param_of as _param_of
    assert _param_of("request needs 19 KV blocks (300 tokens) but the whole pool has 16; raise --kv-cache-memory "
                     "or lower max_tokens") == "max_tokens"
    assert _param_of("the prompt cannot be tokenized: TypeError: n must be") == "prompt"
