"""Prefix caching for recurrent layers: snapshots of a sequence's state at block boundaries, so that a later request
with the same prefix starts from the deepest snapshot its cached chain of blocks reaches.

A snapshot is taken where a step crosses a multiple of `interval` tokens (a multiple of the block size: vLLM's
mamba_block_size): every such boundary of a prompt chunk, and a decode step's. It is keyed like a cached block
(BlockKey's way): the chain hash of the block that ends at the boundary, the chain hash before it, and that block's
tokens, so that a hash collision cannot hand out another prefix's state. Snapshots live in `num_slots` slots of the
state pool of their own, least recently used first out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

SnapshotKey = tuple[int, int | None, tuple[int, ...]]  # (chain hash of the last block, of the one before, its tokens)


@dataclass
class SnapshotStats:
    saved: int = 0  # snapshots written
    hits: int = 0  # admissions that started from one
    evicted: int = 0  # dropped for room


class StateSnapshots:
    """An LRU map of SnapshotKey -> a slot among `slots` (state pool slots of their own)."""

    def __init__(self, slots: list[int], interval: int) -> None:
        if not slots:
            raise ValueError("state snapshots need at least one slot")
        self.interval = interval
        self._free = list(reversed(slots))
        self._lru: OrderedDict[SnapshotKey, int] = OrderedDict()
        self.stats = SnapshotStats()

    @property
    def num_slots(self) -> int:
        return len(self._free) + len(self._lru)

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, key: SnapshotKey) -> int | None:
        """The slot holding `key`'s snapshot (now the most recently used), or None."""
        slot = self._lru.get(key)
        if slot is not None:
            self._lru.move_to_end(key)
        return slot

    def reserve(self, key: SnapshotKey) -> int:
        """A slot to write `key`'s snapshot into: its own (rewritten: the same state), a free one, or the least
        recently used one's."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return self._lru[key]
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._lru.popitem(last=False)
            self.stats.evicted += 1
        self._lru[key] = slot
        self.stats.saved += 1
        return slot

    def clear(self) -> int:
        """Forget every snapshot; how many."""
        n = len(self._lru)
        self._free.extend(self._lru.values())
        self._lru.clear()
        return n
