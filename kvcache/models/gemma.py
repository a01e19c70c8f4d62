"""Gemma-2 (`gemma2`) and Gemma-3 text (`gemma3_text`) decoders over the paged KV store: the Llama layer with
Gemma's differences.

- RMSNorm scales by (1 + w), all in float32 and cast once at the end (transformers' Gemma3RMSNorm): the norm
  weights are kept in float32 whatever the compute dtype, with the 1 added once at load.
- Four norms a layer: the attention's and the MLP's outputs are normed before each joins the residual.
- Queries are scaled by query_pre_attn_scalar^-0.5, not head_dim's; layer_types says which layers are local
  (sliding window) and which global: alternating in Gemma-2, 5 local to 1 global in Gemma-3.
- Gemma-2 soft-caps the attention scores (attn_logit_softcapping: s = c * tanh(s / c)), which every attention
  path computes (attention/paged.py: the C++ and Triton kernels, and the portable path's scores written out).
- Gemma-3 norms q and k per head before RoPE, and its local layers rotate with their own RoPE base
  (rope_parameters["sliding_attention"]), global layers with theirs.
- The MLP is GELU (tanh approximation) gated; embeddings are scaled by sqrt(hidden_size) in the compute dtype;
  the final logits are soft-capped where final_logit_softcapping is set.

The KV cache is the Llama one: K and V per layer, sliding layers reading only their window. Bidirectional
attention (use_bidirectional_attention, the embedding variants) is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvcache.attention.metadata import ForwardBatch
from kvcache.attention.paged import Workspace, paged_attention
from kvcache.models.decoder_layer import DecoderLayer, select_rows
from kvcache.models.linear import Dense
from kvcache.models.llama import LlamaModel
from kvcache.store.kv_store import KVStore
from kvcache.store.quantized_store import QuantizedKVStore


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x times `weight` (already 1 + w, float32), computed in float32 and cast to x's dtype once."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def check_config(cfg: PretrainedConfig) -> None:
    """Refuse what these decoders do not compute, naming the field."""
    name = cfg.model_type
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{name} with use_bidirectional_attention=True (an embedding model) is not supported: "
                         "kvcache runs causal decoders")
    act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{name} hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    for field in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(cfg, field, None)
        if (value is not None or field == "query_pre_attn_scalar") and not (value or 0) > 0:
            raise ValueError(f"{name} {field} must be positive; got {value!r}")


class GemmaLayer(DecoderLayer):
    """A Gemma decoder layer; Gemma-3's adds q/k norms and its own RoPE per kind of layer (Gemma3Layer)."""

    NORMS = {**DecoderLayer.NORMS, "pre_ff_norm": "pre_feedforward_layernorm",
             "post_ff_norm": "post_feedforward_layernorm"}
    O_BIAS_ARCHS = ("gemma2", "gemma3_text")
    FUSABLE = False

    def __init__(self, cfg: PretrainedConfig, index: int, window: int | None, linear: type = Dense) -> None:
        super().__init__(cfg, index, window, linear)
        d = cfg.hidden_size
        self.pre_ff_norm = nn.Parameter(torch.ones(d))
        self.post_ff_norm = nn.Parameter(torch.ones(d))
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None

    def norm_weights(self) -> list[nn.Parameter]:
        return [getattr(self, p) for p in self.NORMS] + ([self.q_norm, self.k_norm] if self.qk_norm else [])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, store: KVStore | QuantizedKVStore, ws: Workspace,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        h = gemma_rms_norm(residual, self.input_norm, self.eps)
        T, hd, H, KVH = h.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv(h).view(T, -1, hd)
        if self.qk_norm:
            qk = torch.cat([gemma_rms_norm(qkv[:, :H], self.q_norm, self.eps),
                            gemma_rms_norm(qkv[:, H:H + KVH], self.k_norm, self.eps)], dim=1)
        else:
            qk = qkv[:, :H + KVH]
        qk = self._rope(qk, cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KVH:]
        if batch.capture_rows is not None:  # eviction scores these queries after the forward
            batch.captured_q.append(q.index_select(0, batch.capture_rows))
        src = store.write(self.index, batch.slot_mapping, k, v, batch.kivi)
        o = paged_attention(q, k, v, store, self.index, batch, self.scale, self.window, ws, src, self.softcap)
        o, residual = select_rows(rows, o, residual)  # the last layer: the logits rows only (DecoderLayer.forward)
        residual = residual + gemma_rms_norm(self.o_proj(o.flatten(1)), self.post_norm, self.eps)
        gate, up = self.gate_up(gemma_rms_norm(residual, self.pre_ff_norm, self.eps)).chunk(2, dim=-1)
        out = self.down(F.gelu(gate, approximate="tanh").mul_(up))
        return gemma_rms_norm(out, self.post_ff_norm, self.eps), residual


class Gemma3Layer(GemmaLayer):
    def __init__(self, cfg: PretrainedConfig, index: int, window: int | None, linear: type = Dense) -> None:
        super().__init__(cfg, index, window, linear)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm = nn.Parameter(torch.ones(self.head_dim))
        self.qk_norm = True
        self.rope_key = cfg.layer_types[index]


class Gemma2Model(LlamaModel):
    """Gemma-2's decoder: LlamaModel's stack, loading and head with GemmaLayer's layers."""

    layer_class = GemmaLayer
    ARCHITECTURES = ("gemma2",)

    def __init__(self, cfg: PretrainedConfig, max_positions: int, quantization: str = "none") -> None:
        check_config(cfg)
        super().__init__(cfg, max_positions, quantization)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self._compute_dtype: torch.dtype | None = None  # the norms stay float32: the dtype they were given

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._compute_dtype or self.norm.dtype

    def _norm_weights(self) -> list[nn.Parameter]:
        return [self.norm] + [p for layer in self.layers for p in layer.norm_weights()]

    def keep_scale_dtypes(self) -> Gemma2Model:
        """Also keep every norm weight in float32 (Gemma computes its norms in float32, 1 + w included)."""
        super().keep_scale_dtypes()
        self._compute_dtype = self._compute_dtype or self.norm.dtype
        for p in self._norm_weights():
            p.data = p.data.float()
        return self

    def load_weights(self, source) -> None:
        super().load_weights(source)
        with torch.no_grad():  # w as a parameter of the compute dtype holds it (transformers'), then 1 + w in float32
            for p in self._norm_weights():
                p.copy_(p.to(self.compute_dtype).float() + 1.0)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().embed_tokens(ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the dtype, as transformers

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(h, self.norm, self.config.rms_norm_eps)


class Gemma3Model(Gemma2Model):
    """Gemma-3's text decoder: Gemma-2's with Gemma3Layer's layers (no attention soft cap)."""

    layer_class = Gemma3Layer
    ARCHITECTURES = ("gemma3_text",)
