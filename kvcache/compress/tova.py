"""TOVA: drop the tokens the newest query attends to least.

M. Oren, M. Hassid, N. Yarden, Y. Adi, R. Schwartz, "Transformers are Multi-State RNNs", 2024
(arXiv:2401.06104).

The score is the attention of the newest query, averaged over all the layer's query heads, so every KV
head of a layer keeps the same tokens. TOVA evicts one token per step; here the cache grows one block past
the budget and the newest query then drops that block's worth at once, which frees a whole block.
"""
from __future__ import annotations

import torch

from kvcache.compress.policy import (EvictionPolicy, EvictionState, KeysFn, attention_probs, head_mean,
                                     keep_queries, top_slots, windowed_queries)


class TOVA(EvictionPolicy):
    name = "tova"
    decode = True
    per_head = False

    def capture(self, state: EvictionState, start: int, n: int, prompt_chunk: bool) -> range:
        return range(n - 1, n)

    def observe(self, state: EvictionState, queries: list[torch.Tensor], slots: torch.Tensor, keys: KeysFn,
                scale: float) -> None:
        keep_queries(state, queries, slots, append=False)

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        queries, slots = windowed_queries(state)
        out = []
        for layer, q in enumerate(queries):
            p = head_mean(attention_probs(q[-1:], keys(layer, n), slots[-1:], scale)[:, 0], state)  # [n]
            out.append(top_slots(p[None], counts[layer]).expand(state.num_kv_heads, -1))
        return out
