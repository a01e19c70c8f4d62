"""PyramidKV: SnapKV's scores with budgets that shrink from the lower layers to the upper ones.

Z. Cai, Y. Zhang, B. Gao, Y. Liu, T. Liu, K. Lu, W. Xiong, Y. Dong, B. Chang, J. Hu, W. Xiao, "PyramidKV:
Dynamic KV Cache Compression based on Pyramidal Information Funneling", 2024 (arXiv:2406.02069).

The per-layer budgets follow the reference code (beta = 20) with kvpress's float step: they fall linearly
with depth and average the requested budget. Every layer's survivors end at the same slot (layer 0's budget), so
a layer that keeps fewer tokens leaves the first slots of its table dead and skipped. With PyramidKV as the engine's
policy (--kv-eviction pyramidkv) each layer has its own block table (memory/layer_groups.py) and gives its whole
dead blocks back to the pool: a request holds about the average budget. A request asking for pyramidkv on an
engine with one table of every layer holds layer 0's budget in every layer (the evaluation reports the memory).
"""
from __future__ import annotations

from kvcache.compress.policy import EvictionState
from kvcache.compress.snapkv import SnapKV
from kvcache.compress.spec import WINDOW

BETA = 20


def layer_budgets(budget: int, prompt_len: int, num_layers: int, window: int = WINDOW, beta: int = BETA) -> list[int]:
    """Tokens each layer keeps (observation window included) for `budget` on average."""
    if prompt_len <= budget:
        return [prompt_len] * num_layers
    if num_layers == 1 or prompt_len < 2 * (budget - window) + window:
        return [budget] * num_layers  # the reference falls back to SnapKV's uniform budget here
    lo = (budget - window) // beta
    hi = 2 * (budget - window) - lo
    if hi > prompt_len - window:
        hi = prompt_len - window
        lo = 2 * (budget - window) - hi
    step = (hi - lo) / (num_layers - 1)  # kvpress's float step: the layers average the budget exactly
    return [round(hi - layer * step) + window for layer in range(num_layers)]


class PyramidKV(SnapKV):
    name = "pyramidkv"

    def layer_budgets(self, state: EvictionState) -> list[int]:
        return layer_budgets(state.budget, state.prompt_len, state.num_layers)
