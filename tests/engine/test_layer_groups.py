"""Per-layer-group block tables: models mixing full and sliding layers (Gemma-2, Gemma-3, Qwen2 with
max_window_layers) give back their sliding layers' out-of-window blocks, share prefixes per group, and still
compute transformers' tokens."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tiny_models import hf_greedy, hf_model
from kvcache import LLM, SamplingParams
from kvcache.memory.block_pool import BlockPool
from kvcache.memory.kv_cache_manager import blocks_for
from kvcache.memory.layer_groups import GroupedKVCacheManager
from kvcache.plan.kv_bytes import cache_capacity, group_blocks, kv_bytes_per_token, kv_cache_bytes, table_groups
from kvcache.plan.presets import MODEL_PRESETS
from kvcache.plan.shape import shape_from_config

WINDOW = 24  # tiny_models' sliding layers
BLOCK = 8
CHUNK = 32
HYBRIDS = ["gemma2", "gemma3", "qwen2-swa"]


def _held(kv, seq_id: int) -> list[int]:
    """Blocks each group's table of `seq_id` holds (null entries not counted)."""
    return [len(m.block_tables[seq_id]) - m.num_released(seq_id) for m in kv.groups]


def _prompt(n: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("caching", [None, "hash"])
def test_sliding_groups_hold_their_window_and_tokens_match_transformers(tiny_model_dirs, arch, caching):
    """40 prompt tokens and 260 generated (12x the window) in 32-token chunks: the full group holds every block,
    the sliding group a window behind its newest chunk (ceil(W / block) + 1 while decoding); at the end the
    request holds exactly the planner's blocks_per_request for its length; greedy tokens are transformers'."""
    path = tiny_model_dirs[arch]
    prompt, n = _prompt(40), 260
    llm = LLM(path, kv_cache_memory="2MiB", block_size=BLOCK, max_num_batched_tokens=CHUNK,
              max_model_len=len(prompt) + n, enable_prefix_caching=caching is not None)
    eng = llm.engine
    assert isinstance(eng.kv, GroupedKVCacheManager) and [g.window for g in eng.layer_groups] == [None, WINDOW]
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    seq = eng.requests["r"].seqs[0]
    chunk_bound, decode_bound = blocks_for(WINDOW - 1 + CHUNK, BLOCK) + 1, blocks_for(WINDOW, BLOCK) + 1
    peak_sliding = peak_decode = peak = 0
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if seq.seq_id in eng.kv.block_tables:
            full, sliding = _held(eng.kv, seq.seq_id)
            assert full == blocks_for(seq.num_computed_tokens, BLOCK)  # every block, none given back
            peak_sliding = max(peak_sliding, sliding)
            peak = max(peak, full + sliding)
            if seq.num_computed_tokens > len(prompt):
                peak_decode = max(peak_decode, sliding)
    assert peak_sliding <= chunk_bound and peak_decode == decode_bound, (peak_sliding, peak_decode)
    # the planner's figure (what the start-up's concurrency and kvcache plan count a request at) is what it held
    c = eng.capacity
    assert c.blocks_per_request == blocks_for(len(prompt) + n, BLOCK) + decode_bound == peak
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), prompt, n)
    eng.check_no_leaks()


