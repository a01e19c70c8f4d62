"""Log probabilities through the OpenAI API (the `openai` client against a live server): chat's `logprobs` /
`top_logprobs` and completions' `logprobs`, whole and streamed, checked against transformers' log-softmax on the
same weights and against the offline engine; completions' `echo` with the prompt's logprobs (what lm-evaluation-
harness's loglikelihood requests send); vLLM's `prompt_logprobs`; and their bad values."""
from __future__ import annotations

import httpx
import pytest
import torch

from live_server import API_KEY, MODEL
from tiny_models import hf_model
from kvcache import LLM, SamplingParams

PROMPT = "w5 w6 w7 w8 w9"


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=512)


@pytest.fixture(scope="module")
def oracle(tiny_llama, offline):
    """transformers' log-softmax of the next token after a list of token ids."""
    model = hf_model(tiny_llama)

    def next_logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    return next_logprobs


def _text(offline, t: int) -> str:
    return offline.get_tokenizer().decode([t])


def test_completion_logprobs_match_transformers_and_the_engine(client, offline, oracle):
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
                           use_tqdm=False)[0]
    ids = ref.outputs[0].token_ids
    assert lp.tokens == [_text(offline, t) for t in ids]
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ids, ref.outputs[0].logprobs)], abs=1e-5)
    prompt_ids = ref.prompt_token_ids
    for i, (t, top) in enumerate(zip(ids, lp.top_logprobs)):
        want = oracle(prompt_ids + ids[:i])
        assert lp.token_logprobs[i] == pytest.approx(want[t].item(), abs=1e-4)
        best = want.topk(3)
        assert top == pytest.approx({_text(offline, j): v for j, v in zip(best.indices.tolist(), best.values.tolist())},
                                    abs=1e-4)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(ids))]


def test_chat_logprobs_with_top_logprobs(client, offline, oracle):
    messages = [{"role": "user", "content": "w12 w13 w14"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=4, extra_body={"ignore_eos": True})
    ref = offline.chat(messages, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=4),
                       use_tqdm=False)[0]
    ids = ref.outputs[0].token_ids
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [_text(offline, t) for t in ids]
    for i, (t, c) in enumerate(zip(ids, content)):
        want = oracle(ref.prompt_token_ids + ids[:i])
        assert c.logprob == pytest.approx(want[t].item(), abs=1e-4)
        assert c.bytes == list(c.token.encode("utf-8"))
        best = want.topk(4)
        assert [x.token for x in c.top_logprobs] == [_text(offline, j) for j in best.indices.tolist()]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                           extra_body={"ignore_eos": True})
    assert [c.logprob for c in plain.choices[0].logprobs.content] == pytest.approx([c.logprob for c in content])
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_streamed_logprobs_are_the_whole_ones_with_samples_and_stop_strings(client):
    """Each chunk carries the logprobs of the tokens that arrived since its choice's last chunk, even where the
    text is held back (a stop string's start): together they are the whole response's."""
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3, n=2, logprobs=2, stop=["w9 w"],
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**body)
    streamed: dict[int, dict[str, list]] = {}
    for ev in client.completions.create(**body, stream=True):
        for c in ev.choices:
            if c.logprobs is not None:
                acc = streamed.setdefault(c.index, {"tokens": [], "token_logprobs": [], "text_offset": []})
                for k in acc:
                    acc[k] += getattr(c.logprobs, k)
    for c in whole.choices:
        assert streamed[c.index] == {k: getattr(c.logprobs, k) for k in ("tokens", "token_logprobs", "text_offset")}
        assert c.finish_reason == "stop" or len(c.logprobs.tokens) == 12
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "w12"}], max_tokens=6, temperature=0,
                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat).choices[0].logprobs.content
    parts = [c.logprobs.content for ev in client.chat.completions.create(**chat, stream=True)
             for c in ev.choices if c.logprobs is not None]
    assert [x.model_dump() for p in parts for x in p] == [x.model_dump() for x in whole]


