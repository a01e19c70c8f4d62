"""DeepSeek-V2 (`deepseek_v2`) and DeepSeek-V3 (`deepseek_v3`) decoders: multi-head latent attention (MLA) over a
latent KV cache, and DeepSeek's mixture-of-experts FFN.

MLA (DeepSeek-V2 paper, section 2.1). Per token a layer caches one latent: the compressed KV `c` (kv_lora_rank
values, RMS-normed) and the decoupled RoPE key `k_pe` (qk_rope_head_dim values, shared by every head), side by side
as one vector of D = kv_lora_rank + qk_rope_head_dim, in a latent store (store/kv_store.py: one tensor, read as
both K and V). That is the planner's bytes per token: no heads, no K/V pair.

- Attention in the absorbed form (decode rows, and prefill chunks over a cached prefix): the key up-projection
  W_UK (kv_b_proj's key rows) is folded into the query, q_abs = [q_nope W_UK, q_pe], so that scores are q_abs . latent
  over the cache's latents; the output (softmax . latent)[:kv_lora_rank] goes through the value up-projection W_UV
  after attention. To the paged kernels this is MQA with one KV head of width D whose V is its K (the output's last
  qk_rope_head_dim columns are computed and dropped: 1/9 more work on V3's shape than reading the latent alone).
- Prefill chunks with no cached prefix expand their fresh latents into per-head K and V (kv_b_proj, as transformers
  does) and attend with SDPA: cheaper than the absorbed form over many queries, and transformers' own arithmetic.
- `MLALayer.expanded = True` expands for every row (decode reads the cache's latents and expands them each step):
  the comparison `kvcache bench mla` times; outputs equal the absorbed form's to rounding.
- RoPE pairs are interleaved in DeepSeek's checkpoints ((x0, x1), (x2, x3), ...): q_pe and k_pe are de-interleaved
  (evens, then odds) and rotated by halves, which is transformers' arithmetic for V3 and, for V2's complex-number
  rotation, the same products in another order of dimensions (dot products are unchanged). V2 rotates in float32.

MoE (first_k_dense_replace dense layers, then MoE layers): n_shared_experts always-on experts plus top-k of
n_routed_experts routed ones. V2 scores experts by softmax (topk_method "greedy", or "group_limited_greedy": the
top topk_group of n_group groups by their best expert first); V3 by sigmoid, choosing with e_score_correction_bias
added, groups ranked by their two best, the weights the unbiased scores; norm_topk_prob renormalises the k weights,
routed_scaling_factor scales them. The router runs in float32 (its weights stay float32, as transformers keeps them).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvcache.attention.metadata import ForwardBatch
from kvcache.attention.paged import Workspace, _attend, gather_blocks, paged_attention
from kvcache.models.checkpoint import CheckpointReader
from kvcache.models.decoder_layer import select_rows
from kvcache.models.linear import Dense
from kvcache.models.llama import LlamaModel
from kvcache.models.norm import rms_norm
from kvcache.models.rope import apply_rope


def _positive(cfg: PretrainedConfig, field: str, allow_none: bool = False) -> None:
    value = getattr(cfg, field, None)
    if value is None and allow_none:
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{cfg.model_type} {field} must be a positive integer; got {value!r}")


def check_config(cfg: PretrainedConfig) -> None:
    """Refuse an MLA or MoE configuration these decoders cannot compute, naming the field."""
    name = cfg.model_type
    for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        _positive(cfg, field)
    _positive(cfg, "q_lora_rank", allow_none=True)
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"{name} qk_rope_head_dim must be even (RoPE rotates pairs of dimensions); got "
                         f"{cfg.qk_rope_head_dim}")
    if getattr(cfg, "attention_bias", False):
        raise ValueError(f"{name} with attention_bias=True is not supported (no DeepSeek checkpoint has attention biases)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name} hidden_act {cfg.hidden_act!r} is not supported (silu is)")
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        raise ValueError(f"{name} checkpoint is quantized (quantization_config {method}): kvcache loads bf16/fp16/fp32 "
                         "weights; convert it first (DeepSeek's fp8_cast_bf16.py) or use --quantization int8")
    n, dense = cfg.num_hidden_layers, getattr(cfg, "first_k_dense_replace", 0) or 0
    if not 0 <= dense <= n:
        raise ValueError(f"{name} first_k_dense_replace must be between 0 and num_hidden_layers ({n}); got {dense}")
    if (getattr(cfg, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"{name} moe_layer_freq {cfg.moe_layer_freq} is not supported (1: every layer after the "
                         "dense ones is MoE)")
    if dense == n:
        return
    for field in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
        _positive(cfg, field)
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if k > experts:
        raise ValueError(f"{name} num_experts_per_tok {k} exceeds n_routed_experts {experts}")
    if (getattr(cfg, "n_shared_experts", 0) or 0) < 0:
        raise ValueError(f"{name} n_shared_experts must be 0 or more; got {cfg.n_shared_experts}")
    method = getattr(cfg, "topk_method", None) or "greedy"
    grouped = name == "deepseek_v3" or method == "group_limited_greedy"
    if name == "deepseek_v2" and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"{name} topk_method {method!r} is not supported (greedy, group_limited_greedy are)")
    if grouped:
        _positive(cfg, "n_group")
        _positive(cfg, "topk_group")
        groups = cfg.n_group
        if experts % groups or cfg.topk_group > groups:
            raise ValueError(f"{name} n_group {groups} must divide n_routed_experts {experts} and be at least "
                             f"topk_group {cfg.topk_group}")
        if name == "deepseek_v3" and experts // groups < 2:
            raise ValueError(f"{name} ranks expert groups by their two best experts: n_routed_experts / n_group must "
                             f"be 2 or more; got {experts} / {groups}")


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, d: int, inter: int, linear: type) -> None:
        super().__init__()
        self.gate_up = linear(d, 2 * inter, False)
        self.down = linear(inter, d, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate).mul_(up))


class MoE(nn.Module):
    """Shared experts plus the top-k routed experts of each token (see the module docstring for the routing)."""

    def __init__(self, cfg: PretrainedConfig, linear: type) -> None:
        super().__init__()
        d, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        self.v3 = cfg.model_type == "deepseek_v3"
        self.top_k = cfg.num_experts_per_tok
        self.grouped = self.v3 or getattr(cfg, "topk_method", None) == "group_limited_greedy"
        self.num_groups, self.topk_group = (cfg.n_group, cfg.topk_group) if self.grouped else (1, 1)
        self.normalize = bool(getattr(cfg, "norm_topk_prob", False))
        self.routed_scale = float(getattr(cfg, "routed_scaling_factor", 1.0))
        self.gate = nn.Parameter(torch.empty(experts, d))  # float32 (keep_scale_dtypes)
        self.score_bias = nn.Parameter(torch.zeros(experts)) if self.v3 else None  # e_score_correction_bias
        self.experts = nn.ModuleList(MLP(d, inter, linear) for _ in range(experts))
        shared = getattr(cfg, "n_shared_experts", 0) or 0
        self.shared = MLP(d, inter * shared, linear) if shared else None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of each token's routed experts."""
        logits = F.linear(h.float(), self.gate)
        scores = logits.sigmoid() if self.v3 else logits.softmax(-1)
        choice = scores + self.score_bias if self.v3 else scores
        if self.grouped:
            per_group = choice.view(h.shape[0], self.num_groups, choice.shape[-1] // self.num_groups)  # 0 rows too
            rank = per_group.topk(2, dim=-1).values.sum(-1) if self.v3 else per_group.amax(-1)
            keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1),
                                        float("-inf") if self.v3 else 0.0)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scale, ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(h)
        out = torch.zeros_like(h)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        at = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[at:at + n]
            at += n
            tokens = pairs // self.top_k
            y = self.experts[e](h.index_select(0, tokens)) * weights.flatten()[pairs, None]  # float32, as transformers
            out.index_add_(0, tokens, y.to(h.dtype))
        return out + self.shared(h) if self.shared is not None else out


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved RoPE pairs as halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def softmax_scale(cfg: PretrainedConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the RoPE scaling sets mscale_all_dim
    (transformers' yarn_apply_mscale, written out: importing its modeling module at start-up imports triton before
    TRITON_INTERPRET can be set)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = getattr(cfg, "rope_parameters", None) or {}
    all_dim = params.get("mscale_all_dim", 0) if params.get("rope_type", "default") != "default" else 0
    factor = params.get("factor", 1.0)
    if all_dim and factor > 1:
        m = 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLALayer(nn.Module):
    """A DeepSeek decoder layer: MLA over the latent store, then a dense MLP or the MoE."""

    FUSABLE = False

    def __init__(self, cfg: PretrainedConfig, index: int, window: int | None, linear: type = Dense) -> None:
        super().__init__()
        self.index, self.window, self.rope_key = index, None, None
        d, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.eps = H, cfg.rms_norm_eps
        self.nope, self.rope_dim, self.rank, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                           cfg.kv_lora_rank, cfg.v_head_dim)
        self.num_kv_heads, self.head_dim = 1, self.rank + self.rope_dim  # what the store holds: one latent per token
        q_rank = cfg.q_lora_rank
        self.q_out = q_rank or H * (self.nope + self.rope_dim)
        self.qkv_a = linear(d, self.q_out + self.head_dim, False)  # q_a_proj (or q_proj) and kv_a_proj_with_mqa
        self.q_b = linear(q_rank, H * (self.nope + self.rope_dim), False) if q_rank else None
        self.q_a_norm = nn.Parameter(torch.ones(q_rank)) if q_rank else None
        self.kv_a_norm = nn.Parameter(torch.ones(self.rank))
        self.kv_b = nn.Parameter(torch.empty(H, self.nope + self.v_dim, self.rank))  # kv_b_proj, per head
        self.o_proj = linear(H * self.v_dim, d, False)
        self.input_norm = nn.Parameter(torch.ones(d))
        self.post_norm = nn.Parameter(torch.ones(d))
        moe = index >= (getattr(cfg, "first_k_dense_replace", 0) or 0)
        self.mlp = MoE(cfg, linear) if moe else MLP(d, cfg.intermediate_size, linear)
        self.scale = softmax_scale(cfg)
        self.interleaved = cfg.model_type == "deepseek_v2" or getattr(cfg, "rope_interleave", True)
        self.expanded = False  # expand the latents for every row (the benchmark's comparison), not only fresh prefills
        self.kernels = None

    def fuse(self, kernels) -> None:
        """The fused C++ layer calls compute Llama's arithmetic, not this layer's."""

    @property
    def w_uk(self) -> torch.Tensor:
        """kv_b_proj's key rows per head, [H, nope, rank]: q_nope W_UK scores the latent directly."""
        return self.kv_b[:, :self.nope]

    @property
    def w_uv(self) -> torch.Tensor:
        """kv_b_proj's value rows per head, transposed: [H, rank, v_head_dim]."""
        return self.kv_b[:, self.nope:].transpose(1, 2)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x = _deinterleave(x)
        return apply_rope(x.to(cos.dtype), cos, sin).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, store, ws: Workspace, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        h = rms_norm(residual, self.input_norm, self.eps)
        T, H = h.shape[0], self.num_heads
        a = self.qkv_a(h)
        q = a[:, :self.q_out] if self.q_b is None else self.q_b(rms_norm(a[:, :self.q_out], self.q_a_norm, self.eps))
        q = q.view(T, H, self.nope + self.rope_dim)
        q = torch.cat((q[..., :self.nope], self._rope(q[..., self.nope:], cos, sin)), dim=-1)  # [q_nope, q_pe]
        c = rms_norm(a[:, self.q_out:self.q_out + self.rank], self.kv_a_norm, self.eps)
        k_pe = self._rope(a[:, self.q_out + self.rank:].unsqueeze(1), cos, sin)
        latent = torch.cat((c.unsqueeze(1), k_pe), dim=-1)  # [T, 1, rank + rope]
        store.write(self.index, batch.slot_mapping, latent, latent, None)
        o = self._attention(q, latent, batch, store, ws)
        o, residual = select_rows(rows, o, residual)  # the last layer: the logits rows only (DecoderLayer.forward)
        residual = residual + self.o_proj(o.flatten(1))
        return self.mlp(rms_norm(residual, self.post_norm, self.eps)), residual

    def _attention(self, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch, store, ws: Workspace
                   ) -> torch.Tensor:
        """[T, H, v_head_dim]: absorbed over the cache for decode rows and cached-prefix chunks, expanded for fresh
        prefill chunks (every row when `expanded`)."""
        expanded = batch.prefills if self.expanded else [p for p in batch.prefills if p.block_ids is None]
        absorbed = [] if self.expanded else [p for p in batch.prefills if p.block_ids is not None]
        if not self.expanded and (batch.decode_groups or absorbed):
            q_abs = torch.cat((torch.bmm(q[..., :self.nope].transpose(0, 1), self.w_uk).transpose(0, 1),
                               q[..., self.nope:]), dim=-1)
            o = paged_attention(q_abs, latent, latent, store, self.index, batch, self.scale, None, ws,
                                prefills=absorbed)
            out = torch.bmm(o[..., :self.rank].transpose(0, 1), self.w_uv).transpose(0, 1)
        else:
            out = torch.empty(q.shape[0], self.num_heads, self.v_dim, dtype=q.dtype, device=q.device)
        if self.expanded:
            self._expanded_decode(out, q, store, batch, ws, latent)
        for p in expanded:
            rows = slice(p.start, p.start + p.length)
            lat = latent[rows, 0] if p.block_ids is None else \
                gather_blocks(store, self.index, p.block_ids, ws, latent)[0].flatten(0, 1)[:, 0]
            k, v = self._expand(lat)  # [L, H, *]
            o = _attend(q[rows].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                        v.transpose(0, 1).unsqueeze(0), p.masks[None], self.scale, None)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out

    def _expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [..., D] -> per-head keys [..., H, nope + rope] and values [..., H, v_head_dim] (kv_b_proj)."""
        kv = F.linear(lat[..., :self.rank], self.kv_b.view(-1, self.rank)).view(*lat.shape[:-1], self.num_heads, -1)
        k_pe = lat[..., None, self.rank:].expand(*lat.shape[:-1], self.num_heads, self.rope_dim)
        return torch.cat((kv[..., :self.nope], k_pe), dim=-1), kv[..., self.nope:]

    def _expanded_decode(self, out: torch.Tensor, q: torch.Tensor, store, batch: ForwardBatch, ws: Workspace,
                         like: torch.Tensor) -> None:
        """Decode rows in the expanded form: each group's latents gathered from the cache and expanded per head."""
        for g in batch.decode_groups:
            table, lens = g.view(self.index)
            B, L = g.rows.numel(), table.shape[1] * store.block_size
            lat = gather_blocks(store, self.index, table.flatten(), ws, like)[0].view(B, L, -1)
            k, v = self._expand(lat)  # [B, L, H, *]
            mask = (torch.arange(L, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
            o = _attend(q.index_select(0, g.rows).unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask,
                        self.scale, None)
            out[g.rows] = o.squeeze(2)


class DeepseekModel(LlamaModel):
    """DeepSeek-V2/V3: LlamaModel's embeddings, head and step with MLALayer's layers and a latent KV cache."""

    layer_class = MLALayer
    ARCHITECTURES = ("deepseek_v2", "deepseek_v3")
    CUDA_GRAPHS = False  # engine/cuda_graphs.py: decode steps run eager
    CUDA_GRAPHS_WHY = "its MoE counts each expert's tokens on the host to route them"

    def __init__(self, cfg: PretrainedConfig, max_positions: int, quantization: str = "none") -> None:
        check_config(cfg)
        super().__init__(cfg, max_positions, quantization)
        if cfg.model_type == "deepseek_v2":
            self.rope_dtype = torch.float32  # V2 rotates in float32 (transformers' complex product)

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        return 1, self.layers[0].head_dim, True

    @staticmethod
    def int4_input_sizes(cfg: PretrainedConfig) -> dict[str, int]:
        sizes = {"hidden_size": cfg.hidden_size, "num_attention_heads x v_head_dim": cfg.num_attention_heads * cfg.v_head_dim}
        if cfg.q_lora_rank:
            sizes["q_lora_rank"] = cfg.q_lora_rank
        if (getattr(cfg, "first_k_dense_replace", 0) or 0) > 0:
            sizes["intermediate_size"] = cfg.intermediate_size
        if (getattr(cfg, "first_k_dense_replace", 0) or 0) < cfg.num_hidden_layers:
            sizes["moe_intermediate_size"] = cfg.moe_intermediate_size
        return sizes

    def _moe(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def keep_scale_dtypes(self) -> DeepseekModel:
        """Also keep the routers' weights and score biases float32 (transformers keeps them so)."""
        super().keep_scale_dtypes()
        for moe in self._moe():
            moe.gate.data = moe.gate.data.float()
            if moe.score_bias is not None:
                moe.score_bias.data = moe.score_bias.data.float()
        return self

    def load_weights(self, source) -> None:
        ck = CheckpointReader(source)
        with torch.no_grad():
            self._load_embeddings(ck)
            for i, layer in enumerate(self.layers):
                a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                q_name = a + ("q_proj.weight" if layer.q_b is None else "q_a_proj.weight")
                ck.put_fused(layer.qkv_a, [q_name, a + "kv_a_proj_with_mqa.weight"], None,
                             [layer.q_out, layer.head_dim])
                if layer.q_b is not None:
                    ck.put_linear(layer.q_b, a + "q_b_proj.weight")
                    ck.put(layer.q_a_norm, a + "q_a_layernorm.weight")
                ck.put(layer.kv_a_norm, a + "kv_a_layernorm.weight")
                ck.put(layer.kv_b.view(-1, layer.rank), a + "kv_b_proj.weight")
                ck.put_linear(layer.o_proj, a + "o_proj.weight")
                ck.put(layer.input_norm, f"model.layers.{i}.input_layernorm.weight")
                ck.put(layer.post_norm, f"model.layers.{i}.post_attention_layernorm.weight")
                if isinstance(layer.mlp, MoE):
                    moe = layer.mlp
                    ck.put(moe.gate, m + "gate.weight")
                    if moe.score_bias is not None:
                        ck.put(moe.score_bias, m + "gate.e_score_correction_bias")
                    for e, expert in enumerate(moe.experts):
                        ck.put_mlp(expert.gate_up, expert.down, f"{m}experts.{e}.")
                    if moe.shared is not None:
                        ck.put_mlp(moe.shared.gate_up, moe.shared.down, m + "shared_experts.")
                else:
                    ck.put_mlp(layer.mlp.gate_up, layer.mlp.down, m)
        n = len(self.layers)
        # V3 checkpoints carry their multi-token-prediction layers after the last (model.layers.61.*): not run
        ck.check_all_used(ignore=lambda name: name.startswith("model.layers.") and int(name.split(".")[2]) >= n)