def _single_table() -> dict:
    """The option under which a hybrid model keeps one table of every layer (vLLM's flag)."""
    return {"disable_hybrid_kv_cache_manager": True}


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_groups_compute_what_one_table_computes_with_forks_seeds_and_quantized_caches(tiny_model_dirs, kv_dtype):
    """n = 2 seeded samples and greedy requests, prompts past the window, a shared prefix: token for token what the
    single-table engine draws, in float32 and in per-token quantized caches."""
    path = tiny_model_dirs["gemma2"]
    shared = _prompt(48, 1)
    prompts = [shared + _prompt(20, s) for s in (2, 3)] + [_prompt(70, 4)]
    params = [SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=60, ignore_eos=True)]
    runs = []
    for kw in ({}, _single_table()):
        llm = LLM(path, kv_cache_memory="2MiB", block_size=BLOCK, max_num_batched_tokens=CHUNK, kv_cache_dtype=kv_dtype,
                  **kw)
        assert isinstance(llm.engine.kv, GroupedKVCacheManager) == (not kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([[c.token_ids for c in o.outputs] for o in outs])
        llm.engine.check_no_leaks()
    assert runs[0] == runs[1]


def test_a_prefix_hit_needs_every_group_and_a_gone_window_shortens_it(tiny_model_dirs):
    """The same long prompt twice: the second finds every block-aligned prefix block in the full group and the
    window's blocks before the hit point in the sliding one (null before them), and computes the same tokens."""
    path = tiny_model_dirs["gemma3"]
    llm = LLM(path, kv_cache_memory="2MiB", block_size=BLOCK, max_num_batched_tokens=CHUNK)
    eng = llm.engine
    prompt = _prompt(100, 9)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    hits_before = eng.kv.stats.hits
    second = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert eng.kv.stats.hits - hits_before == (len(prompt) - 1) // BLOCK * BLOCK
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == hf_greedy(hf_model(path), prompt, 20)
    eng.check_no_leaks()


def test_window_prefix_lookup_on_the_manager():
    """Manager level: after a sequence's sliding group gave back its early blocks and they were reused, the hit is
    the longest prefix whose window blocks are all still cached; the sliding table starts with null entries."""
    bs, window = 4, 6
    kv = GroupedKVCacheManager(1 + 20, bs, [None, window], "hash")
    tokens = list(range(100, 124))  # 6 blocks
    assert kv.allocate(1, len(tokens))
    kv.cache_blocks(1, tokens, len(tokens))
    kv.slide(1, len(tokens))
    assert _held(kv, 1) == [6, blocks_for(window, bs) + 1 - 1]  # blocks 4, 5 (tokens 16..23): 18..23 are in view
    kv.free(1)
    hit = kv.find_prefix(2, tokens + [7])
    assert len(hit) == 6 and hit.tables[1][:4] == [BlockPool.NULL_BLOCK] * 4  # queries from 24 on see 19..23
    # take every free block: the freed cached ones are reused newest-last, oldest (sliding group's first) first
    assert kv.allocate(3, (kv.num_free_blocks // 2) * bs)
    shorter = kv.find_prefix(4, tokens + [7])
    assert len(shorter) < 6
    for g, table in enumerate(shorter.tables):
        assert len(table) == len(shorter)
    kv.free(3)
    assert kv.num_free_blocks == kv.pool.num_usable


def test_a_fork_of_a_sequence_that_stopped_caching_keeps_giving_back_its_window():
    """Seq 4 repeats seq 1's tokens and stops caching where it meets seq 1's block under another parent; its sliding
    groups give back past what it cached. Its fork must know (it holds null entries there): it grows, caches and
    slides without touching the null block, and holds only its window."""
    bs, window = 4, 6
    kv = GroupedKVCacheManager(1 + 48, bs, [None, window, window], "hash")
    tokens = [1] * 200
    for s, n in ((1, 21), (4, 1), (4, 41)):
        assert kv.allocate(s, n, kv.find_prefix(s, tokens[:n]) if s == 1 else None)
        kv.cache_blocks(s, tokens, n)
        kv.slide(s, n)
    kv.fork(4, 7, 41)
    kv.free(1)
    assert kv.allocate(7, 50)
    kv.cache_blocks(7, tokens, 50)
    kv.slide(7, 50)
    for m, w in zip(kv.groups, kv.windows):
        if w is not None:
            assert all(b == BlockPool.NULL_BLOCK for b in m.block_tables[7][:(50 - w + 1) // bs])
    for s in (4, 7):
        kv.free(s)
    assert kv.num_free_blocks == kv.pool.num_usable


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fork"]), st.integers(0, 5),
                              st.integers(1, 40)), min_size=1, max_size=40))
# found by hypothesis: seq 4 repeats seq 1's tokens while seq 1's out-of-window blocks, given back but still cached,
# are partly reused, so seq 4's chain meets a cached block whose parent is another block (held by seq 1, or idle)
@example(ops=[("add", 1, 33), ("add", 4, 1), ("grow", 4, 28)])
@example(ops=[("add", 1, 21), ("add", 4, 1), ("grow", 4, 40)])
def test_grouped_tables_never_leak_under_random_lifecycles(ops):
    """free (idle cached included) + held == usable after any interleaving; every group's table of a sequence has the same
    length; a sliding group never holds a block all of whose tokens are out of its window; after freeing all,
    every block is free or idle cached."""
    bs, window = 4, 6
    kv = GroupedKVCacheManager(1 + 48, bs, [None, window, window], "hash")
    lengths: dict[int, int] = {}
    tokens = {s: [s % 3] * 200 for s in range(8)}  # three distinct prompts: prefix hits happen
    for op, s, n in ops:
        if op == "add" and s not in lengths:
            hit = kv.find_prefix(s, tokens[s][:n])
            if kv.allocate(s, n, hit):
                lengths[s] = n
        elif op == "grow" and s in lengths:
            if kv.allocate(s, lengths[s] + n):
                lengths[s] += n
        elif op == "free" and s in lengths:
            kv.free(s)
            del lengths[s]
        elif op == "fork" and s in lengths and s + 6 not in lengths and s + 6 < 8:
            try:
                kv.fork(s, s + 6, lengths[s])
                lengths[s + 6] = lengths[s]
            except Exception:
                pass
        for q, m in lengths.items():
            kv.cache_blocks(q, tokens[q], m)
            kv.slide(q, m)
        held = set()
        for q in lengths:
            tables = kv.tables(q)
            assert len({len(t) for t in tables}) == 1
            for g, t in enumerate(tables):
                if kv.windows[g] is not None:
                    assert all(b == BlockPool.NULL_BLOCK for b in t[:max(0, lengths[q] - window + 1) // bs])
            held.update(b for t in tables for b in t if b != BlockPool.NULL_BLOCK)
        # the free list holds the idle cached blocks too (vLLM's pool: they lose their key when reused)
        assert kv.pool.num_free + len(held) == kv.pool.num_usable
        assert kv.num_idle_cached_blocks <= kv.pool.num_free
    for q in list(lengths):
        kv.free(q)
    assert kv.num_free_blocks == kv.pool.num_usable


def test_preemption_under_a_small_pool_keeps_tokens_exact(tiny_model_dirs):
    """Eight requests through a pool that holds two at once: preempted and recomputed, tokens are transformers'."""
    path = tiny_model_dirs["qwen2-swa"]
    probe = LLM(path, kv_cache_memory="1MiB", block_size=BLOCK)
    per_block = probe.kv_cache_info()["bytes_per_token"] * BLOCK
    llm = LLM(path, kv_cache_memory=40 * per_block, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    prompts = [_prompt(30 + 5 * i, 20 + i) for i in range(8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    hf = hf_model(path)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 80)
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("kw, why", [
    (_single_table(), "--disable-hybrid-kv-cache-manager"),
    ({"enable_prefix_caching": True, "prefix_caching_algo": "radix"}, "radix"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative decoding"),
    ({"preemption_mode": "swap", "kv_offload_memory": "4MiB"}, "swap"),
])
def test_features_that_need_one_table_keep_it_and_say_why(tiny_model_dirs, kw, why, caplog):
    caplog.set_level("INFO", logger="kvcache")
    llm = LLM(tiny_model_dirs["gemma3"], kv_cache_memory="2MiB", block_size=BLOCK, **kw)
    assert not llm.engine.layer_groups and not isinstance(llm.engine.kv, GroupedKVCacheManager)
    assert any("every block is kept" in r.getMessage() and why in r.getMessage() for r in caplog.records)
    prompt = list(range(3, 43))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(tiny_model_dirs["gemma3"]), prompt, 40)


def test_more_requests_fit_the_same_budget_and_the_planner_agrees(tiny_model_dirs):
    """At one budget a grouped Gemma-2 fits more max_model_len requests than one table of every layer, by the
    planner's own figures; kvcache plan's cache line is then the engine's (no separate `paged` line)."""
    path = tiny_model_dirs["gemma2"]
    llm = LLM(path, kv_cache_memory="2MiB", block_size=BLOCK)
    grouped = llm.kv_cache_info()
    # the store holds one group's layers per block (its layers alias one another's tensors): the planner's bytes
    store = llm.engine.store
    assert store.nbytes == (grouped["num_blocks"] + 1) * grouped["bytes_per_token"] * BLOCK
    assert store.k[0] is store.k[1] and len(store.block_tensors()) == 2
    single = LLM(path, kv_cache_memory="2MiB", block_size=BLOCK, **_single_table()).kv_cache_info()
    assert grouped["layers_per_block"] == 1 and single["layers_per_block"] == 2
    assert grouped["num_blocks"] == 2 * single["num_blocks"]
    mml = grouped["max_model_len"]
    assert grouped["blocks_per_request"] == blocks_for(mml, BLOCK) + group_blocks(WINDOW, mml, BLOCK)
    assert grouped["max_concurrency"] > 1.5 * single["max_concurrency"]
    _, _, cfg = MODEL_PRESETS["gemma-2-9b"]
    shape = shape_from_config(cfg, name="gemma-2-9b")
    groups = table_groups(shape)
    assert [(g.window, len(g.layers)) for g in groups] == [(None, 21), (4096, 21)]
    cap = cache_capacity(shape, "bfloat16", 8 * 2**30, 16, 8192)
    assert cap.blocks_per_request == 512 + 257 and cap.layers_per_block == 21
    cb = kv_cache_bytes(shape, "bfloat16", 4, 8192)
    assert cb.paged_bytes == cb.total_bytes


@pytest.mark.parametrize("kv_dtype, block", [("float32", BLOCK), ("int4", 64)])
def test_the_planner_sizes_a_hybrid_pool_as_the_engine_does(tiny_model_dirs, kv_dtype, block):
    """`kvcache plan --kv-cache-memory` gives the engine's blocks and concurrency; KIVI keeps one table of every
    layer in both (its fp16 key residual), and the pool's tokens count every layer, not one group's slots."""
    from kvcache.plan.capacity import plan_device
    from kvcache.plan.kv_bytes import pool_tokens
    from kvcache.plan.model_source import load_model_shape
    path = tiny_model_dirs["gemma2"]
    info = LLM(path, kv_cache_memory="2MiB", block_size=block, kv_cache_dtype=kv_dtype).kv_cache_info()
    c = plan_device(load_model_shape(path), kv_dtype, kv_cache_memory=2 * 2**20, block_size=block,
                    seq_len=info["max_model_len"]).capacity
    assert (c.num_blocks, c.blocks_per_request) == (info["num_blocks"], info["blocks_per_request"])
    assert c.max_concurrency == pytest.approx(info["max_concurrency"])
    grouped = kv_dtype == "float32"
    assert bool(c.layers_per_block) == grouped and info["layers_per_block"] == (1 if grouped else 2)
    tokens = info["total_bytes"] // kv_bytes_per_token(load_model_shape(path), kv_dtype)  # of every layer
    assert pool_tokens(info["num_blocks"], block, info["layers_per_block"], info["kv_layers"]).endswith(
        f"= {tokens:,} tokens" + (" of every layer" if grouped else ""))


# ---- PyramidKV: one table per layer -------------------------------------------------------------------------

def _pyramid(path: str, **kw) -> LLM:
    return LLM(path, kv_cache_memory="4MiB", max_num_batched_tokens=64, kv_eviction="pyramidkv", kv_budget=48, **kw)


def test_pyramidkv_layers_give_back_the_blocks_their_budgets_leave_dead(tiny_llama):
    """With --kv-eviction pyramidkv each layer has its own table: after the prompt's compaction the upper layer,
    which keeps fewer tokens, holds fewer blocks (its dead leading ones are back in the pool), where one table holds
    layer 0's budget in every layer; the tokens and the scores are the single table's."""
    from kvcache.compress.pyramidkv import layer_budgets
    P, B = 150, 48
    grouped, single = _pyramid(tiny_llama), _pyramid(tiny_llama, **_single_table())
    eng = grouped.engine
    assert [g.layers for g in eng.layer_groups] == [(0,), (1,)] and not single.engine.layer_groups
    bs = eng.config.block_size
    budgets = layer_budgets(B, P, 2)
    eng.add_request("a", _prompt(P, 11), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seq = eng.requests["a"].seqs[0]
    while seq.num_computed_tokens < P:
        eng.step()
    top = budgets[0]
    dead = (top - budgets[1]) // bs
    assert seq.eviction.layer_start == [0, dead * bs] and dead > 0
    assert _held(eng.kv, seq.seq_id) == [blocks_for(top, bs), blocks_for(top, bs) - dead]
    assert eng.kv.pool.num_usable - eng.kv.num_free_blocks == 2 * blocks_for(top, bs) - dead
    while eng.has_unfinished_requests():
        eng.step()
    eng.check_no_leaks()
    prompts = [_prompt(P, 12), _prompt(90, 13), _prompt(200, 14)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)] for llm in (grouped, single)]
    assert outs[0] == outs[1]
    toks = _prompt(P + 12, 15)
    from kvcache.compress.spec import EvictionSpec
    spec = EvictionSpec("pyramidkv", B)
    a, b = eng.score(toks, P - 1, eviction=spec), single.engine.score(toks, P - 1, eviction=spec)
    assert (a - b).abs().max() <= 1e-5
    eng.check_no_leaks()
    single.engine.check_no_leaks()
