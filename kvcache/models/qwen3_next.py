"""Qwen3-Next (`qwen3_next`): Gated DeltaNet linear attention in most layers (3 of 4 in the released models), gated
full attention in the others, each followed by a sparse MoE (softmax top-k routing and a gated shared expert) or a
dense MLP (`mlp_only_layers`, `decoder_sparse_step`).

- Gated DeltaNet (GatedDeltaNet): in_proj_qkvz and in_proj_ba (laid out per key head: q, k, then the value heads
  it serves' v and z; b and a), a causal conv over q, k and v, the gated delta rule (delta_rule.py) on a state
  [value heads, key dim, value dim], a per-head RMSNorm of the output times silu(z), out_proj. Its conv and delta
  states live in the state pool (store/state_store.py) like Mamba-2's; recurrent.py runs them.
- Gated attention (GatedAttentionLayer): q_proj gives each head's query and an output gate side by side; q and k
  are RMS-normed per head; a quarter of each head rotates (partial_rotary_factor, laid out as rope.py's
  partial_rotary_order); the attention output times sigmoid(gate) goes to o_proj. Its K/V go in the paged store.
- RMSNorms scale by (1 + w) in float32 (kept float32, 1 added at load, as Gemma's); the gated norm by w.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvcache.attention.metadata import ForwardBatch
from kvcache.attention.paged import Workspace, paged_attention
from kvcache.models.checkpoint import CheckpointReader
from kvcache.models.deepseek import MLP
from kvcache.models.delta_rule import delta_chunk, delta_step
from kvcache.models.gemma import gemma_rms_norm
from kvcache.models.hybrid import HybridModel
from kvcache.models.linear import Dense
from kvcache.models.recurrent import RecurrentMixer
from kvcache.models.rope import apply_rope, partial_rotary_order
from kvcache.store.kv_store import KVStore

DELTA_CHUNK = 64  # tokens per block of the chunked delta rule (transformers' and FLA's)


def check_config(cfg: PretrainedConfig) -> None:
    """Refuse what this decoder does not compute, naming the field."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"qwen3_next hidden_act {cfg.hidden_act!r} is not supported (silu is)")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError(f"qwen3_next linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
                         f"linear_num_key_heads ({cfg.linear_num_key_heads})")
    if cfg.num_experts and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"qwen3_next num_experts_per_tok must be from 1 to num_experts ({cfg.num_experts}); got "
                         f"{cfg.num_experts_per_tok}")
    kinds = set(cfg.layer_types)
    if not kinds <= {"linear_attention", "full_attention"}:
        raise ValueError(f"qwen3_next layer_types must be linear_attention or full_attention; got {sorted(kinds)}")


class GatedDeltaNet(RecurrentMixer):
    """Qwen3-Next's linear attention (see the module docstring); `layer` its index among the recurrent layers."""

    def __init__(self, cfg: PretrainedConfig, layer: int, linear: type = Dense) -> None:
        super().__init__()
        self.layer, self.eps = layer, cfg.rms_norm_eps
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.dk, self.Hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, False)
        self.in_proj_ba = linear(cfg.hidden_size, 2 * self.Hv, False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, cfg.linear_conv_kernel_dim))
        self.conv_bias = None
        self.dt_bias = nn.Parameter(torch.empty(self.Hv))
        self.A_log = nn.Parameter(torch.empty(self.Hv))
        self.norm = nn.Parameter(torch.ones(self.dv))
        self.out_proj = linear(self.value_dim, cfg.hidden_size, False)

    @property
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"conv": (self.conv_dim, self.conv_weight.shape[-1] - 1), "ssm": (self.Hv, self.dk, self.dv)}

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.Hv, self.dv

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q k v for the conv [T, conv_dim], g and beta [T, 2 Hv], z [T, Hv, dv])."""
        T, r = h.shape[0], self.Hv // self.Hk
        q, k, v, z = self.in_proj_qkvz(h).view(T, self.Hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], -1)
        b, a = self.in_proj_ba(h).view(T, self.Hk, 2 * r).split([r, r], -1)
        g = -self.A_log.float().exp() * F.softplus(a.reshape(T, self.Hv).float() + self.dt_bias.float())
        beta = b.reshape(T, self.Hv).sigmoid().float()
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return qkv, torch.cat([g, beta], dim=-1), z.reshape(T, self.Hv, self.dv)

    def _split(self, out: torch.Tensor, per_row: torch.Tensor):
        n = out.shape[0]
        q, k, v = out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = per_row.split([self.Hv, self.Hv], dim=-1)
        return q.view(n, self.Hk, self.dk), k.view(n, self.Hk, self.dk), v.view(n, self.Hv, self.dv), g, beta

    def chunk(self, conv_out: torch.Tensor, per_row: torch.Tensor, state: torch.Tensor | None, start: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_chunk(*self._split(conv_out, per_row), DELTA_CHUNK, state)

    def step(self, conv_out: torch.Tensor, per_row: torch.Tensor, states: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_step(states, *self._split(conv_out, per_row))

    def finish(self, y: torch.Tensor, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head (in float32, cast back before the weight multiplies), times silu(z), out_proj."""
        y = y.to(h.dtype).float()
        y = self.norm * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)
        y = (y * F.silu(z.float())).to(h.dtype)
        return self.out_proj(y.reshape(h.shape[0], -1))

    def load(self, ck: CheckpointReader, prefix: str) -> None:
        for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
            ck.put_linear(getattr(self, name), f"{prefix}{name}.weight")
        ck.put(self.conv_weight, prefix + "conv1d.weight")
        for name in ("dt_bias", "A_log"):
            ck.put(getattr(self, name), prefix + name)
        ck.put(self.norm, prefix + "norm.weight")


