"""The physical KV cache in full precision (float32, float16, bfloat16): one K and one V tensor per layer.

Quantized formats live in quantized_store.py; `make_store` picks one. Both give attention the
same two operations: `write` the step's new K/V through the batch's slot mapping, and `gather`
whole blocks back in the compute dtype.
"""
from __future__ import annotations

import torch

from kvcache.native import host_memory


def block_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A layer's zeroed block tensor; on the CPU on huge pages where the OS gives them (host_memory.huge_page_zeros):
    decode reads blocks scattered over the whole pool, a TLB miss per 4 KiB page otherwise."""
    if torch.device(device).type == "cpu":
        return host_memory.huge_page_zeros(tuple(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVStore:
    """Per-layer tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].

    Slot `s` is token offset `s % block_size` of block `s // block_size`. New K/V go in
    through a slot mapping; attention reads whole blocks through block tables. When the storage
    dtype is narrower than the compute dtype (float16 storage, float32 compute) reads widen it.

    A `latent` store (MLA) keeps one tensor per layer: V is K (`self.v[i] is self.k[i]`), so attention reads the
    latent as both and it is stored, counted and moved once.
    """

    kivi_group = 0  # no key residual: see QuantizedKVStore

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 compute_dtype: torch.dtype | None = None, latent: bool = False) -> None:
        self.block_size = block_size
        self.latent = latent
        self.num_blocks = num_blocks
        self.compute_dtype = compute_dtype or dtype
        # Reads return exactly what attention computed: prefill may attend to its fresh K/V directly.
        self.exact = dtype == self.compute_dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: the null block pads block tables and must hold finite values.
        self.k = [block_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = self.k if latent else [block_zeros(shape, dtype, device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.block_tensors())

    def alias(self, slots: list[int]) -> None:
        """Make layer i use the tensors built for layer slots[i] (per-layer-group tables: a block holds one group's
        layers, so layers of different groups at the same slot share memory, each group's blocks its own)."""
        alias_lists(self, ("k", "v"), slots)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan=None) -> None:
        """Store k, v ([tokens, kv_heads, head_dim]) at the slots `slot_mapping` ([tokens], int64)."""
        pairs = ((self.k[layer], k),) if self.latent else ((self.k[layer], k), (self.v[layer], v))
        for cache, x in pairs:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x if x.dtype == cache.dtype else x.to(cache.dtype))
        return None

    def native_write(self, layer: int, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K cache, V cache, slots) for a native kernel that stores this step's k, v itself, as `write` would (the
        fused CPU decode path: cpu_kernels.attn_in). Every K/V write goes through `write` or this."""
        return self.k[layer], self.v[layer], slot_mapping

    def gather(self, layer: int, block_ids: torch.Tensor, out_k: torch.Tensor | None = None,
               out_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `block_ids` ([N]) in the compute dtype, [N, block_size, kv_heads, head_dim] each. An exact
        store writes them into `out_k`/`out_v` when given (workspace buffers of that shape); a narrower one widens
        fresh copies."""
        k, v = self.k[layer], self.v[layer]
        if self.exact:
            kg = torch.index_select(k, 0, block_ids, out=out_k)
            return kg, kg if self.latent else torch.index_select(v, 0, block_ids, out=out_v)
        kg = k.index_select(0, block_ids).to(self.compute_dtype)
        return kg, kg if self.latent else v.index_select(0, block_ids).to(self.compute_dtype)

    def move_slots(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head h, slot dst[h, i] takes the K/V of slot src[h, i] ([kv_heads, n] int64 each): eviction's
        compaction. All reads happen before any write, so the ranges may overlap."""
        move_slots([self.k[layer]] if self.latent else [self.k[layer], self.v[layer]], src, dst, self.block_size)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose dim 0 is the block, each once: a block's content is its row in each (offload copies
        them)."""
        return _unique(list(self.k) if self.latent else self.k + self.v)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Clear `blocks` in every layer (a failed request's, which may hold NaN)."""
        if blocks and self.k:  # (a model whose every layer is recurrent stores no K/V: no layer here)
            idx = torch.tensor(blocks, device=self.k[0].device)
            for t in self.block_tensors():
                t.index_fill_(0, idx, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block)."""
        copy_rows(self.block_tensors(), pairs)


def copy_rows(tensors: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """Copy rows (dim 0) src -> dst in each of `tensors`, all on one device (no-op for no pairs or no tensors)."""
    if not pairs or not tensors:
        return
    src = torch.tensor([p[0] for p in pairs], device=tensors[0].device)
    dst = torch.tensor([p[1] for p in pairs], device=tensors[0].device)
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


def move_slots(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, block_size: int) -> None:
    """Per KV head, copy slots src -> dst in tensors shaped [blocks, block_size, kv_heads, ...] (views too)."""
    heads = torch.arange(src.shape[0], device=src.device)[:, None]
    for t in tensors:
        t[dst // block_size, dst % block_size, heads] = t[src // block_size, src % block_size, heads]


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` without repeats (aliased layers, a latent's K and V), in order."""
    return list({id(t): t for t in tensors}.values())


def alias_lists(store, names: tuple[str, ...], slots: list[int]) -> None:
    """Rebind each per-layer list attribute of `store` in `names` to one entry per layer of `slots`."""
    built = len(getattr(store, names[0]))
    if not slots or min(slots) < 0 or max(slots) >= built:
        raise ValueError(f"layer slots {slots} must index the {built} layers the store was built with")
    for name in names:
        per_layer = getattr(store, name)
        if per_layer:  # an empty list (no KIVI residual views) stays empty
            setattr(store, name, [per_layer[s] for s in slots])
