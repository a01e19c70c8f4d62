"""The physical KV cache in a quantized format: fp8_e4m3, fp8_e5m2, int8 (a scale per token and KV
head) and int4, int2 (KIVI: Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache"). The codecs are in codecs.py; the bytes are the ones plan/kv_bytes.py counts, which
the constructor checks.

Each layer owns one byte tensor [num_blocks, block bytes]; the codes, scales and zero points of a
block are views of its row. New K/V are quantized as they are written; `gather` dequantizes the
blocks a step reads, so no full-precision copy of the cache is ever kept.

KIVI keys are quantized per channel over a group of 64 tokens, so a group can only be quantized
once all its tokens exist. Until then (at most 63 tokens) its keys wait in full precision (fp16)
in the sequence's *private blocks*: `seq_blocks` pool blocks whose rows, read as fp16, hold the
residual (see memory/kv_cache_manager.py). Groups never straddle blocks (block_size is a multiple
of 64), so a full block holds only quantized groups and is shared by the prefix cache as it is.
A query attends to the keys of earlier groups dequantized and to those of its own group in full
precision, whether its tokens arrive in one prefill chunk or one decode step at a time; values
are quantized per token at write time, as KIVI does.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcache.plan.kv_bytes import check_latent_format, kv_dtype
from kvcache.store.codecs import BITS, FP8, quantize_per_channel, quantize_per_token, unpack
from kvcache.store.kv_store import KVStore, _unique, alias_lists, block_zeros, copy_rows, move_slots


@dataclass(slots=True)
class KiviPlan:
    """Where one step's keys go under KIVI; built once per step (attention/metadata.py), read by every layer.

    Full-precision keys come from `cat(k, residual keys)`: this step's new keys (T rows) followed by the
    residual keys it reads (`resid_read`). Indices named `src` point into that concatenation.
    """

    resid_read: torch.Tensor  # [R * E / resid_unit] indices of the R residual tokens read (E = kv_heads x head_dim)
    group_src: torch.Tensor  # [NG * 64] src rows of the groups this step completes, in token order
    group_blocks: torch.Tensor  # [NG * 64] block of each of those tokens
    group_offsets: torch.Tensor  # [NG * 64] offset in the block
    scale_blocks: torch.Tensor  # [NG] block holding each group
    scale_groups: torch.Tensor  # [NG] group index inside that block
    resid_rows: torch.Tensor  # [W] rows of k kept in the residual (their group is not complete)
    resid_write: torch.Tensor  # [W * E / resid_unit] indices they go to
    # the residual indices count in units of this many fp16 elements of a layer's flat16: E (a token's row) where no
    # token straddles two private blocks, else 1
    resid_unit: int = 1


class QuantizedKVStore:
    """KV blocks stored as codes plus fp16 scales (and zero points for int4/int2).

    A `latent` store (MLA, per-token formats only) holds one code vector and one scale per token and layer: the
    latent and its RoPE key quantized together, one scale for both (the planner's bytes). Its V views are its K
    views: V's offsets in a row are K's, so the decode kernels read the latent as both."""

    exact = False

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str, device: str | torch.device = "cpu", compute_dtype: torch.dtype = torch.float32,
                 expected_bytes_per_token: int | None = None, latent: bool = False) -> None:
        spec = kv_dtype(dtype)
        if spec.scales == "none":
            raise ValueError(f"{dtype} is not a quantized format; use KVStore")
        if latent:
            check_latent_format(spec.name)
        self.latent = latent
        self.dtype, self.block_size, self.num_blocks = spec.name, block_size, num_blocks
        self.num_kv_heads, self.head_dim, self.compute_dtype = num_kv_heads, head_dim, compute_dtype
        self.kivi_group = spec.group if spec.scales == "kivi" else 0
        bs, h, d = block_size, num_kv_heads, head_dim
        if self.kivi_group:
            g = self.kivi_group
            self.bits = BITS[spec.name]
            per = 8 // self.bits
            # byte -> its `per` codes as floats: unpacking is one gather, not a shift and mask per code
            self.lut = unpack(torch.arange(256, dtype=torch.uint8)[:, None], self.bits).to(device, compute_dtype)
            self.value_group = min(g, d)
            if bs % g or d % per or d % self.value_group:
                raise ValueError(f"{spec.name} needs block_size a multiple of {g} and head_dim a multiple of "
                                 f"{per} and of {self.value_group}; got block_size {bs}, head_dim {d}")
            parts = {"kd": (torch.uint8, (bs, h, d // per)), "vd": (torch.uint8, (bs, h, d // per)),
                     "ks": (torch.float16, (bs // g, h, d)), "kz": (torch.float16, (bs // g, h, d)),
                     "vs": (torch.float16, (bs, h, d // self.value_group)),
                     "vz": (torch.float16, (bs, h, d // self.value_group))}
        else:
            code = FP8.get(spec.name, torch.int8)
            self.value_group = 1
            self.lut = torch.arange(256, dtype=torch.uint8).view(code).to(device, compute_dtype)  # byte -> value
            parts = {"kd": (code, (bs, h, d)), "vd": (code, (bs, h, d)),
                     "ks": (torch.float16, (bs, h)), "vs": (torch.float16, (bs, h))}
            if latent:
                del parts["vd"], parts["vs"]
        sizes = {n: torch.Size(s).numel() * torch.empty(0, dtype=t).element_size() for n, (t, s) in parts.items()}
        self.row_bytes = sum(sizes.values())
        if expected_bytes_per_token is not None and self.row_bytes * num_layers != expected_bytes_per_token * bs:
            raise RuntimeError(f"{spec.name} block layout takes {self.row_bytes * num_layers:,} bytes per block; the "
                               f"planner counts {expected_bytes_per_token * bs:,}")
        # zeros: the null block pads block tables and must dequantize to finite values.
        self.raw = [block_zeros((num_blocks, self.row_bytes), torch.uint8, device) for _ in range(num_layers)]
        starts = dict(zip(parts, [sum(list(sizes.values())[:i]) for i in range(len(sizes))]))
        self.parts = [{name: raw[:, starts[name]:starts[name] + sizes[name]].view(t).view(num_blocks, *shape)
                       for name, (t, shape) in parts.items()} for raw in self.raw]
        if latent:
            starts.update(vd=starts["kd"], vs=starts["ks"])
        # byte offsets of K codes, V codes, K scales, V scales, K zeros, V zeros in a row (the C++ decode kernel's view)
        self.offsets = [starts.get(n, 0) for n in ("kd", "vd", "ks", "vs", "kz", "vz")]
        # The residual's fp16 elements, addressed across a sequence's private blocks.
        self.row_elems = self.row_bytes // 2
        self.flat16 = [raw.view(torch.float16).view(-1) for raw in self.raw] if self.kivi_group else []
        # A fused quantize-and-scatter kernel for the per-token formats (the Triton backend's), else the codec's ops
        self.fused_write: Callable[[QuantizedKVStore, int, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(r.numel() for r in self.block_tensors())

    def alias(self, slots: list[int]) -> None:
        """Layer i uses the rows built for layer slots[i] (see KVStore.alias)."""
        alias_lists(self, ("raw", "parts", "flat16"), slots)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              plan: KiviPlan | None = None) -> torch.Tensor | None:
        """Quantize and store k, v ([tokens, kv_heads, head_dim]) for the slots `slot_mapping`; under KIVI,
        `plan` says which key groups complete and which keys wait in the residual.

        Returns, under KIVI, the step's full-precision keys (`key_source`) as read before the write: attention
        needs them, and the write may reuse residual slots that earlier queries of this step still read."""
        p = self.parts[layer]
        if not self.kivi_group and self.fused_write is not None:
            self.fused_write(self, layer, slot_mapping, k, v)
            return None
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        if not self.kivi_group:
            for x, data, scale in ((k, "kd", "ks"),) if self.latent else ((k, "kd", "ks"), (v, "vd", "vs")):
                q = quantize_per_token(x, self.dtype)
                p[data][blocks, offsets] = q.data
                p[scale][blocks, offsets] = q.scale.squeeze(-1)
            return None
        q = quantize_per_token(v, self.dtype, self.kivi_group)
        p["vd"][blocks, offsets] = q.data
        p["vs"][blocks, offsets] = q.scale
        p["vz"][blocks, offsets] = q.zero
        src = self.key_source(layer, k, plan)
        if plan.group_src.numel():
            g = self.kivi_group
            groups = src.index_select(0, plan.group_src).view(-1, g, *k.shape[1:])  # [NG, g, H, D]
            qk = quantize_per_channel(groups.transpose(0, 1), self.dtype)  # reduce over each group's tokens
            p["kd"][plan.group_blocks, plan.group_offsets] = qk.data.transpose(0, 1).reshape(-1, *qk.data.shape[2:])
            p["ks"][plan.scale_blocks, plan.scale_groups] = qk.scale
            p["kz"][plan.scale_blocks, plan.scale_groups] = qk.zero
        if plan.resid_rows.numel():
            u = plan.resid_unit
            self.flat16[layer].view(-1, u).index_copy_(0, plan.resid_write,
                                                       k.index_select(0, plan.resid_rows).to(torch.float16).view(-1, u))
        return src

    def key_source(self, layer: int, k: torch.Tensor, plan: KiviPlan) -> torch.Tensor:
        """cat(k, the residual keys the step reads), in fp16 precision and the compute dtype: what `src` indices
        point into. New keys are rounded to fp16 like the residual, so a key is the same whether it was
        written this step or an earlier one (outputs do not depend on chunking)."""
        k16 = k.to(torch.float16)
        if plan.resid_read.numel():
            read = self.flat16[layer].view(-1, plan.resid_unit).index_select(0, plan.resid_read)
            k16 = torch.cat([k16, read.view(-1, *k.shape[1:])])
        return k16.to(k.dtype)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of `block_ids` ([N]), [N, block_size, kv_heads, head_dim] each in the compute dtype.

        Slots not yet written (and, under KIVI, keys of groups not yet complete) hold stale finite values:
        attention masks them or overlays the residual."""
        p = {name: t.index_select(0, block_ids) for name, t in self.parts[layer].items()}
        if not self.kivi_group:
            k = p["kd"].to(self.compute_dtype).mul_(p["ks"].unsqueeze(-1))
            if self.latent:
                return k, k
            v = p["vd"].to(self.compute_dtype).mul_(p["vs"].unsqueeze(-1))
        else:
            n, g, h, d = block_ids.numel(), self.kivi_group, self.num_kv_heads, self.head_dim
            k = self._codes(p["kd"]).view(n, -1, g, h, d)
            k = torch.addcmul(p["kz"].unsqueeze(2).to(k.dtype), k, p["ks"].unsqueeze(2).to(k.dtype))
            v = self._codes(p["vd"]).view(n, self.block_size, h, -1, self.value_group)
            v = torch.addcmul(p["vz"].unsqueeze(-1).to(v.dtype), v, p["vs"].unsqueeze(-1).to(v.dtype))
            k, v = k.view(n, self.block_size, h, d), v.view(n, self.block_size, h, d)
        return k, v

    def _codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed int4/int2 bytes [..., D * bits / 8] -> their codes as compute-dtype floats [..., D]."""
        return self.lut.index_select(0, packed.flatten().int()).view(*packed.shape[:-1], -1)

    def move_slots(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per KV head, slot dst[h, i] takes the codes and scales of slot src[h, i] ([kv_heads, n] each). Per-token
        formats only: a KIVI key group shares its scales across 64 tokens, so its tokens cannot move alone."""
        if self.kivi_group:
            raise ValueError(f"{self.dtype} quantizes keys in {self.kivi_group}-token groups: its tokens cannot be "
                             "evicted one by one")
        move_slots(list(self.parts[layer].values()), src, dst, self.block_size)

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose dim 0 is the block, each once: a block's codes and scales are its row of each layer's
        bytes."""
        return _unique(self.raw)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Clear `blocks` in every layer, codes, scales and residuals (a failed request's, which may hold NaN)."""
        if blocks:
            idx = torch.tensor(blocks, device=self.raw[0].device)
            for raw in self.block_tensors():
                raw.index_fill_(0, idx, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (a fork's partial block and private blocks)."""
        copy_rows(self.block_tensors(), pairs)


def make_store(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
               compute_dtype: torch.dtype, device: str | torch.device,
               expected_bytes_per_token: int | None = None, latent: bool = False, layer_slots: list[int] | None = None):
    """The store for `kv_cache_dtype` (a name from plan.kv_bytes.KV_DTYPES); `latent`: one tensor per token and layer
    (MLA), read as both K and V. With `expected_bytes_per_token` (the planner's figure), RuntimeError unless the
    store's blocks take exactly that. With `layer_slots` (per-layer-group tables) the store is built for
    `num_layers` layers, the layers of one group, and layer i of the model uses slot layer_slots[i] (`alias`)."""
    spec = kv_dtype(kv_cache_dtype)
    if spec.scales != "none":
        store = QuantizedKVStore(num_layers, num_blocks, block_size, num_kv_heads, head_dim, spec.name, device,
                                 compute_dtype, expected_bytes_per_token, latent)
        if layer_slots is not None:
            store.alias(layer_slots)
        return store
    store = KVStore(num_layers, num_blocks, block_size, num_kv_heads, head_dim, getattr(torch, spec.name), device,
                    compute_dtype, latent)
    if layer_slots is not None:
        store.alias(layer_slots)
    if expected_bytes_per_token is not None and store.nbytes != expected_bytes_per_token * block_size * num_blocks:
        raise RuntimeError(f"the {spec.name} store takes {store.nbytes // (num_blocks * block_size):,} bytes per token; "
                           f"the planner counts {expected_bytes_per_token:,}")
    return store