class SparseMoE(nn.Module):
    """Softmax top-k routed experts (weights renormalised with norm_topk_prob) plus a shared expert gated by
    sigmoid(shared_expert_gate x)."""

    def __init__(self, cfg: PretrainedConfig, linear: type = Dense) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.top_k, self.normalize = cfg.num_experts_per_tok, bool(cfg.norm_topk_prob)
        self.gate = nn.Parameter(torch.empty(cfg.num_experts, d))
        self.experts = nn.ModuleList(MLP(d, cfg.moe_intermediate_size, linear) for _ in range(cfg.num_experts))
        self.shared = MLP(d, cfg.shared_expert_intermediate_size, linear)
        self.shared_gate = nn.Parameter(torch.empty(1, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = F.linear(h, self.gate).float().softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for e in ids.unique().tolist():
            tokens, slot = torch.where(ids == e)
            out.index_add_(0, tokens, self.experts[e](h.index_select(0, tokens)) * weights[tokens, slot, None])
        return out + torch.sigmoid(F.linear(h, self.shared_gate)) * self.shared(h)

    def load(self, ck: CheckpointReader, prefix: str) -> None:
        ck.put(self.gate, prefix + "gate.weight")
        for e, expert in enumerate(self.experts):
            ck.put_mlp(expert.gate_up, expert.down, f"{prefix}experts.{e}.")
        ck.put_mlp(self.shared.gate_up, self.shared.down, prefix + "shared_expert.")
        ck.put(self.shared_gate, prefix + "shared_expert_gate.weight")


def feed_forward(cfg: PretrainedConfig, i: int) -> nn.Module:
    """Layer i's MoE, or its dense MLP (mlp_only_layers, or off the decoder_sparse_step)."""
    if i not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0:
        return SparseMoE(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size, Dense)


def _load_ffn(ffn: nn.Module, ck: CheckpointReader, prefix: str) -> None:
    if isinstance(ffn, SparseMoE):
        ffn.load(ck, prefix)
    else:
        ck.put_mlp(ffn.gate_up, ffn.down, prefix)


class Qwen3NextLayer(nn.Module):
    """Gated DeltaNet then the feed-forward, each between a (1 + w) RMSNorm and the residual stream."""

    recurrent = True

    def __init__(self, cfg: PretrainedConfig, i: int, layer: int) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.post_norm = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.mixer = GatedDeltaNet(cfg, layer)
        self.mlp = feed_forward(cfg, i)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        residual = residual + self.mixer(gemma_rms_norm(residual, self.input_norm, self.eps), batch)
        return self.mlp(gemma_rms_norm(residual, self.post_norm, self.eps)), residual

    def load(self, ck: CheckpointReader, prefix: str) -> None:
        ck.put(self.input_norm, prefix + "input_layernorm.weight")
        ck.put(self.post_norm, prefix + "post_attention_layernorm.weight")
        self.mixer.load(ck, prefix + "linear_attn.")
        _load_ffn(self.mlp, ck, prefix + "mlp.")


class GatedAttentionLayer(nn.Module):
    """Qwen3-Next's attention layer (see the module docstring) and its feed-forward; `index` counts attention layers
    only (the KV store holds those)."""

    recurrent = False

    def __init__(self, cfg: PretrainedConfig, i: int, index: int) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.index, self.window, self.eps = index, None, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = cfg.num_attention_heads, \
            cfg.num_key_value_heads, hd, hd ** -0.5
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = Dense(d, self.num_heads * hd * 2, bias)
        self.k_proj = Dense(d, self.num_kv_heads * hd, bias)
        self.v_proj = Dense(d, self.num_kv_heads * hd, bias)
        self.o_proj = Dense(self.num_heads * hd, d, bias)
        self.q_norm, self.k_norm = nn.Parameter(torch.zeros(hd)), nn.Parameter(torch.zeros(hd))
        self.input_norm = nn.Parameter(torch.zeros(d))
        self.post_norm = nn.Parameter(torch.zeros(d))
        self.mlp = feed_forward(cfg, i)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, store: KVStore, ws: Workspace, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        h = gemma_rms_norm(residual, self.input_norm, self.eps)
        T, H, KVH, hd = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(h).view(T, H, 2 * hd).split([hd, hd], dim=-1)
        q = apply_rope(gemma_rms_norm(q, self.q_norm, self.eps), cos, sin)
        k = apply_rope(gemma_rms_norm(self.k_proj(h).view(T, KVH, hd), self.k_norm, self.eps), cos, sin)
        v = self.v_proj(h).view(T, KVH, hd)
        src = store.write(self.index, batch.slot_mapping, k, v, batch.kivi)
        o = paged_attention(q, k, v, store, self.index, batch, self.scale, None, ws, src)
        o = o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1))
        if rows is not None:  # only the rows the LM head reads go on
            o, residual = o.index_select(0, rows), residual.index_select(0, rows)
        residual = residual + self.o_proj(o)
        return self.mlp(gemma_rms_norm(residual, self.post_norm, self.eps)), residual

    def norm_weights(self) -> list[nn.Parameter]:
        return [self.input_norm, self.post_norm, self.q_norm, self.k_norm]

    def load(self, ck: CheckpointReader, prefix: str, order: list[int] | None) -> None:
        a = prefix + "self_attn."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ck.put_linear(getattr(self, name), f"{a}{name}.weight")
            if getattr(self, name).bias is not None:
                ck.put(getattr(self, name).bias, f"{a}{name}.bias")
        ck.put(self.q_norm, a + "q_norm.weight")
        ck.put(self.k_norm, a + "k_norm.weight")
        ck.put(self.input_norm, prefix + "input_layernorm.weight")
        ck.put(self.post_norm, prefix + "post_attention_layernorm.weight")
        _load_ffn(self.mlp, ck, prefix + "mlp.")
        if order is not None:
            self._permute(order)

    def _permute(self, order: list[int]) -> None:
        """Lay out q's and k's dims (and their norms') in `order` (rope.partial_rotary_order); the gate's stay."""
        hd, idx = self.head_dim, torch.tensor(order)
        q_cols = torch.cat([h * 2 * hd + idx for h in range(self.num_heads)])
        gate_cols = torch.cat([h * 2 * hd + hd + torch.arange(hd) for h in range(self.num_heads)])
        q_order = torch.stack([q_cols.view(self.num_heads, hd), gate_cols.view(self.num_heads, hd)], 1).flatten()
        k_order = torch.cat([h * hd + idx for h in range(self.num_kv_heads)])
        for dense, cols in ((self.q_proj, q_order), (self.k_proj, k_order)):
            dense.weight.copy_(dense.weight.index_select(1, cols))
            if dense.bias is not None:
                dense.bias.copy_(dense.bias.index_select(0, cols))
        for norm in (self.q_norm, self.k_norm):
            norm.copy_(norm.index_select(0, idx))


