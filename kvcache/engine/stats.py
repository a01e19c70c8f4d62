"""The engine's counters since start-up (LLMEngine.stats; kv_cache_info and the server's metrics read them)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since start-up (tokens, requests, preemptions)."""

    prompt_tokens: int = 0  # prompt tokens submitted
    prefill_tokens_computed: int = 0  # tokens run through the model in prefill chunks (recompute included)
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    steps: int = 0
    spec_drafts: int = 0  # steps in which a sequence verified a proposal (speculative decoding)
    spec_draft_tokens: int = 0  # tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [i]: proposals whose token i was accepted
    spec_propose_seconds: float = 0.0  # spent proposing (n-gram lookups, draft forwards), found or not
    peak_used_blocks: int = 0

    def count_draft(self, proposed: int, accepted: int) -> None:
        """One verified proposal of `proposed` tokens whose first `accepted` were accepted."""
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        per = self.spec_accepted_per_position
        per.extend([0] * (proposed - len(per)))
        for i in range(accepted):
            per[i] += 1
