"""Model shapes: what a decoder's KV cache holds, read from a Hugging Face config (as a dict).

Where public calculators go wrong, this module reads what the config says:
`num_key_value_heads` (GQA/MQA), a stated `head_dim` (Gemma-2 states 256 while hidden/heads
is 224), MLA's latent (`kv_lora_rank + qk_rope_head_dim` values, one tensor, no K/V pair),
sliding-window and alternating local/global layers, and linear-attention / state-space
layers whose per-request state is constant. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

LayerKind = Literal["full", "sliding", "mla", "linear"]

# Architectures whose MLP has two matrices (up, down) instead of three (gate, up, down).
_UNGATED_MLP = {"gpt2", "gpt3", "gpt_neox", "gptj", "opt", "bloom", "falcon", "gpt_bigcode", "starcoder2", "phi"}


class ConfigError(ValueError):
    """A model configuration lacks, or contradicts, what the KV formula needs."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers the KV formula and capacity planning need, per model.

    Counts are per model (not per GPU); `layer_kinds` has one entry per decoder layer.
    """

    num_layers: int
    num_kv_heads: int  # per attention layer; = num_attention_heads for MHA, 1 for MQA
    head_dim: int
    num_attention_heads: int = 0  # 0 = same as num_kv_heads
    layer_kinds: tuple[LayerKind, ...] = ()  # () = every layer full attention
    sliding_window: int | None = None  # tokens cached by "sliding" layers
    kv_lora_rank: int = 0  # MLA: compressed KV latent per token and layer
    qk_rope_head_dim: int = 0  # MLA: the decoupled RoPE key, cached beside the latent
    qk_nope_head_dim: int = 0  # MLA: each head's key without RoPE (expanded from the latent; not cached)
    v_head_dim: int = 0  # MLA: each head's value (expanded from the latent; not cached)
    linear_state_values: int = 0  # values of constant state per linear/SSM layer and request
    linear_heads: int = 0  # heads of the linear layers (split by tensor parallelism)
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int | None = None
    num_parameters: int | None = None
    weight_dtype: str = "bfloat16"
    model_type: str = ""
    name: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.layer_kinds:
            kind = "sliding" if self.sliding_window else "full"
            object.__setattr__(self, "layer_kinds", (kind,) * self.num_layers)
        if not self.num_attention_heads:
            object.__setattr__(self, "num_attention_heads", self.num_kv_heads)
        if len(self.layer_kinds) != self.num_layers:
            raise ConfigError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ConfigError("sliding-window layers need a sliding_window (tokens)")

    @property
    def attention_kind(self) -> str:
        """MHA, GQA, MQA or MLA (of the attention layers)."""
        if "mla" in self.layer_kinds:
            return "MLA"
        if self.num_kv_heads == 1 and self.num_attention_heads > 1:
            return "MQA"
        return "GQA" if self.num_kv_heads < self.num_attention_heads else "MHA"

    def count(self, kind: LayerKind) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache K/V (or a latent): every layer but linear-attention ones."""
        return self.num_layers - self.count("linear")

    def layer_window(self, kind: LayerKind) -> int | None:
        """Tokens a layer of this kind caches at most; None = all of them."""
        return self.sliding_window if kind == "sliding" else None


def _get(cfg: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _need(cfg: dict, what: str, *names: str) -> int:
    v = _get(cfg, *names)
    if v is None:
        alts = f" (nor {'/'.join(names[1:])})" if len(names) > 1 else ""
        raise ConfigError(f"config has no {names[0]}{alts}: needed for {what}")
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"config field {names[0]} must be a positive integer, got {v!r}")
    return v


