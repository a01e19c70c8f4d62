"""Tensor parallelism over torch.distributed (gloo, 2 ranks on the CPU): the same greedy tokens as one rank, half the
KV heads per rank as the planner counts, a dead rank reported instead of hung on, bad sizes refused with numbers."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from transformers import AutoConfig

from kvcache import LLM, SamplingParams
from kvcache.compress.spec import POLICIES, EvictionSpec
from kvcache.engine.llm_engine import EngineDeadError
from kvcache.plan.kv_bytes import kv_bytes_per_token
from kvcache.plan.shape import shape_from_config

from tiny_models import hf_greedy, hf_model

KW = dict(kv_cache_memory="1MiB", max_model_len=160, max_num_batched_tokens=32, block_size=16)


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(m),), generator=g).tolist() for m in torch.randint(5, 70, (n,), generator=g)]


def _tokens(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def tp_llm():
    made = []

    def make(path, **kw):
        llm = LLM(path, tensor_parallel_size=2, **{**KW, **kw})
        made.append(llm)
        return llm
    yield make
    for llm in made:
        llm.engine.close()


# llama: GQA 4 heads over 2 KV heads (one KV head per rank); llama-mqa-tied: one KV head, replicated on both ranks,
# and a tied vocabulary-parallel embedding; qwen2: q/k/v biases; qwen3: q/k norms and head_dim 32
@pytest.mark.parametrize("arch, kv", [("llama", "auto"), ("llama-mqa-tied", "int8"), ("qwen2", "fp8_e4m3"),
                                      ("qwen3", "int4")])
def test_two_ranks_give_one_ranks_tokens(tiny_model_dirs, tp_llm, arch, kv):
    """A mixed batch with chunked prefill (32-token steps), a prefix-cache hit on the second pass, preemptions
    (a pool of 14 blocks) and seeded samples with n = 2 (forks: their block copies reach the worker's store): the tokens
    of one rank, and transformers' greedy tokens in float32."""
    path = tiny_model_dirs[arch]
    block = 64 if kv == "int4" else 16
    # a pool of a few requests, as many blocks on each rank as on one (a rank's block holds its KV heads only)
    shape = shape_from_config(AutoConfig.from_pretrained(path).to_dict())
    dtype = "float32" if kv == "auto" else kv
    blocks = 30 if kv == "int4" else 14  # int4: 64-token blocks, 2 a request and 2 for its key residual
    one = LLM(path, kv_cache_dtype=kv, **{**KW, "block_size": block,
                                          "kv_cache_memory": blocks * block * kv_bytes_per_token(shape, dtype)})
    two = tp_llm(path, kv_cache_dtype=kv, block_size=block,
                 kv_cache_memory=blocks * block * kv_bytes_per_token(shape, dtype, 2))
    assert two.kv_cache_info()["num_blocks"] == one.kv_cache_info()["num_blocks"] == blocks
    prompts = _prompts(seed=len(arch))
    prompts.append((prompts[1] * 9)[:block + 8])  # at least a block: a prefix-cache hit on the second pass
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for _ in range(2):
        assert _tokens(two, prompts, greedy) == _tokens(one, prompts, greedy)
    assert two.kv_cache_info()["prefix_cache_hits"] > 0
    if kv != "int4":  # (its pool fits the prefix to hit on instead)
        assert two.kv_cache_info()["num_preemptions"] > 0
    if kv == "auto":
        hf = hf_model(path)
        assert [t[0] for t in _tokens(two, prompts, greedy)] == [hf_greedy(hf, p, 24) for p in prompts]
    sampled = SamplingParams(n=2, temperature=1.0, top_k=20, seed=5, max_tokens=12, ignore_eos=True)
    assert _tokens(two, prompts[:2], sampled) == _tokens(one, prompts[:2], sampled)
    two.engine.check_no_leaks()


def test_each_rank_holds_the_planners_per_gpu_kv_bytes(tiny_model_dirs, tp_llm):
    path = tiny_model_dirs["llama"]
    two = tp_llm(path)
    logs = two.engine.tp.log_dir
    assert os.listdir(logs) == ["rank1.log"]
    info = two.kv_cache_info()
    shape = two.engine.shape  # the whole model's
    assert info["bytes_per_token"] == kv_bytes_per_token(shape, "float32", 2) == kv_bytes_per_token(shape, "float32") // 2
    assert info["formula"].endswith(f"= {info['bytes_per_token']:,} bytes/token per rank (2 ranks)")  # what it holds
    store = two.engine.store
    assert store.nbytes == info["bytes_per_token"] * info["block_size"] * (info["num_blocks"] + 1)
    assert store.k[0].shape[2] == 1  # one of the two KV heads on this rank (the worker checks its own store alike)
    two.engine.close()
    assert not os.path.exists(logs)  # every worker exited with 0: nothing left in /tmp


def test_a_rank_that_dies_is_reported_not_hung_on(tiny_model_dirs, tp_llm):
    two = tp_llm(tiny_model_dirs["llama"])
    proc = two.engine.tp.procs[0]
    proc.kill()
    proc.wait(timeout=10)
    with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 \(process \d+\) exited with code -9"):
        two.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
    two.engine.close()
    assert os.path.exists(two.engine.tp.logs[0])  # the dead rank's log, which its error names, stays
    shutil.rmtree(two.engine.tp.log_dir)


def test_bad_sizes_are_refused_before_loading_with_the_numbers(tiny_model_dirs):
    path = tiny_model_dirs["llama"]  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the 2 KV heads or be a multiple of them"):
        LLM(path, tensor_parallel_size=3, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs a CPU core per rank; this process may use"):
        LLM(path, tensor_parallel_size=4, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(path, tensor_parallel_size=0, **KW)
    with pytest.raises(ValueError, match="runs the llama, mistral, qwen2, qwen3 architectures, not gemma2"):
        LLM(tiny_model_dirs["gemma2"], tensor_parallel_size=2, **KW)
    with pytest.raises(ValueError, match="cannot be combined with the KV offload tiers yet"):
        LLM(path, tensor_parallel_size=2, kv_offload_memory="1MiB", **KW)


def test_what_tensor_parallelism_cannot_take_is_refused_with_the_numbers(tiny_model_dirs, monkeypatch):
    """Refusals that start no process: the combinations rank 0's store alone serves, a size that does not divide the
    query heads, more ranks than GPUs, and replicas of a tensor-parallel engine."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from kvcache.config import EngineConfig
    from kvcache.router.replicas import serve_replicas
    from kvcache.parallel.sharding import check_tensor_parallel
    path = tiny_model_dirs["llama"]
    with pytest.raises(ValueError, match="cannot be combined with the KV offload tiers and preemption_mode swap yet"):
        LLM(path, tensor_parallel_size=2, preemption_mode="swap", kv_offload_memory="1MiB", **KW)
    with pytest.raises(ValueError, match="cannot be combined with a draft model yet"):
        LLM(path, tensor_parallel_size=2, speculative_config={"model": path, "num_speculative_tokens": 2}, **KW)
    cfg = LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=64,
                      num_hidden_layers=1, vocab_size=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 must divide num_attention_heads \(6\)"):
        check_tensor_parallel(cfg, 4, torch.device("cpu"))
    cfg.num_attention_heads = 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs; torch sees 1"):
        check_tensor_parallel(cfg, 2, torch.device("cuda"))
    with pytest.raises(ValueError, match="--replicas with --tensor-parallel-size is not supported yet"):
        serve_replicas(SimpleNamespace(replicas=2), EngineConfig(model=path, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="--replicas must be >= 1, got 0"):
        serve_replicas(SimpleNamespace(replicas=0), EngineConfig(model=path))
    for balance in (-1.0, float("nan")):  # refused before Ray starts (the test has no Ray cluster)
        with pytest.raises(ValueError, match="routing balance must be >= 0"):
            serve_replicas(SimpleNamespace(replicas=2, routing="kv-aware", routing_balance=balance),
                           EngineConfig(model=path))


def _evicting(engine, prompts, specs, params) -> list[list[int]]:
    """Each prompt with its own eviction (all in one continuous batch), stepped to the end: their tokens."""
    for i, (p, spec) in enumerate(zip(prompts, specs)):
        engine.add_request(str(i), p, params, eviction=spec)
    done = engine.run_to_completion()
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


# llama: one KV head per rank with all its query heads (h2o, snapkv and pyramidkv score per head on each rank alone;
# tova's mean over a layer's heads is all-reduced); llama-mqa-tied: its one KV head on both ranks, each with half of
# its query heads, so every per-head score is all-reduced before the ranks select
@pytest.mark.parametrize("arch", ["llama", "llama-mqa-tied"])
def test_every_eviction_policy_on_two_ranks_keeps_one_ranks_tokens(tiny_model_dirs, tp_llm, arch):
    """Every policy at once in one batch (prompts past the 40-token budget, 16-token blocks, chunked prefill: decode-time
    policies compact again every block): the tokens of one rank, as many tokens evicted and blocks freed, no leak."""
    path = tiny_model_dirs[arch]
    policies = [p for p in POLICIES if p != "none"]
    specs = [EvictionSpec(p, 40) for p in policies]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(60, 100, (len(specs),),
                                                                                               generator=g)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    one = LLM(path, **KW)
    two = tp_llm(path)
    tokens = _evicting(two.engine, prompts, specs, greedy)
    assert tokens == _evicting(one.engine, prompts, specs, greedy)
    a, b = one.kv_cache_info(), two.kv_cache_info()
    assert b["eviction_compactions"] >= 2 * len(specs)  # the prompt's, and the decode-time policies' again
    for k in ("evicted_tokens", "eviction_freed_blocks", "eviction_compactions"):
        assert b[k] == a[k], k
    # a tiny random model's greedy tokens barely depend on which tokens a cache kept: its logits do (score runs one
    # sequence's chunks with a policy; a rank that kept other tokens gives other logits)
    for prompt, out, spec in zip(prompts, tokens, specs):
        ids = prompt + out
        got, want = (llm.engine.score(ids, len(prompt) - 1, chunk_size=32, eviction=spec) for llm in (two, one))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=spec.policy)
    two.engine.check_no_leaks()
    assert two.engine.tp.procs[0].poll() is None


def test_per_layer_group_tables_on_two_ranks(tiny_model_dirs, tp_llm):
    """A model mixing full and sliding layers keeps a table per group on every rank (the chunks carry each group's
    tables to the worker): the sliding group gives back blocks behind its window, the tokens are one rank's and
    transformers'; and --kv-eviction pyramidkv (a table per layer, dead leading blocks given back) likewise."""
    path = tiny_model_dirs["qwen2-swa"]  # window 24: layer 0 full, layer 1 sliding
    prompts = [p * 4 for p in _prompts(seed=4, n=3)]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    kw = dict(max_model_len=400, kv_cache_memory="2MiB")
    one, two = LLM(path, **{**KW, **kw}), tp_llm(path, **kw)
    assert [g.window for g in two.engine.layer_groups] == [None, 24]
    freed = []
    real = two.engine.kv.slide
    two.engine.kv.slide = lambda seq_id, n: freed.extend(real(seq_id, n)) or freed
    got = _tokens(two, prompts, greedy)
    assert got == _tokens(one, prompts, greedy)
    assert [t[0] for t in got] == [hf_greedy(hf_model(path), p, 60) for p in prompts]
    assert freed  # out-of-window blocks went back to the pool while the requests ran
    two.engine.check_no_leaks()
    two.engine.close()  # one process group per process

    path = tiny_model_dirs["llama"]
    kw = dict(kv_eviction="pyramidkv", kv_budget=40, max_model_len=240)
    one, two = LLM(path, **{**KW, **kw}), tp_llm(path, **kw)
    assert len(two.engine.layer_groups) == two.engine.shape.num_layers
    prompts = [torch.randint(3, 300, (90,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    assert _tokens(two, prompts, greedy) == _tokens(one, prompts, greedy)
    a, b = one.kv_cache_info(), two.kv_cache_info()
    assert b["eviction_freed_blocks"] == a["eviction_freed_blocks"] > 0
    two.engine.check_no_leaks()


def test_ngram_speculation_on_two_ranks(tiny_model_dirs, tp_llm):
    """Verification rows (several logits of one sequence, each attended as a decode) go through the broadcast too:
    one rank's tokens, with proposals accepted."""
    path = tiny_model_dirs["llama"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    one = LLM(path, speculative_config=spec, **KW)
    two = tp_llm(path, speculative_config=spec)
    prompts = [p[:20] * 3 for p in _prompts(seed=9, n=3)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert _tokens(two, prompts, greedy) == _tokens(one, prompts, greedy)
    assert two.kv_cache_info()["spec_decode_num_accepted_tokens"] > 0


def test_torchrun_starts_every_rank_and_the_command_runs_on_rank_0(tiny_model_dirs):
    """The multi-node launch, on one machine: `torchrun --nproc-per-node 2 -m kvcache.cli generate ...`; rank 1
    serves as rank 0's worker and exits 0 when it stops; rank 0 prints one rank's text."""
    import subprocess
    import sys
    path = tiny_model_dirs["llama"]
    args = ["-m", "kvcache.cli", "generate", "--model", path, "--kv-cache-memory", "1MiB", "--max-model-len", "128",
            "--prompt", "w5 w6 w7 w8", "--max-tokens", "8", "--ignore-eos"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = subprocess.run(torchrun + args + ["--tensor-parallel-size", "2"], capture_output=True, text=True,
                         timeout=240)
    one = subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=240)
    assert two.returncode == 0, two.stderr[-2000:]
    text = [line for line in one.stdout.splitlines() if line.startswith("w")]
    assert text and [line for line in two.stdout.splitlines() if line.startswith("w")] == text
