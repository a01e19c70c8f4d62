"""Retention control: the pool evicts the lowest priority first, then the least recently used; an expired TTL drops
a block's priority to 0; a pinned block is never evicted. Then through the engine: kv_retention on requests, and a
--kv-pin-prefix that survives a workload churning the pool ten times with a 100% hit rate. Bad settings are refused
with the field and change nothing."""
from __future__ import annotations

import pytest
import torch

from kvcache import SamplingParams
from kvcache.config import EngineConfig
from kvcache.engine.llm_engine import LLMEngine
from kvcache.memory.block_hash import BlockKey
from kvcache.memory.block_pool import DEFAULT_PRIORITY, BlockPool


def _cached_pool(n: int, now: list[float]) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(n + 1)
    pool.clock = lambda: now[0]
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.cache(b, BlockKey(1000 + i, (i,), (), None))
    return pool, blocks


def test_the_lowest_priority_goes_first_then_the_least_recently_used():
    now = [0.0]
    pool, (a, b, c, d) = _cached_pool(4, now)
    pool.retain([a], 90, None)
    pool.retain([b], 10, None)
    pool.retain([c], 10, None)  # d keeps the default
    pool.free([a, c, b, d])  # c freed before b: LRU among equals
    assert pool.allocate(1) == [c] and pool.allocate(1) == [b] and pool.allocate(1) == [d] and pool.allocate(1) == [a]
    assert pool.priority[a] == DEFAULT_PRIORITY  # handed out anew: retention gone
    assert pool.num_evictions == 4


def test_a_block_keeps_the_highest_priority_its_requests_gave_it():
    now = [0.0]
    pool, (a, b) = _cached_pool(2, now)
    pool.retain([a], 80, None)
    pool.retain([a], 20, None)  # a later, lower request does not lower it
    pool.free([a, b])
    assert pool.allocate(1) == [b]


def test_an_expired_ttl_drops_the_priority_to_zero():
    now = [0.0]
    pool, (a, b, c) = _cached_pool(3, now)
    pool.retain([a], 100, 5.0)
    pool.retain([c], 100, None)
    pool.free([b, a, c])  # b (default priority) is the oldest
    now[0] = 4.0
    assert pool.allocate(1) == [b]  # a is still retained at 100
    pool.free([b])
    now[0] = 6.0
    assert pool.allocate(1) == [a]  # a expired: priority 0, before b
    assert pool.allocate(1) == [b] and pool.allocate(1) == [c]


def test_a_pinned_block_is_never_evicted_and_outlives_a_cache_reset():
    now = [0.0]
    pool, (a, b, c) = _cached_pool(3, now)
    pool.free([a, b, c])
    pool.pin([b])
    assert pool.num_free == 2 and pool.ref_counts[b] == 1
    assert sorted(pool.allocate(2)) == sorted([a, c])
    with pytest.raises(Exception, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    assert pool.clear_cache() == 0 and pool.lookup(1001) == b  # a and c were evicted; b stays findable
    with pytest.raises(ValueError, match="only cached blocks can be pinned"):
        pool.pin([a])


# ---- through the engine ---------------------------------------------------------------------------------------

def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, **{"kv_cache_memory": 40 * 16 * 512, "block_size": 16,
                                                 "max_num_batched_tokens": 256, **kw}))


def _generate(eng: LLMEngine, rid: str, prompt: list[int], **params) -> None:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, **params))
    eng.run_to_completion()


def test_requests_retain_their_prefixes_by_priority(tiny_llama):
    eng = _engine(tiny_llama)
    keep, drop = _tokens(161, 1), _tokens(161, 2)  # 10 full blocks each
    _generate(eng, "keep", keep, kv_retention={"priority": 90})
    _generate(eng, "drop", drop, kv_retention={"priority": 5})
    for i in range(3):  # 30 more blocks of the default priority: the pool (40) must give up 10 cached ones
        _generate(eng, f"churn{i}", _tokens(161, 10 + i))
    probe = next(eng._seq_ids)
    assert len(eng.kv.find_prefix(probe, keep)) == 10  # the priority-90 prefix stayed whole
    assert len(eng.kv.find_prefix(probe + 1, drop)) == 0  # the priority-5 one went first
    eng.kv.free(probe)
    eng.kv.free(probe + 1)
    eng.check_no_leaks()


def test_a_preempted_request_keeps_its_retention(tiny_llama):
    """A request preempted on its way (its blocks freed, to be recomputed) still gives the priority it asked for to
    the blocks it caches after it resumes: its prompt's 10 and the 2 its output fills."""
    eng = _engine(tiny_llama)
    keep = _tokens(161, 1)
    eng.add_request("keep", keep, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                 kv_retention={"priority": 90}))
    seq = eng.requests["keep"].seqs[0]
    while seq.num_computed_tokens < len(keep):
        eng.step()
    eng.scheduler._preempt(seq)
    whole = eng.run_to_completion()["keep"]
    assert seq.num_preemptions == 1
    for i in range(3):  # 30 blocks of the default priority through a pool of 40
        _generate(eng, f"churn{i}", _tokens(161, 10 + i))
    probe = next(eng._seq_ids)
    assert len(eng.kv.find_prefix(probe, keep + whole.outputs[0].token_ids + [5])) == 12
    eng.kv.free(probe)
    eng.check_no_leaks()


def test_a_pinned_prefix_survives_ten_churns_of_the_pool_with_every_lookup_a_hit(tiny_llama):
    system = " ".join(f"w{i}" for i in range(40, 140))  # the tiny tokenizer: one token a word
    eng = _engine(tiny_llama, kv_pin_prefix=system)
    pinned = eng.kv_cache_info()["pinned_blocks"]
    ids = eng.tokenize(system)
    assert pinned == len(ids) // 16 > 0
    usable = eng.kv.pool.num_usable
    churned, requests = 0, 0
    while churned < 10 * usable:
        prompt = ids + _tokens(150, requests)  # the system prompt, then a user turn of its own
        before = eng.kv.stats.hits
        _generate(eng, f"r{requests}", prompt)
        assert eng.kv.stats.hits - before >= pinned * 16, requests  # every request finds the whole pin
        churned += 150 // 16 + 1
        requests += 1
    assert eng.kv.pool.num_evictions > 5 * usable  # the rest of the pool turned over
    before = eng.kv.stats.hits
    eng.add_request("salted", ids + _tokens(20, 99), SamplingParams(max_tokens=1), cache_salt="tenant-b")
    eng.run_to_completion()
    assert eng.kv.stats.hits == before  # cache_salt isolation holds: the pin is the unsalted prefix's
    assert eng.reset_prefix_cache() >= 0 and eng.kv_cache_info()["pinned_blocks"] == pinned
    eng.check_no_leaks()


def test_bad_retention_and_pins_are_refused(tiny_llama):
    for bad, match in (({"priority": 101}, r"kv_retention.priority must be an int in \[0, 100\], got 101"),
                       ({"priority": -1}, r"kv_retention.priority must be an int in \[0, 100\]"),
                       ({"ttl_s": -3}, "kv_retention.ttl_s must be a positive number of seconds or null, got -3"),
                       ({"priority": 5, "pin": True}, "kv_retention must be an object with priority"),
                       ("high", "kv_retention must be an object")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(kv_retention=bad)
    radix = _engine(tiny_llama, prefix_caching_algo="radix")
    with pytest.raises(ValueError, match="kv_retention needs prefix caching with --prefix-caching-algo hash"):
        radix.add_request("r", [5, 6, 7], SamplingParams(kv_retention={"priority": 50}))
    assert not radix.requests and not radix.kv.block_tables  # nothing changed
    with pytest.raises(ValueError, match="kv_pin_prefix keeps a prefix in the prefix cache"):
        EngineConfig(kv_pin_prefix="w1 w2", enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"kv_pin_max_fraction .* must be in \(0, 0.9\]; got 0"):
        EngineConfig(kv_pin_max_fraction=0)
    with pytest.raises(ValueError, match="kv_pin_prefix is 3 tokens, less than one block of 16"):
        _engine(tiny_llama, kv_pin_prefix="w1 w2 w3")
    long = " ".join(f"w{i}" for i in range(200))
    with pytest.raises(ValueError, match=r"kv_pin_prefix takes 12 blocks \(200 tokens\), above kv_pin_max_fraction "
                                         r"0.25 of the pool's 40 blocks \(10\)"):
        _engine(tiny_llama, kv_pin_prefix=long)
