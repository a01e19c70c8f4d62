"""H2O: heavy hitters (the largest accumulated attention) plus a recent window.

Z. Zhang, Y. Sheng, T. Zhou, T. Chen, L. Zheng, R. Cai, Z. Song, Y. Tian, C. Re, C. Barrett, Z. Wang,
B. Chen, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
NeurIPS 2023 (arXiv:2306.14048).

Every query of the sequence, prompt and output, adds its attention probabilities to a per-(layer, KV head,
token) score (the raw sum, as the paper; a KV head's query heads are averaged). The budget is split half
recent tokens, half heavy hitters, the paper's 0.1 + 0.1 setting. Prompt scores are accumulated chunk by
chunk, so no prompt-length-squared matrix is held.
"""
from __future__ import annotations

import torch

from kvcache.compress.policy import EvictionPolicy, EvictionState, KeysFn, attention_probs, group_mean, top_slots

ROWS = 256  # queries scored at once: bounds the transient to ROWS x tokens x heads floats


class H2O(EvictionPolicy):
    name = "h2o"
    decode = True

    def cacheable_prefix(self, state: EvictionState) -> int:
        return 0  # every prompt query adds to the scores

    def capture(self, state: EvictionState, start: int, n: int, prompt_chunk: bool) -> range:
        return range(n)

    def observe(self, state: EvictionState, queries: list[torch.Tensor], slots: torch.Tensor, keys: KeysFn,
                scale: float) -> None:
        n = int(slots.max()) + 1
        if state.scores is None or state.scores.shape[2] < n:
            grown = torch.zeros(state.num_layers, state.num_kv_heads, max(n, 2 * state.budget),
                                device=slots.device)
            if state.scores is not None:
                grown[:, :, :state.scores.shape[2]] = state.scores
            state.scores = grown
        for layer, q in enumerate(queries):
            k = keys(layer, n)
            for r in range(0, q.shape[0], ROWS):
                p = attention_probs(q[r:r + ROWS], k, slots[r:r + ROWS], scale).sum(1)
                state.scores[layer, :, :n] += group_mean(p, state)

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        recent = state.budget // 2
        return [top_slots(state.scores[layer, :, :n], c, n - recent) for layer, c in enumerate(counts)]
