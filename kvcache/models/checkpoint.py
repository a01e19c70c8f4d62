"""Reading a checkpoint's Hugging Face-named tensors into a model's parameters, checked by name and shape."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvcache.models.weights import WeightSource


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
