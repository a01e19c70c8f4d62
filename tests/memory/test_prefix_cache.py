"""Prefix caching: cached blocks in the pool (LRU free list, eviction) and in KVCacheManager, by hash
chain and by radix tree."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.memory.block_hash import ROOT_HASH, BlockKey, block_hash, chain_hashes
from kvcache.memory.block_pool import BlockPool, OutOfBlocksError
from kvcache.memory.kv_cache_manager import KVCacheManager

BS = 4
MODES = ["hash", "radix"]


def key_for(tokens: list[int], i: int = 0, extra: tuple = (), parent=None) -> BlockKey:
    """The key of block `i` of `tokens` as the manager would build it."""
    return BlockKey(chain_hashes(tokens, BS, extra, [])[i], tuple(tokens[i * BS:(i + 1) * BS]), extra, parent)


def tree_blocks(kv: KVCacheManager) -> list[int]:
    return [b for n in kv.radix._nodes() for b in n.blocks] if kv.radix else []


def run_and_cache(kv: KVCacheManager, seq: int, tokens: list[int], extra: tuple = ()) -> list[int]:
    """Admit `seq` (taking whatever prefix is cached), compute all its tokens and register its full blocks."""
    prefix = kv.find_prefix(seq, tokens, extra)
    assert kv.allocate(seq, len(tokens), prefix)
    kv.cache_blocks(seq, tokens, len(tokens), extra)
    return list(kv.block_tables[seq])


def assert_no_leak(kv: KVCacheManager) -> None:
    """No sequence is left: every block is free, or (radix) held once by the tree and unlocked."""
    assert kv.block_tables == {}
    in_tree = tree_blocks(kv)
    assert len(set(in_tree)) == len(in_tree)
    for b in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[b] == (1 if b in in_tree else 0), b
    assert kv.pool.num_free == kv.pool.num_usable - len(in_tree)
    assert kv.num_free_blocks == kv.pool.num_usable
    if kv.radix:
        assert all(n.lock_ref == 0 for n in kv.radix._nodes())
        assert kv.radix.evictable_blocks == kv.radix.num_blocks == len(in_tree)


# ---- the pool ----------------------------------------------------------------------------------

def test_freed_cached_block_stays_findable_until_it_is_handed_out_again():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    b = blocks[0]
    key = key_for(list(range(10, 14)))
    assert pool.cache(b, key)
    assert pool.num_cached == 1 and pool.keys[b] == key
    pool.free(blocks[1:])
    pool.free([b])  # last holder gone
    assert pool.ref_counts[b] == 0 and pool.num_free == 3
    assert pool.lookup(key.hash) == b and pool.keys[b] == key  # still findable while idle
    gen = pool.generation[b]
    # a prefix hit takes it back out of the free list
    pool.touch([b])
    assert pool.ref_counts[b] == 1 and pool.num_free == 2 and b not in pool._free
    assert pool.generation[b] == gen and pool.num_evictions == 0
    pool.touch([b])  # a second holder of a held cached block
    assert pool.ref_counts[b] == 2 and pool.num_free == 2
    pool.free([b, b])
    assert pool.num_free == 3 and pool.lookup(key.hash) == b
    # drain the blocks freed before b: b is now the LRU front, and handing it out evicts it
    assert pool.allocate(2) == blocks[1:]
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [b]
    assert pool.lookup(key.hash) is None and pool.keys[b] is None
    assert pool.num_evictions == 1 and pool.num_cached == 0
    assert pool.generation[b] == gen + 1


def test_touch_refuses_uncached_blocks():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, key_for([1, 2, 3, 4]))
    pool.free([a, b])
    free_before, counts = pool.num_free, list(pool.ref_counts)
    with pytest.raises(ValueError):
        pool.touch([a, b])
    assert pool.num_free == free_before and pool.ref_counts == counts


def test_free_list_is_lru_and_fresh_blocks_go_before_idle_cached_ones():
    pool = BlockPool(7)
    held = pool.allocate(3)  # 1, 2, 3
    assert held == [1, 2, 3]
    for i, b in enumerate(held):
        assert pool.cache(b, key_for(list(range(10 * i, 10 * i + 4))))
    pool.free([3])
    pool.free([1])
    pool.free([2])
    assert list(pool._free) == [4, 5, 6, 3, 1, 2]
    # never-used blocks first: no cached block is evicted while fresh ones remain
    assert pool.allocate(3) == [4, 5, 6]
    assert pool.num_evictions == 0 and pool.num_cached == 3
    # then idle cached blocks, first freed first
    assert pool.allocate(1) == [3]
    assert pool.num_evictions == 1 and pool.keys[3] is None and pool.keys[1] is not None
    assert pool.allocate(2) == [1, 2]
    assert pool.num_evictions == 3 and pool.num_cached == 0
    # a block freed again goes to the back
    pool.free([5, 4, 6])
    assert list(pool._free) == [5, 4, 6]


def test_cache_refuses_a_duplicate_hash_and_an_unheld_block():
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    key = key_for([1, 2, 3, 4])
    assert pool.cache(a, key)
    # another block under the same hash: refused, nothing changes
    dup = BlockKey(key.hash, (9, 9, 9, 9), (), None)
    assert pool.cache(b, dup) is False
    assert pool.keys[b] is None and pool.lookup(key.hash) == a and pool.keys[a] == key
    assert pool.num_cached == 1
    # a block nobody holds cannot be cached
    free_block = next(iter(pool._free))
    with pytest.raises(ValueError):
        pool.cache(free_block, key_for([5, 6, 7, 8]))
    assert pool.keys[free_block] is None and pool.num_cached == 1
    # nor can a block be cached twice
    with pytest.raises(ValueError):
        pool.cache(a, key_for([5, 6, 7, 8]))
    assert pool.keys[a] == key


def test_clear_cache_forgets_every_key():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    keys = [key_for(list(range(10 * i, 10 * i + 4))) for i in range(3)]
    for b, k in zip(blocks, keys):
        pool.cache(b, k)
    pool.free(blocks[:2])  # two idle, one held
    free_before = list(pool._free)
    assert pool.clear_cache() == 3
    assert pool.num_cached == 0 and pool.keys == [None] * 6
    assert all(pool.lookup(k.hash) is None for k in keys)
    assert list(pool._free) == free_before and pool.ref_counts[blocks[2]] == 1  # blocks stay put
    pool.allocate(pool.num_free)
    assert pool.num_evictions == 0  # forgotten keys are not evictions
    assert pool.clear_cache() == 0


# ---- the manager, both modes -------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_second_sequence_shares_the_cached_prefix(mode):
    kv = KVCacheManager(40, BS, mode)
    a = list(range(100, 150))  # 50 tokens: 12 full blocks and a partial one
    assert kv.find_prefix(1, a) == []
    ta = run_and_cache(kv, 1, a)
    assert len(ta) == 13 and kv.num_cached_blocks == 12
    b = a[:40] + list(range(500, 510))
    prefix = kv.find_prefix(2, b)
    assert prefix == ta[:10]
    free_before = kv.num_free_blocks
    assert kv.allocate(2, len(b), prefix)
    tb = kv.block_tables[2]
    assert len(tb) == 13 and tb[:10] == ta[:10]
    tree = 1 if mode == "radix" else 0
    assert all(kv.pool.ref_counts[x] == 2 + tree for x in ta[:10])
    new = tb[10:]
    assert len(set(new)) == 3 and set(new).isdisjoint(ta) and kv.pool.NULL_BLOCK not in new
    assert all(kv.pool.ref_counts[x] == 1 for x in new)
    assert all(kv.pool.keys[x] is None for x in new) and not set(new) & set(tree_blocks(kv))
    assert kv.num_free_blocks == free_before - 3
    kv.cache_blocks(2, b, len(b))
    assert kv.num_cached_blocks == 14  # B's two new full blocks; the shared ten are cached once
    assert kv.find_prefix(3, b + [1]) == tb[:12]
    assert kv.find_prefix(4, a + [1]) == ta[:12]
    kv.free(1)
    assert all(kv.pool.ref_counts[x] == 1 + tree for x in ta[:10])
    kv.free(2)
    assert kv.num_free_blocks == kv.pool.num_usable
    if mode == "hash":
        assert kv.pool.num_free == kv.pool.num_usable
        assert all(c == 0 for c in kv.pool.ref_counts)
    else:
        assert sorted(tree_blocks(kv)) == sorted(ta[:12] + tb[10:12])
    assert_no_leak(kv)
    # everything is still findable while idle
    assert kv.find_prefix(5, b + [1]) == tb[:12]


@pytest.mark.parametrize("mode", MODES)
def test_the_last_prompt_token_is_always_recomputed(mode):
    kv = KVCacheManager(20, BS, mode)
    t = list(range(100, 112))  # exactly 3 full blocks
    ta = run_and_cache(kv, 1, t)
    assert kv.num_cached_blocks == 3
    assert kv.find_prefix(2, t) == ta[:2]
    assert kv.find_prefix(3, t + [7]) == ta[:3]
    assert kv.find_prefix(4, t[:5]) == ta[:1]
    assert kv.find_prefix(5, t[:4]) == []
    assert kv.find_prefix(6, t[:1]) == []
    # a sequence that already has a table gets no prefix
    assert kv.find_prefix(1, t + [7]) == []


@pytest.mark.parametrize("mode", MODES)
def test_extra_keys_never_share(mode):
    kv = KVCacheManager(40, BS, mode)
    t = list(range(100, 113))
    ta = run_and_cache(kv, 1, t, ("tenant-a",))
    assert kv.find_prefix(2, t, ("tenant-b",)) == []
    assert kv.find_prefix(3, t, ()) == []
    assert kv.find_prefix(4, t, ("tenant-a",)) == ta[:3]
    tb = run_and_cache(kv, 5, t, ("tenant-b",))
    tc = run_and_cache(kv, 6, t, ())
    assert len(set(ta[:3]) | set(tb[:3]) | set(tc[:3])) == 9
    assert kv.num_cached_blocks == 9
    for sid, (extra, table) in enumerate(((("tenant-a",), ta), (("tenant-b",), tb), ((), tc)), start=10):
        assert kv.find_prefix(sid, t, extra) == table[:3]


def test_hash_collision_with_different_tokens_is_not_a_hit():
    kv = KVCacheManager(20, BS, "hash")
    b_tokens = list(range(100, 113))
    other = [7, 7, 7, 7]
    forged = BlockKey(chain_hashes(b_tokens, BS, (), [])[0], tuple(other), (), None)
    (blk,) = kv.pool.allocate(1)
    assert kv.pool.cache(blk, forged)
    assert kv.pool.lookup(forged.hash) == blk
    assert kv.find_prefix(1, b_tokens) == []  # same hash, different tokens
    # a key with the right tokens but another extra is no hit either
    kv2 = KVCacheManager(20, BS, "hash")
    (blk2,) = kv2.pool.allocate(1)
    kv2.pool.cache(blk2, BlockKey(forged.hash, tuple(b_tokens[:4]), ("salt",), None))
    assert kv2.find_prefix(1, b_tokens) == []


def test_forged_child_with_the_wrong_parent_is_not_a_hit():
    kv = KVCacheManager(20, BS, "hash")
    t = list(range(100, 113))
    first = kv.pool.allocate(1)[0]
    assert kv.pool.cache(first, key_for(t, 0))
    child = kv.pool.allocate(1)[0]
    wrong_parent = (first, kv.pool.generation[first] + 1)  # right block, wrong generation
    assert kv.pool.cache(child, key_for(t, 1, parent=wrong_parent))
    assert kv.find_prefix(1, t) == [first]
    kv3 = KVCacheManager(20, BS, "hash")
    first, other = kv3.pool.allocate(2)
    kv3.pool.cache(first, key_for(t, 0))
    child = kv3.pool.allocate(1)[0]
    kv3.pool.cache(child, key_for(t, 1, parent=(other, kv3.pool.generation[other])))  # another block
    assert kv3.find_prefix(1, t) == [first]
    # the genuine chain is found
    kv4 = KVCacheManager(20, BS, "hash")
    t4 = run_and_cache(kv4, 1, t)
    assert kv4.find_prefix(2, t) == t4[:3]
    assert kv4.pool.keys[t4[1]].parent == (t4[0], kv4.pool.generation[t4[0]])
    assert kv4.pool.keys[t4[0]].parent is None


def test_evicted_and_reallocated_parent_invalidates_its_children():
    kv = KVCacheManager(9, BS, "hash")  # 8 usable
    t = list(range(100, 113))
    ta = run_and_cache(kv, 1, t)
    a0, a1, a2 = ta[:3]
    old_gen = kv.pool.generation[a0]
    kv.free(1)
    # take the children back so that only the first block (and the partial one) can be evicted
    kv.pool.touch([a1, a2])
    rest = kv.pool.allocate(kv.pool.num_free)
    assert a0 in rest and kv.pool.lookup(key_for(t, 0).hash) is None
    kv.pool.free([a0] + [x for x in rest if x != a0])  # a0 at the front of the free list
    kv.pool.free([a1, a2])
    assert kv.pool.lookup(key_for(t, 1).hash) == a1  # the child is still cached ...
    # ... another sequence computes the first block again, in the same block id
    c = t[:4] + [1]
    assert kv.find_prefix(2, c) == []
    assert kv.allocate(2, len(c))
    assert kv.block_tables[2][0] == a0 and kv.pool.generation[a0] > old_gen
    kv.cache_blocks(2, c, len(c))
    assert kv.pool.lookup(key_for(t, 0).hash) == a0
    # ... but the old child's parent is (a0, old generation): the lookup stops after the first block
    assert kv.pool.keys[a1].parent == (a0, old_gen)
    assert kv.find_prefix(3, t) == [a0]


@pytest.mark.parametrize("mode", MODES)
def test_num_evictions_counts_cached_blocks_reused(mode):
    kv = KVCacheManager(9, BS, mode)
    run_and_cache(kv, 1, list(range(100, 113)))  # 3 cached blocks of 4
    kv.free(1)
    assert kv.num_evictions == 0
    assert kv.allocate(2, 4 * 5)  # the 5 uncached blocks: no eviction
    assert kv.num_evictions == 0
    assert kv.allocate(2, 4 * 8)  # the 3 cached ones too
    assert kv.num_evictions == 3
    kv.free(2)
    assert kv.find_prefix(3, list(range(100, 113))) == []


@pytest.mark.parametrize("mode", MODES)
def test_idle_prefix_blocks_count_as_leaving_the_free_set(mode):
    kv = KVCacheManager(9, BS, mode)  # 8 usable
    a = list(range(100, 113))
    ta = run_and_cache(kv, 1, a)  # 4 blocks, 3 of them cached
    kv.free(1)
    assert kv.num_free_blocks == 8
    assert kv.allocate(2, 16)  # X: 4 uncached blocks
    assert set(kv.block_tables[2]).isdisjoint(ta[:3])
    assert kv.num_free_blocks == 4  # 1 free + the 3 idle cached ones
    b = a[:12] + list(range(500, 512))  # 24 tokens: 6 blocks, 3 of them cached
    prefix = kv.find_prefix(3, b)
    assert prefix == ta[:3]
    assert kv.blocks_needed(3, 24, prefix) == 6  # 3 new + 3 idle that stop being free
    assert kv.blocks_needed(3, 20, prefix) == 5
    assert kv.blocks_needed(3, 16, prefix) == 4
    tables = {s: list(t) for s, t in kv.block_tables.items()}
    counts = list(kv.pool.ref_counts)
    free_list = list(kv.pool._free)
    evictable = kv.radix.evictable_blocks if kv.radix else None
    locks = [n.lock_ref for n in kv.radix._nodes()] if kv.radix else None
    for n in (24, 20):
        assert kv.allocate(3, n, prefix) is False
        assert kv.block_tables == tables and 3 not in kv.block_tables
        assert kv.pool.ref_counts == counts and list(kv.pool._free) == free_list
        assert kv.num_free_blocks == 4 and kv.pool.num_free == len(free_list)
        if kv.radix:
            assert kv.radix.evictable_blocks == evictable
            assert [n.lock_ref for n in kv.radix._nodes()] == locks
    assert kv.num_evictions == 0
    assert kv.allocate(3, 16, prefix)  # exactly fits
    assert kv.block_tables[3][:3] == ta[:3] and kv.num_free_blocks == 0
    assert kv.num_evictions == 0  # the prefix was taken, not evicted
    kv.free(2)
    kv.free(3)
    assert_no_leak(kv)


@pytest.mark.parametrize("mode", MODES)
def test_prefix_held_by_a_running_sequence_costs_nothing(mode):
    kv = KVCacheManager(20, BS, mode)
    a = list(range(100, 113))
    ta = run_and_cache(kv, 1, a)  # still running
    prefix = kv.find_prefix(2, a[:12] + [5] * 8)
    assert prefix == ta[:3]
    assert kv.blocks_needed(2, 20, prefix) == 2
    free_before = kv.num_free_blocks
    assert kv.allocate(2, 20, prefix)
    assert kv.num_free_blocks == free_before - 2


@pytest.mark.parametrize("mode", MODES)
def test_fork_after_a_prefix_hit_shares_full_blocks_and_copies_the_partial_one(mode):
    kv = KVCacheManager(30, BS, mode)
    a = list(range(100, 113))
    ta = run_and_cache(kv, 1, a)
    kv.free(1)
    b = a[:12] + [5, 6]  # 14 tokens: 3 cached blocks and a partial one
    tb = run_and_cache(kv, 2, b)
    assert tb[:3] == ta[:3]
    free_before = kv.num_free_blocks
    copy = kv.fork(2, 3, len(b))
    tc = kv.block_tables[3]
    assert tc[:3] == tb[:3] and len(tc) == 4
    assert copy == [(tb[3], tc[3])] and tc[3] not in tb and tc[3] != BlockPool.NULL_BLOCK
    tree = 1 if mode == "radix" else 0
    assert all(kv.pool.ref_counts[x] == 2 + tree for x in tb[:3])
    assert kv.pool.ref_counts[tb[3]] == 1 and kv.pool.ref_counts[tc[3]] == 1
    assert kv.num_free_blocks == free_before - 1
    # a block-aligned fork copies nothing
    assert kv.fork(2, 4, 12) == [] and kv.block_tables[4] == tb[:3]
    # the child grows and caches on its own
    c = b + [8, 8]
    assert kv.allocate(3, len(c))
    kv.cache_blocks(3, c, len(c))
    assert kv.find_prefix(9, c + [0]) == tc[:4]
    assert kv.find_prefix(10, b[:12] + [0]) == ta[:3]
    for s in (2, 3, 4):
        kv.free(s)
    assert_no_leak(kv)


@pytest.mark.parametrize("mode", MODES)
def test_fork_of_less_than_a_block_after_caching_leaks_nothing(mode):
    """fork(parent, child, n) with n < block_size from a parent whose blocks are cached: the child
    shares no full block, so after both are freed every cached block must be evictable again."""
    kv = KVCacheManager(20, BS, mode)
    t = list(range(100, 113))
    run_and_cache(kv, 1, t)
    copy = kv.fork(1, 2, 2)
    assert copy and len(kv.block_tables[2]) == 1
    kv.free(1)
    kv.free(2)
    assert_no_leak(kv)
    assert kv.reset_prefix_cache() == 3
    assert kv.pool.num_free == kv.pool.num_usable


def test_forked_child_that_diverges_caches_its_own_blocks_under_its_own_hashes():
    """A child forked at 8 tokens from a parent whose token list (and memoized hashes) runs further
    caches its later blocks; a prompt equal to the child's tokens must then find them."""
    kv = KVCacheManager(20, BS, "hash")
    t = list(range(100, 120))  # 20 tokens known, 8 computed
    assert kv.allocate(1, len(t))
    kv.cache_blocks(1, t, 8)
    kv.fork(1, 2, 8)
    c = t[:8] + [99] * 12
    assert kv.allocate(2, len(c))
    kv.cache_blocks(2, c, len(c))
    tc = kv.block_tables[2]
    assert all(kv.pool.keys[b] is not None for b in tc)
    # each cached key's hash is the chain hash of the tokens it holds
    assert [kv.pool.keys[b].hash for b in tc] == chain_hashes(c, BS, (), [])
    assert kv.find_prefix(3, c + [1]) == tc