def _layer_kinds(cfg: dict, n: int, model_type: str) -> tuple[tuple[str, ...], list[str]]:
    """Per-layer attention kind from the config, and a note on how it was read."""
    window = _get(cfg, "sliding_window", "attention_chunk_size")
    if cfg.get("kv_lora_rank"):
        return ("mla",) * n, ["MLA: kv_lora_rank set"]
    if isinstance(cfg.get("layer_types"), list):
        names = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
                 "chunked_attention": "sliding", "linear_attention": "linear", "mamba": "linear"}
        bad = sorted({t for t in cfg["layer_types"] if t not in names})
        if bad:
            raise ConfigError(f"unknown layer_types {bad}; known: {', '.join(names)}")
        if len(cfg["layer_types"]) != n:
            raise ConfigError(f"layer_types has {len(cfg['layer_types'])} entries for {n} layers")
        return tuple(names[t] for t in cfg["layer_types"]), ["per-layer kinds from layer_types"]
    if model_type in ("mamba", "mamba2"):
        return ("linear",) * n, [f"{model_type}: every layer a state-space mixer"]
    if model_type == "bamba" or "attn_layer_indices" in cfg:
        at = set(cfg.get("attn_layer_indices") or ())
        return (tuple("full" if i in at else "linear" for i in range(n)),
                [f"attention at layers {sorted(at)}, Mamba-2 mixers elsewhere"])
    if cfg.get("full_attention_interval"):  # Qwen3-Next: the released config states only the interval
        every = cfg["full_attention_interval"]
        return (tuple("full" if (i + 1) % every == 0 else "linear" for i in range(n)),
                [f"1 full-attention layer in every {every}, linear attention elsewhere"])
    if model_type == "gemma2" and window:
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(n)), ["Gemma-2: local/global layers alternate"]
    if model_type in ("gemma3", "gemma3_text") and window:
        pattern = _get(cfg, "sliding_window_pattern", default=6)
        return (tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n)),
                [f"Gemma-3: 1 global layer in every {pattern}"])
    if model_type == "jamba":
        period, offset = _get(cfg, "attn_layer_period", default=8), _get(cfg, "attn_layer_offset", default=4)
        return (tuple("full" if i % period == offset else "linear" for i in range(n)),
                [f"Jamba: attention every {period} layers from {offset}, Mamba elsewhere"])
    if window and cfg.get("use_sliding_window") is False:
        return ("full",) * n, ["sliding_window is set but use_sliding_window is false"]
    if window and model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        first = _get(cfg, "max_window_layers", default=0)
        return tuple("sliding" if i >= first else "full" for i in range(n)), [f"sliding from layer {first}"]
    if window:
        return ("sliding",) * n, ["every layer uses the sliding window"]
    return ("full",) * n, []


# Mamba2Config's names -> Bamba's (mamba_*), for a Mamba-2 mixer's sizes
_MAMBA2_FIELDS = {"num_heads": "mamba_n_heads", "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups",
                  "state_size": "mamba_d_state", "conv_kernel": "mamba_d_conv"}


def _linear_state(cfg: dict, model_type: str, hidden: int) -> tuple[int, int]:
    """(values of state per linear layer and request, heads) for the hybrid models we know."""
    if "linear_num_value_heads" in cfg:  # Gated DeltaNet (Qwen3-Next): recurrent state + causal-conv state
        kh, vh = _need(cfg, "linear attention", "linear_num_key_heads"), _need(cfg, "linear attention", "linear_num_value_heads")
        kd, vd = _need(cfg, "linear attention", "linear_key_head_dim"), _need(cfg, "linear attention", "linear_value_head_dim")
        conv = _need(cfg, "linear attention", "linear_conv_kernel_dim")
        return vh * kd * vd + (2 * kh * kd + vh * vd) * (conv - 1), vh
    if model_type == "mamba2" or "mamba_n_heads" in cfg:  # Mamba-2: SSM state per head + conv state of x, B and C
        m = {k: cfg.get(k if model_type == "mamba2" else v) for k, v in _MAMBA2_FIELDS.items()}
        if not isinstance(m["head_dim"], int):  # Bamba's "auto": the mixer's channels over its heads
            m["head_dim"] = _need(cfg, "Mamba-2 layers", "mamba_expand") * hidden // m["num_heads"]
        missing = [k for k, v in m.items() if not isinstance(v, int) or v < 1]
        if missing:
            raise ConfigError(f"{model_type}'s Mamba-2 layers need positive integers for "
                              f"{', '.join(k if model_type == 'mamba2' else _MAMBA2_FIELDS[k] for k in missing)}")
        d_inner = m["num_heads"] * m["head_dim"]
        conv = (d_inner + 2 * m["n_groups"] * m["state_size"]) * (m["conv_kernel"] - 1)
        return d_inner * m["state_size"] + conv, m["num_heads"]
    if "mamba_d_state" in cfg:  # Mamba-1 (Jamba): SSM state + conv state per channel of d_inner
        d_inner = _need(cfg, "Mamba layers", "mamba_expand") * hidden
        return d_inner * _need(cfg, "Mamba layers", "mamba_d_state") + d_inner * (_need(cfg, "Mamba layers", "mamba_d_conv") - 1), 1
    raise ConfigError(f"{model_type or 'this model'} has linear-attention/state-space layers but the config has neither "
                      "linear_num_value_heads (Gated DeltaNet) nor mamba_d_state (Mamba): cannot size their state")


