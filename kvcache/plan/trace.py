"""Request traces for the allocator simulator: synthetic (seeded) or loaded from JSONL.

A trace is a list of `TraceRequest`s: when each request arrives (seconds), how many prompt
tokens it brings and how many output tokens it will generate. No torch here.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np


class TraceError(ValueError):
    """A trace or a length distribution spec that cannot be used; the message names the culprit."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Token counts are tokens; `prefix_tokens` <= `prompt_tokens` are the
    leading prompt tokens shared with the other requests of `prefix_group`."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_group: int | None = None
    prefix_tokens: int = 0


# An approximation of published ShareGPT length statistics, not the dataset itself: the vLLM paper
# (Kwon et al., SOSP 2023, Fig. 11) reports mean 161 input and 338 output tokens with a long tail.
# We mimic that with a two-component log-normal mixture per side, (median tokens, sigma):
# 85% short turns and 15% long ones. Means come out near 165 prompt / 340 output tokens.
SHAREGPT_LONG_FRACTION = 0.15
SHAREGPT_PROMPT = ((70.0, 0.9), (450.0, 0.6))
SHAREGPT_OUTPUT = ((210.0, 0.8), (520.0, 0.6))


def _lengths(spec: str, n: int, rng: np.random.Generator, side: str) -> np.ndarray:
    """`n` token counts (>= 1) drawn from `spec`."""
    kind, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    try:
        if kind.isdigit() and not args:
            value = int(kind)
            if value < 1:
                raise TraceError(f"{side} length spec {spec!r}: a fixed length must be >= 1 token")
            return np.full(n, value, dtype=np.int64)
        if kind == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            if not 1 <= lo <= hi:
                raise TraceError(f"{side} length spec {spec!r}: need 1 <= LO <= HI, got LO={lo}, HI={hi}")
            return rng.integers(lo, hi + 1, n)
        if kind == "normal" and len(args) == 2:
            mean, std = float(args[0]), float(args[1])
            if not (math.isfinite(mean) and math.isfinite(std) and std >= 0):
                raise TraceError(f"{side} length spec {spec!r}: need a finite MEAN and STD >= 0")
            return np.maximum(np.round(rng.normal(mean, std, n)), 1).astype(np.int64)
        if kind == "sharegpt" and not args:
            (short_med, short_sig), (long_med, long_sig) = SHAREGPT_PROMPT if side == "prompt" else SHAREGPT_OUTPUT
            long = rng.random(n) < SHAREGPT_LONG_FRACTION
            draws = np.where(long, rng.lognormal(math.log(long_med), long_sig, n),
                             rng.lognormal(math.log(short_med), short_sig, n))
            return np.maximum(np.round(draws), 1).astype(np.int64)
    except ValueError as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{side} length spec {spec!r}: {e}") from None
    raise TraceError(f"unknown {side} length spec {spec!r}; use 'uniform:LO:HI', 'normal:MEAN:STD', "
                     f"'sharegpt' or a fixed token count like '512'")


def synthetic_trace(num_requests: int, *, seed: int = 0, rate: float = math.inf, prompt: str = "sharegpt",
                    output: str = "sharegpt", max_model_len: int = 4096, prefix_groups: int = 0,
                    prefix_len: int = 0) -> list[TraceRequest]:
    """A seeded trace of `num_requests` requests with Poisson arrivals at `rate` requests/s (inf: all at t=0).

    prompt+output never exceeds `max_model_len` tokens: the output is capped first (it stays >= 1),
    then the prompt. With `prefix_groups` G > 0 and `prefix_len` P > 0, request i joins group i % G
    and its prompt gets P extra leading tokens shared within the group (counted in prompt_tokens).
    """
    if num_requests < 1:
        raise TraceError(f"a trace needs at least 1 request, got {num_requests}")
    if not rate > 0:
        raise TraceError(f"arrival rate must be > 0 requests/s (inf: all at once), got {rate}")
    if prefix_groups < 0 or prefix_len < 0:
        raise TraceError(f"prefix_groups and prefix_len must be >= 0, got {prefix_groups} and {prefix_len}")
    shared = prefix_len if prefix_groups > 0 else 0
    if shared + 2 > max_model_len:
        raise TraceError(f"a {shared}-token shared prefix leaves no room for a prompt token and an output "
                         f"token in max_model_len={max_model_len}")
    rng = np.random.default_rng(seed)
    prompts = _lengths(prompt, num_requests, rng, "prompt") + shared
    outputs = np.minimum(_lengths(output, num_requests, rng, "output"), max_model_len - shared - 1)
    prompts = np.minimum(prompts, max_model_len - outputs)
    if math.isinf(rate):
        arrivals = np.zeros(num_requests)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / rate, num_requests))
    return [TraceRequest(float(arrivals[i]), int(prompts[i]), int(outputs[i]),
                         i % prefix_groups if shared else None, shared)
            for i in range(num_requests)]


def _field(obj: dict, key: str, where: str, *, optional: bool = False) -> int | float | None:
    if key not in obj:
        if optional:
            return None
        raise TraceError(f"{where}: missing field {key!r}")
    value = obj[key]
    numeric = (int, float) if key == "arrival_s" else (int,)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise TraceError(f"{where}: {key} must be {'a number' if key == 'arrival_s' else 'an integer'}, "
                         f"got {value!r}")
    return value


def load_trace(path: str) -> list[TraceRequest]:
    """Read a JSONL trace: one `{arrival_s, prompt_tokens, output_tokens[, prefix_group][, prefix_tokens]}`
    per line (seconds, tokens); blank lines skipped. Returned sorted by arrival. Errors name `path:line`."""
    trace = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            arrival = _field(obj, "arrival_s", where)
            prompt = _field(obj, "prompt_tokens", where)
            output = _field(obj, "output_tokens", where)
            group = _field(obj, "prefix_group", where, optional=True)
            prefix = _field(obj, "prefix_tokens", where, optional=True) or 0
            if not (math.isfinite(arrival) and arrival >= 0):
                raise TraceError(f"{where}: arrival_s must be a finite number >= 0, got {arrival}")
            if prompt < 1 or output < 1:
                raise TraceError(f"{where}: token counts must be >= 1, got prompt_tokens={prompt}, "
                                 f"output_tokens={output}")
            if not 0 <= prefix <= prompt:
                raise TraceError(f"{where}: prefix_tokens must be in [0, prompt_tokens={prompt}], got {prefix}")
            if prefix and group is None:
                raise TraceError(f"{where}: prefix_tokens={prefix} given without a prefix_group")
            trace.append(TraceRequest(float(arrival), prompt, output, group, prefix))
    if not trace:
        raise TraceError(f"{path}: the trace holds no requests")
    return sorted(trace, key=lambda r: r.arrival_s)


def save_trace(trace: list[TraceRequest], path: str) -> None:
    """Write `trace` as JSONL in the format `load_trace` reads; prefix fields only where set."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            obj: dict = {"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
            if r.prefix_group is not None:
                obj["prefix_group"] = r.prefix_group
            if r.prefix_tokens:
                obj["prefix_tokens"] = r.prefix_tokens
            f.write(json.dumps(obj) + "\n")