@pytest.mark.parametrize("mode", MODES)
def test_reset_prefix_cache(mode):
    kv = KVCacheManager(20, BS, mode)
    t = list(range(100, 113))
    run_and_cache(kv, 1, t)
    with pytest.raises(RuntimeError, match="1 sequences"):
        kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 3
    assert kv.allocate(2, 3)
    with pytest.raises(RuntimeError, match="2 sequences"):
        kv.reset_prefix_cache()
    kv.free(1)
    kv.free(2)
    assert len(kv.find_prefix(3, t)) == 3  # idle cached blocks are still findable before the reset
    assert kv.reset_prefix_cache() == 3
    assert kv.num_cached_blocks == 0
    assert kv.find_prefix(4, t) == []
    assert kv.pool.num_free == kv.pool.num_usable and kv.num_free_blocks == kv.pool.num_usable
    assert all(c == 0 for c in kv.pool.ref_counts)
    assert all(k is None for k in kv.pool.keys)
    assert kv.reset_prefix_cache() == 0


@pytest.mark.parametrize("mode", MODES)
def test_hit_rate_stats(mode):
    kv = KVCacheManager(20, BS, mode)
    t = list(range(100, 113))
    assert kv.stats.hit_rate == 0.0
    run_and_cache(kv, 1, t)
    assert len(kv.find_prefix(2, t)) == 3
    assert kv.stats.queries == 0 and kv.stats.hits == 0  # a lookup alone counts nothing: admission does
    kv.record_lookup(len(t), 12)
    assert kv.stats.queries == 13 and kv.stats.hits == 12
    kv.record_lookup(10, 0)
    assert kv.stats.queries == 23 and kv.stats.hits == 12
    assert kv.stats.hit_rate == pytest.approx(12 / 23)


