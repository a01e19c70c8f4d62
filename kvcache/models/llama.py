"""Llama-family decoder (llama, mistral, qwen2, qwen3) over the paged KV store.

Weights use Hugging Face names at load time and are fused here (q/k/v into one matrix,
gate/up into one) so that each layer runs two large GEMMs instead of five small ones.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvcache.native import host_memory
from kvcache.attention import cpu_kernel
from kvcache.attention.metadata import ForwardBatch
from kvcache.config import WEIGHT_QUANTIZATIONS
from kvcache.attention.paged import Workspace, paged_attention
from kvcache.models import cpu_kernels
from kvcache.models.quant_linear import INT4_UNIT, Int4Dense, Int8Dense, Q8Dense, exact_codes
from kvcache.models.weights import WeightSource
from kvcache.store.kv_store import KVStore
from kvcache.store.quantized_store import QuantizedKVStore

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Weights: as loaded; int8 per output channel; or 4-bit groups of 32 (Q4_1) with the LM head in int8 (quant_linear.py)
QUANTIZATIONS = tuple(WEIGHT_QUANTIZATIONS)


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(cfg: PretrainedConfig) -> list[int | None]:
    """Sliding window (tokens) of each layer, None for full attention. ValueError, naming the field, for
    layer_types that do not give every layer a known kind, or a sliding layer without a positive window."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        if len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"{cfg.model_type} layer_types must give each of the {n} layers one of "
                             f"{', '.join(LAYER_TYPES)}; got {len(types)} entries: {sorted(set(types))}")
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ValueError(f"{cfg.model_type} has sliding_attention layers but sliding_window is {window!r}: it "
                             "must be a positive number of tokens")
        return [window if t == "sliding_attention" else None for t in types]
    if cfg.model_type == "mistral":
        return [window] * n
    return [None] * n


def check_int4_sizes(sizes: dict[str, int]) -> None:
    """int4's kernel packs INT4_UNIT (64) inputs at a time: every linear layer's input size (named in `sizes`, from
    the config) must be a multiple."""
    bad = [f"{k} {v}" for k, v in sizes.items() if v % INT4_UNIT]
    if bad:
        raise ValueError(f"quantization int4 needs layer input sizes that are multiples of {INT4_UNIT}; this model "
                         f"has {', '.join(bad)}: use --quantization int8 or none")


