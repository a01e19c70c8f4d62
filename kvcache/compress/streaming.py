"""StreamingLLM: keep the first sink tokens and the most recent ones.

G. Xiao, Y. Tian, B. Chen, S. Han, M. Lewis, "Efficient Streaming Language Models with Attention Sinks",
ICLR 2024 (arXiv:2309.17453). Reference code keeps 4 sinks. Positions are not re-indexed here: kept keys
keep their original rotation, which is exact within the model's context length (kvpress does the same).
"""
from __future__ import annotations

import torch

from kvcache.compress.policy import EvictionPolicy, EvictionState, KeysFn, shared
from kvcache.compress.spec import SINK_TOKENS


class StreamingLLM(EvictionPolicy):
    name = "streaming"
    decode = True
    per_head = False

    def select(self, state: EvictionState, n: int, counts: list[int], keys: KeysFn, scale: float) -> list[torch.Tensor]:
        recent = counts[0] - SINK_TOKENS
        slots = torch.cat([torch.arange(SINK_TOKENS), torch.arange(n - recent, n)])
        return shared(slots, state.num_kv_heads, state.num_layers)
