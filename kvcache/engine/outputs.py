"""What the engine hands back: a request's outputs, its samples, its timings, and how they are assembled."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvcache.engine.sampling_params import SamplingParams
from kvcache.engine.sequence import Sequence

# finish_reason values: vLLM's stop, length and abort, and "error" for a request the engine failed
# (its blocks are freed and RequestOutput.error says why; the other requests carry on).
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # one of FINISH_REASONS, None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's samples so far (streaming) or at the end. `error` is set, for the client to read, when the
    engine failed this request (finish_reason "error"); the details are in the server log under its id."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    # with SamplingParams.prompt_logprobs: prompt token i's {its id: logprob, top ids: theirs}, None for the first
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # and each prompt token's rank in the model's distribution (1-based, as vLLM's Logprob.rank), None for the first
    prompt_logprob_ranks: list[int | None] | None = None
    # prompt tokens whose KV (and, for recurrent layers, state) it found cached when first admitted, in the pool or
    # the offload tiers (vLLM's num_cached_tokens; OpenAI's usage.prompt_tokens_details.cached_tokens)
    num_cached_tokens: int = 0
    # what the memory-pressure ladder did to its cache (engine/pressure.py), over its samples: tokens evicted and
    # how often, preemptions, and those of them that swapped its KV out to a tier
    kv_degradation: dict[str, int] | None = None


def kv_degradation(seqs: list[Sequence]) -> dict[str, int]:
    """A request's pressure counts, summed over its sequences."""
    return {"evicted_tokens": sum(s.pressure_evicted for s in seqs),
            "evictions": sum(s.pressure_evictions for s in seqs),
            "preemptions": sum(s.num_preemptions for s in seqs),
            "swapped_out": sum(s.num_swapped_out for s in seqs)}


class RequestFailedError(RuntimeError):
    """LLM.generate/chat raise it once every request has finished if the engine failed any of them (non-finite
    logits, say: float16 overflow). `outputs` holds every request's output in prompt order, the failed ones with
    finish_reason "error" and their `error`, so that the others are not lost."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        failed = [(i, o.error) for i, o in enumerate(outputs) if o.error]
        super().__init__(f"{len(failed)} of {len(outputs)} requests failed; the first, prompt {failed[0][0]}: "
                         f"{failed[0][1]}")
        self.outputs = outputs


@dataclass
class Request:
    """The engine's state of one request: its sequences (n of them once the prompt is prefilled)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    stream: bool
    cache_salt: str | None = None
    error: str | None = None  # set when the engine failed it

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


def request_output(req: Request, finished: bool, detokenize: Callable[[Sequence], str]) -> RequestOutput:
    """The client's view of `req`: one CompletionOutput per sequence, in sample order."""
    comps = []
    for s in sorted(req.seqs, key=lambda s: s.index):
        text = s.text if s.stop_reason in s.params.stop else detokenize(s)
        logprobs = s.params.logprobs is not None
        comps.append(CompletionOutput(s.index, text, s.output_token_ids, s.finish_reason, s.stop_reason,
                                      list(s.logprobs) if logprobs else None, s.cumulative_logprob if logprobs else None))
    first = next((s for s in req.seqs if s.index == 0), None)
    wanted = first is not None and req.params.prompt_logprobs is not None
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, finished, req.metrics, req.error,
                         list(first.prompt_logprobs) if wanted else None, list(first.prompt_ranks) if wanted else None,
                         first.num_cached_tokens if first is not None else 0, kv_degradation(req.seqs))
