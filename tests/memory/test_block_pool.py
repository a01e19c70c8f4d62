"""BlockPool: allocate/free/share semantics, the null block, and pool invariants under random use."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.memory.block_pool import BlockPool, OutOfBlocksError


def test_pool_needs_a_usable_block():
    with pytest.raises(ValueError, match="1"):
        BlockPool(1)
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    assert pool.num_usable == 1 and pool.num_free == 1


def test_fresh_pool_is_all_free():
    pool = BlockPool(10)
    assert pool.num_blocks == 10
    assert pool.num_usable == 9
    assert pool.num_free == 9
    assert pool.ref_counts == [0] * 10


def test_allocate_hands_out_distinct_usable_blocks_with_ref_count_one():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(4)
    assert len(a) == 3 and len(b) == 4
    got = a + b
    assert len(set(got)) == 7
    assert sorted(got) == list(range(1, 8))  # every usable block, never the null block
    assert BlockPool.NULL_BLOCK not in got
    assert all(pool.ref_counts[x] == 1 for x in got)
    assert pool.ref_counts[BlockPool.NULL_BLOCK] == 0
    assert pool.num_free == 0


def test_allocate_zero_is_a_no_op():
    pool = BlockPool(4)
    assert pool.allocate(0) == []
    assert pool.num_free == 3


def test_null_block_is_never_handed_out_even_after_churn():
    pool = BlockPool(5)
    rng = random.Random(0)
    for _ in range(200):
        held = pool.allocate(rng.randint(0, pool.num_free))
        assert BlockPool.NULL_BLOCK not in held
        pool.free(held)
    assert pool.num_free == 4


def test_allocation_is_all_or_nothing():
    pool = BlockPool(6)
    held = pool.allocate(3)
    before_counts = list(pool.ref_counts)
    with pytest.raises(OutOfBlocksError) as e:
        pool.allocate(3)  # only 2 free
    assert "3" in str(e.value) and "2" in str(e.value)
    assert pool.num_free == 2
    assert pool.ref_counts == before_counts
    # the two remaining blocks are still obtainable, and they are not the held ones
    rest = pool.allocate(2)
    assert set(rest).isdisjoint(held)
    assert sorted(held + rest) == [1, 2, 3, 4, 5]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)


def test_out_of_blocks_error_is_a_runtime_error():
    assert issubclass(OutOfBlocksError, RuntimeError)


def test_free_returns_blocks():
    pool = BlockPool(5)
    held = pool.allocate(4)
    pool.free(held[:2])
    assert pool.num_free == 2
    assert [pool.ref_counts[b] for b in held] == [0, 0, 1, 1]
    pool.free(held[2:])
    assert pool.num_free == 4
    assert pool.ref_counts == [0] * 5


def test_double_free_raises():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match=str(b)):
        pool.free([b])
    assert pool.num_free == 3  # the failed free did not add a second copy to the free list
    got = pool.allocate(3)
    assert sorted(got) == [1, 2, 3]


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.free([2])
    with pytest.raises(ValueError):
        pool.free([BlockPool.NULL_BLOCK])
    assert pool.num_free == 3


def test_share_keeps_block_until_last_holder_frees():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    pool.share(blocks[:1])
    assert [pool.ref_counts[b] for b in blocks] == [3, 2]
    pool.free(blocks)
    assert pool.num_free == 1
    assert [pool.ref_counts[b] for b in blocks] == [2, 1]
    pool.free(blocks)
    assert pool.num_free == 2  # blocks[1] is back
    assert pool.ref_counts[blocks[1]] == 0
    pool.free(blocks[:1])
    assert pool.num_free == 3
    assert pool.ref_counts == [0] * 4


def test_share_of_free_block_raises():
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.share([1])
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError):
        pool.share([b])
    assert pool.ref_counts[b] == 0


def test_freed_block_is_reused():
    pool = BlockPool(6)
    held = pool.allocate(5)
    pool.free([held[2]])
    assert pool.allocate(1) == [held[2]]
    assert pool.num_free == 0


def test_free_list_is_fifo():
    """Freed blocks join the tail: never-used blocks go first, then freed ones in the order freed."""
    pool = BlockPool(10)
    a = pool.allocate(4)
    pool.free([a[3], a[0]])
    rest = pool.allocate(5)  # the 5 never-used blocks
    assert set(rest).isdisjoint(a)
    assert pool.allocate(2) == [a[3], a[0]]


def test_large_pool_reuse():
    """The free list stays exact over many blocks and many cycles (no duplicates, no losses)."""
    n = 20_000
    pool = BlockPool(n)
    rng = random.Random(1)
    held: list[int] = pool.allocate(n - 1)
    for _ in range(20):
        rng.shuffle(held)
        k = rng.randint(1, len(held))
        pool.free(held[:k])
        held = held[k:]
        assert pool.num_free == k
        new = pool.allocate(k)
        assert len(set(new)) == k and not set(new) & set(held)
        held += new
    assert sorted(held) == list(range(1, n))


class PoolMachine(RuleBasedStateMachine):
    """Model: a list of holders, each holding a list of blocks (one reference per block)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.holders: list[list[int]] = []

    @rule(n=st.integers(2, 12))
    @precondition(lambda self: self.pool is None)
    def create(self, n):
        self.pool = BlockPool(n)

    def _held(self) -> set[int]:
        return {b for h in self.holders for b in h}

    @rule(n=st.integers(0, 6))
    @precondition(lambda self: self.pool is not None)
    def allocate(self, n):
        held_before = self._held()
        free_before = self.pool.num_free
        counts_before = list(self.pool.ref_counts)
        if n > free_before:
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(n)
            assert self.pool.num_free == free_before
            assert self.pool.ref_counts == counts_before
            return
        got = self.pool.allocate(n)
        assert len(got) == n and len(set(got)) == n
        assert BlockPool.NULL_BLOCK not in got
        assert all(1 <= b < self.pool.num_blocks for b in got)
        assert not set(got) & held_before, "a held block was handed out again"
        self.holders.append(got)

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self.holders)
    def share(self, data):
        src = data.draw(st.sampled_from(self.holders))
        subset = data.draw(st.lists(st.sampled_from(src), unique=True)) if src else []
        self.pool.share(subset)
        self.holders.append(list(subset))

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None and self.holders)
    def free(self, data):
        i = data.draw(st.integers(0, len(self.holders) - 1))
        blocks = self.holders.pop(i)
        self.pool.free(blocks)

    @rule(data=st.data())
    @precondition(lambda self: self.pool is not None)
    def free_unheld_raises(self, data):
        unheld = sorted(set(range(self.pool.num_blocks)) - self._held())
        b = data.draw(st.sampled_from(unheld))  # the null block is always unheld
        free_before = self.pool.num_free
        with pytest.raises(ValueError):
            self.pool.free([b])
        with pytest.raises(ValueError):
            self.pool.share([b])
        assert self.pool.num_free == free_before
        assert self.pool.ref_counts[b] == 0

    @rule()
    @precondition(lambda self: self.pool is not None)
    def drain(self):
        """Take every free block: exactly the blocks nobody holds (minus the null block), then give them back."""
        got = self.pool.allocate(self.pool.num_free)
        assert set(got) == set(range(1, self.pool.num_blocks)) - self._held()
        assert self.pool.num_free == 0
        with pytest.raises(OutOfBlocksError):
            self.pool.allocate(1)
        self.pool.free(got)

    @invariant()
    def accounting(self):
        if self.pool is None:
            return
        held = self._held()
        assert BlockPool.NULL_BLOCK not in held
        assert self.pool.num_free + len(held) == self.pool.num_usable
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_counts[b] == sum(h.count(b) for h in self.holders), b
        free_by_count = sum(1 for b in range(1, self.pool.num_blocks) if self.pool.ref_counts[b] == 0)
        assert free_by_count == self.pool.num_free

    def teardown(self):
        if self.pool is None:
            return
        for h in self.holders:
            self.pool.free(h)
        assert self.pool.num_free == self.pool.num_usable
        assert all(c == 0 for c in self.pool.ref_counts)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockPoolStateMachine = PoolMachine.TestCase
