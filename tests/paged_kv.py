"""Random paged K/V for tests of the decode kernels: each sequence's blocks laid out one after another from block 1
(block 0 left as the null block), and its block table."""
from __future__ import annotations

import torch


def random_paged_kv(lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                    g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """k, v [blocks, block_size, kv_heads, head_dim] (random), tables [len(lens), most blocks] and each sequence's
    block count, for sequences of `lens` tokens."""
    nb = [-(-n // block_size) for n in lens]
    k = torch.randn(sum(nb) + 1, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(sum(nb) + 1, block_size, kv_heads, head_dim, generator=g)
    tables = torch.zeros(len(lens), max(nb), dtype=torch.int64)
    at = 1
    for i, n in enumerate(nb):
        tables[i, :n] = torch.arange(at, at + n)
        at += n
    return k, v, tables, nb
