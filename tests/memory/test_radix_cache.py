"""RadixCache on a BlockPool: match (with node splits), insert, lock/unlock, LRU eviction and reset."""
from __future__ import annotations

from kvcache.memory.block_pool import BlockPool
from kvcache.memory.radix_cache import RadixCache, RadixNode

BS = 4


def make(num_blocks: int = 32) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, BS)


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def nodes(rc: RadixCache) -> list[RadixNode]:
    return list(rc._nodes())


def tree_blocks(rc: RadixCache) -> list[int]:
    return [b for n in nodes(rc) for b in n.blocks]


def cached(pool: BlockPool, rc: RadixCache, tokens: list[int], extra: tuple = ()) -> tuple[list[int], RadixNode]:
    """Insert `tokens` in fresh blocks and drop the caller's reference: the tree alone holds them."""
    blocks = pool.allocate(len(tokens) // BS)
    node, _ = rc.insert(tokens, blocks, extra)
    pool.free(blocks)
    return blocks, node


def test_insert_then_match_returns_the_same_blocks():
    pool, rc = make()
    t = toks(100, 3)
    blocks = pool.allocate(3)
    node, _ = rc.insert(t, blocks, ())
    assert node.blocks == blocks and node.tokens == tuple(t)
    assert rc.num_blocks == 3 and rc.evictable_blocks == 3
    # the tree took one pool reference on each block, next to the caller's
    assert [pool.ref_counts[b] for b in blocks] == [2, 2, 2]
    got, end = rc.match(t, ())
    assert got == blocks and end is node
    # trailing tokens that do not fill a block are ignored; longer queries stop at the cached part
    assert rc.match(t + [1, 2], ()) == (blocks, node)
    assert rc.match(t + toks(900, 2), ())[0] == blocks
    # a query that differs in its first block finds nothing and ends at the root
    got, end = rc.match([0] + t[1:], ())
    assert got == [] and end is rc.roots[()]
    assert rc.match(t[:3], ())[0] == []  # shorter than one block
    pool.free(blocks)
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]


def test_match_ending_inside_a_node_splits_it():
    pool, rc = make()
    t = toks(100, 3)
    blocks = pool.allocate(3)
    node, _ = rc.insert(t, blocks, ())
    rc.lock(node)
    root = rc.roots[()]
    got, upper = rc.match(t[:8] + [7, 7, 7, 7], ())  # two blocks match, the third differs
    assert got == blocks[:2]
    assert upper is not node and len(nodes(rc)) == 2
    assert upper.tokens == tuple(t[:8]) and upper.blocks == blocks[:2]
    assert node.tokens == tuple(t[8:]) and node.blocks == blocks[2:]
    assert node.parent is upper and upper.parent is root
    assert root.children == {tuple(t[:4]): upper}
    assert upper.children == {tuple(t[8:12]): node}
    assert upper.lock_ref == 1 and node.lock_ref == 1  # the lock is copied to the upper part
    # a split moves blocks, it neither adds nor frees any
    assert rc.num_blocks == 3 and rc.evictable_blocks == 0
    assert [pool.ref_counts[b] for b in blocks] == [2, 2, 2]
    rc.unlock(node)
    assert upper.lock_ref == 0 and node.lock_ref == 0 and rc.evictable_blocks == 3
    # the full query still walks both parts
    assert rc.match(t, ()) == (blocks, node)


def test_match_of_a_one_block_prefix_splits_at_the_first_block():
    pool, rc = make()
    t = toks(100, 3)
    blocks, node = cached(pool, rc, t)
    got, upper = rc.match(t[:4] + [0] * 8, ())
    assert got == blocks[:1] and upper.blocks == blocks[:1] and node.blocks == blocks[1:]
    assert upper.children == {tuple(t[4:8]): node}


