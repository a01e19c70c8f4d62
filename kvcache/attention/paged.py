"""Attention over the paged KV store.

Decode rows go through the C++ CPU kernel when it is available (see cpu_kernel.py).
Otherwise, the portable path: decode rows are attended in groups of similar length: their blocks are gathered into a
reused workspace (allocating a fresh tensor each layer costs more than the copy on
CPU), then one SDPA call with a padding mask. Prefill chunks are attended one sequence
at a time; a chunk with no cached prefix attends to its fresh K/V without a gather.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.attention import cpu_kernel
from kvcache.attention.metadata import ForwardBatch


def use_cpu_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode rows go through the C++ kernel (CPU, fp32, compiler present) rather than SDPA."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernel.load() is not None


class Workspace:
    """Grow-only scratch buffers reused across layers and steps."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(max(n, 1), dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, ws: Workspace, name: str) -> torch.Tensor:
    out = ws.get(name, (block_ids.numel(), *cache.shape[1:]), cache)
    return torch.index_select(cache, 0, block_ids, out=out)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: ForwardBatch, scale: float, window: int | None,
                    ws: Workspace) -> torch.Tensor:
    """Attention output [T, H, D] for queries q [T, H, D].

    k, v [T, KVH, D] are this step's new keys/values, already written to the caches
    ([num_blocks, block_size, KVH, D]); GQA/MQA share each KV head across H / KVH query heads.
    """
    T, H, D = q.shape
    kvh = k_cache.shape[2]
    gqa = H != kvh
    out = torch.empty_like(q)
    for g in batch.decode_groups:
        if batch.decode_kernel:
            o = ws.get("decode_out", (g.rows.numel(), H, D), q)
            cpu_kernel.paged_decode(o, q.index_select(0, g.rows), k_cache, v_cache, g.block_table,
                                    g.context_lens, scale, window)
            out.index_copy_(0, g.rows, o)
            continue
        B, L = g.rows.numel(), g.num_blocks * k_cache.shape[1]
        ids = g.block_table.flatten()
        kg = _gather(k_cache, ids, ws, "k").view(B, L, kvh, D).transpose(1, 2)
        vg = _gather(v_cache, ids, ws, "v").view(B, L, kvh, D).transpose(1, 2)
        qg = q.index_select(0, g.rows).unsqueeze(2)  # [B, H, 1, D]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.masks[window], scale=scale, enable_gqa=gqa)
        out.index_copy_(0, g.rows, o.squeeze(2))
    for p in batch.prefills:
        qs = q[p.start:p.start + p.length].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.block_ids is None:
            ks = k[p.start:p.start + p.length]
            vs = v[p.start:p.start + p.length]
        else:
            ks = _gather(k_cache, p.block_ids, ws, "k").flatten(0, 1)
            vs = _gather(v_cache, p.block_ids, ws, "v").flatten(0, 1)
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        mask = p.masks[window]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=gqa)
        out[p.start:p.start + p.length] = o.squeeze(0).transpose(0, 1)
    return out
