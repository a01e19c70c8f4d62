"""What a request asks of eviction: a policy and a KV budget, validated before anything runs."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from kvcache.messages import describe

POLICIES = ("none", "streaming", "h2o", "snapkv", "tova", "pyramidkv", "random")
SINK_TOKENS = 4  # StreamingLLM's attention sinks (its paper and code use 4)
WINDOW = 32  # SnapKV/PyramidKV observation window, in prompt tokens (SnapKV's default configuration)


def min_budget(policy: str) -> tuple[int, str]:
    """The smallest budget (tokens) `policy` can work with, and why."""
    if policy == "streaming":
        return SINK_TOKENS + 1, f"its {SINK_TOKENS} sink tokens plus one recent token"
    if policy in ("snapkv", "pyramidkv"):
        return WINDOW + 1, f"its {WINDOW}-token observation window plus one selected token"
    if policy == "h2o":
        return 2, "one heavy-hitter and one recent token"
    return 1, "one token"


def parse_budget(value: str | int | float | None) -> int | float | None:
    """'512' -> 512 tokens; '0.25' or '25%' -> 0.25 of the prompt; None stays None."""
    if value is None or isinstance(value, numbers.Real) and not isinstance(value, bool):
        return value
    s = str(value).strip()
    try:
        if s.endswith("%"):
            return float(s[:-1]) / 100
        return int(s) if s.isdigit() else float(s)
    except ValueError:
        raise ValueError(f"kv_budget {describe(value)} cannot be read: give tokens (512), a ratio of the prompt (0.25) "
                         "or a percentage (25%)") from None


@dataclass(frozen=True, slots=True)
class EvictionSpec:
    """A request's eviction policy and budget.

    budget: KV tokens a sequence keeps per layer and KV head, as an int (tokens, at least the policy's
    minimum) or a float ratio in (0, 1] of its prompt (floored at that minimum). The cache holds the whole prompt while it is prefilled, then is compacted to the budget;
    policies that also evict while decoding let it grow one block past the budget before compacting again.
    """

    policy: str = "none"
    budget: int | float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"kv_eviction {self.policy!r} is not a policy; supported: {', '.join(POLICIES)}")
        b = self.budget
        if b is None:
            if self.enabled:
                raise ValueError(f"kv_budget is needed by kv_eviction {self.policy}: tokens (--kv-budget 512) or a "
                                 "ratio of the prompt (--kv-budget 0.25)")
            return
        if isinstance(b, bool) or not isinstance(b, numbers.Real):
            raise ValueError(f"kv_budget must be a number of tokens or a ratio, got {describe(b)}")
        if isinstance(b, numbers.Integral):
            need, why = min_budget(self.policy) if self.enabled else (1, "one token")
            if b < need:
                raise ValueError(f"kv_budget {describe(b)} tokens is below {self.policy}'s minimum of {need}: {why}"
                                 if self.enabled else f"kv_budget must be at least 1 token, got {describe(b)}")
        elif not 0 < b <= 1:
            raise ValueError(f"kv_budget as a ratio of the prompt must be in (0, 1], got {describe(b)}")
        if not self.enabled:
            raise ValueError(f"kv_budget {describe(b)} needs a kv_eviction policy ({', '.join(POLICIES[1:])}); "
                             "without one nothing is evicted")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    def tokens(self, prompt_len: int) -> int:
        """The budget in tokens for a prompt of `prompt_len` tokens. A ratio is floored at the policy's
        minimum (min_budget): a short prompt keeps that many tokens, or all of its tokens."""
        b = self.budget
        if isinstance(b, numbers.Integral):
            return int(b)
        return max(int(b * prompt_len + 1e-9), min_budget(self.policy)[0])  # 0.29 x 100 is 29, not 28

    def check_ratio(self, prompt_len: int) -> None:
        """ValueError (with the numbers) if a ratio budget falls below the policy's minimum on `prompt_len`-
        token prompts, where `tokens` would floor it; for evaluations that must keep the ratio they report."""
        need, why = min_budget(self.policy)
        n = int(self.budget * prompt_len + 1e-9) if not isinstance(self.budget, numbers.Integral) else self.budget
        if self.enabled and n < need:
            raise ValueError(f"kv_budget {self.budget:g} of a {prompt_len:,}-token prompt ({n:,} tokens) is below "
                             f"{self.policy}'s minimum of {need}: {why}")