def head_dim_of(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _rope_tables(cfg: PretrainedConfig, max_positions: int, layer_type: str | None = None
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 whatever x's dtype; the result is cast back before the weight multiplies it,
    in transformers' order (LlamaRMSNorm), so that half-precision runs round as it does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# Whether Dense.pack also keeps a float32 layer whose weights are a GGUF grid's (Q4_0/Q4_1, Q8_0) as codes that
# decode to those very floats (cpu_kernels' code panels), for steps of up to code_rows() rows (8 with AVX-512; none
# without): the same outputs from 0.75-1.25 bytes a weight instead of 4, decoded in registers (single-stream decode
# of the demo ~2.8x). Larger steps keep the float32 panels, faster there (see CODE_ROWS in cpu_kernels).
EXACT_CODES = os.environ.get("KVCACHE_EXACT_CODES", "1") != "0"


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` can be packed (Dense.pack): float32 on a CPU, with the project's C++
    kernels or oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and (
        cpu_kernels.load() is not None or torch.backends.mkldnn.is_available())


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A contiguous [out, in] float32 weight in oneDNN's blocked layout (mkldnn::_reorder_linear_weight)."""
    return torch.ops.mkldnn._reorder_linear_weight(w)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through oneDNN's linear on a weight from pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
                 codes: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x W^T + b through the C++ kernel (cpu_kernels' panel_linear) on W [n_out, in] packed by its pack_panels, or
    for a step of up to code_rows() rows on W's codes where it has them (code_panel_linear: the same floats)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], n_out, dtype=x.dtype)
    if codes is not None and rows.shape[0] <= cpu_kernels.code_rows():
        cpu_kernels.load().code_panel_linear(out, rows, *codes)
    else:
        cpu_kernels.load().panel_linear(out, rows, panels)
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], n_out)


class Dense(nn.Module):
    """y = x W + b with W stored [in, out]: on CPU (MKL) this layout runs the skinny GEMMs of
    decode steps faster than nn.Linear's [out, in] (measured: LM head 69 -> 94 GFLOP/s at 64 rows).

    In float32 on the CPU, `pack()` (once the weights are loaded) repacks W and drops the dense copy, unless it is
    also looked up (a tied embedding). Where the C++ kernels build, W goes into panels of 32 output channels for
    their panel_linear (cpu_kernels.py): with the weights streamed from memory, as in a decode step, it runs
    1.3-1.7x oneDNN's linear on its own packed weights at 1-8 rows on the demo's layers (2 threads), 1.04-1.25x at
    32-64 and the same from 256 (`kvcache bench linear`); each row's result is then independent of the batch. Without them, oneDNN's blocked layout (1.3-2.2x
    MKL's GEMM). `KVCACHE_PACKED_WEIGHTS=onednn` picks oneDNN's, `0` keeps MKL on the dense W."""

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.packed: torch.Tensor | None = None  # W^T in panels (pack_panels) or in oneDNN's layout (pack)
        self.codes: tuple[torch.Tensor, ...] | None = None  # or as code panels (pack_code_panels): codes, scale, min

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if self.packed.is_mkldnn:
                return packed_linear(x, self.packed, self.bias)
            return panel_linear(x, self.packed, self.out_features, self.bias, self.codes)
        return torch.matmul(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def pack(self, keep_dense: bool = False) -> bool:
        """Repack W (float32 CPU weights only; where neither the C++ kernels nor oneDNN are there, or
        KVCACHE_PACKED_WEIGHTS=0, keep it as it is); the dense W is dropped unless `keep_dense`. Whether it packed."""
        w, how = self.weight, os.environ.get("KVCACHE_PACKED_WEIGHTS", "1")
        if how not in ("0", "1", "onednn"):
            raise ValueError(f"KVCACHE_PACKED_WEIGHTS={how!r}: use 1 (panels for the C++ kernels, else oneDNN), "
                             "onednn or 0 (dense)")
        if self.packed is not None or self.codes is not None or w is None or not packable(w.dtype, w.device) or \
                how == "0":
            return False
        kernels = cpu_kernels.load() if how == "1" else None
        if kernels is None and not torch.backends.mkldnn.is_available():
            return False
        exact = exact_codes(w.detach().t()) if kernels is not None and EXACT_CODES and cpu_kernels.code_rows() else None
        if exact is not None:
            self.codes = cpu_kernels.pack_code_panels(*exact)
        # loading peaks at the weights plus one matrix (tests/models/test_loading.py): the panels are read from W's
        # transposed view with no copy; for oneDNN a contiguous [out, in] copy is made (it would copy the view
        # itself), so that W can go before the repacking
        w_t = w.detach().t() if kernels is not None else w.detach().t().contiguous()
        del w
        if not keep_dense:
            self.weight = None
        self.packed = cpu_kernels.pack_panels(w_t, kernels) if kernels is not None else pack_weight(w_t)
        return True

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight (a tied head keeps its dense one too, a parameter, and holds both)."""
        codes = sum(t.numel() * t.element_size() for t in self.codes) if self.codes is not None else 0
        return codes + (self.packed.numel() * 4 if self.packed is not None else 0)

    def load_rows(self, start: int, rows: torch.Tensor) -> None:
        """Copy Hugging Face weight rows [n, in] (output channels start .. start + n) into their columns."""
        self.weight[:, start:start + rows.shape[0]].copy_(rows.t())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` of the Hugging Face layout, [len(ids), in] (a tied embedding's lookups)."""
        return self.weight.index_select(1, ids).t()


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
        self.fused = [_kernel_tensors(m) for m in linears] if usable else None
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
        writes_kv = _native_write(store)  # a float32 store: attn_in stores K/V itself
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


def _native_write(store: KVStore | QuantizedKVStore) -> bool:
    """Whether the fused path's attn_in may store K/V itself (KVStore.native_write): a float32 KVStore (the quantized
    and KIVI stores encode on write, and a narrower float store converts)."""
    return isinstance(store, KVStore) and store.k[0].dtype == torch.float32


# Whether decode-only steps of fused float32-cache models run their layers in one native call (decode_layers)
NATIVE_DECODE = True

# Steps of at most this many tokens take the fused path in layers with int8 weights (its kernel's range); layers of
# other weights take it at every size (4 prompts of 500 tokens, float32: 3.3 s against 3.5-4.4 op by op). 0: never.
FUSED_MAX_ROWS = 32


def _kernel_tensors(m: nn.Module) -> list[torch.Tensor]:
    """A linear layer as cpu_kernels' fused calls take it (see linear_into there)."""
    if isinstance(m, Int4Dense):
        ts = [m.qweight, m.scale, m.minimum]
    elif isinstance(m, Int8Dense):
        ts = [m.weight, m.scale]
    else:
        ts = [m.packed if m.packed is not None else m.weight] + (list(m.codes) if m.codes is not None else [])
    return [t.detach() for t in ts] + ([m.bias.detach()] if m.bias is not None else [])


class LlamaModel(nn.Module):
    """Decoder stack + LM head; `forward` returns logits only for `batch.logits_indices`."""

    layer_class = DecoderLayer
    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    # Whether a decode forward can be captured in a CUDA graph (engine/cuda_graphs.py: no data-dependent host work)
    CUDA_GRAPHS = True
    CUDA_GRAPHS_WHY = ""

    def __init__(self, cfg: PretrainedConfig, max_positions: int, quantization: str = "none") -> None:
        super().__init__()
        if cfg.model_type not in self.ARCHITECTURES:
            raise ValueError(f"unsupported architecture {cfg.model_type!r}; supported: {', '.join(self.ARCHITECTURES)}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")
        self.config = cfg
        linear = {"none": Dense, "int8": Int8Dense, "int4": Int4Dense}[quantization]
        if quantization == "int4":
            check_int4_sizes(self.int4_input_sizes(cfg))
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        # The head keeps its weight [hidden, vocab] (the layout its GEMM wants); tied embeddings are that same
        # tensor, looked up by column, so they are stored once.
        self.embed = None if self.tied else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        windows = layer_windows(cfg)
        self.windows = tuple(sorted(set(windows), key=lambda w: (w is not None, w or 0)))
        self.layers = nn.ModuleList(self.layer_class(cfg, i, w, linear) for i, w in enumerate(windows))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        # The head (and a tied embedding) stays at 8 bits under int4, as llama.cpp's GGUFs keep it (the demo's is Q8_0,
        # which Q8Dense holds exactly): its kernel multiplies int8 activations, so the rows of a batch or of a
        # speculative verification cost little more than one (demo head, 2 threads, from memory: 2.2 ms for 1 row,
        # 2.7 for 5, 12 for 64, against 3.1, 6.5 and 33 for int8 per channel with float32 activations). Every row
        # computes what it computes alone: a sequence's logits do not depend on the step's other rows.
        # Where the int4 kernel is not built (no AVX2), Int8Dense's plain C++ kernel keeps the head batch-invariant.
        head = (Q8Dense if cpu_kernels.has_int4() else Int8Dense) if quantization == "int4" else linear
        self.lm_head = head(cfg.hidden_size, cfg.vocab_size, bias=False)
        if isinstance(self.lm_head, Int8Dense):
            self.lm_head.batch_invariant = True
        self.max_positions = max_positions
        self.rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # a layer's rope_key -> (cos, sin)
        self.final_softcap: float | None = None  # logits = c * tanh(logits / c) where set (Gemma)
        self.rope_dtype: torch.dtype | None = None  # the dtype RoPE's cos/sin are cast to per step (None: compute's)
        self.workspace = Workspace()
        self.tp = None  # tensor parallelism: a vocabulary-parallel embedding and head (their collectives)

    @staticmethod
    def int4_input_sizes(cfg: PretrainedConfig) -> dict[str, int]:
        """The config's sizes that are linear layers' inputs (int4 needs multiples of 64)."""
        return {"hidden_size": cfg.hidden_size, "num_attention_heads x head_dim": cfg.num_attention_heads * head_dim_of(cfg),
                "intermediate_size": cfg.intermediate_size}

    def init_rope(self, device: str | torch.device = "cpu") -> None:
        """Build the RoPE cos/sin tables for positions [0, max_positions) (kept in fp32), and pick the fused CPU
        kernels where they apply (float32 on the CPU)."""
        for key in {layer.rope_key for layer in self.layers}:
            cos, sin = _rope_tables(self.config, self.max_positions, key)
            self.rope[key] = cos.to(device), sin.to(device)
        fused = torch.device(device).type == "cpu" and self.compute_dtype == torch.float32
        kernels = cpu_kernels.load() if fused else None
        for m in self.modules():
            if isinstance(m, Dense) and m.pack(keep_dense=m is self.lm_head and self.tied):
                host_memory.trim_heap()
        for layer in self.layers:
            layer.fuse(kernels)
        self.decode_stack = self._decode_stack(kernels)

    def _decode_stack(self, kernels) -> tuple[list[torch.Tensor], list[int], list[int]] | None:
        """(weights, counts, windows) for cpu_kernels.decode_layers, where every layer is a plain fused DecoderLayer
        on one RoPE table (its forward is _forward_fused's calls); else None."""
        layers = list(self.layers)
        if kernels is None or not NATIVE_DECODE or self.tp is not None or not all(
                type(layer) is DecoderLayer and layer.fused is not None and layer.tp is None for layer in layers):
            return None
        if len({(layer.rope_key, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.eps, layer.scale,
                 layer.gate_up.out_features) for layer in layers}) != 1:
            return None
        weights, counts = [], []
        for layer in layers:
            weights += [layer.input_norm.detach(), layer.post_norm.detach()]
            for tensors in layer.fused:
                weights += tensors
                counts.append(len(tensors))
        return weights, counts, [layer.window or 0 for layer in layers]

    def _decode_natively(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                         store: KVStore | QuantizedKVStore) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x, residual) after every layer in one native call (cpu_kernels.decode_layers: the same calls, and floats,
        as the layers' fused forward) for a step of decode rows only on the CPU kernels' float32 cache, or None:
        a decode step of the demo model made ~40 Python calls a layer (~2.5 ms)."""
        stack, T, first = self.decode_stack, x.shape[0], self.layers[0]
        if (stack is None or batch.prefills or not batch.decode_kernel or batch.backend != "cpu"
                or len(batch.decode_groups) != 1 or batch.layer_batches is not None or not first.takes_fused(batch, T)):
            return None
        group = batch.decode_groups[0]
        if (group.rows.numel() != T or group.layer_views is not None or group.full is not None
                or not _native_write(store)):
            return None
        weights, counts, windows = stack
        caches = [store.native_write(i, batch.slot_mapping) for i in range(len(windows))]  # where K/V go (its rule)
        out, residual = first.kernels.decode_layers(
            x, weights, counts, [c[0] for c in caches] + [c[1] for c in caches], windows, first.eps, first.num_heads,
            first.num_kv_heads, first.head_dim, first.gate_up.out_features // 2, cos, sin, caches[0][2],
            group.block_table, group.context_lens, cpu_kernel.NO_RUNS if group.runs is None else group.runs,
            first.scale, cpu_kernel.SPLIT_TOKENS)
        return out, residual

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(KV heads, head_dim, latent) of the store this model writes: K and V per KV head here; one latent read as
        both (MLA) where `latent`."""
        return self.layers[0].num_kv_heads, self.layers[0].head_dim, False

    @property
    def compute_dtype(self) -> torch.dtype:
        """The activations' dtype: the norms' (the final norm follows Module.to(dtype))."""
        return self.norm.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter (tied embeddings counted once) and of weights packed in their place."""
        packed = sum(m.packed_bytes for m in self.modules() if isinstance(m, Dense))
        return packed + sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def weight_read_bytes(self) -> int:
        """Bytes of weights a decode step reads at least (the rooflines' figure): each linear layer in its smallest
        form (its codes where it keeps them, else its panels or weight), and every other parameter but an embedding
        table, whose rows are looked up, not read."""
        dense = [m for m in self.modules() if isinstance(m, Dense)]
        skip = {id(p) for m in dense for p in m.parameters(recurse=False)}
        if self.embed is not None:
            skip |= {id(p) for p in self.embed.parameters()}
        total = 0
        for m in dense:
            smallest = m.codes if m.codes is not None else [m.packed if m.packed is not None else m.weight]
            total += sum(t.numel() * t.element_size() for t in [*smallest, m.bias] if t is not None)
        return total + sum(p.numel() * p.element_size() for p in self.parameters() if id(p) not in skip)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            return self.tp.embed(self._embed_rows, ids)
        return self._embed_rows(ids)

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            return self.lm_head.rows(ids).to(self.compute_dtype).contiguous()
        return self.embed(ids)

    def keep_scale_dtypes(self) -> LlamaModel:
        """Undo Module.to(dtype) on the quantized layers' scales: int8's stay float32 and int4's float16 (their
        storage format), whatever the compute dtype."""
        for m in self.modules():
            if isinstance(m, Int8Dense):
                m.scale.data = m.scale.data.float()
            elif isinstance(m, Int4Dense):
                m.scale.data, m.minimum.data = m.scale.data.half(), m.minimum.data.half()
        return self

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, store: KVStore | QuantizedKVStore) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        rope = {key: tuple(t.index_select(0, batch.positions).unsqueeze(1).to(self.rope_dtype or x.dtype) for t in tables)
                for key, tables in self.rope.items()}
        # Only rows that sample need the last layer's output projection and MLP, the norm and the (large) LM head:
        # a prompt's other rows stop after their last K and V are written.
        rows = batch.logits_indices if batch.logits_indices.numel() < batch.num_tokens else None
        key = self.layers[0].rope_key
        done = None if rows is not None else self._decode_natively(x, *rope[key], batch, store)
        if done is not None:
            x, residual = done
        else:
            residual, last = None, len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, *rope[layer.rope_key], batch.for_layer(i), store, self.workspace,
                                    rows if i == last else None)
        h = x + residual if rows is not None else (x + residual).index_select(0, batch.logits_indices)
        logits = self.lm_head(self.final_norm(h))
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.config.rms_norm_eps)

    def load_weights(self, source: WeightSource) -> None:
        """Copy the checkpoint's Hugging Face-named tensors into the parameters (allocated, in their dtype and on
        their device), chunk by chunk, fusing q/k/v and gate/up as they land. Raises KeyError on a missing tensor
        or one this model does not use."""
        ck = CheckpointReader(source)
        with torch.no_grad():
            self._load_embeddings(ck)
            for i, layer in enumerate(self.layers):
                a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
                q_rows, kv_rows = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
                ck.put_fused(layer.qkv, [a + f"{n}_proj.weight" for n in "qkv"],
                             [a + f"{n}_proj.bias" for n in "qkv"] if layer.qkv.bias is not None else None,
                             [q_rows, kv_rows, kv_rows])
                ck.put_linear(layer.o_proj, a + "o_proj.weight")
                if layer.o_proj.bias is not None:
                    ck.put(layer.o_proj.bias, a + "o_proj.bias")
                ck.put_mlp(layer.gate_up, layer.down, m)
                for param, name in layer.NORMS.items():
                    ck.put(getattr(layer, param), f"model.layers.{i}.{name}.weight")
                if layer.qk_norm:
                    ck.put(layer.q_norm, a + "q_norm.weight")
                    ck.put(layer.k_norm, a + "k_norm.weight")
        ck.check_all_used()

    def _load_embeddings(self, ck: CheckpointReader) -> None:
        """The embedding (or the tied head that serves it), the LM head and the final norm."""
        if self.tied:
            head = "lm_head.weight" if "lm_head.weight" in ck.names else "model.embed_tokens.weight"
            ck.put_linear(self.lm_head, head)
            ck.used.update({"lm_head.weight", "model.embed_tokens.weight"} & ck.names)
        else:
            ck.put(self.embed.weight, "model.embed_tokens.weight")
            ck.put_linear(self.lm_head, "lm_head.weight")
        ck.put(self.norm, "model.norm.weight")


class CheckpointReader:
    """Copies a checkpoint's Hugging Face-named tensors into a model's parameters, chunk by chunk, checking each
    name and shape, and remembers which it used (check_all_used: a tensor the model does not read is an error).
    KeyError names the tensor."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self.names = set(source.names())
        self.used: set[str] = set()

    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.names:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        if self.source.shape(name) != shape:
            raise KeyError(f"tensor {name!r} has shape {list(self.source.shape(name))}, this model needs {list(shape)}")
        self.used.add(name)

    def put(self, dst: torch.Tensor, name: str) -> None:
        """dst <- tensor `name` (an embedding, a norm, a bias), a chunk of rows at a time."""
        self.expect(name, tuple(dst.shape))
        for start, rows in self.source.chunks(name):
            dst[start:start + rows.shape[0]].copy_(rows)

    def put_linear(self, dense, name: str, at: int = 0, rows: int | None = None) -> None:
        """Hugging Face weight `name` ([rows, in]) into output channels at .. at + rows of a Dense/Int8Dense."""
        self.expect(name, (rows or dense.out_features, dense.in_features))
        for start, chunk in self.source.chunks(name):
            dense.load_rows(at + start, chunk)

    def put_fused(self, dense, parts: list[str], bias_parts: list[str] | None, split: list[int]) -> None:
        """Hugging Face's separate projections `parts` ([split[i], in] each), side by side in the columns of one
        fused Dense."""
        missing = [n for n in parts if n not in self.names]
        if missing:
            raise KeyError(f"checkpoint has no tensor {missing[0]!r}")
        rows = [self.source.shape(n)[0] for n in parts]
        if rows != split:
            raise KeyError(f"{', '.join(parts)} have {' + '.join(map(str, rows))} rows, this model needs "
                           f"{' + '.join(map(str, split))}")
        at = 0
        for i, (name, n) in enumerate(zip(parts, rows)):
            self.put_linear(dense, name, at, n)
            if bias_parts:
                self.put(dense.bias[at:at + n], bias_parts[i])
            at += n

    def put_mlp(self, gate_up, down, prefix: str) -> None:
        """A gated MLP's gate_proj and up_proj (fused into `gate_up`) and down_proj, biases too where it has them."""
        bias = gate_up.bias is not None
        inter = gate_up.out_features // 2
        self.put_fused(gate_up, [prefix + "gate_proj.weight", prefix + "up_proj.weight"],
                       [prefix + "gate_proj.bias", prefix + "up_proj.bias"] if bias else None, [inter, inter])
        self.put_linear(down, prefix + "down_proj.weight")
        if bias:
            self.put(down.bias, prefix + "down_proj.bias")

    def check_all_used(self, ignore: Callable[[str], bool] = lambda name: False) -> None:
        leftover = sorted(n for n in self.names - self.used if "rotary_emb" not in n and not ignore(n))
        if leftover:
            raise KeyError(f"checkpoint has {len(leftover)} tensors this model does not use, e.g. {leftover[:3]}")
