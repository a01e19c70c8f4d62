"""Fixed pool of KV blocks: O(1) allocate and free, reference counts, a null block, and
cached blocks that stay findable by hash after their last holder frees them.

The free list is kept in LRU order (vLLM v1's design): a freed block goes to the back; an
allocation takes from the front. A freed block that holds a cached prefix keeps its key,
so a later request can take it back (a prefix-cache hit); it loses its identity only when
the pool hands it out again (an eviction).

Retention (`retain`): a cached block may carry a priority in 0..100 (DEFAULT_PRIORITY unless a request set one,
TensorRT-LLM's scale) until an expiry time; past it, its priority is 0. The free list is one LRU list per priority,
and an allocation takes from the lowest priority first. A pinned block (`pin`) holds a reference of its own, so it
is never free and never evicted.
"""
from __future__ import annotations

import heapq
import math
import time

from kvcache.memory.block_hash import BlockKey
from kvcache.memory.kv_events import KVEventLog


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


DEFAULT_PRIORITY = 35  # a cached block's retention priority unless a request set one (TensorRT-LLM's default)


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Hands out block ids in [1, num_blocks); block 0 is the null block used to pad block tables.

    A block is free when its reference count is 0. Sharing a block (n > 1 samples of one
    prompt, a prefix-cache hit) raises its count; it returns to the free list only when the
    last holder frees it.
    """

    NULL_BLOCK = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (1 null + 1 usable), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # free blocks: one LRU list per retention priority (insertion order = LRU order), and each one's list
        self._lists: dict[int, dict[int, None]] = {DEFAULT_PRIORITY: dict.fromkeys(range(1, num_blocks))}
        self._free: dict[int, int] = dict.fromkeys(range(1, num_blocks), DEFAULT_PRIORITY)
        self.priority = [DEFAULT_PRIORITY] * num_blocks  # a cached block's retention priority ...
        self.expires = [math.inf] * num_blocks  # ... until this time (self.clock), 0 after
        self._expiring: list[tuple[float, int, int]] = []  # (expiry, block, generation) of free retained blocks
        self.pinned: set[int] = set()  # blocks held by a pin (never freed)
        self.clock = time.monotonic
        self.keys: list[BlockKey | None] = [None] * num_blocks  # what a cached block holds
        self.generation = [0] * num_blocks  # bumped each time a block is handed out anew
        self.hits = [0] * num_blocks  # prefix-cache hits on a block since it was last handed out anew
        self._cached: dict[int, int] = {}  # chain hash -> block
        self.num_evictions = 0  # cached blocks that lost their identity to a new allocation
        self.events: KVEventLog | None = None  # records blocks that stop being findable (KV events), if set

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash, held or idle."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, least recently freed first, each with reference count 1; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        self._expire()
        blocks, evicted = [], []
        for _ in range(n):
            lowest = min(self._lists)
            b = next(iter(self._lists[lowest]))
            self._unfree(b)
            self.priority[b], self.expires[b] = DEFAULT_PRIORITY, math.inf
            if self.keys[b] is not None:
                evicted.append(self.keys[b].hash)
                del self._cached[self.keys[b].hash]
                self.keys[b] = None
                self.num_evictions += 1
            self.generation[b] += 1
            self.hits[b] = 0
            self.ref_counts[b] = 1
            blocks.append(b)
        if evicted and self.events is not None:
            self.events.removed(evicted)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each of `blocks`, which must be held already."""
        # Check all before changing any, so a bad list leaves the pool as it was.
        if any(self.ref_counts[b] <= 0 for b in blocks):
            raise ValueError(f"cannot share free blocks {[b for b in blocks if self.ref_counts[b] <= 0]}")
        for b in blocks:
            self.ref_counts[b] += 1

    def touch(self, blocks: list[int]) -> None:
        """Add one holder to each of the cached `blocks`, taking idle ones back from the free list."""
        if any(self.keys[b] is None for b in blocks):
            raise ValueError(f"blocks {[b for b in blocks if self.keys[b] is None]} are not cached")
        for b in blocks:
            if self.ref_counts[b] == 0:
                self._unfree(b)
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder from each of `blocks`; blocks nobody holds go to the back of the free list."""
        holders: dict[int, int] = {}
        for b in blocks:
            holders[b] = holders.get(b, 0) + 1
        over = [b for b, n in holders.items() if n > self.ref_counts[b]]
        if over:
            raise ValueError(f"blocks {over} freed more often than they are held")
        for b in blocks:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._enfree(b)

    def _enfree(self, b: int) -> None:
        """Put `b` at the back of its priority's free list (0 past its expiry)."""
        timed = self.expires[b] != math.inf  # only a TTL reads the clock (free and allocate are on every step)
        expired = timed and self.expires[b] <= self.clock()
        p = 0 if expired else self.priority[b]
        self._lists.setdefault(p, {})[b] = None
        self._free[b] = p
        if timed and not expired:
            heapq.heappush(self._expiring, (self.expires[b], b, self.generation[b]))

    def _unfree(self, b: int) -> None:
        p = self._free.pop(b)
        lst = self._lists[p]
        del lst[b]
        if not lst:
            del self._lists[p]

    def _expire(self) -> None:
        """Move free blocks whose retention expired to the priority-0 list (at its back)."""
        if not self._expiring:
            return
        now = self.clock()
        while self._expiring and self._expiring[0][0] <= now:
            t, b, gen = heapq.heappop(self._expiring)
            if b in self._free and self.generation[b] == gen and self.expires[b] == t and self._free[b] != 0:
                self._unfree(b)
                self._enfree(b)

    def retain(self, blocks: list[int], priority: int, ttl_s: float | None) -> None:
        """Give the cached ones of the held `blocks` retention `priority` (0..100) for `ttl_s` seconds (None: until
        evicted), where that is more than they have now (a block shared by requests keeps the highest)."""
        now = self.clock()
        until = math.inf if ttl_s is None else now + ttl_s
        for b in blocks:
            if self.keys[b] is None or self.ref_counts[b] <= 0:
                continue
            current = self.priority[b] if self.expires[b] > now else 0
            if priority > current or priority == current and until > self.expires[b]:
                self.priority[b], self.expires[b] = priority, until

    def pin(self, blocks: list[int]) -> None:
        """Hold each of the cached `blocks` once more, for good (taking idle ones off the free list): never freed,
        never evicted."""
        if any(self.keys[b] is None for b in blocks):
            raise ValueError(f"only cached blocks can be pinned; got {blocks}")
        for b in blocks:
            if b not in self.pinned:
                self.pinned.add(b)
                if self.ref_counts[b] == 0:
                    self._unfree(b)
                self.ref_counts[b] += 1

    def cache(self, block: int, key: BlockKey) -> bool:
        """Make a held, full `block` findable under `key`. False if another block already holds that key."""
        if self.ref_counts[block] <= 0 or self.keys[block] is not None:
            raise ValueError(f"block {block} must be held and not cached yet to be cached")
        if key.hash in self._cached:
            return False
        self.keys[block] = key
        self._cached[key.hash] = block
        return True

    def uncache(self, block: int) -> None:
        """Make `block` unfindable (its content is about to change); it keeps its holders."""
        key = self.keys[block]
        if key is not None:
            del self._cached[key.hash]
            self.keys[block] = None
            if self.events is not None:
                self.events.removed([key.hash])

    def lookup(self, block_hash: int) -> int | None:
        """The block cached under `block_hash`, if any (the caller verifies its key)."""
        return self._cached.get(block_hash)

    def clear_cache(self) -> int:
        """Forget every cached key but the pinned blocks' (blocks stay where they are); returns how many were dropped."""
        dropped = [h for h, b in self._cached.items() if b not in self.pinned]  # pins stay findable
        for h in dropped:
            self.keys[self._cached.pop(h)] = None
        return len(dropped)
