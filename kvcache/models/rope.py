"""Rotary position embeddings: the cos/sin tables a model builds once, and their rotate-half application."""
from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def head_dim_of(cfg: PretrainedConfig) -> int:
    """Each attention head's size: the config's head_dim, or hidden_size over the heads where it has none."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def rope_tables(cfg: PretrainedConfig, max_positions: int, layer_type: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] in float32; `layer_type` picks its own parameters where a config keeps
    them per kind of layer (Gemma-3: rope_parameters["sliding_attention"] and ["full_attention"])."""
    params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    dim = head_dim_of(cfg)
    if rope_type == "default":
        rotated = rotary_dim(cfg, params)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rotated, 2, dtype=torch.float) / rotated))
        scaling = 1.0
    else:
        kw = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kw)
    # a partial rotation's other dims turn by angle 0 (cos 1, sin 0), once partial_rotary_order has put them there
    inv_freq = torch.nn.functional.pad(inv_freq.float(), (0, dim // 2 - inv_freq.numel()))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotary_dim(cfg: PretrainedConfig, params: dict | None = None) -> int:
    """How many of each head's dims RoPE rotates: head_dim x partial_rotary_factor (all of them by default)."""
    params = params if params is not None else (getattr(cfg, "rope_parameters", None) or {})
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim_of(cfg) * factor)


def partial_rotary_order(cfg: PretrainedConfig) -> list[int] | None:
    """Where a config rotates only the first R of each head's D dims (transformers: pairs (i, i + R/2) for i < R/2,
    the rest passed through), the order in which to lay out q's and k's dims so that a full-width rotation (pairs
    (j, j + D/2), angle 0 for j >= R/2: rope_tables) computes the same: our dim j holds transformers' dim order[j].
    Attention scores are dot products of q and k, which a permutation of both leaves as they are; V is untouched.
    None where every dim rotates."""
    D, R = head_dim_of(cfg), rotary_dim(cfg)
    if R >= D:
        return None
    if R % 2:
        raise ValueError(f"{cfg.model_type}: a rotary dimension of {R} (head_dim {D} x partial_rotary_factor) must be even")
    half, passed = D // 2, list(range(R, D))
    return list(range(R // 2)) + passed[:half - R // 2] + list(range(R // 2, R)) + passed[half - R // 2:]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; cos/sin in x's dtype (computed in float32, cast once per step, as transformers does)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
