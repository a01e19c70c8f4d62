"""DeviceBlockTables: the device copy of the block tables stays equal to the manager's, written by diffs."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import LLM, SamplingParams
from kvcache.memory.device_tables import DeviceBlockTables, upload
from kvcache.memory.kv_cache_manager import KVCacheManager


def test_upload_is_one_tensor_of_views():
    a, b, c = upload([[1, 2], [], [3, 4, 5]], "cpu")
    assert a.tolist() == [1, 2] and b.numel() == 0 and c.tolist() == [3, 4, 5]
    assert a.dtype == torch.long and a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()


def test_growth_appends_only_new_entries():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    dev = DeviceBlockTables("cpu", rows=2, cols=2)
    for n in range(1, 41):  # one sequence decoding 40 tokens: 10 blocks, each entry written once
        assert kv.allocate(7, n)
        dev.sync(kv, [7])
        dev.check(kv, [7])
    assert dev.entries_written == 10
    assert dev.table.shape[1] >= 10  # the columns grew


def test_freed_rows_are_reused_and_zeroed():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    dev = DeviceBlockTables("cpu", rows=1, cols=4)
    kv.allocate(1, 16)
    dev.sync(kv, [1])
    row = dev.row_of[1]
    kv.free(1)
    kv.allocate(2, 5)  # a shorter table in the same row: the old tail must read as the null block
    assert dev.sync(kv, [2]) == [row]
    dev.check(kv, [2])
    assert 1 not in dev.row_of


def assert_evictable_is_free(kv: KVCacheManager) -> None:
    """What the radix tree counts as evictable, evicting frees: no sequence holds a block of an unlocked node."""
    held = {b: kv.pool.ref_counts[b] for n in kv.radix._nodes() if not n.lock_ref for b in n.blocks}
    assert all(n == 1 for n in held.values()), held
    assert kv.radix.evictable_blocks == len(held)


def test_forks_at_different_points_lock_the_blocks_a_sibling_hands_to_the_tree():
    """P forks C1 after 2 blocks, grows, forks C2 after 5; C1 registers its branch first, then P its own, which C2
    shares and locks on C1's branch. Once P is freed, C2 still holds P's blocks 2-4: they must stay locked, and an
    allocation of every block the manager counts free must succeed."""
    bs = 4
    kv = KVCacheManager(num_blocks=24, block_size=bs, prefix_caching="radix")
    p_tokens = list(range(1, 21))  # 5 blocks
    kv.find_prefix(0, p_tokens)
    assert kv.allocate(0, 8)
    kv.fork(0, 1, 8)
    assert kv.allocate(0, 20)
    kv.fork(0, 2, 20)
    c1_tokens = p_tokens[:8] + [99] * 8
    assert kv.allocate(1, 16)
    kv.cache_blocks(1, c1_tokens, 16)
    kv.cache_blocks(0, p_tokens, 20)
    assert_evictable_is_free(kv)
    kv.free(0)
    assert_evictable_is_free(kv)
    kv.find_prefix(3, [7] * 200)
    assert kv.allocate(3, kv.num_free_blocks * bs)  # every block counted free can be had
    for s in (1, 2, 3):
        kv.free(s)
    assert kv.radix.evictable_blocks == kv.radix.num_blocks  # every lock let go
    assert all(n.lock_ref == 0 for n in kv.radix._nodes())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([None, "hash", "radix"]), st.integers(0, 2**31 - 1))
def test_random_lifecycles_keep_the_copy_exact(prefix_caching, seed):
    """Growth, prefix hits, dedup swaps (two sequences computing the same blocks), forks, compactions and frees
    in random order; after every sync the synced rows equal the manager's tables, and a sync writes no more than
    the new entries of growing tables plus whole rows of the tables changed in place. With radix, every block the
    tree counts as evictable is one that only the tree holds (a fork or a compaction's fixed blocks must lock
    theirs), so an allocation the count allows always finds its blocks."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(num_blocks=48, block_size=bs, prefix_caching=prefix_caching)
    dev = DeviceBlockTables("cpu", rows=2, cols=2)
    tokens: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(40):
        op = rng.random()
        live = list(kv.block_tables)
        if op < 0.3 or not live:  # a new sequence, often with a shared prompt
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
            prefix = kv.find_prefix(next_id, prompt)
            if kv.allocate(next_id, len(prompt), prefix):
                kv.record_lookup(len(prompt), len(prefix) * bs)
                tokens[next_id] = prompt
                next_id += 1
        elif op < 0.6:  # grow and register computed blocks
            s = rng.choice(live)
            t = tokens[s] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            if kv.allocate(s, len(t)):
                tokens[s] = t
                if rng.random() < 0.7:  # else registered later (forks may come in between)
                    kv.cache_blocks(s, t, len(t))
        elif op < 0.7:
            s = rng.choice(live)
            n = len(tokens[s])
            try:
                kv.fork(s, next_id, n)
            except Exception:
                continue
            tokens[next_id] = list(tokens[s])
            next_id += 1
        elif op < 0.8:
            s = rng.choice(live)
            keep = rng.randrange(1, len(tokens[s]) + 1)
            if kv.compact(s, keep, fixed_blocks=rng.choice([0, 0, 1])) is not None:
                tokens[s] = tokens[s][:keep]
        else:
            s = rng.choice(live)
            kv.free(s)
            del tokens[s]
        if kv.radix:
            assert_evictable_is_free(kv)
        batch = [s for s in kv.block_tables if rng.random() < 0.7]
        before = {s: len(kv.block_tables[s]) for s in batch}
        written = dev.entries_written
        dev.sync(kv, batch)
        dev.check(kv, batch)
        assert dev.entries_written - written <= sum(before.values()) + dev.table.shape[1] * len(batch)


