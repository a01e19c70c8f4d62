"""Fixed pool of KV blocks: O(1) allocate and free, reference counts, a null block."""
from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Hands out block ids in [1, num_blocks); block 0 is the null block used to pad block tables.

    A block is free when its reference count is 0. Sharing a block (n > 1 samples of one
    prompt) raises its count; it returns to the free list only when the last holder frees it.
    """

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (1 null + 1 usable), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each of `blocks`."""
        # Check all before changing any, so a bad list leaves the pool as it was.
        if any(self.ref_counts[b] <= 0 for b in blocks):
            raise ValueError(f"cannot share free blocks {[b for b in blocks if self.ref_counts[b] <= 0]}")
        for b in blocks:
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder from each of `blocks`; blocks nobody holds go back to the free list."""
        holders: dict[int, int] = {}
        for b in blocks:
            holders[b] = holders.get(b, 0) + 1
        over = [b for b, n in holders.items() if n > self.ref_counts[b]]
        if over:
            raise ValueError(f"blocks {over} freed more often than they are held")
        for b in blocks:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
