"""Seeded synthetic workloads: random token prompts with exact input and output lengths."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def parse_range(text: str) -> tuple[int, int]:
    """'64:512' -> (64, 512); '128' -> (128, 128)."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 1 or hi < lo:
        raise ValueError(f"a length range is A:B with 1 <= A <= B (or a single number), got {text!r}")
    return lo, hi


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int, avoid: set[int] | frozenset = frozenset()) -> Workload:
    """Prompts of uniformly random length and random token ids (ids in `avoid` replaced), seeded."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, num_prompts)
    outs = rng.integers(output_len[0], output_len[1] + 1, num_prompts)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(avoid, dtype=np.int64, count=len(avoid)))
    prompts = [allowed[rng.integers(0, len(allowed), int(n))].tolist() for n in ins]
    return Workload(prompts, [int(o) for o in outs])
