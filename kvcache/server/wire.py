"""What the API process and the engine process (`kvcache serve --engine-process`) send each other over ZMQ, in
msgpack: requests, aborts and snapshot asks one way; the outputs of each step, the metrics' exposition text and
replies the other way.

Every message is a multipart ZMQ message whose first frame names its kind. A request's own data travels in frames
of its own beside its id, so that a frame that cannot be decoded fails only that request:
- to the engine: [b"add", rid, body] (body: prompt ids and SamplingParams' fields), [b"abort", rid],
  [b"abort_all", message], [b"snapshot", id, show_text], [b"stop"];
- from the engine: [b"ready", info], [b"added", rid, error or b""], [b"outputs", counts, rid, body, rid, body, ...],
  [b"metrics", text], [b"snapshot", id, body, error], [b"failed_start", message], [b"closed"].

An output's body is a RequestOutput's fields (each sample's text and token ids so far, as the in-process loop hands
them over), its prompt ids only in the first output of the request.
"""
from __future__ import annotations

import dataclasses

import msgpack

from kvcache.compress.spec import EvictionSpec
from kvcache.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvcache.engine.sampling_params import SamplingParams

_PARAMS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_SAMPLE = tuple(f.name for f in dataclasses.fields(CompletionOutput))
_TIMES = tuple(f.name for f in dataclasses.fields(RequestMetrics))


class WireError(ValueError):
    """A frame that does not decode to what its kind carries."""


def pack(obj) -> bytes:
    # strings pass as they are, lone surrogates too (JSON lets a client send "\ud800"; the engine thread takes it)
    return msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")


def unpack(frame: bytes):
    """The frame's value; WireError if it is not msgpack."""
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False, unicode_errors="surrogatepass")
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, StackError, ValueError)
        raise WireError(f"a frame of {len(frame)} bytes is not msgpack: {type(e).__name__}: {e}") from None


def pack_request(prompt: list[int], params: SamplingParams, add_special_tokens: bool, cache_salt: str | None,
                 eviction: EvictionSpec | None) -> bytes:
    return pack({"prompt": prompt, "params": {name: getattr(params, name) for name in _PARAMS},
                 "special": add_special_tokens, "salt": cache_salt,
                 "eviction": None if eviction is None else [eviction.policy, eviction.budget]})


def unpack_request(frame: bytes) -> dict:
    """add_request's keyword arguments from an "add" body; WireError if it is not one, ValueError (the engine's
    own message) for parameters out of range."""
    body = unpack(frame)
    try:
        prompt, params = body["prompt"], body["params"]
        eviction = body["eviction"]
        return {"prompt": prompt, "params": SamplingParams(**params), "add_special_tokens": body["special"],
                "cache_salt": body["salt"], "eviction": None if eviction is None else EvictionSpec(*eviction)}
    except (KeyError, TypeError) as e:
        raise WireError(f"an add request's body is malformed: {type(e).__name__}: {e}") from None


def pack_output(out: RequestOutput, first: bool) -> bytes:
    return pack([out.prompt, out.prompt_token_ids if first else None,
                 [[getattr(c, name) for name in _SAMPLE] for c in out.outputs], out.finished,
                 [getattr(out.metrics, name) for name in _TIMES], out.error, out.prompt_logprobs,
                 out.prompt_logprob_ranks, out.num_cached_tokens, out.kv_degradation])


def unpack_output(rid: str, frame: bytes, prompt_ids: list[int] | None) -> tuple[RequestOutput, list[int]]:
    """The RequestOutput of an "outputs" body, and its prompt ids (from the body, or `prompt_ids` kept from the
    request's first output); WireError if it is not one."""
    body = unpack(frame)
    try:
        (prompt, ids, samples, finished, times, error, prompt_lps, ranks, cached, degradation) = body
        outputs = [CompletionOutput(**dict(zip(_SAMPLE, s, strict=True))) for s in samples]
        metrics = RequestMetrics(*times)
    except (TypeError, ValueError) as e:
        raise WireError(f"request {rid}'s output is malformed: {type(e).__name__}: {e}") from None
    ids = ids if ids is not None else prompt_ids
    if ids is None:
        raise WireError(f"request {rid}'s first output came without its prompt ids")
    return RequestOutput(rid, prompt, ids, outputs, finished, metrics, error, prompt_lps, ranks, cached,
                         degradation), ids
