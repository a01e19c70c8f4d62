"""The recurrent state's slots (memory/state_slots.py) and snapshots (memory/state_snapshots.py), and the block
manager handing them out with a sequence's blocks."""
import pytest

from kvcache.memory.block_pool import OutOfBlocksError
from kvcache.memory.kv_cache_manager import KVCacheManager
from kvcache.memory.state_slots import OutOfStateSlotsError, StateSlots
from kvcache.memory.state_snapshots import StateSnapshots


def test_slots_are_taken_and_given_back_with_the_blocks_and_copied_on_a_fork():
    slots = StateSlots(2)
    kv = KVCacheManager(16, 4, states=slots)
    assert kv.allocate(1, 5) and kv.allocate(2, 3)
    assert slots.num_free == 0 and {slots.slot_of[1], slots.slot_of[2]} == {0, 1}
    assert not kv.allocate(3, 4) and 3 not in kv.block_tables  # no slot: no blocks either, nothing changed
    with pytest.raises(OutOfBlocksError):  # a fork without a free slot fails as one without blocks does
        kv.fork(1, 3, 5)
    assert 3 not in kv.block_tables and slots.take_copies() == []
    kv.free(2)
    kv.fork(1, 3, 5)
    assert slots.take_copies() == [(slots.slot_of[1], slots.slot_of[3])] and slots.take_copies() == []
    kv.free(1), kv.free(3)
    assert slots.num_free == 2 and not slots.slot_of


def test_a_freed_slot_drops_the_copies_queued_into_it():
    slots = StateSlots(3)
    slots.allocate(1)
    slots.fork(1, 2)
    slots.free(2)
    assert slots.take_copies() == []
    full = StateSlots(1)
    full.allocate(0)
    with pytest.raises(OutOfStateSlotsError, match="all 1 state slots are held"):
        full.allocate(9)
    assert full.slot_of == {0: 0}


def test_snapshots_are_least_recently_used_out_first():
    snaps = StateSnapshots([5, 6], interval=16)
    a, b, c = (1, None, (1,)), (2, 1, (2,)), (3, 2, (3,))
    assert snaps.reserve(a) == 5 and snaps.reserve(b) == 6
    assert snaps.find(a) == 5  # a is now the most recently used
    assert snaps.reserve(c) == 6 and snaps.find(b) is None  # b goes
    assert snaps.reserve(a) == 5 and snaps.stats.saved == 3 and snaps.stats.evicted == 1  # rewritten in place
    assert snaps.clear() == 2 and len(snaps) == 0 and snaps.num_slots == 2


def test_a_prefix_cache_of_recurrent_sequences_needs_snapshots():
    with pytest.raises(ValueError, match="needs the hash prefix cache and snapshots"):
        KVCacheManager(16, 4, "hash", states=StateSlots(2))
    with pytest.raises(ValueError, match="needs the hash prefix cache and snapshots"):
        KVCacheManager(16, 4, "radix", states=StateSlots(2), snapshots=StateSnapshots([2], 4))


def test_a_cached_prefix_is_found_only_as_deep_as_a_snapshot_of_it():
    slots, snaps = StateSlots(2), StateSnapshots([2, 3], interval=8)
    kv = KVCacheManager(32, 4, "hash", states=slots, snapshots=snaps)
    tokens = list(range(100, 120))  # 5 blocks of 4
    assert kv.allocate(1, 20)
    kv.cache_blocks(1, tokens, 20)
    assert kv.find_prefix(2, tokens + [1]) == []  # blocks cached, but no snapshot: nothing
    snaps.reserve(kv.snapshot_key(1, tokens, (), 8))
    assert len(kv.find_prefix(2, tokens + [1])) == 2  # 8 tokens: the snapshot's boundary
    snaps.reserve(kv.snapshot_key(1, tokens, (), 16))
    prefix = kv.find_prefix(2, tokens + [1])
    assert len(prefix) == 4
    assert kv.allocate(2, 21, prefix)
    assert slots.take_copies() == [(snaps.find(kv.snapshot_key(1, tokens, (), 16)), slots.slot_of[2])]
    assert snaps.stats.hits == 1
    other = tokens[:15] + [999] + tokens[16:]  # the same hash chain cannot hold another block's tokens
    assert len(kv.find_prefix(3, other + [1])) == 2
