"""KVCacheManager: block tables that grow, fork with copy-on-write of a partial block, and free."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.memory.block_pool import BlockPool, OutOfBlocksError
from kvcache.memory.kv_cache_manager import KVCacheManager, blocks_for


@pytest.mark.parametrize("tokens,bs,want", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3),
                                            (7, 1, 7), (16, 16, 1), (17, 16, 2)])
def test_blocks_for(tokens, bs, want):
    assert blocks_for(tokens, bs) == want


def test_allocate_grows_block_by_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.num_free_blocks == 9
    assert kv.allocate(7, 1)
    assert len(kv.block_tables[7]) == 1 and kv.num_free_blocks == 8
    for n in (2, 3, 4):
        assert kv.allocate(7, n)
        assert len(kv.block_tables[7]) == 1 and kv.num_free_blocks == 8
    first = list(kv.block_tables[7])
    assert kv.allocate(7, 5)
    assert len(kv.block_tables[7]) == 2 and kv.block_tables[7][:1] == first
    assert kv.allocate(7, 13)  # 4 blocks: two more at once
    table = kv.block_tables[7]
    assert len(table) == 4 and kv.num_free_blocks == 5
    assert len(set(table)) == 4 and BlockPool.NULL_BLOCK not in table
    assert all(kv.pool.ref_counts[b] == 1 for b in table)
    # asking for fewer tokens than covered changes nothing
    assert kv.allocate(7, 3)
    assert kv.block_tables[7] == table and kv.num_free_blocks == 5


def test_blocks_needed():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.blocks_needed(1, 9) == 3
    kv.allocate(1, 5)
    assert kv.blocks_needed(1, 9) == 1
    assert kv.blocks_needed(1, 8) == 0
    assert kv.blocks_needed(1, 2) == 0


def test_allocate_short_returns_false_without_side_effects():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable
    assert kv.allocate(1, 8)
    table = list(kv.block_tables[1])
    counts = list(kv.pool.ref_counts)
    assert not kv.allocate(1, 17)  # needs 3 more, 2 free
    assert kv.block_tables[1] == table
    assert kv.pool.ref_counts == counts and kv.num_free_blocks == 2
    assert not kv.allocate(2, 9)  # a new sequence: needs 3
    assert 2 not in kv.block_tables
    assert kv.pool.ref_counts == counts and kv.num_free_blocks == 2
    # exactly what is free still fits
    assert kv.allocate(2, 8)
    assert kv.num_free_blocks == 0
    assert not kv.allocate(1, 9)
    assert kv.block_tables[1] == table


def test_fork_shares_full_blocks_and_copies_partial_last_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate(1, 10)  # blocks: full, full, partial (2 of 4 tokens)
    p = list(kv.block_tables[1])
    free_before = kv.num_free_blocks
    copy = kv.fork(1, 2, 10)
    child = kv.block_tables[2]
    assert child[:2] == p[:2]
    assert len(child) == 3 and child[2] not in p and child[2] != BlockPool.NULL_BLOCK
    assert copy == [(p[2], child[2])]
    assert kv.pool.ref_counts[p[0]] == 2 and kv.pool.ref_counts[p[1]] == 2
    assert kv.pool.ref_counts[p[2]] == 1 and kv.pool.ref_counts[child[2]] == 1
    assert kv.num_free_blocks == free_before - 1
    assert kv.block_tables[1] == p  # parent untouched


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate(1, 8)
    p = list(kv.block_tables[1])
    free_before = kv.num_free_blocks
    assert kv.fork(1, 2, 8) == []
    assert kv.block_tables[2] == p
    assert all(kv.pool.ref_counts[b] == 2 for b in p)
    assert kv.num_free_blocks == free_before


def test_fork_of_a_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    kv.allocate(1, 12)
    p = list(kv.block_tables[1])
    copy = kv.fork(1, 2, 5)  # one full block shared, the second block (1 token used) copied
    child = kv.block_tables[2]
    assert child[0] == p[0] and len(child) == 2
    assert copy == [(p[1], child[1])]
    assert [kv.pool.ref_counts[b] for b in p] == [2, 1, 1]


def test_fork_many_children():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    kv.allocate(0, 6)
    p = list(kv.block_tables[0])
    copies = [kv.fork(0, c, 6) for c in (1, 2, 3)]
    assert kv.pool.ref_counts[p[0]] == 4
    dsts = [c[0][1] for c in copies]
    assert all(c[0][0] == p[1] for c in copies) and len(set(dsts)) == 3
    for s in (0, 1, 2, 3):
        kv.free(s)
    assert kv.num_free_blocks == 19
    assert all(c == 0 for c in kv.pool.ref_counts)


def test_fork_without_a_free_block_raises_and_rolls_back():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable
    kv.allocate(1, 10)  # all 3
    counts = list(kv.pool.ref_counts)
    with pytest.raises(OutOfBlocksError):
        kv.fork(1, 2, 10)
    assert kv.pool.ref_counts == counts
    assert 2 not in kv.block_tables
    assert kv.num_free_blocks == 0
    # a block-aligned fork needs no new block and still works
    assert kv.fork(1, 3, 8) == []


def test_free_returns_everything():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    kv.allocate(1, 10)
    kv.allocate(2, 3)
    kv.fork(1, 3, 10)
    kv.free(1)
    # the shared blocks are still held by the child
    shared = kv.block_tables[3][:2]
    assert all(kv.pool.ref_counts[b] == 1 for b in shared)
    kv.free(3)
    kv.free(2)
    assert kv.num_free_blocks == 11
    assert kv.block_tables == {}
    assert all(c == 0 for c in kv.pool.ref_counts)
    kv.free(99)  # unknown sequence: no-op
    kv.free(1)  # already freed: no-op
    assert kv.num_free_blocks == 11


def test_free_then_reallocate_reuses_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    assert kv.allocate(1, 8)
    old = set(kv.block_tables[1])
    assert not kv.allocate(2, 1)
    kv.free(1)
    assert kv.allocate(2, 8)
    assert set(kv.block_tables[2]) == old


# ---- random sequences of allocate / fork / free -------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 7), st.integers(1, 12)),
        st.tuples(st.just("fork"), st.integers(0, 7), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7), st.integers(0, 0)),
        st.tuples(st.just("release"), st.integers(0, 7), st.integers(0, 60)),  # a sliding window's leading blocks
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 4, 8]), ops=ops)
def test_random_operations_keep_accounting(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    tokens: dict[int, int] = {}  # model: tokens each live sequence covers

    def check():
        tables = kv.block_tables
        assert set(tables) == set(tokens)
        null = BlockPool.NULL_BLOCK
        for s, t in tables.items():
            assert len(t) == blocks_for(tokens[s], block_size), (s, t, tokens[s])
            r = kv.num_released(s)  # released entries are the leading ones, and only they are null
            assert t[:r] == [null] * r and null not in t[r:]
            assert len(set(t[r:])) == len(t) - r
        for b in range(1, num_blocks):
            holders = sum(b in t for t in tables.values())
            assert kv.pool.ref_counts[b] == holders, b
        assert kv.pool.ref_counts[null] == 0
        held = {b for t in tables.values() for b in t} - {null}
        assert kv.num_free_blocks + len(held) == num_blocks - 1

    for op, a, b in ops:
        if op == "alloc":
            # grow a live sequence or start a new one
            target = tokens.get(a, 0) + b
            need = kv.blocks_needed(a, target)
            free_before = kv.num_free_blocks
            before = list(kv.block_tables.get(a, []))
            ok = kv.allocate(a, target)
            assert ok == (need <= free_before)
            if ok:
                tokens[a] = target
                assert kv.block_tables[a][:len(before)] == before
                assert kv.num_free_blocks == free_before - need
            else:
                assert kv.block_tables.get(a, []) == before or a not in kv.block_tables
                assert (a in kv.block_tables) == (a in tokens)
                assert kv.num_free_blocks == free_before
        elif op == "fork":
            if a not in tokens or b in tokens:
                continue
            n = tokens[a]
            free_before = kv.num_free_blocks
            partial = n % block_size != 0
            if partial and free_before == 0:
                with pytest.raises(OutOfBlocksError):
                    kv.fork(a, b, n)
                assert kv.num_free_blocks == 0
            else:
                copy = kv.fork(a, b, n)
                tokens[b] = n
                parent, child = kv.block_tables[a], kv.block_tables[b]
                n_full = n // block_size
                assert child[:n_full] == parent[:n_full]
                if partial:
                    assert copy == [(parent[n_full], child[n_full])]
                    assert kv.num_free_blocks == free_before - 1
                else:
                    assert copy == []
                    assert kv.num_free_blocks == free_before
        elif op == "release":
            if a not in tokens:
                continue
            before = list(kv.block_tables[a])
            end = min(b // block_size, len(before))
            freed = kv.release_leading(a, b)
            table = kv.block_tables[a]
            assert len(table) == len(before) and table[end:] == before[end:]
            assert table[:end] == [BlockPool.NULL_BLOCK] * end
            assert freed == [x for x in before[:end] if x != BlockPool.NULL_BLOCK]
        else:
            kv.free(a)
            tokens.pop(a, None)
        check()

    for s in list(tokens):
        kv.free(s)
    assert kv.block_tables == {}
    assert kv.num_free_blocks == num_blocks - 1
    assert all(c == 0 for c in kv.pool.ref_counts)


def test_private_blocks_come_from_the_pool_and_go_back():
    """seq_blocks private scratch blocks (the KIVI key residual) are taken with a sequence's first
    blocks, counted in blocks_needed, copied on fork and freed with the table."""
    kv = KVCacheManager(num_blocks=12, block_size=4, seq_blocks=2)  # 11 usable
    assert kv.blocks_needed(1, 5) == 2 + 2
    assert kv.allocate(1, 5)
    private = kv.private_blocks[1]
    assert len(private) == 2 and not set(private) & set(kv.block_tables[1])
    assert kv.num_free_blocks == 11 - 4
    assert kv.blocks_needed(1, 9) == 1  # growing needs no more private blocks
    copies = kv.fork(1, 2, 5)  # the partial block and both private blocks are copied
    assert [src for src, _ in copies] == [kv.block_tables[1][1]] + private
    assert [dst for _, dst in copies] == kv.block_tables[2][1:] + kv.private_blocks[2]
    assert kv.num_free_blocks == 11 - 7
    assert not kv.allocate(3, 20)  # 5 + 2 needed, 4 free: refused, nothing taken
    assert 3 not in kv.private_blocks and kv.num_free_blocks == 4
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 11 and not kv.private_blocks
    assert all(c == 0 for c in kv.pool.ref_counts)


def test_fork_refused_when_private_copies_do_not_fit():
    kv = KVCacheManager(num_blocks=6, block_size=4, seq_blocks=2)  # 5 usable
    kv.allocate(1, 8)  # 2 blocks + 2 private
    with pytest.raises(OutOfBlocksError):
        kv.fork(1, 2, 8)  # block-aligned, but 2 private copies need 2 blocks; 1 free
    assert 2 not in kv.block_tables and 2 not in kv.private_blocks and kv.num_free_blocks == 1


@pytest.mark.parametrize("mode", ["hash", "radix"])
def test_private_blocks_never_take_the_prefix_being_reused(mode):
    """The cached prefix a sequence starts from sits at the head of the free list (freed first); its private
    blocks must come from elsewhere, not evict it (they were once taken before the prefix and did)."""
    kv = KVCacheManager(num_blocks=9, block_size=4, prefix_caching=mode, seq_blocks=2)  # 8 usable
    tokens = list(range(9))
    assert kv.allocate(1, 9)  # 3 blocks + 2 private
    assert kv.allocate(2, 4)  # 1 block + 2 private: all 8
    kv.cache_blocks(1, tokens, 9)
    kv.free(1)  # free list: its private blocks, its partial block, then its 2 cached blocks
    assert kv.allocate(4, 4)  # 1 block + 2 private: takes the private and partial ones
    kv.free(2)  # now the cached blocks head the free list
    prefix = kv.find_prefix(3, tokens)
    assert len(prefix) == 2
    assert kv.allocate(3, 9, prefix)
    assert kv.block_tables[3][:2] == prefix
    assert not set(kv.private_blocks[3]) & set(kv.block_tables[3])
    assert all(kv.pool.ref_counts[b] == (2 if mode == "radix" else 1) for b in prefix)
    assert kv.pool.keys[prefix[0]] is not None or mode == "radix"


def test_release_leading_gives_back_registered_blocks_only_and_keeps_them_findable():
    """Hash mode: a block goes back once registered (its successor's key names it); freed, it stays a prefix hit."""
    kv = KVCacheManager(16, 4, "hash")
    ids = list(range(100, 120))  # 5 full blocks
    assert kv.allocate(0, 20)
    table = list(kv.block_tables[0])
    assert kv.release_leading(0, 12) == []  # nothing registered yet
    kv.cache_blocks(0, ids, 8)  # 2 blocks registered
    free = kv.num_free_blocks
    assert kv.release_leading(0, 12) == table[:2]  # 3 blocks are behind the window, 2 registered
    assert kv.block_tables[0][:3] == [BlockPool.NULL_BLOCK, BlockPool.NULL_BLOCK, table[2]]
    assert kv.num_free_blocks == free + 2 and kv.num_released(0) == 2
    kv.cache_blocks(0, ids, 20)  # registering the rest after the release: parents are the cached blocks' keys
    assert kv.release_leading(0, 16) == table[2:4]
    assert kv.find_prefix(1, ids + [7]) == table[:5]  # the whole chain is still findable
    child = kv.fork(0, 2, 20)
    assert child == [] and kv.block_tables[2][:4] == [BlockPool.NULL_BLOCK] * 4 and kv.num_released(2) == 4
    kv.free(0)
    kv.free(2)
    assert all(c == 0 for c in kv.pool.ref_counts) and kv.num_free_blocks == 15


def test_release_leading_is_refused_with_the_radix_tree():
    kv = KVCacheManager(8, 4, "radix")
    assert kv.allocate(0, 8)
    with pytest.raises(ValueError, match="radix"):
        kv.release_leading(0, 8)
