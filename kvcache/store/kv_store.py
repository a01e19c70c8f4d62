"""The physical KV cache: one K and one V tensor per layer, addressed by (block, offset)."""
from __future__ import annotations

import torch


class KVStore:
    """Per-layer tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].

    Slot `s` is token offset `s % block_size` of block `s // block_size`. New K/V go in
    through a slot mapping; attention reads whole blocks through block tables.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: the null block pads block tables and must hold finite values.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, head_dim]) at the slots `slot_mapping` ([tokens], int64)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slot_mapping, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slot_mapping, v.to(vc.dtype))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.k[0].device)
        dst = torch.tensor([p[1] for p in pairs], device=self.k[0].device)
        for t in self.k + self.v:
            t.index_copy_(0, dst, t.index_select(0, src))
