"""CUDA graphs of decode steps (engine/cuda_graphs.py). On the CPU the captured forward is emulated (Replay.EMULATE:
the same static buffers, padding and per-group tables, the forward re-run in place of a replay), so everything but
the capture itself is checked here; the cuda-marked tests capture real graphs (the GPU check)."""
from __future__ import annotations

import logging

import pytest
import torch

from kvcache import LLM, SamplingParams
from kvcache.engine.cuda_graphs import DecodeGraphs, Replay, capture_sizes, why_not

from tiny_models import hf_greedy, hf_model


def test_capture_sizes_follow_vllms_ladder_up_to_the_largest_decode_step():
    assert capture_sizes(128, 2048) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(20, 2048) == [1, 2, 4, 8, 16, 20]  # the largest step has a graph of its own
    assert capture_sizes(3, 2048) == [1, 2, 3]
    assert capture_sizes(256, 12) == [1, 2, 4, 8, 12]  # a step holds no more rows than max_num_batched_tokens
    with pytest.raises(ValueError, match="distinct positive batch sizes"):
        DecodeGraphs(None, None, [4, 2], 8, torch.device("cpu"))


def test_why_decode_steps_run_eager(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="2MiB", max_model_len=128)
    info = llm.kv_cache_info()["cuda_graphs"]
    assert info["captured"] is False and info["why_not"] == "CUDA graphs need a CUDA device"
    model = llm.engine.model
    assert why_not(torch.device("cpu"), "cpu", model, True) == "--enforce-eager"
    assert "attention backend torch" in why_not(torch.device("cuda"), "torch", model, False)
    assert why_not(torch.device("cuda"), "triton", model, False) is None
    mla = LLM(tiny_model_dirs["deepseek_v3"], kv_cache_memory="2MiB", max_model_len=128).engine.model
    assert "MoE counts each expert's tokens on the host" in why_not(torch.device("cuda"), "triton", mla, False)


def _emulated(path: str, **kw) -> LLM:
    """An engine whose decode steps go through the graphs' machinery (emulated on the CPU)."""
    llm = LLM(path, **kw)
    e = llm.engine
    e.runner.graphs = e.graphs.capture(e.store, e.capacity.num_blocks + 1, Replay.EMULATE)
    assert e.runner.graphs is not None and e.kv_cache_info()["cuda_graphs"]["captured"]
    return llm


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(m),), generator=g).tolist() for m in torch.randint(3, 60, (n,), generator=g)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_padded_graph_steps_give_the_eager_tokens_and_kv(tiny_model_dirs, arch):
    """Five requests of different lengths and budgets (decode steps of 5, 4, 3, 2 and 1 rows padded to the sizes
    1, 2, 4, 6), a prefix-cache hit and, for gemma3, per-layer-group tables (a sliding group giving blocks back):
    transformers' greedy tokens, the eager engine's KV in every block a sequence wrote, and no leak. Padding rows
    write the null block only."""
    path = tiny_model_dirs[arch]
    kw = dict(kv_cache_memory="4MiB", max_model_len=192, max_num_seqs=6, max_num_batched_tokens=64, block_size=16)
    graphs, eager = _emulated(path, **kw), LLM(path, **kw)
    assert graphs.engine.runner.graphs.sizes == [1, 2, 4, 6]
    if arch == "gemma3":
        assert len(graphs.engine.layer_groups) == 2
    prompts = _prompts(5, seed=1)
    prompts[4] = (prompts[0] * 32)[:32] + prompts[4]  # two blocks of prompt 0 again
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 9, 23, 3, 31)]
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    hf = hf_model(path)
    assert got == [hf_greedy(hf, p, sp.max_tokens) for p, sp in zip(prompts, params)]
    g = graphs.engine.runner.graphs
    assert g.replays > 30  # the decode steps went through it
    a, b = graphs.engine.store, eager.engine.store
    for x, y in ((a.k, b.k), (a.v, b.v)):
        for layer in range(len(x)):
            torch.testing.assert_close(x[layer][1:], y[layer][1:], atol=1e-5, rtol=0)  # every block but the null one
    graphs.engine.check_no_leaks()


