"""The recurrent state of linear-attention and state-space layers (Mamba-2's conv and SSM states): a fixed number of
bytes per sequence, however long it is, in slots of a pool sized once at start-up beside the KV blocks.

Slot `s` of layer `i` is `tensors[i][name][s]` for each of the layer's named states. A sequence holds one slot
(memory/state_slots.py says which) from its first token until it finishes or is preempted; a chunk that starts at
position 0 starts from zeros, any other from what the slot holds. The step's view of it is a StateBatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvcache.store.kv_store import copy_rows


class StateStore:
    """Per recurrent layer, a tensor [num_slots, *shape] for each named state of `shapes` (the same for every
    layer), in `dtype` on `device`, zeroed."""

    def __init__(self, num_layers: int, num_slots: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots, self.shapes, self.dtype = num_slots, dict(shapes), dtype
        self.tensors = [{name: torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                         for name, shape in shapes.items()} for _ in range(num_layers)]

    @staticmethod
    def slot_bytes(num_layers: int, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes in every layer."""
        return num_layers * sum(math.prod(s) for s in shapes.values()) * dtype.itemsize

    @property
    def bytes_per_slot(self) -> int:
        return self.slot_bytes(len(self.tensors), self.shapes, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot * self.num_slots

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy slots src -> dst in every layer (a sample forked from its parent continues from its state)."""
        copy_rows([t for layer in self.tensors for t in layer.values()], pairs)


def state_formula(shapes: dict[str, tuple[int, ...]], num_layers: int, dtype: torch.dtype) -> str:
    """One sequence's state bytes as a formula, for the start-up log: '2 layers x (conv 192 x 3 + ssm 8 x 16 x 16)
    x 4 bytes'."""
    terms = " + ".join(f"{name} {' x '.join(map(str, shape))}" for name, shape in shapes.items())
    return f"{num_layers} layers x ({terms}) x {dtype.itemsize} bytes"


@dataclass(slots=True)
class StateSpan:
    """A chunk that scans: batch rows [first, first + rows) of one sequence, positions from `start`, in `slot` (from
    zeros where it starts at 0); `saves`: (position, slot) where the state after that position is snapshotted."""

    first: int
    rows: int
    slot: int
    start: int
    saves: list[tuple[int, int]]

    @property
    def fresh(self) -> bool:
        return self.start == 0


@dataclass(slots=True)
class StateBatch:
    """Which slot each row of a step reads and writes: the chunks that scan (a prompt's chunk, or any chunk that
    starts at position 0) one by one, and the decode rows together."""

    store: StateStore
    spans: list[StateSpan]
    decode_rows: torch.Tensor  # [B] batch rows of one token on a sequence already begun
    decode_slots: torch.Tensor  # [B] their slots
    decode_saves: list[tuple[int, int]] = field(default_factory=list)  # (index among the decode rows, snapshot slot)
