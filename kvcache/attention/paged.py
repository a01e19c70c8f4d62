"""Attention over the paged KV store, by the backend chosen at start-up (backend.py).

Decode rows go through a kernel that walks block tables: the C++ CPU kernel (cpu_kernel.py) or the Triton one
(triton_attention.py). Otherwise, the portable path: decode rows are attended in groups of similar length: their
blocks are gathered into a reused workspace (allocating a fresh tensor each layer costs more than the copy on
CPU), then one SDPA call with a padding mask. Prefill chunks are attended one sequence at a time; a chunk with no
cached prefix attends to its fresh K/V without a gather, a chunk over a cached prefix reads the store (the
Triton kernel on that backend, a gather and SDPA otherwise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.attention import cpu_kernel
from kvcache.attention.metadata import ForwardBatch


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


def gather_blocks(store, layer: int, block_ids: torch.Tensor, ws: Workspace, like: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of `block_ids` in the compute dtype: into reused buffers for an exact store, freshly
    dequantized (or widened) otherwise."""
    if not store.exact:
        return store.gather(layer, block_ids)
    shape = (block_ids.numel(), store.block_size, *like.shape[1:])
    return store.gather(layer, block_ids, ws.get("k", shape, like), ws.get("v", shape, like))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store, layer: int, batch: ForwardBatch,
                    scale: float, window: int | None, ws: Workspace, key_src: torch.Tensor | None = None,
                    softcap: float | None = None, prefills: list | None = None) -> torch.Tensor:
    """Attention output [T, H, D] for queries q [T, H, D] over layer `layer` of `store`: of every decode row and
    of the prefill chunks `prefills` (default: all the batch's; rows of the others are left unwritten).

    k, v [T, KVH, D] are this step's new keys/values, already written to the store (a KVStore or a
    QuantizedKVStore); GQA/MQA share each KV head across H / KVH query heads. Blocks are read
    dequantized; under KIVI, keys of each query's own group come in full precision from `key_src`, what
    the store's `write` returned. With `softcap` (Gemma-2) the scores are soft-capped, c * tanh(s / c), before
    the mask and the softmax, by every path.
    """
    T, H, D = q.shape
    kvh = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides (kernels write it)
    src = key_src
    for g in batch.decode_groups:
        table, lens = g.view(layer)
        # every row a decode (in batch order: a kernel's group is not sorted): the kernel writes `out` directly
        whole = batch.decode_kernel and g.rows.numel() == T
        if batch.decode_kernel and batch.backend == "triton":
            o = out if whole else ws.get("decode_out", (g.rows.numel(), H, D), q)
            triton_attention().paged_decode(o, q.contiguous() if whole else q.index_select(0, g.rows), store, layer,
                                            table, lens, scale, window, softcap=softcap)
            if not whole:
                out.index_copy_(0, g.rows, o)
            continue
        if batch.decode_kernel:
            o = out if whole else ws.get("decode_out", (g.rows.numel(), H, D), q)
            # whole: q as it is where its heads are packed (the kernel takes any row stride), not copied every layer
            qg = (q if q.stride(2) == 1 and q.stride(1) == D else q.contiguous()) if whole else q.index_select(0, g.rows)
            if not hasattr(store, "raw"):  # float32, float16 or bfloat16 blocks: the kernel widens as it reads
                cpu_kernel.paged_decode(o, qg, store.k[layer], store.v[layer], table, lens, scale, window, softcap,
                                        g.runs)
            else:
                full = (src, *g.full) if g.full is not None else None
                cpu_kernel.paged_decode_quant(o, qg, store, layer, table, lens, scale, window, full, softcap, g.runs)
            if not whole:
                out.index_copy_(0, g.rows, o)
            continue
        B, L = g.rows.numel(), g.num_blocks * store.block_size
        mask = g.masks[window]
        if g.layer_views:  # eviction left some layers' leading blocks dead: lengths differ per layer
            mask = (torch.arange(L, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        kg, vg = gather_blocks(store, layer, table.flatten(), ws, k)
        kg, vg = kg.view(B, L, kvh, D), vg.view(B, L, kvh, D)
        if g.overlay is not None:
            b, pos, rows = g.overlay
            kg[b, pos] = src.index_select(0, rows)
        qg = q.index_select(0, g.rows).unsqueeze(2)  # [B, H, 1, D]
        o = _attend(qg, kg.transpose(1, 2), vg.transpose(1, 2), mask, scale, softcap)
        out.index_copy_(0, g.rows, o.squeeze(2))
    q_rows = None  # q as the Triton prefill kernel indexes it, [T, H, D] contiguous (q is a view of q/k/v)
    for p in batch.prefills if prefills is None else prefills:
        if batch.backend == "triton" and p.block_ids is not None:
            q_rows = q.contiguous() if q_rows is None else q_rows
            triton_attention().paged_prefill(out, q_rows, store, layer, p.block_ids, p.start, p.length, p.context_len,
                                             scale, window, softcap)
            continue
        if _prefill_kernel(out, q, k, v, store, layer, p, batch, scale, window, softcap, ws, src):
            continue
        qs = q[p.start:p.start + p.length].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.block_ids is None:
            ks = k[p.start:p.start + p.length]
            vs = v[p.start:p.start + p.length]
        else:
            ks, vs = gather_blocks(store, layer, p.block_ids, ws, k)
            ks, vs = ks.flatten(0, 1), vs.flatten(0, 1)
            if p.full_src is not None:
                ks = torch.cat([ks, src.index_select(0, p.full_src)])
                vs = torch.cat([vs, vs[p.full_start:p.context_len]])
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        mask = p.masks[window]
        o = _attend(qs, ks, vs, mask, scale, softcap)
        out[p.start:p.start + p.length] = o.squeeze(0).transpose(0, 1)
    return out


def _prefill_kernel(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store, layer: int, p,
                    batch: ForwardBatch, scale: float, window: int | None, softcap: float | None, ws: Workspace,
                    src: torch.Tensor | None = None) -> bool:
    """Attend prefill chunk `p` with the C++ causal kernel (cpu_kernel.prefill_attention, faster than SDPA's CPU
    kernel on the demo's heads: docs/kernels.md) where it applies, and say whether it did: the cpu backend in float32
    with head sizes a multiple of 32, no soft-cap, no window inside the context, and either a fresh prompt (its own
    K/V) or a chunk over the store's blocks: an exact store's (an MLA latent's too), a per-token quantized store's
    dequantized (as every chunk over a lossy store reads them), or KIVI's (`_kivi_prefill`)."""
    D = q.shape[2]
    if (batch.backend != "cpu" or q.device.type != "cpu" or q.dtype != torch.float32 or softcap is not None
            or D % 32 or cpu_kernel.load() is None):
        return False
    if p.block_ids is None:
        if p.masks[window] is not None:
            return False
        ks, vs = k[p.start:p.start + p.length], v[p.start:p.start + p.length]
    else:
        if (window is not None and window < p.context_len) or (store.latent and not store.exact):
            return False  # a quantized MLA latent keeps SDPA: no test covers it at a head size the kernel takes
        ks, vs = gather_blocks(store, layer, p.block_ids, ws, k)
        ks, vs = ks.flatten(0, 1)[:p.context_len], vs.flatten(0, 1)[:p.context_len]
        if ks.dtype != torch.float32:
            return False
        if p.full_src is not None:
            _kivi_prefill(out, q, ks, vs, src.index_select(0, p.full_src), p, store.kivi_group, scale)
            return True
    cpu_kernel.prefill_attention(out[p.start:p.start + p.length], q[p.start:p.start + p.length], ks, vs, scale)
    return True


def _kivi_prefill(out: torch.Tensor, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, full: torch.Tensor, p,
                  group: int, scale: float) -> None:
    """KIVI's prefill attention with the causal kernel, one key group of queries at a time: a query attends to the
    dequantized keys of the groups before its own and to the full-precision (fp16) keys of its own group's positions
    up to its own; values dequantized throughout. `ks`, `vs` [context, KVH, D] as the blocks hold them (a group not
    yet complete holds stale keys, never read here); `full` the fp16 keys of positions [p.full_start, context).
    `ks` is the step's own dequantized copy: each group's rows take its fp16 keys while it is attended, then their
    dequantized values back for the groups after it (no copy of the growing prefix per group)."""
    ctx, first = p.context_len, p.context_len - p.length
    for g0 in range(first - first % group, ctx, group):
        a, b = max(first, g0), min(ctx, g0 + group)
        kept = ks[g0:b].clone()
        ks[g0:b] = full[g0 - p.full_start:b - p.full_start]
        rows = slice(p.start + a - first, p.start + b - first)
        cpu_kernel.prefill_attention(out[rows], q[rows], ks[:b], vs[:b], scale)
        ks[g0:b] = kept


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """Attention of q [B, H, n, D] over k, v [B, KVH, L, D] (GQA when KVH < H); mask bool [.., n, L] (True:
    attend), None for causal (the last n of the L positions are the queries'). SDPA, or with `softcap` the scores
    computed out, in transformers' eager order: scaled, capped, masked, softmax in float32, cast back."""
    H, kvh = q.shape[1], k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=H != kvh)
    if H != kvh:
        k, v = k.repeat_interleave(H // kvh, dim=1), v.repeat_interleave(H // kvh, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    n, L = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril_(L - n)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, -1, dtype=torch.float32).to(q.dtype), v)


def triton_attention():
    """The Triton kernels' module, imported on first use: triton is needed only by that backend."""
    from kvcache.attention import triton_attention as module
    return module
