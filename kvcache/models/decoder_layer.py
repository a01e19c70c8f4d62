"""The Llama-family decoder layer: attention over the paged store and a gated MLP, op by op or through the C++
kernels' two fused calls around attention (attn_in, mlp), with tensor parallelism's all-reduces where set."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvcache.attention.metadata import ForwardBatch
from kvcache.attention.paged import Workspace, paged_attention
from kvcache.models import cpu_kernels
from kvcache.models.linear import Dense, kernel_tensors
from kvcache.models.norm import rms_norm
from kvcache.models.quant_linear import Int4Dense, Int8Dense
from kvcache.models.rope import apply_rope, head_dim_of
from kvcache.store.kv_store import KVStore
from kvcache.store.quantized_store import QuantizedKVStore

# Steps of at most this many tokens take the fused path in layers with int8 weights (its kernel's range); layers of
# other weights take it at every size, prefill included (faster than op by op there too: docs/kernels.md). 0: never.
FUSED_MAX_ROWS = 32


class DecoderLayer(nn.Module):
    # parameter -> its Hugging Face name under model.layers.{i}.
    NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
    O_BIAS_ARCHS = ("llama", "qwen3")  # whose o_proj has a bias when attention_bias is set
    FUSABLE = True  # whether the fused C++ layer calls (Llama's arithmetic) compute this layer

    def __init__(self, cfg: PretrainedConfig, index: int, window: int | None, linear: type = Dense) -> None:
        super().__init__()
        self.index, self.window = index, window
        self.rope_key: str | None = None  # which of the model's RoPE tables this layer rotates with
        d, hd = cfg.hidden_size, head_dim_of(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        qkv_bias = cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False))
        o_bias = cfg.model_type in self.O_BIAS_ARCHS and bool(getattr(cfg, "attention_bias", False))
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.qkv = linear(d, (self.num_heads + 2 * self.num_kv_heads) * hd, qkv_bias)
        self.o_proj = linear(self.num_heads * hd, d, o_bias)
        self.gate_up = linear(d, 2 * cfg.intermediate_size, mlp_bias)
        self.down = linear(cfg.intermediate_size, d, mlp_bias)
        self.input_norm = nn.Parameter(torch.ones(d))
        self.post_norm = nn.Parameter(torch.ones(d))
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
        self.eps = cfg.rms_norm_eps
        self.scale = hd ** -0.5
        self.kernels = None  # the C++ CPU kernels (cpu_kernels.py) when computing in float32 on the CPU
        self.fused: list[list[torch.Tensor]] | None = None  # the linears' tensors for the fused path
        self.fused_any_rows = False  # whether the fused path takes steps above FUSED_MAX_ROWS (fuse)
        self.tp = None  # tensor parallelism (parallel/sharding.py): all-reduces o_proj's and down's outputs

    def load_attention(self, ck, prefix: str) -> None:
        """q/k/v_proj (fused into qkv) and o_proj, biases too where they have them, from a CheckpointReader `ck`
        under `prefix` (model.layers.{i}.self_attn.)."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        ck.put_fused(self.qkv, [prefix + f"{n}_proj.weight" for n in "qkv"],
                     [prefix + f"{n}_proj.bias" for n in "qkv"] if self.qkv.bias is not None else None,
                     [q_rows, kv_rows, kv_rows])
        ck.put_linear(self.o_proj, prefix + "o_proj.weight")
        if self.o_proj.bias is not None:
            ck.put(self.o_proj.bias, prefix + "o_proj.bias")

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of residual + x, residual + x); the sum may be made in place in `residual` (a tensor of this
        forward's own). The first layer has no residual yet: x is it."""
        if self.kernels is None:
            residual = x if residual is None else residual + x
            return rms_norm(residual, weight, self.eps), residual
        h = torch.empty_like(x)
        if residual is None:
            self.kernels.add_rms_norm(h, x, None, weight, self.eps)
            return h, x
        self.kernels.add_rms_norm(h, residual, x, weight, self.eps)
        return h, residual

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of x [T, heads, hd]: in place through the C++ kernel (x is a view of this step's q/k/v product), or
        into a new tensor."""
        if self.kernels is None:
            return apply_rope(x, cos, sin)
        self.kernels.rope_(x, cos.squeeze(1), sin.squeeze(1))
        return x

    def fuse(self, kernels) -> None:
        """Hand the C++ kernels this layer's weights (float32 on the CPU; int4 needs VNNI)."""
        self.kernels = kernels
        linears = (self.qkv, self.o_proj, self.gate_up, self.down)
        usable = kernels is not None and self.FUSABLE and not self.qk_norm and all(
            not isinstance(m, Int4Dense) or cpu_kernels.has_int4() for m in linears)
        self.fused = [kernel_tensors(m) for m in linears] if usable else None
        # int8's kernel is for decode-sized steps (its layer dequantizes above them); the float32 (oneDNN, MKL) and
        # int4 kernels take any number of rows, so every step of such a layer is fused, prefill included
        self.fused_any_rows = not any(isinstance(m, Int8Dense) for m in linears)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, store: KVStore | QuantizedKVStore, ws: Workspace,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream) for every row, or, given `rows` (the last layer's
        logits rows), for those rows only, in their order: every row's K and V are still written and attended with,
        but the output projection and the MLP run on the rows the LM head reads (as llama.cpp skips a prompt's
        other rows in its last layer). A row's result does not depend on which other rows are in the batch."""
        if self.takes_fused(batch, x.shape[0]):
            return self._forward_fused(x, residual, cos, sin, batch, store, ws, rows)
        h, residual = self._add_norm(x, residual, self.input_norm)
        T, hd, H = h.shape[0], self.head_dim, self.num_heads
        qkv = self.qkv(h).view(T, -1, hd)  # [T, H + 2 KVH, hd]
        v = qkv[:, H + self.num_kv_heads:]
        if self.qk_norm:
            q = self._rope(rms_norm(qkv[:, :H], self.q_norm, self.eps), cos, sin)
            k = self._rope(rms_norm(qkv[:, H:H + self.num_kv_heads], self.k_norm, self.eps), cos, sin)
        else:  # q and k rotated together: half the small ops of a decode step's RoPE
            qk = self._rope(qkv[:, :H + self.num_kv_heads], cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        if batch.capture_rows is not None:  # eviction scores these queries after the forward
            batch.captured_q.append(q.index_select(0, batch.capture_rows))
        src = store.write(self.index, batch.slot_mapping, k, v, batch.kivi)
        o = paged_attention(q, k, v, store, self.index, batch, self.scale, self.window, ws, src)
        o, residual = select_rows(rows, o, residual)
        o = self.o_proj(o.flatten(1))
        if self.tp is not None:  # row-parallel: each rank's heads' share of the projection, summed
            o = self.tp.all_reduce(o)
        h, residual = self._add_norm(o, residual, self.post_norm)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        out = self.down(F.silu(gate).mul_(up))
        return (out if self.tp is None else self.tp.all_reduce(out)), residual


    def takes_fused(self, batch: ForwardBatch, tokens: int) -> bool:
        """Whether a step of `tokens` rows runs this layer's fused calls (attn_in and mlp)."""
        return (self.fused is not None and batch.capture_rows is None and FUSED_MAX_ROWS > 0
                and (tokens <= FUSED_MAX_ROWS or self.fused_any_rows))

    def _forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       batch: ForwardBatch, store: KVStore | QuantizedKVStore, ws: Workspace,
                       rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() in two native calls around attention (the same arithmetic)."""
        T, hd, H, KVH = x.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        w_qkv, w_o, w_gate_up, w_down = self.fused
        if residual is None:
            residual, x = x, None
        writes_kv = native_write(store)  # a float32, float16 or bfloat16 store: attn_in stores K/V itself
        cache = store.native_write(self.index, batch.slot_mapping) if writes_kv else (None, None, None)
        qkv = self.kernels.attn_in(residual, x, self.input_norm, self.eps, w_qkv, (H + 2 * KVH) * hd, cos, sin,
                                   H + KVH, hd, *cache).view(T, -1, hd)
        q, k, v = qkv[:, :H], qkv[:, H:H + KVH], qkv[:, H + KVH:]
        src = None if writes_kv else store.write(self.index, batch.slot_mapping, k, v, batch.kivi)
        o = paged_attention(q, k, v, store, self.index, batch, self.scale, self.window, ws, src)
        o, residual = select_rows(rows, o, residual)
        out = self.kernels.mlp(residual, o.flatten(1), w_o, self.post_norm, self.eps, w_gate_up, w_down,
                               self.gate_up.out_features // 2)
        return out, residual


def select_rows(rows: torch.Tensor | None, o: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's attention output and residual stream, at `rows` only (all of them where None)."""
    if rows is None:
        return o, residual
    return o.index_select(0, rows), residual.index_select(0, rows)


def native_write(store: KVStore | QuantizedKVStore) -> bool:
    """Whether the fused path's attn_in may store K/V itself (KVStore.native_write): a KVStore of float32, float16 or
    bfloat16 (attn_in converts as KVStore.write does); the quantized and KIVI stores encode on write."""
    return isinstance(store, KVStore) and store.k[0].dtype in (torch.float32, torch.float16, torch.bfloat16)