class Qwen3NextModel(HybridModel):
    """Qwen3-Next's stack: embeddings, Qwen3NextLayer and GatedAttentionLayer layers, a (1 + w) final norm, the LM
    head."""

    ARCHITECTURES = ("qwen3_next",)

    def __init__(self, cfg: PretrainedConfig, max_positions: int, quantization: str = "none") -> None:
        check_config(cfg)
        super().__init__(cfg, max_positions, quantization)
        self._compute_dtype: torch.dtype | None = None  # the norms stay float32: the dtype they were given

    def _setup(self, cfg: PretrainedConfig) -> None:
        self.kinds = ["attention" if t == "full_attention" else "recurrent" for t in cfg.layer_types]
        self.eps = cfg.rms_norm_eps

    def _layer(self, cfg: PretrainedConfig, i: int) -> nn.Module:
        before = self.kinds[:i]
        if self.kinds[i] == "attention":
            return GatedAttentionLayer(cfg, i, before.count("attention"))
        return Qwen3NextLayer(cfg, i, before.count("recurrent"))

    @property
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return next(layer.mixer.state_shapes for layer in self.layers if layer.recurrent)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._compute_dtype or self.norm.dtype

    def _norm_weights(self) -> list[nn.Parameter]:
        norms = [self.norm]
        for layer in self.layers:
            norms += layer.norm_weights() if not layer.recurrent else [layer.input_norm, layer.post_norm]
        return norms

    def keep_scale_dtypes(self) -> Qwen3NextModel:
        """Keep every (1 + w) norm weight in float32 (Qwen3-Next computes its norms in float32, 1 + w included)."""
        self._compute_dtype = self._compute_dtype or self.norm.dtype
        for p in self._norm_weights():
            p.data = p.data.float()
        return self

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(h, self.norm, self.eps)

    def load_weights(self, source) -> None:
        ck = CheckpointReader(source)
        order = partial_rotary_order(self.config)
        with torch.no_grad():
            self._load_embeddings(ck)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.load(ck, p) if layer.recurrent else layer.load(ck, p, order)
            for p in self._norm_weights():  # w as the compute dtype holds it (transformers'), then 1 + w in float32
                p.copy_(p.to(self.compute_dtype).float() + 1.0)
        ck.check_all_used(lambda name: name.startswith("mtp."))
