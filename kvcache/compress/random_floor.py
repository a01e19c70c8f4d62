"""Random eviction: a floor for the scored policies.

Each KV head of each layer keeps a uniformly random subset of the prompt, as RandomPress in NVIDIA kvpress
(2024) does (no protected tokens), drawn from the request's own generator so results do not depend on the batch.
"""
from __future__ import annotations

import torch

from kvcache.compress.policy import EvictionPolicy, EvictionState, KeysFn, all_heads, top_slots


class RandomEviction(EvictionPolicy):
    name = "random"

    def budgets(self, state: EvictionState, n: int) -> list[int]:
        return [max(state.budget, n - state.prompt_len)] * state.num_layers  # a late compaction keeps what followed

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        kv_heads = state.share.kv_heads if state.share else state.num_kv_heads  # the same draws on every rank
        scores = all_heads(torch.rand(state.num_layers, kv_heads, n, generator=state.generator), state)
        keep_from = state.prompt_len if state.prompt_len < n else None  # tokens after the prompt (a retry) stay
        return [top_slots(s, c, keep_from) for s, c in zip(scores, counts)]