def shape_from_config(cfg: dict, name: str = "", num_parameters: int | None = None) -> ModelShape:
    """Read a Hugging Face config.json (as a dict). Multimodal configs use their `text_config`."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "torch_dtype": cfg.get("torch_dtype")}
    model_type = str(cfg.get("model_type", ""))
    n = _need(cfg, "the layer count", "num_hidden_layers", "n_layer", "num_layers")
    hidden = _need(cfg, "head_dim and weights", "hidden_size", "n_embd", "d_model")
    heads = _need(cfg, "attention heads", "num_attention_heads", "n_head", "num_heads")
    kinds, notes = _layer_kinds(cfg, n, model_type)
    kv_heads = 1 if cfg.get("multi_query") else _get(cfg, "num_key_value_heads", "num_kv_heads", default=heads)
    if "mla" in kinds:
        kv_heads = heads  # MLA caches no per-head K/V; the latent is shared by all heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        raise ConfigError(f"num_key_value_heads must be a positive divisor of num_attention_heads ({heads}), got {kv_heads!r}")
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"config has no head_dim and hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    window = _get(cfg, "sliding_window", "attention_chunk_size") if "sliding" in kinds else None
    rank = rope = nope = vd = 0
    if "mla" in kinds:
        rank, rope = _need(cfg, "the MLA latent", "kv_lora_rank"), _need(cfg, "the MLA latent", "qk_rope_head_dim")
        nope, vd = _get(cfg, "qk_nope_head_dim", default=128), _get(cfg, "v_head_dim", default=128)
    state = state_heads = 0
    if "linear" in kinds:
        state, state_heads = _linear_state(cfg, model_type, hidden)
    shape = ModelShape(
        num_layers=n, num_kv_heads=kv_heads, head_dim=head_dim, num_attention_heads=heads, layer_kinds=kinds,
        sliding_window=window, kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=vd,
        linear_state_values=state,
        linear_heads=state_heads, hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden),
        vocab_size=_get(cfg, "vocab_size", default=0),
        max_position_embeddings=_get(cfg, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
        num_parameters=num_parameters, weight_dtype=str(_get(cfg, "torch_dtype", "dtype", default="bfloat16")),
        model_type=model_type, name=name, notes=tuple(notes))
    if num_parameters is None:
        object.__setattr__(shape, "num_parameters", estimate_parameters(cfg, shape))
    return shape


def estimate_parameters(cfg: dict, shape: ModelShape) -> int | None:
    """Parameters of a Llama-like decoder (dense, MoE, MLA) counted from its config; None for hybrid SSM models.

    Embeddings + per layer (attention, MLP or experts, two norms) + final norm + LM head unless tied.
    """
    if "linear" in shape.layer_kinds:
        return None
    h, v, heads = shape.hidden_size, shape.vocab_size, shape.num_attention_heads
    if "mla" in shape.layer_kinds:
        nope, vd = shape.qk_nope_head_dim, shape.v_head_dim
        qd = heads * (nope + shape.qk_rope_head_dim)
        qr = _get(cfg, "q_lora_rank")
        q = h * qr + qr + qr * qd if qr else h * qd
        attn = q + h * (shape.kv_lora_rank + shape.qk_rope_head_dim) + shape.kv_lora_rank \
            + shape.kv_lora_rank * heads * (nope + vd) + heads * vd * h
    else:
        qkv = h * (heads + 2 * shape.num_kv_heads) * shape.head_dim
        attn = qkv + heads * shape.head_dim * h
        if cfg.get("attention_bias") or shape.model_type.startswith("qwen2"):
            attn += (heads + 2 * shape.num_kv_heads) * shape.head_dim
        if shape.model_type.startswith("qwen3"):
            attn += 2 * shape.head_dim  # per-head RMSNorm of q and k
    mats = 2 if shape.model_type in _UNGATED_MLP else 3
    dense = mats * h * shape.intermediate_size
    experts = _get(cfg, "num_local_experts", "n_routed_experts", "num_experts", default=0)
    if experts:
        moe_i = _get(cfg, "moe_intermediate_size", default=shape.intermediate_size)
        shared = _get(cfg, "n_shared_experts", default=0) * moe_i + _get(cfg, "shared_expert_intermediate_size", default=0)
        moe = experts * mats * h * moe_i + mats * h * shared + h * experts
        if cfg.get("shared_expert_intermediate_size"):
            moe += h  # Qwen's shared-expert gate
        if shape.model_type == "deepseek_v3":
            moe += experts  # router score-correction bias
        first_dense = _get(cfg, "first_k_dense_replace", default=0)
        mlp_total = first_dense * dense + (shape.num_layers - first_dense) * moe
    else:
        mlp_total = shape.num_layers * dense
    tied = cfg.get("tie_word_embeddings", shape.model_type.startswith("gemma"))
    norms = 4 if shape.model_type.startswith("gemma") else 2  # Gemma-2/3 norm before and after each block
    return v * h * (1 if tied else 2) + shape.num_layers * (attn + norms * h) + mlp_total + h