def test_second_insert_reuses_the_cached_prefix_and_adopts_only_the_suffix():
    pool, rc = make()
    t1 = toks(100, 3)
    b1 = pool.allocate(3)
    n1, _ = rc.insert(t1, b1, ())
    t2 = t1[:8] + toks(500, 2)
    b2 = pool.allocate(4)  # the caller computed the shared part again in its own blocks
    n2, path = rc.insert(t2, b2, ())
    assert n2.blocks == b2[2:] and n2.tokens == tuple(t2[8:])
    assert path == b1[:2] + b2[2:]  # the tree's blocks for the whole prefix: the caller swaps its duplicates
    assert rc.num_blocks == 5 and rc.evictable_blocks == 5
    # the duplicates of the cached part are not taken; the new suffix is, with a pool reference
    assert [pool.ref_counts[b] for b in b2] == [1, 1, 2, 2]
    assert [pool.ref_counts[b] for b in b1] == [2, 2, 2]
    assert sorted(tree_blocks(rc)) == sorted(b1 + b2[2:])
    upper = n2.parent
    assert upper.blocks == b1[:2] and n1.parent is upper
    assert set(upper.children) == {tuple(t1[8:12]), tuple(t2[8:12])}
    assert rc.match(t2, ()) == (b1[:2] + b2[2:], n2)
    assert rc.match(t1, ()) == (b1, n1)
    # inserting something entirely cached adopts nothing and returns the existing node
    b3 = pool.allocate(2)
    assert rc.insert(t1[:8], b3, ()) == (upper, b1[:2])
    assert [pool.ref_counts[b] for b in b3] == [1, 1] and rc.num_blocks == 5


def test_lock_and_unlock_adjust_evictable_blocks_along_the_whole_path():
    pool, rc = make()
    t1 = toks(100, 3)
    _, n1 = cached(pool, rc, t1)
    _, n2 = cached(pool, rc, t1[:8] + toks(500, 2))  # upper(2) -> n1(1), n2(2)
    upper = n2.parent
    assert rc.evictable_blocks == 5
    assert rc.locked_blocks_on_path(n2) == 4
    rc.lock(n2)
    assert rc.evictable_blocks == 1  # only n1 is unlocked
    assert (upper.lock_ref, n2.lock_ref, n1.lock_ref) == (1, 1, 0)
    assert rc.locked_blocks_on_path(n2) == 0 and rc.locked_blocks_on_path(n1) == 1
    rc.lock(n1)  # the shared upper part is already out of the evictable set
    assert rc.evictable_blocks == 0 and upper.lock_ref == 2
    rc.lock(n1)
    assert rc.evictable_blocks == 0 and n1.lock_ref == 2 and upper.lock_ref == 3
    rc.unlock(n2)
    assert rc.evictable_blocks == 2 and upper.lock_ref == 2
    rc.unlock(n1)
    assert rc.evictable_blocks == 2
    rc.unlock(n1)
    assert rc.evictable_blocks == 5
    assert all(n.lock_ref == 0 for n in nodes(rc))
    assert rc.roots[()].lock_ref == 1  # roots are never unlocked by a path


def test_evict_frees_least_recently_used_unlocked_leaves_first():
    pool, rc = make()
    ba, na = cached(pool, rc, toks(100, 2))
    bb, nb = cached(pool, rc, toks(200, 1))
    bc, nc = cached(pool, rc, toks(300, 3))
    free_before = pool.num_free
    assert all(pool.ref_counts[b] == 1 for b in ba + bb + bc)
    rc.match(toks(100, 2), ())  # A is used again: B is now the oldest, then C
    assert rc.evict(1) == 1
    assert rc.match(toks(200, 1), ())[0] == []
    assert [pool.ref_counts[b] for b in bb] == [0] and bb[0] in pool._free
    assert pool.num_free == free_before + 1
    assert rc.num_blocks == 5 and rc.evictable_blocks == 5 and rc.num_evictions == 1
    # a whole leaf goes at once, even when fewer blocks are asked for
    assert rc.evict(1) == 3
    assert rc.match(toks(300, 3), ())[0] == []
    assert all(pool.ref_counts[b] == 0 and b in pool._free for b in bc)
    assert rc.match(toks(100, 2), ())[0] == ba
    assert rc.num_blocks == 2 and rc.num_evictions == 4
    # evicted blocks went to the back of the free list, in eviction order
    assert list(pool._free)[-4:] == bb + bc


