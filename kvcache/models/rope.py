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
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        kw = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **kw)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; cos/sin in x's dtype (computed in float32, cast once per step, as transformers does)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
