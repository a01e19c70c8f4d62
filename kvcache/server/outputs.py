"""A generation request's outputs: waited for (`collect`, aborting all on a client disconnect or an engine failure)
and shaped as OpenAI's completion or chat completion body (`response_body`), logprobs included (LogprobShape)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fastapi import Request

from kvcache.engine.llm_engine import RequestOutput
from kvcache.server.engine_loop import EngineLoop
from kvcache.server.errors import engine_dead, engine_failed
from kvcache.server.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    joined,
    prompt_entries,
)
from kvcache.server.protocol import APIError

DISCONNECT_POLL_S = 0.5


@dataclass
class LogprobShape:
    """A request's logprobs in its endpoint's shape (server/logprobs.py), or None where it asked for none."""

    chat: bool  # chat's shape, else completions'
    texts: TokenTexts
    top: int | None
    echo: dict[str, str]  # completions with echo: sub-request id -> its prompt's text
    prompt_top: int | None = None  # vLLM's prompt_logprobs, the k asked for

    def prompt(self, o: RequestOutput) -> tuple[dict | None, int]:
        """An echoed prompt's logprobs (completions shape) and the text offset after it."""
        if self.top is None:
            return None, 0
        return completion_logprobs(self.texts, o.prompt_token_ids, o.prompt_logprobs, self.top, 0)

    def prompt_logprobs(self, o: RequestOutput) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` of a prompt (server/logprobs.py), or None where the request asked for none."""
        if self.prompt_top is None:
            return None
        return prompt_entries(self.texts, o.prompt_token_ids, o.prompt_logprobs, o.prompt_logprob_ranks,
                              self.prompt_top)

    def of(self, c, start: int = 0, offset: int = 0) -> tuple[dict | None, int]:
        """The logprobs of choice `c`'s tokens from `start` on (a completion's text offsets from `offset`), and the
        offset after them."""
        if self.top is None:
            return None, offset
        ids, lps = c.token_ids[start:], c.logprobs[start:len(c.token_ids)]
        if self.chat:
            return chat_logprobs(self.texts, ids, lps, self.top), offset
        return completion_logprobs(self.texts, ids, lps, self.top, offset)


async def collect(request: Request, loop: EngineLoop, out: asyncio.Queue, ids: list[str],
                  rid: str) -> dict[str, RequestOutput]:
    """Wait for every sub-request's final output; abort all if the client disconnects or the engine fails one."""
    finals: dict[str, RequestOutput] = {}
    open_ids = set(ids)
    next_check = time.monotonic() + DISCONNECT_POLL_S
    while open_ids:
        # Outputs arrive every step, so look for a disconnect on a clock, not only when the queue is quiet.
        if time.monotonic() >= next_check:
            if await request.is_disconnected():
                _abort(loop, open_ids)
                raise APIError(499, "client disconnected")
            next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            item = await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            continue
        if isinstance(item, BaseException):
            raise engine_dead(rid, item)
        if isinstance(item, tuple):
            open_ids.discard(item[0])
        elif item.error is not None:
            _abort(loop, open_ids)
            raise engine_failed(rid, item.error)
        elif item.finished:
            finals[item.request_id] = item
    return finals


def _abort(loop: EngineLoop, ids) -> None:
    for sub_id in ids:
        loop.abort(sub_id)


def usage(finals: list[RequestOutput]) -> dict:
    """OpenAI's `usage` of these outputs: prompt, completion and total tokens, and the prompt tokens found cached
    (prompt_tokens_details.cached_tokens: the prefix cache's and the offload tiers' hits)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}


def kv_degradation(finals: list[RequestOutput]) -> dict[str, int]:
    """What the memory-pressure ladder did to these requests' caches, summed (RequestOutput.kv_degradation): tokens
    evicted and how often, preemptions, and those that swapped the KV out to a tier."""
    total: dict[str, int] = {}
    for o in finals:
        for k, v in (o.kv_degradation or {}).items():
            total[k] = total.get(k, 0) + v
    return total


def response_body(finals: dict[str, RequestOutput], ids: list[str], rid: str, kind: str, created: int, model: str,
                  n: int, shape: LogprobShape) -> dict:
    """The whole (not streamed) response: `n` choices per sub-request, in the order of `ids`."""
    choices = []
    for i, sub_id in enumerate(ids):
        o = finals[sub_id]
        # a prompt's parts once, for all n of its choices
        head, offset = shape.prompt(o) if sub_id in shape.echo else (None, 0)
        prompt_lps = shape.prompt_logprobs(o) if kind != "chat.completion" else None  # vLLM's: on each choice
        for c in o.outputs:
            choice = {"index": i * n + c.index, "finish_reason": c.finish_reason}
            choice.update(_content(c, kind, shape, sub_id, head, offset))
            if c.stop_reason is not None:
                choice["stop_reason"] = c.stop_reason
            if prompt_lps is not None:
                choice["prompt_logprobs"] = prompt_lps
            choices.append(choice)
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
            "usage": usage([finals[i] for i in ids]), "kv_degradation": kv_degradation([finals[i] for i in ids])}
    if kind == "chat.completion" and shape.prompt_top is not None:  # vLLM's: the response's one prompt
        body["prompt_logprobs"] = shape.prompt_logprobs(finals[ids[0]])
    return body


def _content(c, kind: str, shape: LogprobShape, sub_id: str, head: dict | None, offset: int) -> dict:
    """A choice's message or text, and its logprobs (an echoed prompt's first)."""
    if kind == "chat.completion":
        return {"message": {"role": "assistant", "content": c.text}, "logprobs": shape.of(c)[0]}
    if sub_id in shape.echo:  # the prompt first, text and logprobs
        return {"text": shape.echo[sub_id] + c.text,
                "logprobs": joined(head, shape.of(c, 0, offset)[0]) if head is not None else None}
    return {"text": c.text, "logprobs": shape.of(c)[0]}