def test_evict_skips_locked_nodes_and_cascades_to_parents_that_become_leaves():
    pool, rc = make()
    t1 = toks(100, 3)
    _, n1 = cached(pool, rc, t1)
    b2, n2 = cached(pool, rc, t1[:8] + toks(500, 2))
    upper = n2.parent
    _, n3 = cached(pool, rc, toks(300, 1))
    rc.lock(n3)
    assert rc.evictable_blocks == 5
    freed = rc.evict(100)
    assert freed == 5  # n1, n2, then upper once it is a leaf; never the locked n3
    assert rc.num_blocks == 1 and rc.evictable_blocks == 0 and rc.num_evictions == 5
    assert nodes(rc) == [n3]
    assert rc.roots[()].children == {tuple(toks(300, 1)[:4]): n3}
    assert all(pool.ref_counts[b] == 0 for b in upper.blocks + n1.blocks + b2)
    assert pool.num_free == pool.num_usable - 1
    assert rc.evict(100) == 0
    rc.unlock(n3)
    assert rc.evict(1) == 1 and rc.num_blocks == 0 and pool.num_free == pool.num_usable


def test_evict_keeps_a_locked_leafs_ancestors():
    pool, rc = make()
    t1 = toks(100, 3)
    _, n1 = cached(pool, rc, t1)
    _, n2 = cached(pool, rc, t1[:8] + toks(500, 2))
    upper = n2.parent
    rc.lock(n1)
    assert rc.evict(100) == 2  # only n2: upper is locked through n1 and still has a child
    assert nodes(rc) and set(nodes(rc)) == {upper, n1}
    assert rc.match(t1, ()) == (upper.blocks + n1.blocks, n1)


def test_evict_with_everything_locked_frees_nothing():
    pool, rc = make()
    _, na = cached(pool, rc, toks(100, 2))
    _, nb = cached(pool, rc, toks(200, 1))
    rc.lock(na)
    rc.lock(nb)
    free_before = pool.num_free
    assert rc.evict(3) == 0
    assert rc.reset() == 0
    assert rc.num_blocks == 3 and pool.num_free == free_before and rc.num_evictions == 0


def test_reset_frees_every_unlocked_node():
    pool, rc = make()
    t1 = toks(100, 3)
    _, n1 = cached(pool, rc, t1)
    cached(pool, rc, t1[:8] + toks(500, 2))
    _, n3 = cached(pool, rc, toks(300, 1))
    _, n4 = cached(pool, rc, toks(400, 2), extra=("salt",))
    rc.lock(n3)
    assert rc.reset() == 7
    assert rc.num_blocks == 1 and nodes(rc) == [n3]
    rc.unlock(n3)
    assert rc.reset() == 1
    assert rc.num_blocks == 0 and rc.evictable_blocks == 0
    assert pool.num_free == pool.num_usable and all(c == 0 for c in pool.ref_counts)


def test_different_extra_keys_get_different_roots():
    pool, rc = make()
    t = toks(100, 2)
    ba, na = cached(pool, rc, t, extra=("tenant-a",))
    assert rc.match(t, ("tenant-b",))[0] == []
    assert rc.match(t, ())[0] == []
    bb, nb = cached(pool, rc, t, extra=("tenant-b",))
    assert set(ba).isdisjoint(bb)
    assert rc.roots[("tenant-a",)] is not rc.roots[("tenant-b",)]
    assert rc.match(t, ("tenant-a",)) == (ba, na)
    assert rc.match(t, ("tenant-b",)) == (bb, nb)
    assert na.parent is rc.roots[("tenant-a",)] and nb.parent is rc.roots[("tenant-b",)]
    assert rc.num_blocks == 4
