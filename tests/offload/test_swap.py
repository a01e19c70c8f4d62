"""Swap preemption (issue 15, `--preemption-mode swap`): a preempted sequence's blocks go to the cpu tier (or the disk
tier) and come back when it resumes, so it continues exactly where it was: its greedy tokens are those of a run
with no preemption at all, in every KV format, with eviction too; a tier with no room falls back to recompute."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from kvcache import LLM, SamplingParams
from kvcache.config import EngineConfig
from kvcache.memory.kv_cache_manager import blocks_for
from kvcache.offload.tiers import CpuTier, DiskTier


def _workload(seed=0, n=12):
    """Short prompts with long outputs (they grow after admission, so a small pool must preempt) and long ones."""
    rng = random.Random(seed)
    lengths = [3, 5, 9, 4, 120, 25, 64] + [rng.randint(3, 120) for _ in range(n - 7)]
    prompts = [[rng.randrange(3, 320) for _ in range(k)] for k in lengths]
    max_tokens = [64, 64, 60, 56, 1, 33, 17] + [rng.randint(1, 40) for _ in range(n - 7)]
    return prompts, max_tokens


def _kivi_workload():
    """Short prompts that grow by 4 blocks of 64 each: a 10-block pool admits two and must preempt one."""
    return [list(range(3 + i, 13 + 2 * i)) for i in range(4)], [250] * 4


def _run(llm, prompts, max_tokens):
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_no_leaks()
    return [o.outputs[0].token_ids for o in outs]


def _small_pool(path, prompts, max_tokens, kv="auto", **kw):
    """An engine whose pool holds about 1.5 of the largest requests (8-token blocks; KIVI: 10 blocks of 64)."""
    bs = 64 if kv in ("int4", "int2") else 8
    per_token = LLM(path, kv_cache_memory="1MiB", kv_cache_dtype=kv, block_size=bs).kv_cache_info()["bytes_per_token"]
    if bs == 64:
        blocks = 10
    else:
        blocks = max(blocks_for(len(p) + n, bs) for p, n in zip(prompts, max_tokens)) * 3 // 2
    return LLM(path, kv_cache_memory=blocks * bs * per_token, kv_cache_dtype=kv, block_size=bs,
               max_num_batched_tokens=48, **kw)


@pytest.mark.parametrize("kv, algo", [("float32", "hash"), ("float32", "radix"), ("float32", None),
                                      ("int8", "hash"), ("fp8_e4m3", "hash"), ("int4", "hash"), ("int2", "radix")])
def test_a_swapped_sequence_continues_where_it_was(tiny_llama, kv, algo):
    """Outputs equal those of a pool large enough to never preempt, every preemption is swapped and resumed, and
    nothing is prefilled twice (recompute prefills again what the prefix cache lost)."""
    prompts, max_tokens = _kivi_workload() if kv in ("int4", "int2") else _workload()
    caching = dict(enable_prefix_caching=False) if algo is None else dict(prefix_caching_algo=algo)
    want = _run(LLM(tiny_llama, kv_cache_memory="16MiB", kv_cache_dtype=kv, **caching), prompts, max_tokens)
    recompute = _small_pool(tiny_llama, prompts, max_tokens, kv, **caching)
    swap = _small_pool(tiny_llama, prompts, max_tokens, kv, preemption_mode="swap", kv_offload_memory="64MiB",
                       **caching)
    r_out, s_out = _run(recompute, prompts, max_tokens), _run(swap, prompts, max_tokens)
    if kv in ("float32", "int8", "fp8_e4m3"):  # per-token formats: exact, like recompute (tests/engine)
        assert s_out == want
    assert s_out == r_out or kv in ("int4", "int2")  # KIVI recompute may flip near-ties (test_quantized_kv.py)
    r, s = recompute.kv_cache_info(), swap.kv_cache_info()
    assert s["num_preemptions"] > 0 and s["num_swapped_out"] == s["num_swapped_in"] == s["num_preemptions"]
    assert s["num_swap_fallbacks"] == 0
    assert s["prefill_tokens_computed"] == sum(map(len, prompts)) <= r["prefill_tokens_computed"]
    if algo is None:  # without a prefix cache, recompute prefills every preempted token again
        assert r["prefill_tokens_computed"] > s["prefill_tokens_computed"]
    tier = s["offload"]["tiers"][0]
    assert tier["swapped_out"] == tier["swapped_in"] == s["num_swapped_out"] and tier["swap_bytes"] == 0
    o = s["offload"]
    assert o["swapped_out_blocks"] >= o["swapped_in_blocks"] > 0  # resuming skips blocks the pool still caches


def test_a_swapped_kivi_sequence_is_token_exact(tiny_llama):
    """Swap restores KIVI's fp16 key residual with the blocks: no re-quantization, so no near-tie flips either."""
    prompts, max_tokens = _kivi_workload()
    want = _run(LLM(tiny_llama, kv_cache_memory="16MiB", kv_cache_dtype="int4"), prompts, max_tokens)
    got = _run(_small_pool(tiny_llama, prompts, max_tokens, "int4", preemption_mode="swap",
                           kv_offload_memory="64MiB"), prompts, max_tokens)
    assert got == want


