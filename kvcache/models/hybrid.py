"""State-space and hybrid decoders: Mamba-2 (`mamba2`: every layer a Mamba-2 mixer) and Bamba (`bamba`: Mamba-2
mixers with a few Llama-style attention layers, each layer followed by a gated MLP), over the paged KV store for
their attention layers and the state pool (store/state_store.py) for their mixers.

A mixer's state is fixed in size: per sequence and layer, a conv state [conv_dim, K - 1] (the last K - 1 inputs of
the causal depthwise convolution) and an SSM state [heads, head_dim, d_state]. The arithmetic is ssm.py's; which
slot each row reads and writes is the batch's StateBatch (`batch.states`), built by the model runner.

Bamba's attention rotates a part of each head (partial_rotary_factor): its q and k rows are permuted at load so
that the engine's full-width RoPE (rope.py, the C++ kernels) computes it (rope.partial_rotary_order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from kvcache.attention.metadata import ForwardBatch
from kvcache.attention.paged import Workspace
from kvcache.models.checkpoint import CheckpointReader
from kvcache.models.decoder_layer import DecoderLayer
from kvcache.models.linear import Dense
from kvcache.models.llama import LlamaModel
from kvcache.models.norm import rms_norm
from kvcache.models.rope import partial_rotary_order, rope_tables
from kvcache.models.recurrent import RecurrentMixer
from kvcache.models.ssm import gated_rms_norm, ssd_chunk, ssm_step
from kvcache.models.weights import WeightSource
from kvcache.store.kv_store import KVStore
from kvcache.store.quantized_store import QuantizedKVStore

ARCHITECTURES = ("mamba2", "bamba")


@dataclass(frozen=True, slots=True)
class MambaDims:
    """A Mamba-2 mixer's sizes, from either config's names (Mamba2Config's or Bamba's mamba_* fields)."""

    hidden: int
    heads: int
    head_dim: int
    groups: int
    d_state: int
    conv_kernel: int
    chunk: int
    eps: float
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.groups * self.d_state

    @property
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each sequence's state in one layer: the conv window and the SSM state."""
        return {"conv": (self.conv_dim, self.conv_kernel - 1), "ssm": (self.heads, self.head_dim, self.d_state)}


def mamba_dims(cfg: PretrainedConfig) -> MambaDims:
    limit = tuple(float(v) for v in (getattr(cfg, "time_step_limit", None) or (0.0, float("inf"))))
    if cfg.model_type == "mamba2":
        return MambaDims(cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.n_groups, cfg.state_size, cfg.conv_kernel,
                         cfg.chunk_size, cfg.layer_norm_epsilon, cfg.use_conv_bias, cfg.use_bias, limit)
    return MambaDims(cfg.hidden_size, cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state,
                     cfg.mamba_d_conv, cfg.mamba_chunk_size, cfg.rms_norm_eps, cfg.mamba_conv_bias,
                     cfg.mamba_proj_bias, limit)


def layer_kinds(cfg: PretrainedConfig) -> list[str]:
    """'recurrent' (a Mamba-2 mixer) or 'attention' for each layer."""
    if cfg.model_type == "mamba2":
        return ["recurrent"] * cfg.num_hidden_layers
    return ["attention" if t == "full_attention" else "recurrent" for t in cfg.layers_block_type]


