"""Log probabilities in the OpenAI API's two shapes, from the engine's per-token dicts.

The engine gives, per generated token, {sampled id: logprob, and the k most likely ids: theirs} (logprobs of the
model's own distribution, before temperature and the other sampling stages, as vLLM returns them).
- Chat (`logprobs: true`, `top_logprobs: k`): {"content": [{"token", "logprob", "bytes", "top_logprobs": [the k most
  likely, each {"token", "logprob", "bytes"}]}]}.
- Completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob} of the k most likely
  and the sampled one], "text_offset"}: the legacy shape, each token's offset in the choice's text.

A token's text is its id decoded alone (vLLM's choice): a token that ends inside a UTF-8 character reads as U+FFFD,
and its `bytes` are that text's UTF-8 bytes.
"""
from __future__ import annotations

from functools import lru_cache

FLOOR = -9999.0  # JSON has no -inf: a token of probability 0 (masked, or underflowed) reads as this, as in vLLM


class TokenTexts:
    """Each token id's text, decoded once."""

    def __init__(self, tokenizer) -> None:
        self.text = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))


def _lp(value: float) -> float:
    return value if value >= FLOOR else FLOOR  # NaN too: JSON has none


def _ranked(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely of a token's dict (the sampled token is among them only if it ranks there)."""
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(texts: TokenTexts, token_ids: list[int], lps: list[dict[int, float]], k: int) -> dict:
    """The chat shape for `token_ids` (their dicts `lps`, one each), `k` top entries per token."""
    def entry(t: int, lp: float) -> dict:
        s = texts.text(t)
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(i, v) for i, v in _ranked(d, k)]}
                        for t, d in zip(token_ids, lps)]}


def completion_logprobs(texts: TokenTexts, token_ids: list[int], lps: list[dict[int, float] | None], k: int,
                        offset: int) -> tuple[dict, int]:
    """The completions shape for `token_ids`, the first starting at `offset` in the choice's text; and the offset
    after the last (a stream's next chunk starts there). A None entry (an echoed prompt's first token) has null
    token_logprobs and top_logprobs, as in OpenAI's and vLLM's echo."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, d in zip(token_ids, lps):
        s = texts.text(t)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if d is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(d[t]))
        top = {texts.text(i): _lp(v) for i, v in _ranked(d, k)}
        top.setdefault(s, _lp(d[t]))
        out["top_logprobs"].append(top)
    return out, offset


def prompt_entries(texts: TokenTexts, token_ids: list[int], lps: list[dict[int, float] | None],
                   ranks: list[int | None], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` for a prompt: per token, None for the first (nothing comes before it), else
    {id: {"logprob", "rank", "decoded_token"}} for the `k` most likely (ranks 1 to k) and the token (its rank in
    the whole distribution, `ranks`'), ids as JSON keys (strings). `lps` may hold more than k: the engine keeps
    the most any part of the response needs."""
    out: list[dict | None] = []
    for t, d, rank in zip(token_ids, lps, ranks):
        if d is None:
            out.append(None)
            continue
        entry = {i: (v, r + 1) for r, (i, v) in enumerate(_ranked(d, k))}
        entry[t] = (d[t], rank)
        out.append({str(i): {"logprob": _lp(v), "rank": r, "decoded_token": texts.text(i)}
                    for i, (v, r) in entry.items()})
    return out


def joined(a: dict, b: dict) -> dict:
    """Two completions-shape parts, one after the other (an echoed prompt's and its continuation's)."""
    return {key: a[key] + b[key] for key in a}