@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_engine_decode_writes_each_block_entry_once(tiny_llama, prefix):
    """A long decode uploads each new block's entry once, not every table every step; and every sync the
    engine makes leaves the rows equal to the manager's tables (prefix hits and a fork included)."""
    llm = LLM(tiny_llama, kv_cache_memory="8MiB", block_size=16, enable_prefix_caching=True,
              prefix_caching_algo=prefix)
    eng = llm.engine
    dev = eng.runner.tables
    synced = []
    real_sync = dev.sync

    def checked_sync(kv, seq_ids):
        seq_ids = list(seq_ids)
        rows = real_sync(kv, seq_ids)
        dev.check(kv, seq_ids)
        synced.append(sum(len(kv.block_tables[s]) for s in seq_ids))
        return rows

    dev.sync = checked_sync
    prompt = list(range(5, 69))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=160)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert dev.entries_written == -(-(64 + 160 - 1) // 16)  # the last sampled token is never written
    assert sum(synced) > 20 * dev.entries_written  # what rebuilding every table every step would upload
    # a prefix hit and n=2 (a fork) on top: still exact at every sync
    llm.generate([{"prompt_token_ids": prompt + [1, 2, 3]}], SamplingParams(temperature=0.8, n=2, max_tokens=20,
                                                                           seed=3), use_tqdm=False)
    eng.check_no_leaks()


@pytest.mark.cuda
def test_a_cuda_decode_step_waits_on_the_device_once(tiny_llama):
    """On CUDA a pure-decode step makes the host wait for the device once (the sampled ids): block tables by diffs
    and the step's inputs through pinned memory copy without blocking. torch's sync debug mode reports each wait."""
    import warnings

    llm = LLM(tiny_llama, device="cuda", dtype="bfloat16", kv_cache_memory="64MiB")
    eng = llm.engine
    for i in range(4):
        eng.add_request(f"r{i}", list(range(3 + i, 40 + i)),
                        SamplingParams(temperature=0.8, top_k=20, max_tokens=40, ignore_eos=True, seed=i))
    for _ in range(3):  # prefills done: every later step is a pure decode
        eng.step()
    waits = []
    for _ in range(5):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        # (the mode's first use also warns that it is a prototype: not a wait)
        waits.append([str(w.message) for w in caught
                      if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)])
    assert all(len(w) <= 1 for w in waits), waits
    assert eng.runner.tables.entries_written < 4 * 40  # diffs, not whole tables each step