def test_swap_to_disk_when_there_is_no_cpu_tier(tiny_llama, tmp_path):
    prompts, max_tokens = _workload()
    want = _run(LLM(tiny_llama, kv_cache_memory="16MiB"), prompts, max_tokens)
    llm = _small_pool(tiny_llama, prompts, max_tokens, preemption_mode="swap", kv_offload_dir=str(tmp_path))
    assert _run(llm, prompts, max_tokens) == want
    info = llm.kv_cache_info()
    assert info["offload"]["swap_tier"] == "disk" and info["num_swapped_in"] == info["num_preemptions"] > 0
    llm.engine.offload.flush()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(DiskTier.SWAP_PREFIX)]  # each taken back, deleted


def test_a_tier_without_room_falls_back_to_recompute(tiny_llama):
    prompts, max_tokens = _workload()
    want = _run(LLM(tiny_llama, kv_cache_memory="16MiB"), prompts, max_tokens)
    llm = _small_pool(tiny_llama, prompts, max_tokens, preemption_mode="swap", kv_offload_memory=4096)
    assert _run(llm, prompts, max_tokens) == want
    info = llm.kv_cache_info()
    assert info["num_preemptions"] > 0 and info["num_swapped_out"] == 0
    assert info["num_swap_fallbacks"] == info["num_preemptions"]
    assert info["offload"]["tiers"][0]["swap_refused"] == info["num_preemptions"]


def test_swap_with_eviction_resumes_the_compacted_cache(tiny_llama):
    """A compacted sequence swaps out what eviction kept and resumes with it: the tokens of a run never preempted,
    which recompute cannot give (it prefills everything again and compacts anew)."""
    prompts, max_tokens = _workload()
    kw = dict(kv_eviction="streaming", kv_budget=24, enable_prefix_caching=False)
    want = _run(LLM(tiny_llama, kv_cache_memory="16MiB", block_size=8, **kw), prompts, max_tokens)  # same blocks
    llm = _small_pool(tiny_llama, prompts, max_tokens, preemption_mode="swap", kv_offload_memory="64MiB", **kw)
    got = _run(llm, prompts, max_tokens)
    assert got == want
    info = llm.kv_cache_info()
    assert info["num_swapped_in"] == info["num_preemptions"] > 0 and info["eviction_compactions"] > 0


def test_n_samples_forked_then_swapped(tiny_llama):
    """n = 2: each child gets its copy of the parent's partial block at once, so a child preempted at the next step
    swaps out real KV (seeded sampling: the same tokens as a pool that never preempts)."""
    prompts, max_tokens = _workload(n=8)
    params = [SamplingParams(temperature=0.8, n=2, seed=i, ignore_eos=True, max_tokens=m)
              for i, m in enumerate(max_tokens)]

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.check_no_leaks()
        return [[c.token_ids for c in o.outputs] for o in outs]
    want = run(LLM(tiny_llama, kv_cache_memory="16MiB"))
    llm = _small_pool(tiny_llama, prompts, [2 * m for m in max_tokens], preemption_mode="swap",
                      kv_offload_memory="64MiB")
    assert run(llm) == want
    assert llm.kv_cache_info()["num_swapped_in"] > 0


def test_an_aborted_swapped_request_lets_its_swap_go(tiny_llama):
    prompts, max_tokens = _workload()
    llm = _small_pool(tiny_llama, prompts, max_tokens, preemption_mode="swap", kv_offload_memory="64MiB")
    eng = llm.engine
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))
    while not eng.scheduler._swapped:
        eng.step()
    tier = eng.offload.swap_tier
    assert tier.held_bytes > 0
    victim = next(iter(eng.scheduler._swapped))
    rid = next(s.request_id for s in eng.scheduler.waiting if s.seq_id == victim)
    assert eng.abort_request(rid)
    assert victim not in eng.scheduler._swapped
    eng.run_to_completion()
    eng.check_no_leaks()
    assert tier.held_bytes == 0 and not tier._held


def test_swap_needs_a_tier_that_holds_sequences():
    with pytest.raises(ValueError, match="--kv-offload-memory SIZE"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be recompute or swap"):
        EngineConfig(preemption_mode="evict")
    EngineConfig(preemption_mode="swap", kv_offload_memory="1GiB", enable_prefix_caching=False)  # swap alone


# ---- the tiers' side ------------------------------------------------------------------------------------------


def test_held_values_make_room_and_are_never_dropped():
    t = CpuTier(300)
    for k in (b"a", b"b"):
        assert t.put(k, bytes(100))
    assert t.hold(b"s", "rows", 150)  # drops the least recent prefix value for room
    assert not t.contains(b"a") and t.contains(b"b") and t.used_bytes + t.held_bytes == 250
    assert not t.hold(b"t", "rows", 151)  # 150 + 151 held would exceed 300
    assert t.stats.swap_refused == 1
    assert not t.put(b"c", bytes(151)) and t.stats.errors == {"full": 1}  # no room beside what is held
    assert t.put(b"c", bytes(150)) and not t.contains(b"b")
    assert t.take(b"s") == "rows" and t.take(b"s") is None and t.held_bytes == 0
    info = t.info()
    assert (info["swapped_out"], info["swapped_in"], info["swap_refused"]) == (1, 1, 1)


def test_disk_swap_files_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = tmp_path / f"{DiskTier.SWAP_PREFIX}{dead}-00ff"
    stale.write_bytes(b"x" * 10)
    mine = DiskTier(str(tmp_path), 1000)
    assert not stale.exists()
    assert mine.hold(b"\x01", b"abc", 3) and mine.take(b"\x01") == b"abc"
    alive = tmp_path / f"{DiskTier.SWAP_PREFIX}{os.getpid()}-0102"
    alive.write_bytes(b"y")
    DiskTier(str(tmp_path), 1000)
    assert alive.exists()  # a running process's swap is left alone
