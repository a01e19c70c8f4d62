"""Sliding-window models give back the blocks no future query can see, and still match transformers."""
from __future__ import annotations

import random

import pytest

from tiny_models import hf_greedy, hf_model
from kvcache import LLM, SamplingParams
from kvcache.memory.kv_cache_manager import blocks_for

WINDOW = 24  # tiny_models' mistral-swa
BLOCK = 8
CHUNK = 32


def _held(kv, seq_id: int) -> int:
    return len(kv.block_tables[seq_id]) - kv.num_released(seq_id)


@pytest.mark.parametrize("caching", [None, "hash"])
def test_a_sequence_holds_its_window_at_any_length_and_matches_transformers(tiny_model_dirs, caching):
    """40 prompt tokens and 360 generated (16x the window) in 32-token chunks: after every step the sequence holds
    at most the blocks of a window behind its newest chunk (ceil(W / block) + 1 while decoding), against the 50
    of its whole length; its tokens are transformers' greedy ones."""
    path = tiny_model_dirs["mistral-swa"]
    prompt = [random.Random(5).randrange(3, 320) for _ in range(40)]
    n = 360
    kw = {"enable_prefix_caching": caching is not None} | ({"prefix_caching_algo": caching} if caching else {})
    llm = LLM(path, kv_cache_memory="2MiB", block_size=BLOCK, max_num_batched_tokens=CHUNK, **kw)
    eng = llm.engine
    assert eng.release_window == WINDOW
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    seq = eng.requests["r"].seqs[0]
    decode_bound, chunk_bound = blocks_for(WINDOW, BLOCK) + 1, blocks_for(WINDOW - 1 + CHUNK, BLOCK) + 1
    peak_decode = peak = 0
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        if seq.seq_id in eng.kv.block_tables:
            held = _held(eng.kv, seq.seq_id)
            peak = max(peak, held)
            if seq.num_computed_tokens > len(prompt):
                peak_decode = max(peak_decode, held)
    assert peak <= chunk_bound and peak_decode == decode_bound, (peak, peak_decode)
    # the planner's figure (what kvcache plan and the start-up's concurrency count a request at) is what it held
    c = eng.capacity
    assert round(c.num_blocks / c.max_concurrency) == decode_bound
    assert blocks_for(len(prompt) + n, BLOCK) == 50
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), prompt, n)
    eng.check_no_leaks()


def test_a_long_request_fits_a_pool_smaller_than_itself(tiny_model_dirs):
    """Admission counts what a sequence holds at once: a window behind a chunk, not its whole length."""
    path = tiny_model_dirs["mistral-swa"]
    probe = LLM(path, kv_cache_memory="1MiB", block_size=BLOCK)
    per_token = probe.kv_cache_info()["bytes_per_token"]
    bound = blocks_for(WINDOW - 1 + CHUNK, BLOCK) + 1
    llm = LLM(path, kv_cache_memory=(bound + 1) * BLOCK * per_token, block_size=BLOCK, max_num_batched_tokens=CHUNK)
    prompt = list(range(3, 63))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                       use_tqdm=False)[0]
    assert blocks_for(len(prompt) + 200, BLOCK) > bound + 1  # it would not fit whole
    assert out.outputs[0].token_ids == hf_greedy(hf_model(path), prompt, 200)
    with pytest.raises(ValueError, match="whole pool"):  # unchunked, its recompute after a preemption needs it all
        LLM(path, kv_cache_memory=(bound + 1) * BLOCK * per_token, block_size=BLOCK, enable_chunked_prefill=False,
            max_num_batched_tokens=512).generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=200),
                                                 use_tqdm=False)


@pytest.mark.parametrize("arch, kw, why", [
    # layer 0 is full attention: per-layer-group tables (test_layer_groups.py), but the radix tree holds every block
    ("qwen2-swa", {"enable_prefix_caching": True, "prefix_caching_algo": "radix"}, "radix"),
    ("mistral-swa", {"enable_prefix_caching": True, "prefix_caching_algo": "radix"}, "radix"),
])
def test_every_block_is_kept_where_one_table_cannot_give_any_back(tiny_model_dirs, arch, kw, why, caplog):
    caplog.set_level("INFO", logger="kvcache")
    llm = LLM(tiny_model_dirs[arch], kv_cache_memory="2MiB", block_size=BLOCK, **kw)
    assert llm.engine.release_window is None
    assert any(why in r.getMessage() for r in caplog.records)
    out = llm.generate([{"prompt_token_ids": list(range(3, 43))}], SamplingParams(temperature=0, max_tokens=40,
                                                                                     ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model(tiny_model_dirs[arch]), list(range(3, 43)), 40)