def test_steps_a_graph_cannot_run_go_eager(tiny_model_dirs):
    """More rows than the largest size, prefill chunks in the step and logits of several rows (speculative
    verification) take the eager path; the same tokens come out."""
    path = tiny_model_dirs["llama"]
    kw = dict(kv_cache_memory="4MiB", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    llm, eager = _emulated(path, **kw), LLM(path, **kw)
    g = llm.engine.runner.graphs
    g.graphs = {s: f for s, f in g.graphs.items() if s <= 2}  # only sizes 1 and 2 left: 3 rows or more run eager
    prompts = [p[:20] * 3 for p in _prompts(4, seed=2)]  # repeats: the n-gram proposer finds drafts
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert llm.kv_cache_info()["spec_decode_num_drafts"] > 0
    llm.engine.check_no_leaks()


def test_a_graph_that_ignores_its_inputs_is_caught_at_start_up(tiny_model_dirs, monkeypatch, caplog):
    """The start-up check replays on inputs other than the capture's: a 'graph' that replays stale work (here: does
    nothing) is found, the engine warns and runs eager, and still gives the right tokens."""
    monkeypatch.setattr(DecodeGraphs, "_record", lambda self, step: (lambda: None))
    llm = LLM(tiny_model_dirs["llama"], kv_cache_memory="2MiB", max_model_len=128, max_num_seqs=4)
    e = llm.engine
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert e.graphs.capture(e.store, e.capacity.num_blocks + 1, Replay.EMULATE) is None
    assert "the graph of batch size 1 gave logits" in caplog.text and "decode steps run eager" in caplog.text
    assert e.kv_cache_info()["cuda_graphs"]["captured"] is False
    assert "gave logits" in e.kv_cache_info()["cuda_graphs"]["why_not"]


@pytest.mark.cuda
@pytest.mark.gpu_memory
@pytest.mark.parametrize("arch, kv", [("llama", "auto"), ("llama", "fp8_e4m3"), ("gemma3", "auto"),
                                      ("qwen3", "int8")])
def test_real_cuda_graphs_give_the_eager_tokens(tiny_model_dirs, arch, kv, caplog):
    """On a GPU: the graphs are captured at start-up (logged, with their memory, set aside by the KV sizing when the
    budget is derived), serve the decode steps, and give --enforce-eager's greedy tokens."""
    path = tiny_model_dirs[arch]
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_dtype=kv, max_model_len=256, max_num_seqs=12,
              max_num_batched_tokens=64, gpu_memory_utilization=0.3)
    with caplog.at_level(logging.INFO, logger="kvcache"):
        graphs = LLM(path, **kw)
    info = graphs.kv_cache_info()
    assert info["cuda_graphs"]["captured"], info["cuda_graphs"]
    assert info["cuda_graphs"]["sizes"] == [1, 2, 4, 8, 12]
    assert info["cuda_graphs"]["estimated_bytes"] > 0 and "CUDA graphs" in info["kv_cache_budget"]
    assert "CUDA graphs: captured 5 decode batch sizes" in caplog.text
    eager = LLM(path, enforce_eager=True, kv_cache_memory="64MiB", **{k: v for k, v in kw.items()
                                                                      if k != "gpu_memory_utilization"})
    assert eager.kv_cache_info()["cuda_graphs"]["why_not"] == "--enforce-eager"
    prompts = _prompts(9, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    # bf16 GEMMs of b rows and of n rows may round differently: the same tokens up to a near tie, most of them all
    same = sum(a == b for a, b in zip(got, ref))
    assert same >= 7, (got, ref)
    assert graphs.engine.runner.graphs.replays > 20
    graphs.engine.check_no_leaks()
