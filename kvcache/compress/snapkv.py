"""SnapKV: once the prompt is cached, keep the tokens its last queries attend to.

Y. Li, Y. Huang, B. Yang, B. Venkitesh, A. Locatelli, H. Ye, T. Cai, P. Lewis, D. Chen, "SnapKV: LLM Knows
What You are Looking for Before Generation", 2024 (arXiv:2404.14469).

The last WINDOW prompt queries (the observation window) are saved as their chunks run; when the prompt is
in the cache their attention over it is averaged over the window, smoothed by average pooling (kernel 5)
along the tokens, and averaged over each KV head's query heads. Each KV head keeps its own top tokens; the
window itself is always kept and counts in the budget. Nothing is evicted while decoding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.compress.policy import (EvictionPolicy, EvictionState, KeysFn, attention_probs, group_mean,
                                     keep_queries, top_slots, windowed_queries)
from kvcache.compress.spec import WINDOW

KERNEL = 5


def window_scores(state: EvictionState, n: int, prefix: int, keys: KeysFn, scale: float) -> list[torch.Tensor]:
    """Observation-window attention over the first `prefix` of the n cached tokens, pooled along them (the
    window's own tokens are kept anyway and take no part in the pooling, as in the reference), per layer
    [KVH, prefix]."""
    queries, slots = windowed_queries(state)
    out = []
    for layer, q in enumerate(queries):
        p = attention_probs(q, keys(layer, n), slots, scale).mean(1)[:, :prefix]  # [H, prefix]
        p = F.avg_pool1d(p[:, None], KERNEL, stride=1, padding=KERNEL // 2)[:, 0]
        out.append(group_mean(p, state))
    return out


class SnapKV(EvictionPolicy):
    name = "snapkv"

    def cacheable_prefix(self, state: EvictionState) -> int:
        return state.prompt_len - WINDOW  # the observation window's queries must run

    def capture(self, state: EvictionState, start: int, n: int, prompt_chunk: bool) -> range:
        if not prompt_chunk or state.prompt_len <= state.budget:
            return range(0)
        first = max(start, state.prompt_len - WINDOW)
        return range(max(0, first - start), max(0, min(n, state.prompt_len - start)))

    def observe(self, state: EvictionState, queries: list[torch.Tensor], slots: torch.Tensor, keys: KeysFn,
                scale: float) -> None:
        keep_queries(state, queries, slots, append=True)

    def budgets(self, state: EvictionState, n: int) -> list[int]:
        # a compaction put off while decoding keeps every token after the prompt too
        return [max(b, n - (state.prompt_len - WINDOW)) for b in self.layer_budgets(state)]

    def layer_budgets(self, state: EvictionState) -> list[int]:
        return [state.budget] * state.num_layers

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        keep_from = state.prompt_len - WINDOW  # the window, and anything cached after the prompt
        scores = window_scores(state, n, keep_from, keys, scale)
        state.queries, state.query_slots = [], []
        return [top_slots(F.pad(s, (0, n - keep_from)), c, keep_from) for s, c in zip(scores, counts)]
