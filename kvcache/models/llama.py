"""Llama-family decoder (llama, mistral, qwen2, qwen3) over the paged KV store: the stack, its LM head, the
whole-stack native decode, and reading its checkpoint.

Weights use Hugging Face names at load time and are fused (q/k/v into one matrix, gate/up into one) so that each
layer runs two large GEMMs instead of five small ones. The layer is decoder_layer.py's; its linear layers
linear.py's and quant_linear.py's; RoPE rope.py's.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kvcache.attention import cpu_kernel
from kvcache.attention.metadata import ForwardBatch
from kvcache.attention.paged import Workspace
from kvcache.config import WEIGHT_QUANTIZATIONS
from kvcache.models import cpu_kernels
from kvcache.models.checkpoint import CheckpointReader
from kvcache.models.decoder_layer import DecoderLayer, native_write
from kvcache.models.linear import Dense, check_int4_sizes
from kvcache.models.norm import rms_norm
from kvcache.models.quant_linear import Int4Dense, Int8Dense, Q8Dense
from kvcache.models.rope import head_dim_of, rope_tables
from kvcache.models.weights import WeightSource
from kvcache.native import host_memory
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


# Whether decode-only steps of fused models on a float32, float16 or bfloat16 cache run their layers in one native
# call (decode_layers)
NATIVE_DECODE = True


class LlamaModel(nn.Module):
    """Decoder stack + LM head; `forward` returns logits only for `batch.logits_indices`."""

    layer_class = DecoderLayer
    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    windows_of = staticmethod(layer_windows)  # each layer's sliding window from a config (None: full attention)
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
        # speculative verification cost little more than one (docs/kernels.md). Every row computes what it
        # computes alone: a sequence's logits do not depend on the step's other rows.
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
            cos, sin = rope_tables(self.config, self.max_positions, key)
            self.rope[key] = cos.to(device), sin.to(device)
        kernels = self.pack_weights(device)
        for layer in self.layers:
            layer.fuse(kernels)
        self.decode_stack = self._decode_stack(kernels)

    def pack_weights(self, device: str | torch.device):
        """Repack every float32 linear layer's weights (Dense.pack; a tied head keeps its dense copy too); the C++
        kernels where this model computes in float32 on the CPU, else None."""
        fused = torch.device(device).type == "cpu" and self.compute_dtype == torch.float32
        kernels = cpu_kernels.load() if fused else None
        for m in self.modules():
            if isinstance(m, Dense) and m.pack(keep_dense=m is self.lm_head and self.tied):
                host_memory.trim_heap()
        return kernels

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
        as the layers' fused forward) for a step of decode rows only on a float (not quantized) cache, or None. It
        saves the ~40 Python calls a layer that the layers' own forward makes."""
        stack, T, first = self.decode_stack, x.shape[0], self.layers[0]
        if (stack is None or batch.prefills or not batch.decode_kernel or batch.backend != "cpu"
                or len(batch.decode_groups) != 1 or batch.layer_batches is not None or not first.takes_fused(batch, T)):
            return None
        group = batch.decode_groups[0]
        if (group.rows.numel() != T or group.layer_views is not None or group.full is not None
                or not native_write(store)):
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
    def attention_scale(self) -> float:
        """The softmax scale of the attention layers' scores (eviction scores with it)."""
        return self.layers[0].scale

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
                layer.load_attention(ck, a)
                ck.put_mlp(layer.gate_up, layer.down, m)
                for param, name in layer.NORMS.items():
                    ck.put(getattr(layer, param), f"model.layers.{i}.{name}.weight")
                if layer.qk_norm:
                    ck.put(layer.q_norm, a + "q_norm.weight")
                    ck.put(layer.k_norm, a + "k_norm.weight")
        ck.check_all_used()

    def _load_embeddings(self, ck: CheckpointReader, embed: str = "model.embed_tokens.weight",
                         norm: str = "model.norm.weight") -> None:
        """The embedding `embed` (or the tied head that serves it), the LM head and the final norm `norm`."""
        if self.tied:
            ck.put_linear(self.lm_head, "lm_head.weight" if "lm_head.weight" in ck.names else embed)
            ck.used.update({"lm_head.weight", embed} & ck.names)
        else:
            ck.put(self.embed.weight, embed)
            ck.put_linear(self.lm_head, "lm_head.weight")
        ck.put(self.norm, norm)
