"""Per-sequence state: tokens, how many are in the cache, and why it stopped."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvcache.compress.policy import EvictionState
from kvcache.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens (a request with n > 1 has n of them, sharing the prompt's blocks)."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # output tokens allowed (params.max_tokens or what the context leaves)
    generator: torch.Generator | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # with params.prompt_logprobs: entry i is prompt token i's (None for the first), filled as the prompt's chunks run
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each prompt token's rank in its row, alike
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    text: str = ""  # detokenized output, kept current only when stop strings need it
    # incremental detokenization (StopChecker.detokenize): output tokens [0, read) are decoded into `confirmed`;
    # tokens from `prefix` on are decoded again each time, as the context of the new ones
    detok: tuple[int, int, str] = (0, 0, "")  # (prefix, read, confirmed)
    forked: bool = False
    extra_key: tuple = ()  # prefix-cache extra keys: (cache_salt,) when the request has one
    prefix_counted: bool = False  # its prefix lookup has been counted in the hit rate
    num_cached_tokens: int = 0  # prompt tokens found cached (pool or tiers) at its first admission
    eviction: EvictionState | None = None  # its eviction policy's state, if it has one
    pressure_evicted: int = 0  # tokens the pressure ladder evicted from its cache (engine/pressure.py)
    pressure_evictions: int = 0  # times it did
    num_swapped_out: int = 0  # preemptions that kept its KV in an offload tier
    draft: list[int] = field(default_factory=list)  # tokens proposed for this step (speculative decoding)
    # a sampled request's draft-model proposal: row j is the distribution draft[j] was drawn from ([k, vocab]);
    # None where each proposed token is the proposer's one choice (n-gram, greedy)
    draft_probs: torch.Tensor | None = None

    @property
    def max_cached_prefix(self) -> int | None:
        """Tokens it may take from the prefix cache (None: any); an eviction policy may need its queries run, and
        prompt logprobs need the logits of every prompt position not yet recorded."""
        limit = self.eviction.policy.cacheable_prefix(self.eviction) if self.eviction else None
        if self.wants_prompt_logits:
            own = max(0, len(self.prompt_logprobs) - 1)  # position p's logits give entry p + 1
            limit = own if limit is None else min(limit, own)
        return limit

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs were asked for and some are not recorded yet (by the first sample: the others fork from it
        after the prompt, and a recomputed one need not record them again)."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def num_evicted(self) -> int:
        """Tokens evicted from its cache: its cache holds num_computed_tokens - num_evicted slots."""
        return self.eviction.num_evicted if self.eviction else 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