def test_echo_gives_the_prompt_and_its_logprobs_as_lm_eval_reads_them(client, offline, oracle):
    """lm-evaluation-harness sends context + continuation as token ids with echo, logprobs=1 and max_tokens=1, and
    sums token_logprobs[len(context):-1]: that sum is transformers' log-likelihood of the continuation."""
    tok = offline.get_tokenizer()
    context, continuation = tok.encode("w5 w6 w7"), tok.encode("w8 w9 w10", add_special_tokens=False)
    ids = context + continuation
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = got.choices[0].logprobs
    assert got.choices[0].text.startswith(tok.decode(ids)) and len(lp.tokens) == len(ids) + 1
    assert lp.tokens[:len(ids)] == [_text(offline, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = sum(oracle(ids[:i])[ids[i]].item() for i in range(len(context), len(ids)))
    assert sum(lp.token_logprobs[len(context):-1]) == pytest.approx(want, abs=1e-4)
    for i in range(1, len(ids)):  # each prompt entry: its token's and the most likely one's
        best = oracle(ids[:i]).topk(1)
        assert lp.top_logprobs[i] == pytest.approx({_text(offline, ids[i]): oracle(ids[:i])[ids[i]].item(),
                                                    _text(offline, best.indices.item()): best.values.item()}, abs=1e-4)
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[-1:])


def test_echo_whole_and_streamed_with_text_and_token_prompts(client, offline):
    for prompt in (PROMPT, offline.get_tokenizer().encode(PROMPT)):
        body = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, extra_body={"ignore_eos": True})
        whole = client.completions.create(**body)
        gen = client.completions.create(**{**body, "echo": False}).choices[0].text
        echoed = PROMPT if isinstance(prompt, str) else offline.get_tokenizer().decode(prompt)
        assert whole.choices[0].text == echoed + gen and whole.choices[0].logprobs is None
        chunks = [c for ev in client.completions.create(**body, stream=True, logprobs=2) for c in ev.choices]
        assert "".join(c.text for c in chunks) == echoed + gen
        assert chunks[0].text == echoed and chunks[0].logprobs.token_logprobs[0] is None
        streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
        assert streamed == client.completions.create(**body, logprobs=2).choices[0].logprobs.token_logprobs


def _check_prompt_entries(entries, ids, oracle, offline, k):
    """vLLM's prompt_logprobs against transformers: None first, then the k most likely (ranks 1 to k; compared by
    value, as a random model's ties make their ids a choice) and the token, its rank 1 + how many ids are more
    likely, each with its text."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        want = oracle(ids[:i])
        best = want.topk(k).values.tolist()
        entry = {int(j): v for j, v in entries[i].items()}
        assert ids[i] in entry and len(entry) in (k, k + 1)
        for j, v in entry.items():
            assert v["logprob"] == pytest.approx(want[j].item(), abs=1e-4)
            assert v["decoded_token"] == _text(offline, j)
        others = sorted(v["rank"] for j, v in entry.items() if j != ids[i])
        assert len(set(others)) == len(others) >= k - 1 and set(others) <= set(range(1, k + 1))
        for j, v in entry.items():
            if j != ids[i]:
                assert v["logprob"] == pytest.approx(best[v["rank"] - 1], abs=1e-4)
        lp = want[ids[i]].item()
        above, near = int((want > lp + 1e-5).sum()), int((want > lp - 1e-5).sum())
        assert above + 1 <= entry[ids[i]]["rank"] <= near  # its rank, up to float ties with transformers


def test_prompt_logprobs_in_completions_and_chat_as_vllm_gives_them(live, client, offline, oracle):
    """vLLM's extra `prompt_logprobs: k`: completions put each prompt's on its choices, chat on the response;
    with echo, both come from one count the engine keeps (the larger), each cut to its own."""
    ids = offline.get_tokenizer().encode(PROMPT)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    for choice in got.choices:
        _check_prompt_entries(choice.prompt_logprobs, ids, oracle, offline, 2)
    for echo_k, k in ((1, 3), (4, 1)):
        both = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                         logprobs=echo_k, extra_body={"prompt_logprobs": k})
        _check_prompt_entries(both.choices[0].prompt_logprobs, ids, oracle, offline, k)
        alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                          logprobs=echo_k)
        assert both.choices[0].logprobs == alone.choices[0].logprobs  # echo's own count, not the engine's larger
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None

    messages = [{"role": "user", "content": "w12 w13 w14"}]
    r = httpx.post(f"{live.url}/tokenize", json={"model": MODEL, "messages": messages},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    chat_ids = r.json()["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    assert chat.usage.prompt_tokens == len(chat_ids)
    _check_prompt_entries(chat.prompt_logprobs, chat_ids, oracle, offline, 1)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": "many"}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1, "echo": True, "logprobs": 3}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "prompt_logprobs": 2, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}], "prompt_logprobs": "all"},
     "prompt_logprobs"),
])
def test_bad_logprobs_values_are_refused(live, path, body, param):
    r = httpx.post(f"{live.url}{path}", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
