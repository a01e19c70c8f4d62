"""Checkpoint tensors read lazily, a slice of rows at a time: safetensors files, GGUF files, or a dict.

A model is loaded by copying each tensor into its (already allocated) parameter in chunks of at most
CHUNK_BYTES, converting to the parameter's dtype and device on the way, so loading never holds more than
the final weights plus one chunk: no float32 copy of the model on the host or the device.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from safetensors import safe_open

CHUNK_BYTES = 16 * 2**20  # read and converted at a time (of the checkpoint's own dtype, or float32 for GGUF quants)


class WeightSource:
    """Named tensors of a checkpoint (Hugging Face names), each readable a range of rows at a time."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` (all of a 1-D tensor), on the host, in a dtype of the source's
        choosing (the stored one, or float32 for quantized GGUF data)."""
        raise NotImplementedError

    def row_bytes(self, name: str) -> int:
        """Bytes one row takes once read (what chunking is sized by)."""
        shape = self.shape(name)
        return 4 * int(np.prod(shape[1:])) if len(shape) > 1 else 4

    def chunks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of `name`, CHUNK_BYTES at a time."""
        shape = self.shape(name)
        if len(shape) < 2:
            yield 0, self.read(name)
            return
        step = max(1, CHUNK_BYTES // max(1, self.row_bytes(name)))
        for start in range(0, shape[0], step):
            yield start, self.read(name, start, min(shape[0], start + step))


class TensorSource(WeightSource):
    """Tensors already in memory (tests, converted checkpoints)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.tensors[name]
        return t if t.dim() < 2 else t[start:stop]


class SafetensorsSource(WeightSource):
    """The *.safetensors files of a Hugging Face directory, read through safetensors' slices (memory-mapped)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self._where: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    self._where[key] = file
        self._open: dict[str, object] = {}

    def _handle(self, name: str):
        file = self._where[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file]

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def row_bytes(self, name: str) -> int:
        shape = self.shape(name)
        size = {"F32": 4, "F64": 8, "I64": 8}.get(self._handle(name).get_slice(name).get_dtype(), 2)
        return size * int(np.prod(shape[1:])) if len(shape) > 1 else size

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        sl = self._handle(name).get_slice(name)
        return sl[:] if len(sl.get_shape()) < 2 else sl[start:stop]

    def close(self) -> None:
        self._open.clear()


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each Llama q/k head; undo it
    # so the rotate-half RoPE of the Hugging Face layout applies.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource(WeightSource):
    """A GGUF file (memory-mapped by `gguf`), its tensors under Hugging Face names, dequantized (F16, BF16, Q8_0,
    Q4_0/1, K-quants: whatever `gguf` supports) row range by row range. Llama q/k rows are un-permuted, which
    needs the whole tensor (they are small)."""

    def __init__(self, path: str, arch: str, num_heads: int, num_kv_heads: int) -> None:
        import gguf  # only GGUF checkpoints need it

        from kvcache.models import gguf_meta
        self._gguf = gguf
        self.arch, self.num_heads, self.num_kv_heads = arch, num_heads, num_kv_heads
        self._tensors = {}
        for t in gguf_meta.tensor_index(path):
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
            name = (f"model.layers.{m.group(1)}.{_LAYER_NAMES.get(m.group(2), m.group(2))}" if m
                    else _GLOBAL_NAMES.get(t.name, t.name))
            self._tensors[name] = t

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape))  # GGUF lists dimensions innermost first

    def _permuted(self, name: str) -> int:
        """Heads to un-permute `name` over (0: none)."""
        if self.arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            return 0
        return self.num_heads if "q_proj" in name else self.num_kv_heads

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self._tensors[name]
        heads = self._permuted(name)
        data = t.data if heads or t.data.ndim < 2 else t.data[start:stop]
        w = self._gguf.quants.dequantize(data, t.tensor_type)
        if heads:
            w = _unpermute(w, heads)
            w = w if w.ndim < 2 else w[start:stop]
        w = np.ascontiguousarray(w)
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def chunks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        if self._permuted(name):
            yield 0, self.read(name)
        else:
            yield from super().chunks(name)


def read_all(source: WeightSource) -> dict[str, torch.Tensor]:
    """Every tensor of `source` whole (tests and conversions; a model loads chunk by chunk instead)."""
    return {name: source.read(name) for name in source.names()}
