"""Per-request sampling parameters, in the shape of vLLM's SamplingParams."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from kvcache.messages import describe

# vLLM treats temperatures below this as 0: dividing logits by it would only overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # each is searched for after every token
MAX_STOP_TOKEN_IDS = 1024  # each is looked up after every token
DEFAULT_RETENTION_PRIORITY = 35  # memory/block_pool.py's DEFAULT_PRIORITY (TensorRT-LLM's default)
KV_PRESSURE = ("degrade", "exact")  # what the pressure ladder may do to a request's cache (engine/pressure.py)
# Sample i of a request is seeded with seed + i, which must fit torch's 64-bit generator seed.
MIN_SEED, MAX_SEED = -2**63, 2**64 - 1 - MAX_N


@dataclass
class SamplingParams:
    """How to pick each next token of a request, and when to stop.

    Counts are in tokens; probabilities are fractions in [0, 1]; penalties are in logit units
    except repetition_penalty, which is a divisor (multiplier for negative logits).

    n: independent samples (sequences) to generate for the prompt.
    temperature: logits are divided by it before sampling; 0 means greedy (argmax).
    top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p.
    top_k: keep the top_k most likely tokens; 0 or -1 disables it.
    min_p: drop tokens whose probability is below min_p times the most likely token's.
    presence_penalty: subtracted once from the logit of every token already in the output.
    frequency_penalty: subtracted from a token's logit once per time it appears in the output.
    repetition_penalty: applied to tokens seen in the prompt or output; > 1 discourages them.
    seed: seeds a per-request generator, so its samples do not depend on the rest of the batch.
    stop: strings that end generation when they appear in the output text (not included).
    stop_token_ids: token ids that end generation (included in the output tokens).
    ignore_eos: keep generating past the EOS token.
    max_tokens: output tokens to generate at most; None means up to the context limit.
    min_tokens: output tokens to generate before EOS or stop_token_ids may be sampled.
    logprobs: how many most likely tokens' log probabilities to return per step, besides the
        sampled token's; 0 returns only the sampled token's, None returns none.
    prompt_logprobs: the same for every prompt token after the first (each given the tokens before it; vLLM's
        field): the prompt is computed in full, without the prefix cache's blocks (logits only come from a forward),
        at most max_num_seqs of such rows a step with chunked prefill (scheduler.py).
    skip_special_tokens: leave special tokens out of the detokenized text.
    kv_pressure: "degrade" (default) lets the engine's pressure ladder (--kv-pressure-policy ladder) evict tokens of
        this request's cache when the pool runs dry; "exact" never does: the request is only ever preempted, so its
        output is the unconstrained one's.
    kv_retention: {"priority": 0..100, "ttl_s": seconds or None} for the prefix-cache blocks this request leaves
        behind: evicted lowest priority first, then least recently used (the default priority is 35, TensorRT-LLM's);
        past ttl_s their priority is 0. None: the default.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    kv_pressure: str = "degrade"
    kv_retention: dict | None = None

    def __post_init__(self) -> None:
        self.n = _int("n", self.n)
        _check("n", self.n, 1 <= self.n <= MAX_N, f"in [1, {MAX_N}]")
        self.temperature = _float("temperature", self.temperature)
        _check("temperature", self.temperature, 0 <= self.temperature <= 2, "in [0, 2]")
        self.top_p = _float("top_p", self.top_p)
        _check("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]")
        self.top_k = _int("top_k", self.top_k)
        _check("top_k", self.top_k, self.top_k >= -1, "-1 (disabled) or >= 0")
        self.min_p = _float("min_p", self.min_p)
        _check("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]")
        self.presence_penalty = _float("presence_penalty", self.presence_penalty)
        _check("presence_penalty", self.presence_penalty, -2 <= self.presence_penalty <= 2, "in [-2, 2]")
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty)
        _check("frequency_penalty", self.frequency_penalty, -2 <= self.frequency_penalty <= 2, "in [-2, 2]")
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        _check("repetition_penalty", self.repetition_penalty, 0 < self.repetition_penalty <= 2, "in (0, 2]")
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            _check("seed", self.seed, MIN_SEED <= self.seed <= MAX_SEED, f"in [{MIN_SEED}, {MAX_SEED}]")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
            _check("max_tokens", self.max_tokens, self.max_tokens >= 1, ">= 1 or None")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.max_tokens is None:
            _check("min_tokens", self.min_tokens, self.min_tokens >= 0, ">= 0")
        else:
            _check("min_tokens", self.min_tokens, 0 <= self.min_tokens <= self.max_tokens,
                   f"in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            _check("logprobs", self.logprobs, 0 <= self.logprobs <= MAX_LOGPROBS,
                   f"in [0, {MAX_LOGPROBS}] or None")
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs)
            _check("prompt_logprobs", self.prompt_logprobs, 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                   f"in [0, {MAX_LOGPROBS}] or None")
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)
        self.kv_retention = _retention(self.kv_retention)
        if self.kv_pressure not in KV_PRESSURE:
            raise ValueError(f"kv_pressure must be one of {', '.join(map(repr, KV_PRESSURE))}, got "
                             f"{describe(self.kv_pressure)}")

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (temperature 0, or too small to divide by)."""
        return self.temperature < GREEDY_TEMPERATURE


def _retention(value: object) -> dict | None:
    """kv_retention as {"priority": int, "ttl_s": float | None}; ValueError naming the field that is bad."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"priority", "ttl_s"}:
        raise ValueError(f"kv_retention must be an object with priority (0..100) and ttl_s (seconds), got "
                         f"{describe(value)}")
    priority, ttl = value.get("priority", DEFAULT_RETENTION_PRIORITY), value.get("ttl_s")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral) or not 0 <= priority <= 100:
        raise ValueError(f"kv_retention.priority must be an int in [0, 100], got {describe(priority)}")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, numbers.Real) or not 0 < ttl < 10**9):
        raise ValueError(f"kv_retention.ttl_s must be a positive number of seconds or null, got {describe(ttl)}")
    return {"priority": int(priority), "ttl_s": None if ttl is None else float(ttl)}


def _check(name: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {describe(value)}")


def _int(name: str, value: object) -> int:
    # bool is an Integral, but n=True or max_tokens=False is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {describe(value)}")
    return int(value)


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{name} must be a finite number, got {describe(value)}") from None


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {describe(value)}")
    return value


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a str, a list of str or None, got {type(stop).__name__} {describe(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop entries must be non-empty strings, got {describe(s)}")
    return list(stop)


def _stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"stop_token_ids must be a list of int or None, got {type(ids).__name__} {describe(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids):,}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < 2**63:
            raise ValueError(f"stop_token_ids entries must be ints in [0, 2**63), got {describe(t)}")
    return [int(t) for t in ids]
