"""A generation request streamed as server-sent events (`stream: true`), in OpenAI's chunk shapes."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from kvcache.engine.llm_engine import RequestOutput
from kvcache.engine.sampling_params import SamplingParams
from kvcache.server.engine_loop import EngineLoop
from kvcache.server.errors import engine_dead, engine_failed
from kvcache.server.outputs import LogprobShape, kv_degradation, usage

DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


@dataclass
class EventStream:
    """Server-sent events: text deltas per choice, a finish_reason per choice, usage if asked, then [DONE].

    Text that may be the start of a stop string, or an unfinished UTF-8 character, is held back
    until the next tokens settle it. With logprobs, a chunk carries those of the tokens that arrived since the
    last chunk of its choice (its text may still be held back): the chunks' logprobs together are the choice's.
    A choice is keyed by (sub-request id, choice index).
    """

    loop: EngineLoop
    out: asyncio.Queue
    ids: list[str]
    rid: str
    kind: str  # "chat.completion" or "text_completion"
    created: int
    model: str
    params: SamplingParams
    include_usage: bool
    shape: LogprobShape
    sent: dict[tuple[str, int], int] = field(default_factory=dict)  # characters sent
    # (tokens whose logprobs went out, their text offset)
    lp_sent: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    ended: set[tuple[str, int]] = field(default_factory=set)  # choices whose finish chunk went out
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    index_of: dict[str, int] = field(init=False)  # sub-request id -> its place in the request

    def __post_init__(self) -> None:
        self.index_of = {sub_id: i for i, sub_id in enumerate(self.ids)}

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    async def events(self) -> AsyncIterator[str]:
        """The stream's events, to the end or to the engine's error; the sub-requests still open when it stops (the
        client went away, or the engine failed) are aborted, freeing their blocks."""
        open_ids = set(self.ids)
        try:
            if self.chat:  # each choice's role first
                for index in range(len(self.ids) * self.params.n):
                    yield self._chunk(index, None, None, role=True)
            while open_ids:
                item = await self.out.get()
                if isinstance(item, tuple):
                    open_ids.discard(item[0])
                    continue
                if isinstance(item, BaseException) or item.error is not None:  # vLLM's way: an error event, [DONE]
                    error = engine_dead(self.rid, item) if isinstance(item, BaseException) else engine_failed(self.rid,
                                                                                                      item.error)
                    yield sse(error.body())
                    yield DONE
                    return
                for c in item.outputs:
                    for text in self._choice_chunks(item, c):
                        yield text
                if item.finished:
                    self.finals[item.request_id] = item
            if self.include_usage:
                finals = [self.finals[i] for i in self.ids if i in self.finals]
                yield self._envelope([], usage=usage(finals), kv_degradation=kv_degradation(finals))
            yield DONE
        finally:
            for sub_id in open_ids:
                self.loop.abort(sub_id)

    def _choice_chunks(self, item: RequestOutput, c) -> Iterator[str]:
        """The chunks choice `c` of `item` adds: an echoed prompt the first time, the text settled since its last
        chunk, and its finish."""
        key = (item.request_id, c.index)
        if key in self.ended:
            return
        index = self.index_of[item.request_id] * self.params.n + c.index
        if item.request_id in self.shape.echo and key not in self.lp_sent:  # the prompt first, with its logprobs
            head, offset = self.shape.prompt(item)
            self.lp_sent[key] = (0, offset)
            yield self._chunk(index, self.shape.echo[item.request_id], None, logprobs=head)
        done = c.finish_reason is not None
        start = self.sent.get(key, 0)
        end = self._settled(c.text, start, done)
        if end > start:
            self.sent[key] = end
            yield self._chunk(index, c.text[start:end], None, logprobs=self._new_logprobs(key, c))
        if done:
            self.ended.add(key)
            yield self._chunk(index, None, c.finish_reason, logprobs=self._new_logprobs(key, c))

    def _settled(self, text: str, start: int, done: bool) -> int:
        """How much of a choice's `text` may go out: all once it is done, else all but what may begin a stop string
        or end inside a UTF-8 character."""
        if done:
            return len(text)
        end = max(start, len(text) - (max((len(s) for s in self.params.stop), default=1) - 1))
        while end > start and text[end - 1] == "\ufffd":
            end -= 1
        return end

    def _new_logprobs(self, key: tuple[str, int], c):
        """The logprobs of choice `c`'s tokens not sent yet, None if there are none (or none were asked for)."""
        tokens, offset = self.lp_sent.get(key, (0, 0))
        if tokens == len(c.token_ids):
            return None
        lps, offset = self.shape.of(c, tokens, offset)
        self.lp_sent[key] = (len(c.token_ids), offset)
        return lps

    def _chunk(self, index: int, text: str | None, finish: str | None, role: bool = False, logprobs=None) -> str:
        """One choice's chunk: a completion's text, or a chat delta (the role in a choice's first)."""
        if not self.chat:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        else:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope([choice])

    def _envelope(self, choices: list[dict], **extra) -> str:
        chunk_kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({"id": self.rid, "object": chunk_kind, "created": self.created, "model": self.model,
                    "choices": choices, **extra})
