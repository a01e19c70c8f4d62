"""Which slot of the recurrent-state pool (store/state_store.py) each sequence holds: taken with the sequence's
first blocks, given back with them, copied on a fork or from a snapshot (the copies wait for the next forward)."""
from __future__ import annotations

from kvcache.memory.block_pool import OutOfBlocksError


class OutOfStateSlotsError(OutOfBlocksError):
    """Every state slot is held (an OutOfBlocksError: whoever handles a pool that ran dry handles this alike)."""


class StateSlots:
    """A free list of `num_slots` slots and the slot of each sequence that holds one. Forks queue the copies
    (parent's slot -> child's) that must reach the store before the next forward (take_copies)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.slot_of: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, seq_id: int) -> int:
        """The slot of `seq_id`, taken now if it holds none; OutOfStateSlotsError (and no change) if none is free."""
        if seq_id in self.slot_of:
            return self.slot_of[seq_id]
        if not self._free:
            raise OutOfStateSlotsError(f"all {self.num_slots} state slots are held")
        slot = self.slot_of[seq_id] = self._free.pop()
        return slot

    def free(self, seq_id: int) -> None:
        """Give back the slot of `seq_id` (no-op if it holds none)."""
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)
            self._copies = [(s, d) for s, d in self._copies if d != slot]

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give `child_id` a slot holding the parent's state (the copy queued); OutOfStateSlotsError if none is free."""
        dst = self.allocate(child_id)
        self._copies.append((self.slot_of[parent_id], dst))

    def load(self, seq_id: int, src: int | None) -> None:
        """Have the slot of `seq_id` start from slot `src` (a snapshot's): queued like a fork's copy."""
        if src is None:
            raise ValueError(f"sequence {seq_id} starts after a cached prefix but no snapshot of its state was found")
        self._copies.append((src, self.slot_of[seq_id]))

    def take_copies(self) -> list[tuple[int, int]]:
        """The copies forks queued since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies
