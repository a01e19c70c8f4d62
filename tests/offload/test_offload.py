"""Offload tiers (issue 15): prefix blocks kept in host memory and on disk below a pool too small for them, loaded
back instead of recomputed, checked on load, and scoped by model fingerprint and cache_salt."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvcache import LLM, SamplingParams
from kvcache.config import EngineConfig
from kvcache.offload.offloader import decode_block, encode_block
from kvcache.offload.tiers import CpuTier, DiskTier

POOL = "8MiB"  # the tiny llama's pool: 16,384 tokens, a fraction of the CPU default (2 GiB zeroed per engine)
GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)


# ---- tiers ------------------------------------------------------------------------------------------------------


def test_cpu_tier_drops_least_recently_used_to_stay_in_capacity():
    t = CpuTier(300)
    for k in (b"a", b"b", b"c"):
        assert t.put(k, bytes(100))
    assert t.get(b"a") is not None  # a is now the most recent
    assert t.put(b"d", bytes(100))
    assert not t.contains(b"b") and t.contains(b"a") and t.used_bytes == 300
    assert not t.put(b"e", bytes(301)) and t.stats.errors == {"too_large": 1}
    assert t.get(b"zz") is None and t.stats.misses == 1


def test_disk_tier_writes_atomically_and_keeps_its_size(tmp_path):
    t = DiskTier(str(tmp_path), 250)
    for k in (b"\x01", b"\x02", b"\x03"):
        assert t.put(k, k * 100)
    names = sorted(os.listdir(tmp_path))
    assert names == ["02.kvb", "03.kvb"]  # the oldest went to stay under 250 bytes; no temporary files left
    assert t.get(b"\x03") == b"\x03" * 100 and t.get(b"\x01") is None
    again = DiskTier(str(tmp_path), 250)  # another process: finds the files and their sizes
    assert again.used_bytes == 200 and again.get(b"\x02") == b"\x02" * 100


def test_disk_tier_refuses_an_unusable_directory_and_counts_failed_writes(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot be written"):
        DiskTier(str(blocker / "sub"), 1000)
    t = DiskTier(str(tmp_path / "d"), 1000)
    os.rmdir(tmp_path / "d")  # the directory disappears under a running engine
    assert not t.put(b"\x01", b"x") and t.stats.errors == {"write": 1}
    assert t.get(b"\x01") is None


def test_a_block_value_is_checked_before_use():
    fp, key, tokens, payload = b"F" * 32, 12345, (1, 2, 3, 4), bytes(range(64))
    value = encode_block(fp, key, tokens, payload)
    assert decode_block(value, fp, key, tokens, 64) == (payload, "")
    assert decode_block(value[:-9], fp, key, tokens, 64)[1] == "truncated"
    flipped = bytearray(value)
    flipped[70] ^= 1
    assert decode_block(bytes(flipped), fp, key, tokens, 64)[1] == "checksum"
    assert decode_block(value, b"G" * 32, key, tokens, 64)[1] == "fingerprint"
    assert decode_block(value, fp, key + 1, tokens, 64)[1] == "key"
    assert decode_block(value, fp, key, (1, 2, 3, 5), 64)[1] == "tokens"


@pytest.mark.parametrize("kw, match", [
    (dict(kv_offload_memory="-1"), "kv_offload_memory must be a positive size"),
    (dict(kv_offload_memory="25%"), "kv_offload_memory"),
    (dict(kv_offload_disk_size="1GiB"), "needs kv_offload_dir"),
    (dict(kv_offload_dir="/tmp/x", kv_offload_disk_size="lots"), "kv_offload_disk_size must be")])
def test_bad_offload_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


# ---- the engine -------------------------------------------------------------------------------------------------


def _conversations(n=6, system=200, own=30, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(system)]
    return [shared + [rng.randrange(3, 300) for _ in range(own)] for _ in range(n)]


def _turns(llm, convs, turns=3):
    """Every conversation's turns one request at a time; the pool cannot hold them all between turns."""
    outs = []
    for turn in range(turns):
        for c in convs:
            outs.append(llm.generate([{"prompt_token_ids": c + [turn + 3] * 5}], GREEDY,
                                     use_tqdm=False)[0].outputs[0].token_ids)
    if llm.engine.offload:
        llm.engine.offload.flush()
    llm.engine.check_no_leaks()
    return outs, llm.kv_cache_info()


def _small_pool(path, kv="auto"):
    """20 blocks of 16 tokens; for KIVI, 8 of 64 (a request also holds 2 for its key residual)."""
    blocks, block = (8, 64) if kv in ("int4", "int2") else (20, 16)
    per_token = LLM(path, kv_cache_memory="1MiB", kv_cache_dtype=kv).kv_cache_info()["bytes_per_token"]
    return dict(kv_cache_memory=blocks * block * per_token, kv_cache_dtype=kv)


@pytest.mark.parametrize("kv, algo", [("float32", "hash"), ("float32", "radix"), ("int8", "hash"), ("int4", "hash")])
def test_tiers_load_what_the_pool_dropped_with_the_same_tokens(tiny_llama, tmp_path, kv, algo):
    pool = _small_pool(tiny_llama, kv)
    convs = _conversations(own=100 if kv == "int4" else 30)  # with 64-token blocks, each its own full block
    plain, p_info = _turns(LLM(tiny_llama, prefix_caching_algo=algo, **pool), convs)
    got, info = _turns(LLM(tiny_llama, prefix_caching_algo=algo, kv_offload_memory="64MiB",
                           kv_offload_dir=str(tmp_path), **pool), convs)
    assert got == plain
    o = info["offload"]
    assert o["loaded_blocks"] > 0 and info["prefill_tokens_computed"] < p_info["prefill_tokens_computed"]
    assert info["prefix_cache_hit_rate"] > p_info["prefix_cache_hit_rate"]
    cpu, disk = o["tiers"]
    assert cpu["stored_blocks"] == disk["stored_blocks"] > 0 and cpu["hits"] > 0 and not cpu["errors"]


def test_another_process_loads_from_a_shared_directory(tiny_llama, tmp_path):
    """A second engine process with the same model and format finds the first one's blocks on disk (deterministic
    keys); another KV format, or another cache_salt, finds nothing."""
    convs = _conversations(n=2)
    code = (f"from kvcache import LLM, SamplingParams\n"
            f"llm = LLM({tiny_llama!r}, kv_cache_memory={POOL!r}, kv_offload_dir={str(tmp_path)!r})\n"
            f"llm.generate([{{'prompt_token_ids': p}} for p in {convs!r}], SamplingParams(max_tokens=1), "
            f"use_tqdm=False)\n"
            f"llm.engine.offload.flush()\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                   env={**os.environ, "PYTHONHASHSEED": "123"})
    assert len(os.listdir(tmp_path)) == 200 // 16 + 2 * (230 // 16 - 200 // 16)  # the system prompt's blocks once
    llm = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path))
    llm.generate([{"prompt_token_ids": convs[0] + [7]}], GREEDY, use_tqdm=False)
    info = llm.kv_cache_info()
    assert info["offload"]["loaded_blocks"] == 230 // 16 and info["prefill_tokens_computed"] == 231 - 224
    other = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
    other.generate([{"prompt_token_ids": convs[0] + [7]}], GREEDY, use_tqdm=False)
    assert other.kv_cache_info()["offload"]["loaded_blocks"] == 0
    salted = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path))
    salted.generate([{"prompt_token_ids": convs[1] + [7], "cache_salt": "tenant-b"}], GREEDY, use_tqdm=False)
    assert salted.kv_cache_info()["offload"]["loaded_blocks"] == 0


def test_a_corrupted_or_foreign_block_is_never_loaded(tiny_llama, tmp_path):
    convs = _conversations(n=1)
    first = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path))
    want = first.generate([{"prompt_token_ids": convs[0] + [7]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    first.engine.offload.flush()
    files = sorted(os.listdir(tmp_path), key=lambda n: os.path.getmtime(tmp_path / n))
    victim = tmp_path / files[0]  # a block of the prompt: which one does not matter, the chain stops at it
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    llm = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path))
    got = llm.generate([{"prompt_token_ids": convs[0] + [7]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    o = llm.kv_cache_info()["offload"]
    assert o["refused"] == {"checksum": 1} and o["tiers"][0]["errors"] == {"checksum": 1}


def test_the_kv_summary_shows_each_tier(tiny_llama, tmp_path, capsys):
    from kvcache.cli import print_kv_summary
    llm = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_memory="8MiB", kv_offload_dir=str(tmp_path))
    llm.generate([{"prompt_token_ids": _conversations(n=1)[0]}], GREEDY, use_tqdm=False)
    llm.engine.offload.flush()
    print_kv_summary(llm.engine)
    out = capsys.readouterr().out
    assert "tier cpu  : 14 blocks" in out and "tier disk : 14 blocks" in out and "offload   : 0 blocks loaded" in out


# ---- the redis tier (a real redis-server) ---------------------------------------------------------------------


def test_two_engines_share_prefix_blocks_through_redis(tiny_llama, redis_server):
    """Engine A computes a document; engine B (nothing shared but the server) loads it instead of recomputing,
    with the same greedy tokens as computing it."""
    doc = _conversations(n=1, system=200, own=40)[0]
    a = LLM(tiny_llama, kv_cache_memory=POOL, kv_remote=redis_server.url)
    want = a.generate([{"prompt_token_ids": doc + [9]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    a.engine.offload.flush()
    assert a.kv_cache_info()["offload"]["tiers"][0]["stored_blocks"] == 240 // 16
    b = LLM(tiny_llama, kv_cache_memory=POOL, kv_remote=redis_server.url)
    got = b.generate([{"prompt_token_ids": doc + [9]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    info = b.kv_cache_info()
    assert got == want and info["offload"]["loaded_blocks"] == 240 // 16
    assert info["prefill_tokens_computed"] == 241 - 240
    assert info["offload"]["tiers"][0]["tier"] == "redis" and info["offload"]["tiers"][0]["hits"] == 15


def test_redis_going_away_and_coming_back(tiny_llama, redis_server):
    """Redis stopped mid-run: requests still finish (recomputed), the failure is counted and the tier backs off
    instead of failing on every block; once it is back and the backoff is over, it is used again."""
    convs = _conversations(n=3)
    llm = LLM(tiny_llama, kv_cache_memory=POOL, kv_remote=redis_server.url, kv_remote_timeout=0.2)
    tier = llm.engine.offload.tiers[0]
    tier.backoff = 60.0  # longer than the test: the counts below do not depend on how fast it runs
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, kv_cache_memory=POOL).generate(
        [{"prompt_token_ids": c} for c in convs], GREEDY, use_tqdm=False)]
    redis_server.stop()
    got = llm.generate([{"prompt_token_ids": c} for c in convs], GREEDY, use_tqdm=False)
    llm.engine.offload.flush()
    assert [o.outputs[0].token_ids for o in got] == want
    assert 1 <= tier.stats.errors["unavailable"] <= 2  # the engine's and the writer's first calls; then the backoff
    assert tier.stats.errors["skipped"] > 0 and tier.stats.stored == 0
    redis_server.start()
    tier._down_until = 0.0  # the backoff is over
    fresh = _conversations(n=1, seed=7)[0]
    llm.generate([{"prompt_token_ids": fresh}], GREEDY, use_tqdm=False)
    llm.engine.offload.flush()
    assert tier.stats.stored == len(fresh) // 16
    other = LLM(tiny_llama, kv_cache_memory=POOL, kv_remote=redis_server.url)
    other.generate([{"prompt_token_ids": fresh}], GREEDY, use_tqdm=False)
    assert other.kv_cache_info()["offload"]["loaded_blocks"] == (len(fresh) - 1) // 16


def test_a_bad_remote_url_is_refused_before_loading():
    with pytest.raises(ValueError, match="redis://"):
        EngineConfig(kv_remote="http://cache:6379")
    with pytest.raises(ValueError, match="kv_remote_timeout"):
        EngineConfig(kv_remote="redis://localhost:6379/0", kv_remote_timeout=0)


def test_prompts_admitted_together_load_a_shared_prefix_once(tiny_llama, tmp_path):
    """Two requests for one document arrive together at an engine whose tier holds it: the first loads it, and its
    loaded blocks are findable at once, so the second, admitted in the same step, shares them instead of loading
    the same blocks a second time."""
    doc = _conversations(n=1, system=200, own=40)[0]
    first = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path))
    first.generate([{"prompt_token_ids": doc}], GREEDY, use_tqdm=False)
    first.engine.offload.flush()
    llm = LLM(tiny_llama, kv_cache_memory=POOL, kv_offload_dir=str(tmp_path))
    steps = []
    real = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: steps.append(real()) or steps[-1]
    outs = llm.generate([{"prompt_token_ids": doc + [7, 8]}, {"prompt_token_ids": doc + [9, 10]}], GREEDY,
                        use_tqdm=False)
    assert len(steps[0].chunks) == 2  # both admitted in the first step
    info = llm.kv_cache_info()
    assert info["offload"]["loaded_blocks"] == 240 // 16
    assert info["prefill_tokens_computed"] == 2 + 2  # each computes only its own two tokens
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in LLM(tiny_llama, kv_cache_memory=POOL).generate(
        [{"prompt_token_ids": doc + [7, 8]}, {"prompt_token_ids": doc + [9, 10]}], GREEDY, use_tqdm=False)]


def test_an_engine_with_tiers_dropped_without_close_is_collected(tiny_llama, tmp_path):
    """The offload writer and the KV events publisher hold neither the engine nor its store: a dropped engine is
    collected (its KV pool freed) and both threads end."""
    import gc
    import weakref
    llm = LLM(tiny_llama, kv_cache_memory="4MiB", kv_offload_memory="8MiB", kv_offload_dir=str(tmp_path),
              kv_events_endpoint=f"ipc://{tmp_path}/events", preemption_mode="swap")
    llm.generate([{"prompt_token_ids": _conversations(n=1)[0]}], GREEDY, use_tqdm=False)
    threads = [llm.engine.offload._writer, llm.engine.event_publisher._thread]
    store = weakref.ref(llm.engine.store)
    del llm
    gc.collect()
    assert store() is None
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