def check_config(cfg: PretrainedConfig) -> None:
    """Refuse what these decoders do not compute, naming the field."""
    name = cfg.model_type
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{name} hidden_act {act!r} is not supported (the mixers' convolution and MLP use silu)")
    d = mamba_dims(cfg)
    if d.heads % d.groups:
        raise ValueError(f"{name}: the mixer's {d.heads} heads do not divide into its {d.groups} groups")
    if d.d_inner % d.groups:
        raise ValueError(f"{name}: the mixer's {d.d_inner} channels do not divide into its {d.groups} norm groups")
    if cfg.model_type == "mamba2" and d.d_inner != int(cfg.expand * cfg.hidden_size):
        raise ValueError(f"mamba2 num_heads x head_dim ({d.d_inner}) must equal expand x hidden_size "
                         f"({int(cfg.expand * cfg.hidden_size)})")
    if cfg.model_type == "bamba" and getattr(cfg, "num_experts", 1) not in (None, 1):
        raise ValueError("bamba with experts is not supported (num_experts must be 1)")


class Mamba2Mixer(RecurrentMixer):
    """in_proj -> (z, x B C, dt); causal conv over x B C; the SSD scan; gated RMSNorm with z; out_proj. `layer` is
    its index among the model's recurrent layers (its slot tensors in the state store)."""

    def __init__(self, d: MambaDims, layer: int, linear: type = Dense) -> None:
        super().__init__()
        self.d, self.layer = d, layer
        self.in_proj = linear(d.hidden, d.d_inner + d.conv_dim + d.heads, d.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(d.conv_dim)) if d.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(d.heads))
        self.A_log = nn.Parameter(torch.empty(d.heads))
        self.D = nn.Parameter(torch.empty(d.heads))
        self.norm = nn.Parameter(torch.ones(d.d_inner))
        self.out_proj = linear(d.d_inner, d.hidden, d.proj_bias)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.d.heads, self.d.head_dim

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.d
        z, xbc, dt = self.in_proj(h).split([d.d_inner, d.conv_dim, d.heads], dim=-1)
        return xbc, F.softplus((dt + self.dt_bias).float()), z

    def chunk(self, conv_out: torch.Tensor, dt: torch.Tensor, state: torch.Tensor | None, start: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        # the chunked form clamps dt to time_step_limit, the one-step form does not (transformers' and mamba_ssm's);
        # the scan's blocks sit on the sequence's multiples of `chunk`
        d = self.d
        x, B, C = self._split(conv_out, conv_out.shape[0])
        return ssd_chunk(x, dt.clamp(*d.dt_limit), -torch.exp(self.A_log.float()), B, C, self.D.float(), d.chunk,
                         state, start % d.chunk)

    def step(self, conv_out: torch.Tensor, dt: torch.Tensor, states: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        x, B, C = self._split(conv_out, conv_out.shape[0])
        return ssm_step(states, x, dt, -torch.exp(self.A_log.float()), B, C, self.D.float())

    def finish(self, y: torch.Tensor, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        y = gated_rms_norm(y.view(h.shape[0], -1).to(h.dtype), z, self.norm, self.d.groups, self.d.eps)
        return self.out_proj(y)

    def _split(self, xbc: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, heads, head_dim], B and C [n, groups, d_state] of the conv's output."""
        d = self.d
        x, B, C = xbc.split([d.d_inner, d.groups * d.d_state, d.groups * d.d_state], dim=-1)
        return x.view(n, d.heads, d.head_dim), B.view(n, d.groups, d.d_state), C.view(n, d.groups, d.d_state)

    def load(self, ck: CheckpointReader, prefix: str) -> None:
        ck.put_linear(self.in_proj, prefix + "in_proj.weight")
        ck.put_linear(self.out_proj, prefix + "out_proj.weight")
        if self.d.proj_bias:
            ck.put(self.in_proj.bias, prefix + "in_proj.bias")
            ck.put(self.out_proj.bias, prefix + "out_proj.bias")
        ck.put(self.conv_weight, prefix + "conv1d.weight")
        if self.conv_bias is not None:
            ck.put(self.conv_bias, prefix + "conv1d.bias")
        for name in ("dt_bias", "A_log", "D"):
            ck.put(getattr(self, name), prefix + name)
        ck.put(self.norm, prefix + "norm.weight")


class MambaLayer(nn.Module):
    """A mixer between RMSNorm and the residual stream; with `mlp` (Bamba), a gated MLP after it likewise."""

    recurrent = True

    def __init__(self, d: MambaDims, layer: int, linear: type = Dense, intermediate: int | None = None,
                 mlp_bias: bool = False) -> None:
        super().__init__()
        self.eps = d.eps
        self.input_norm = nn.Parameter(torch.ones(d.hidden))
        self.mixer = Mamba2Mixer(d, layer, linear)
        self.mlp = intermediate is not None
        if self.mlp:
            self.post_norm = nn.Parameter(torch.ones(d.hidden))
            self.gate_up = linear(d.hidden, 2 * intermediate, mlp_bias)
            self.down = linear(intermediate, d.hidden, mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x
        out = self.mixer(rms_norm(residual, self.input_norm, self.eps), batch)
        if not self.mlp:
            return out, residual
        residual = residual + out
        gate, up = self.gate_up(rms_norm(residual, self.post_norm, self.eps)).chunk(2, dim=-1)
        return self.down(F.silu(gate).mul_(up)), residual


class HybridModel(LlamaModel):
    """Mamba-2 or Bamba: embeddings, layers of mixers (and attention), final norm, LM head. Its recurrent layers
    read and write `batch.states`; its attention layers the KV store, as Llama's do (their `index` counts
    attention layers only: the store holds those)."""

    ARCHITECTURES = ARCHITECTURES
    CUDA_GRAPHS = False
    CUDA_GRAPHS_WHY = "the mixers' steps index their state slots on the host"

    @staticmethod
    def windows_of(cfg: PretrainedConfig) -> list[int | None]:
        return [None] * cfg.num_hidden_layers  # no sliding layers

    def __init__(self, cfg: PretrainedConfig, max_positions: int, quantization: str = "none") -> None:
        nn.Module.__init__(self)
        if cfg.model_type not in self.ARCHITECTURES:
            raise ValueError(f"unsupported architecture {cfg.model_type!r}; supported: {', '.join(self.ARCHITECTURES)}")
        if quantization != "none":
            raise ValueError(f"quantization {quantization} is not supported on {cfg.model_type} models yet (their "
                             "mixers' projections run in the compute dtype): use --quantization none")
        self.config = cfg
        self._setup(cfg)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed = None if self.tied else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.windows = (None,)
        self.layers = nn.ModuleList(self._layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = Dense(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.final_softcap, self.rope_dtype, self.tp, self.decode_stack = None, None, None, None
        self.workspace = Workspace()

    def _setup(self, cfg: PretrainedConfig) -> None:
        """Check the config and read what the layers need: each layer's kind ('attention' or 'recurrent')."""
        check_config(cfg)
        self.dims, self.kinds = mamba_dims(cfg), layer_kinds(cfg)

    def _layer(self, cfg: PretrainedConfig, i: int) -> nn.Module:
        kind, before = self.kinds[i], self.kinds[:i]
        if kind == "attention":
            return HybridAttentionLayer(cfg, before.count("attention"), None)
        mlp = cfg.intermediate_size if cfg.model_type == "bamba" else None
        return MambaLayer(self.dims, before.count("recurrent"), Dense, mlp, bool(getattr(cfg, "mlp_bias", False)))

    @property
    def num_recurrent_layers(self) -> int:
        return self.kinds.count("recurrent")

    @property
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each sequence's state in one recurrent layer (StateStore's shapes)."""
        return self.dims.state_shapes

    @property
    def _attention(self) -> list[nn.Module]:
        return [layer for layer in self.layers if not layer.recurrent]

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """The attention layers' (KV heads, head_dim, latent); (1, 1) where there are none (the store has no layer)."""
        attn = self._attention
        return (attn[0].num_kv_heads, attn[0].head_dim, False) if attn else (1, 1, False)

    @property
    def attention_scale(self) -> float:
        attn = self._attention
        return attn[0].scale if attn else 1.0

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.dims.eps)  # Mamba2's layer_norm_epsilon, Bamba's rms_norm_eps

    def init_rope(self, device: str | torch.device = "cpu") -> None:
        """RoPE tables where there are attention layers; pack the linear layers and hand the attention layers the
        C++ kernels (float32 on the CPU), as Llama's."""
        if "attention" in self.kinds:
            cos, sin = rope_tables(self.config, self.max_positions)
            self.rope[None] = cos.to(device), sin.to(device)
        kernels = self.pack_weights(device)
        for layer in self.layers:
            if isinstance(layer, DecoderLayer):
                layer.fuse(kernels)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, store: KVStore | QuantizedKVStore) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        cos = sin = None
        if self.rope:
            cos, sin = (t.index_select(0, batch.positions).unsqueeze(1).to(x.dtype) for t in self.rope[None])
        rows = batch.logits_indices if batch.logits_indices.numel() < batch.num_tokens else None
        residual, last = None, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if layer.recurrent:
                x, residual = layer(x, residual, batch)
            else:
                x, residual = layer(x, residual, cos, sin, batch, store, self.workspace, rows if i == last else None)
        selected = rows is not None and not self.layers[last].recurrent
        h = x + residual
        if not selected:
            h = h.index_select(0, batch.logits_indices)
        return self.lm_head(self.final_norm(h))

    def load_weights(self, source: WeightSource) -> None:
        ck = CheckpointReader(source)
        mamba2 = self.config.model_type == "mamba2"
        base = "backbone." if mamba2 else "model."
        with torch.no_grad():
            self._load_embeddings(ck, base + ("embeddings.weight" if mamba2 else "embed_tokens.weight"),
                                  base + ("norm_f.weight" if mamba2 else "final_layernorm.weight"))
            for i, layer in enumerate(self.layers):
                p = f"{base}layers.{i}."
                if layer.recurrent:
                    ck.put(layer.input_norm, p + ("norm.weight" if mamba2 else "input_layernorm.weight"))
                    layer.mixer.load(ck, p + ("mixer." if mamba2 else "mamba."))
                    if layer.mlp:
                        ck.put(layer.post_norm, p + "pre_ff_layernorm.weight")
                        ck.put_mlp(layer.gate_up, layer.down, p + "feed_forward.")
                else:
                    layer.load(ck, p, partial_rotary_order(self.config))
        ck.check_all_used()


class HybridAttentionLayer(DecoderLayer):
    """Bamba's attention layer: Llama's, with its norms and MLP under Bamba's names."""

    NORMS = {"input_norm": "input_layernorm", "post_norm": "pre_ff_layernorm"}
    O_BIAS_ARCHS = ("bamba",)
    recurrent = False

    def load(self, ck: CheckpointReader, prefix: str, order: list[int] | None) -> None:
        """Its weights under `prefix` (model.layers.{i}.); with `order`, q's and k's dims of each head permuted so
        (rope.partial_rotary_order)."""
        self.load_attention(ck, prefix + "self_attn.")
        ck.put_mlp(self.gate_up, self.down, prefix + "feed_forward.")
        for param, name in self.NORMS.items():
            ck.put(getattr(self, param), f"{prefix}{name}.weight")
        if order is not None:
            self._permute_qk(order)

    def _permute_qk(self, order: list[int]) -> None:
        hd, heads = self.head_dim, self.num_heads + self.num_kv_heads  # q's and k's heads lead the fused columns
        idx = torch.tensor([h * hd + j for h in range(heads) for j in order], device=self.qkv.weight.device)
        cols = slice(0, heads * hd)
        self.qkv.weight[:, cols] = self.qkv.weight[:, cols].index_select(1, idx)
        if self.qkv.bias is not None:
            self.qkv.bias[cols] = self.qkv.bias[cols].index_select(0, idx)