def test_no_prefix_caching_finds_nothing():
    kv = KVCacheManager(20, BS, None)
    t = list(range(100, 113))
    assert kv.allocate(1, len(t))
    kv.cache_blocks(1, t, len(t))
    assert kv.num_cached_blocks == 0
    assert kv.find_prefix(2, t) == [] and kv.stats.queries == 0


# ---- random use: both modes --------------------------------------------------------------------

VOCAB = st.integers(0, 3)
PREFIXES = [[1, 2, 3, 0] * 4, [3, 3, 1, 2, 0, 1, 2, 3, 3, 2, 1, 0, 0, 0, 1, 1], [2, 0] * 8]
EXTRAS = [(), ("salt",)]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences admitted through find_prefix + allocate, computed in chunks, grown, forked and freed.

    The model tracks each sequence's tokens and computed count, and each block's content (the token
    written at each slot), so every prefix hit can be checked against what the blocks really hold.
    """

    MODE = "hash"
    NUM_BLOCKS = 25
    SEQ_BLOCKS = 0  # private blocks per sequence (the KIVI key residual)

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS, self.MODE, seq_blocks=self.SEQ_BLOCKS)
        self.seqs: dict[int, dict] = {}  # seq id -> {"tokens", "extra", "computed"}
        self.content: dict[int, list] = {}  # block -> the token computed at each slot (None: not yet)
        self.next_id = 0

    def _snapshot(self):
        kv = self.kv
        return ({s: list(t) for s, t in kv.block_tables.items()}, list(kv.pool.ref_counts), list(kv.pool._free),
                kv.radix.evictable_blocks if kv.radix else None)

    def _fresh(self, blocks):
        for b in blocks:
            self.content[b] = [None] * BS

    @rule(p=st.integers(0, len(PREFIXES) - 1), cut=st.sampled_from([16, 13, 12, 9, 8, 5, 4, 2, 0]),
          suffix=st.lists(VOCAB, max_size=6),
          e=st.integers(0, len(EXTRAS) - 1))
    def add(self, p, cut, suffix, e):
        tokens = PREFIXES[p][:cut] + suffix
        if not tokens:
            return
        extra = EXTRAS[e]
        sid = self.next_id
        self.next_id += 1
        kv = self.kv
        prefix = kv.find_prefix(sid, tokens, extra)
        assert len(prefix) <= (len(tokens) - 1) // BS
        for i, b in enumerate(prefix):  # a hit hands out exactly the K/V of these tokens
            assert self.content[b] == tokens[i * BS:(i + 1) * BS], (b, i)
        before = self._snapshot()
        need = kv.blocks_needed(sid, len(tokens), prefix)
        free = kv.num_free_blocks
        ok = kv.allocate(sid, len(tokens), prefix)
        assert ok == (need <= free)
        if not ok:
            assert self._snapshot() == before
            return
        table = kv.block_tables[sid]
        assert table[:len(prefix)] == prefix
        assert kv.num_free_blocks == free - need
        self._fresh(table[len(prefix):])
        private = kv.private_blocks.get(sid, [])
        assert len(private) == self.SEQ_BLOCKS and not set(private) & set(table)
        self._fresh(private)  # scratch: overwritten with other data (a cached block here would be corrupted)
        self.seqs[sid] = {"tokens": tokens, "extra": extra, "computed": len(prefix) * BS}

    @rule(data=st.data(), whole=st.booleans())
    @precondition(lambda self: any(s["computed"] < len(s["tokens"]) for s in self.seqs.values()))
    def compute(self, data, whole):
        """Compute a chunk of a sequence's pending tokens (or all of them), then register its full blocks."""
        sid = data.draw(st.sampled_from(sorted(s for s, v in self.seqs.items() if v["computed"] < len(v["tokens"]))))
        s = self.seqs[sid]
        left = len(s["tokens"]) - s["computed"]
        k = left if whole else data.draw(st.integers(1, left))
        table = self.kv.block_tables[sid]
        for pos in range(s["computed"], s["computed"] + k):
            b = table[pos // BS]
            # a block being written is this sequence's alone: not shared, not cached
            assert self.kv.pool.ref_counts[b] == 1, (b, pos)
            assert self.kv.pool.keys[b] is None
            self.content[b][pos % BS] = s["tokens"][pos]
        s["computed"] += k
        self.kv.cache_blocks(sid, s["tokens"], s["computed"], s["extra"])

    @rule(data=st.data(), more=st.lists(VOCAB, min_size=1, max_size=6))
    @precondition(lambda self: self.seqs)
    def grow(self, data, more):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        n = len(s["tokens"]) + len(more)
        before = self._snapshot()
        old = len(self.kv.block_tables[sid])
        need = self.kv.blocks_needed(sid, n)
        free = self.kv.num_free_blocks
        ok = self.kv.allocate(sid, n)
        assert ok == (need <= free)
        if not ok:
            assert self._snapshot() == before
            return
        table = self.kv.block_tables[sid]
        assert table[:old] == before[0][sid]
        self._fresh(table[old:])
        s["tokens"] = s["tokens"] + more

    @rule(data=st.data())
    @precondition(lambda self: any(0 < s["computed"] == len(s["tokens"]) for s in self.seqs.values()))
    def fork(self, data):
        # as the engine does: a fully computed sequence forks at its computed length
        sid = data.draw(st.sampled_from(sorted(s for s, v in self.seqs.items()
                                               if 0 < v["computed"] == len(v["tokens"]))))
        s = self.seqs[sid]
        n = s["computed"]
        child = self.next_id
        self.next_id += 1
        before = self._snapshot()
        try:
            copy = self.kv.fork(sid, child, n)
        except OutOfBlocksError:
            assert self.kv.num_free_blocks < (1 if n % BS else 0) + self.SEQ_BLOCKS
            assert self._snapshot() == before
            return
        parent, table = self.kv.block_tables[sid], self.kv.block_tables[child]
        assert table[:n // BS] == parent[:n // BS]
        private = [(a, b) for a, b in zip(self.kv.private_blocks.get(sid, []), self.kv.private_blocks.get(child, []))]
        assert len(private) == self.SEQ_BLOCKS
        if n % BS:
            assert copy == [(parent[n // BS], table[n // BS])] + private
        else:
            assert copy == private and len(table) == n // BS
        for a, b in copy:
            self.content[b] = list(self.content[a])  # the caller copies the blocks
        self.seqs[child] = {"tokens": list(s["tokens"]), "extra": s["extra"], "computed": n}

    @rule(data=st.data())
    @precondition(lambda self: self.seqs)
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.kv.free(sid)
        del self.seqs[sid]

    @rule()
    @precondition(lambda self: not self.seqs)
    def reset(self):
        cached = self.kv.num_cached_blocks
        assert self.kv.reset_prefix_cache() == cached
        assert self.kv.num_cached_blocks == 0
        assert self.kv.pool.num_free == self.kv.pool.num_usable

    @invariant()
    def accounting(self):
        kv, pool = self.kv, self.kv.pool
        assert set(kv.block_tables) == set(self.seqs)
        in_tree = tree_blocks(kv)
        assert len(set(in_tree)) == len(in_tree), "the tree holds a block twice"
        tables = list(kv.block_tables.values())
        for t in tables:
            assert BlockPool.NULL_BLOCK not in t
        privates = [b for p in kv.private_blocks.values() for b in p]
        assert set(kv.private_blocks) <= set(kv.block_tables)
        for b in range(pool.num_blocks):
            holders = sum(t.count(b) for t in tables) + (b in in_tree) + privates.count(b)
            assert pool.ref_counts[b] == holders, (b, pool.ref_counts[b], holders)
            assert (b in pool._free) == (b != BlockPool.NULL_BLOCK and holders == 0), b
        referenced = sum(1 for b in range(pool.num_blocks) if pool.ref_counts[b] > 0)
        assert pool.num_free + referenced == pool.num_usable
        if kv.radix:
            nodes = list(kv.radix._nodes())
            assert kv.radix.num_blocks == len(in_tree)
            assert kv.radix.evictable_blocks == sum(len(n.blocks) for n in nodes if n.lock_ref == 0)
            for n in nodes:
                assert len(n.tokens) == len(n.blocks) * BS and n.blocks
                assert n.lock_ref >= sum(c.lock_ref for c in n.children.values())
                assert n.parent.children[n.tokens[:BS]] is n
                for i, b in enumerate(n.blocks):  # the tree's blocks hold the tokens of their edge
                    assert self.content[b] == list(n.tokens[i * BS:(i + 1) * BS])
        else:
            for b in range(pool.num_blocks):
                key = pool.keys[b]
                if key is None:
                    continue
                assert pool.lookup(key.hash) == b  # idle or held, a cached block is findable
                assert self.content[b] == list(key.tokens)  # and holds the tokens of its key
                # the hash chains on from the block before it (while that block still holds its key)
                if key.parent is None:
                    assert key.hash == block_hash(ROOT_HASH, key.tokens, key.extra)
                elif pool.generation[key.parent[0]] == key.parent[1] and pool.keys[key.parent[0]] is not None:
                    assert key.hash == block_hash(pool.keys[key.parent[0]].hash, key.tokens, key.extra)
            assert pool.num_cached == sum(k is not None for k in pool.keys)

    def teardown(self):
        for sid in list(self.seqs):
            self.kv.free(sid)
        self.seqs.clear()
        assert_no_leak(self.kv)


class RadixPrefixCacheMachine(PrefixCacheMachine):
    MODE = "radix"


class PrivateBlocksHashMachine(PrefixCacheMachine):
    SEQ_BLOCKS = 2
    NUM_BLOCKS = 12  # tight: private blocks come from a pool full of idle cached blocks


class PrivateBlocksRadixMachine(PrefixCacheMachine):
    MODE = "radix"
    SEQ_BLOCKS = 1
    NUM_BLOCKS = 12


TestHashPrefixCacheMachine = PrefixCacheMachine.TestCase
TestRadixPrefixCacheMachine = RadixPrefixCacheMachine.TestCase
TestPrivateBlocksHashMachine = PrivateBlocksHashMachine.TestCase
TestPrivateBlocksRadixMachine = PrivateBlocksRadixMachine.TestCase
for _machine in (PrefixCacheMachine, RadixPrefixCacheMachine):
    _machine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
for _machine in (PrivateBlocksHashMachine, PrivateBlocksRadixMachine):
    _machine.TestCase.settings = settings(max_examples=50, stateful_step_count=40, deadline=None)


# ---- duplicates and collisions ------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_the_same_blocks_computed_twice_are_merged(mode):
    """Two sequences admitted together compute the same prompt: once registered, the second drops its copies
    and reads the cached blocks, so the duplicates go back to the pool instead of being pinned."""
    kv = KVCacheManager(20, BS, mode)
    t = list(range(100, 114))  # 3 full blocks + 2
    for seq in (1, 2):
        assert kv.allocate(seq, len(t))  # no prefix yet: both compute everything
    free_before = kv.pool.num_free
    kv.cache_blocks(1, t, len(t))
    kv.cache_blocks(2, t, len(t))
    assert kv.block_tables[1][:3] == kv.block_tables[2][:3]
    assert kv.block_tables[1][3] != kv.block_tables[2][3]  # the partial blocks stay private
    assert kv.pool.num_free == free_before + 3
    assert kv.num_free_blocks == kv.pool.num_usable - 5  # 3 shared blocks and 2 private partial ones
    for seq in (1, 2):
        kv.free(seq)
    assert_no_leak(kv)


def test_hash_collision_never_hands_out_another_prompts_blocks(monkeypatch):
    """Force every first block to hash alike: a colliding sequence caches nothing, and a later prompt that
    shares the first block of one of them finds only that block, never one computed after other tokens."""
    import kvcache.memory.kv_cache_manager as manager

    def weak(token_ids, bs, extra, start):  # block 0's hash ignores its tokens
        hashes, prev = list(start), start[-1] if start else ROOT_HASH
        for i in range(len(hashes), len(token_ids) // bs):
            prev = hash((prev, "collide" if i == 0 else tuple(token_ids[i * bs:(i + 1) * bs]), extra))
            hashes.append(prev)
        return hashes

    monkeypatch.setattr(manager, "chain_hashes", weak)
    kv = KVCacheManager(20, 2, "hash")
    x, y, z = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [1, 2, 7, 8, 9]
    run_and_cache(kv, 1, x)
    y_table = run_and_cache(kv, 2, y)
    assert all(kv.pool.keys[b] is None for b in y_table)  # y collided on block 0: nothing of it is cached
    assert kv.find_prefix(3, z) == kv.block_tables[1][:1]  # x's first block, and nothing computed after y's
    assert kv.find_prefix(4, y) == []



@pytest.mark.parametrize("mode", MODES)
def test_idle_cached_blocks_are_the_cached_ones_nobody_holds(mode):
    kv = KVCacheManager(20, BS, mode)
    t = list(range(100, 114))  # 3 full blocks + 2
    run_and_cache(kv, 1, t)
    assert kv.num_cached_blocks == 3 and kv.num_idle_cached_blocks == 0  # held by sequence 1
    kv.free(1)
    assert kv.num_idle_cached_blocks == 3
    run_and_cache(kv, 2, t[:9])  # takes 2 of them back
    assert kv.num_idle_cached_blocks == 1


@pytest.mark.parametrize("algo", ["hash", "radix"])
def test_find_prefix_stops_at_max_tokens_and_never_wraps(algo):
    kv = KVCacheManager(16, 4, algo)
    tokens = list(range(100, 117))
    assert kv.allocate(0, len(tokens))
    kv.cache_blocks(0, tokens, len(tokens))
    assert len(kv.find_prefix(1, tokens)) == 4
    assert len(kv.find_prefix(1, tokens, max_tokens=9)) == 2  # whole blocks within 9 tokens
    assert kv.find_prefix(1, tokens, max_tokens=-5) == []  # a policy's limit below zero means none


def test_compaction_writes_in_place_only_blocks_held_alone_and_uncached():
    kv = KVCacheManager(12, 4, "hash")
    tokens = list(range(100, 116))
    assert kv.allocate(0, 16)
    kv.cache_blocks(0, tokens, 8)  # the first two blocks are cached
    table = list(kv.block_tables[0])
    old, new = kv.compact(0, 12)
    assert old == table and len(new) == 3
    assert new[2] == table[2] and new[0] not in table and new[1] not in table  # cached ones got fresh copies
    assert kv.pool.ref_counts[table[3]] == 0 and kv.pool.keys[table[0]] is not None  # freed; still cached
    kv.cache_blocks(0, tokens, 16)  # a compacted table no longer matches its tokens: nothing is cached
    assert kv.pool.keys[new[0]] is None
    kv.free(0)
    assert kv.num_free_blocks == kv.pool.num_usable


def test_block_keys_are_the_same_in_every_process():
    """SHA-256 chain, no per-process salt: a fresh interpreter (another PYTHONHASHSEED) computes the same keys for
    the same tokens and cache_salt, so processes sharing an offload tier find each other's blocks."""
    import subprocess
    import sys
    code = ("from kvcache.memory.block_hash import chain_hashes; "
            "print(chain_hashes(list(range(40)), 16, ('tenant-a',), []))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert runs == {f"{chain_hashes(list(range(40)), 16, ('tenant-a',), [])}\n"}
    assert chain_hashes(list(range(40)), 16, ("tenant-b",), []) != chain_hashes(list(range(40)), 16, ("tenant-a",), [])
