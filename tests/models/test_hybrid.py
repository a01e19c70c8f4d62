"""State-space and hybrid models (models/hybrid.py, qwen3_next.py): Mamba-2, Bamba and Qwen3-Next against
transformers on tiny random models, through chunked prefill (chunks that split the scan's blocks and the conv
window), continuous batching, preemption, forks and prefix caching of states; their state pool as the planner sizes
it; what cannot run on a per-sequence state refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from kvcache import LLM, SamplingParams
from kvcache.models.rope import apply_rope, partial_rotary_order, rope_tables
from kvcache.models.ssm import ssd_chunk, ssm_step
from kvcache.plan.kv_bytes import state_bytes_per_seq
from kvcache.plan.shape import shape_from_config
from kvcache.store.state_store import StateStore
from tiny_models import TINY_HYBRIDS, hf_greedy, hf_model, make_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hybrids")
    return {a: make_tiny_model(str(root / a), a) for a in TINY_HYBRIDS}


def _prompts(n: int = 4) -> list[list[int]]:
    return [list(range(3 + i, 40 + 7 * i)) for i in range(n)]  # 37 to 58 tokens: 3 to 4 scan blocks of 16


def test_the_scan_is_transformers_and_its_steps_and_any_split_of_it():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    g = torch.Generator().manual_seed(0)
    n, H, P, G, N = 37, 4, 8, 2, 6
    x, raw_dt = torch.randn(n, H, P, generator=g), torch.randn(n, H, generator=g)
    A, D, bias = -torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g), torch.randn(H, generator=g)
    B, C, start = torch.randn(n, G, N, generator=g), torch.randn(n, G, N, generator=g), torch.randn(H, P, N, generator=g)
    dt = F.softplus(raw_dt + bias)
    want, want_final = mamba2_chunk_scan(x[None], raw_dt[None], A, B[None], C[None], chunk_size=8, D=D, dt_bias=bias,
                                         initial_states=start[None], dt_softplus=True, return_final_states=True)
    y, final = ssd_chunk(x, dt, A, B, C, D, 8, start)
    torch.testing.assert_close(y, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final[0], atol=1e-5, rtol=1e-5)
    state, steps = start[None].clone(), []
    for t in range(n):  # the one-step recurrence, token by token
        out, state = ssm_step(state, x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], final, atol=1e-5, rtol=1e-5)
    y1, mid = ssd_chunk(x[:13], dt[:13], A, B[:13], C[:13], D, 8, start)  # a split inside a block
    y2, end = ssd_chunk(x[13:], dt[13:], A, B[13:], C[13:], D, 8, mid)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_a_partial_rotation_is_a_full_one_on_permuted_dims(hybrid_dirs):
    """Bamba rotates half of each head: our layout (partial_rotary_order) under the full-width tables gives the same
    scores as transformers' partial rotation."""
    from transformers import AutoConfig
    from transformers.models.bamba.modeling_bamba import BambaRotaryEmbedding, apply_rotary_pos_emb
    cfg = AutoConfig.from_pretrained(hybrid_dirs["bamba"])
    order = partial_rotary_order(cfg)
    D = cfg.hidden_size // cfg.num_attention_heads
    assert sorted(order) == list(range(D)) and order != list(range(D))
    q, k, pos = torch.randn(1, 2, 9, D), torch.randn(1, 2, 9, D), torch.arange(9)
    cos, sin = BambaRotaryEmbedding(cfg)(q, pos[None])
    hq, hk = apply_rotary_pos_emb(q, k, cos, sin)
    ours_cos, ours_sin = (t[pos][:, None] for t in rope_tables(cfg, 16))
    oq = apply_rope(q[0].transpose(0, 1)[..., order], ours_cos, ours_sin).transpose(0, 1)  # [heads, 9, D]
    ok = apply_rope(k[0].transpose(0, 1)[..., order], ours_cos, ours_sin).transpose(0, 1)
    torch.testing.assert_close(oq @ ok.transpose(-1, -2), hq[0] @ hk[0].transpose(-1, -2), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(oq @ ok.transpose(-1, -2), q[0] @ k[0].transpose(-1, -2), atol=1e-3)  # it rotates


@pytest.mark.parametrize("arch", list(TINY_HYBRIDS))
def test_greedy_equals_transformers_through_chunks_and_batching(hybrid_dirs, arch):
    """4 prompts, 3 running at once, 32 tokens a step: prompts are split mid-block and decode rows share steps
    with other sequences' prompt chunks."""
    hf = hf_model(hybrid_dirs[arch])
    prompts = _prompts()
    want = [hf_greedy(hf, p, 16) for p in prompts]
    llm = LLM(hybrid_dirs[arch], max_num_batched_tokens=32, max_num_seqs=3, kv_cache_memory=2**22)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == want
    info = llm.kv_cache_info()
    assert info["free_state_slots"] == 3 and info["state_slots"] == 3 + info["state_snapshot_slots"]  # all given back


@pytest.mark.parametrize("arch", ["bamba", "qwen3_next"])  # (Mamba-2's blocks hold no bytes: none run out)
def test_a_preempted_sequence_recomputes_its_state(hybrid_dirs, arch):
    """A pool of 12 blocks for 3 sequences of up to 82 tokens: some are preempted (their slot given back) and
    recomputed from their tokens, never resumed from a stale state."""
    path = hybrid_dirs[arch]
    hf = hf_model(path)
    prompts = _prompts()
    want = [hf_greedy(hf, p, 24) for p in prompts]
    sizes = LLM(path, max_num_seqs=3, enable_prefix_caching=False, kv_cache_memory=2**22).kv_cache_info()
    budget = 3 * sizes["state_bytes_per_seq"] + 12 * 16 * sizes["bytes_per_token"]
    llm = LLM(path, max_num_batched_tokens=32, max_num_seqs=3, max_model_len=128, enable_prefix_caching=False,
              kv_cache_memory=budget)
    assert llm.kv_cache_info()["num_blocks"] == 12
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=24, **GREEDY))
    assert llm.kv_cache_info()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next"])
def test_samples_forked_after_the_prompt_continue_from_its_state(hybrid_dirs, monkeypatch, arch):
    path = hybrid_dirs[arch]
    prompt = _prompts()[1]
    want = hf_greedy(hf_model(path), prompt, 12)
    copies = []
    real = StateStore.copy
    monkeypatch.setattr(StateStore, "copy", lambda self, pairs: (copies.extend(pairs), real(self, pairs)))
    llm = LLM(path, max_num_seqs=4, kv_cache_memory=2**22)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, n=3, **GREEDY))[0]
    assert len(copies) == 2  # the two samples forked from the first: their slots copied from its slot
    assert [c.token_ids for c in out.outputs] == [want] * 3


@pytest.mark.parametrize("arch", list(TINY_HYBRIDS))
def test_the_state_pool_is_what_the_planner_counts(hybrid_dirs, arch):
    with open(os.path.join(hybrid_dirs[arch], "config.json")) as f:
        shape = shape_from_config(json.load(f))
    per_seq = state_bytes_per_seq(shape, "float32")
    per_layer = {  # Mamba-2: conv state (128 channels of x + 2 groups x 16 of B and C) x 3, SSM state 8 x 16 x 16
        "mamba2": (128 + 2 * 2 * 16) * 3 + 8 * 16 * 16, "bamba": (128 + 2 * 2 * 16) * 3 + 8 * 16 * 16,
        # Gated DeltaNet: conv state (q and k of 2 heads x 16, v of 4 heads x 16) x 3, delta state 4 x 16 x 16
        "qwen3_next": (2 * 2 * 16 + 4 * 16) * 3 + 4 * 16 * 16}[arch]
    assert per_seq == shape.count("linear") * per_layer * 4
    llm = LLM(hybrid_dirs[arch], max_num_seqs=5, num_state_snapshots=7, kv_cache_memory=2**22)
    info = llm.kv_cache_info()
    assert info["state_bytes_per_seq"] == per_seq and info["state_slots"] == 5 + 7
    assert info["state_snapshot_slots"] == 7 and info["max_concurrency"] <= 5
    assert llm.engine.state_store.nbytes == info["state_bytes"] == 12 * per_seq
    assert info["total_bytes"] + info["state_bytes"] <= 2**22
    assert info["kv_layers"] == shape.num_kv_layers
    off = LLM(hybrid_dirs[arch], max_num_seqs=5, enable_prefix_caching=False, kv_cache_memory=2**22).kv_cache_info()
    assert off["state_slots"] == 5 and off["state_snapshot_slots"] == 0 and off["prefix_caching"] is None


@pytest.mark.parametrize("kwargs, words", [
    (dict(kv_eviction="h2o", kv_budget=64), "kv_eviction h2o"),
    (dict(kv_cache_dtype="int4"), "KIVI"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(quantization="int8"), "--quantization int8"),
    (dict(prefix_caching_algo="radix"), "radix prefix cache"),
])
def test_what_cannot_run_on_a_per_sequence_state_is_refused(hybrid_dirs, kwargs, words):
    with pytest.raises(ValueError, match=f"linear-attention / SSM layers: .*{words}"):
        LLM(hybrid_dirs["bamba"], kv_cache_memory=2**22, **kwargs)


def test_a_budget_without_room_for_the_states_is_refused(hybrid_dirs):
    with pytest.raises(ValueError, match="does not hold the state of 16 sequences"):
        LLM(hybrid_dirs["mamba2"], max_num_seqs=8, kv_cache_memory=1000)


@pytest.mark.parametrize("arch", list(TINY_HYBRIDS))
def test_a_slot_handed_on_starts_from_zeros(hybrid_dirs, arch):
    """One slot, three requests in turn: the third (the first's prompt again) computes the first's very floats, not
    a state left by the second."""
    llm = LLM(hybrid_dirs[arch], max_num_seqs=1, kv_cache_memory=2**22)
    params = SamplingParams(max_tokens=4, logprobs=1, **GREEDY)
    first, _, again = (llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0]
                       for p in (list(range(5, 45)), list(range(50, 90)), list(range(5, 45))))
    assert again.token_ids == first.token_ids
    assert again.cumulative_logprob == pytest.approx(first.cumulative_logprob, abs=1e-6)


@pytest.mark.parametrize("arch", list(TINY_HYBRIDS))
def test_a_shared_prefix_starts_from_a_snapshot_of_its_state(hybrid_dirs, arch):
    """Snapshots every 16 tokens: a second prompt sharing 40 tokens with the first starts from the state after 32
    (the deepest snapshot its cached chain reaches), and computes what transformers and an engine without prefix
    caching compute."""
    path = hybrid_dirs[arch]
    shared = list(range(100, 140))
    first, second = shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]
    want = hf_greedy(hf_model(path), second, 12)
    params = SamplingParams(max_tokens=12, logprobs=1, **GREEDY)
    llm = LLM(path, mamba_block_size=16, max_num_seqs=4, kv_cache_memory=2**22)
    llm.generate([{"prompt_token_ids": first}], params)
    before = llm.kv_cache_info()
    out = llm.generate([{"prompt_token_ids": second}], params)[0]
    got, info = out.outputs[0], llm.kv_cache_info()
    assert out.num_cached_tokens == 32
    assert info["state_snapshot_hits"] - before["state_snapshot_hits"] == 1
    assert info["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    assert got.token_ids == want
    cold = LLM(path, enable_prefix_caching=False, max_num_seqs=4, kv_cache_memory=2**22)
    alone = cold.generate([{"prompt_token_ids": second}], params)[0].outputs[0]
    assert got.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)


def test_a_conversation_resumes_from_the_state_its_last_turn_left(hybrid_dirs):
    """Turn 2 is turn 1's prompt, its answer and a new message: the snapshots taken while the answer was decoded
    serve it, so it recomputes fewer than 16 + 8 of its tokens."""
    path = hybrid_dirs["bamba"]
    llm = LLM(path, mamba_block_size=16, max_num_seqs=4, kv_cache_memory=2**22)
    params = SamplingParams(max_tokens=20, **GREEDY)
    turn1 = list(range(20, 57))
    answer = llm.generate([{"prompt_token_ids": turn1}], params)[0].outputs[0].token_ids
    turn2 = turn1 + answer + [5, 6, 7, 8, 9, 10, 11, 12]
    before = llm.kv_cache_info()["prefix_cache_hits"]
    got = llm.generate([{"prompt_token_ids": turn2}], params)[0].outputs[0].token_ids
    hits = llm.kv_cache_info()["prefix_cache_hits"] - before
    assert hits == (len(turn1) + len(answer) - 1) // 16 * 16 == 48  # the answer's last token is not in the cache
    assert got == hf_greedy(hf_model(path), turn2, 20)


def test_snapshots_beyond_their_slots_are_evicted_least_recent_first(hybrid_dirs):
    """One snapshot slot: each prompt's snapshot evicts the last; a prompt whose snapshot is gone is recomputed
    from zeros (no hit, the right tokens), never started from another prefix's state."""
    path = hybrid_dirs["mamba2"]
    llm = LLM(path, mamba_block_size=32, num_state_snapshots=1, max_num_seqs=4, kv_cache_memory=2**22)
    params = SamplingParams(max_tokens=6, logprobs=1, **GREEDY)
    a, b = list(range(10, 50)), list(range(60, 100))
    first = llm.generate([{"prompt_token_ids": a + [1]}], params)[0].outputs[0]
    llm.generate([{"prompt_token_ids": b + [1]}], params)
    info = llm.kv_cache_info()
    assert info["state_snapshots"] == 1 and info["state_snapshots_evicted"] >= 1
    again = llm.generate([{"prompt_token_ids": a + [1]}], params)[0].outputs[0]
    assert llm.kv_cache_info()["state_snapshot_hits"] == info["state_snapshot_hits"]  # a's snapshot was evicted
    assert again.token_ids == first.token_ids
    assert again.cumulative_logprob == pytest.approx(first.cumulative_logprob, abs=1e-5)


def test_the_multi_turn_bench_saves_prefill_on_a_hybrid(hybrid_dirs, tmp_path):
    """`kvcache bench throughput --workload multi-turn` with prefix caching off and on: the same greedy tokens, and
    each turn after the first starts from the state its conversation's last turn left."""
    from kvcache.cli import main
    out = tmp_path / "mt.json"
    rc = main(["bench", "throughput", "--model", hybrid_dirs["bamba"], "--workload", "multi-turn",
               "--prefix-caching-modes", "off,hash", "--num-conversations", "3", "--num-turns", "3",
               "--prefix-len", "40", "--suffix-len", "12", "--output-len", "12", "--mamba-block-size", "16",
               "--max-num-seqs", "4", "--kv-cache-memory", "4MiB", "--json", str(out)])
    assert rc == 0
    modes = json.loads(out.read_text())["modes"]
    assert modes["hash"]["outputs_match_first_mode"] and modes["off"]["prefix_cache_hits"] == 0
    assert modes["hash"]["prefill_reduction"] > 0.5


def test_the_delta_rule_is_transformers_and_its_steps_and_any_split_of_it():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    from kvcache.models.delta_rule import delta_chunk, delta_step
    gen = torch.Generator().manual_seed(0)
    n, Hk, Hv, dk, dv = 37, 2, 4, 8, 6
    q, k = torch.randn(n, Hk, dk, generator=gen), torch.randn(n, Hk, dk, generator=gen)
    v, start = torch.randn(n, Hv, dv, generator=gen), torch.randn(Hv, dk, dv, generator=gen)
    g, beta = -torch.rand(n, Hv, generator=gen), torch.rand(n, Hv, generator=gen)
    want, want_final = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], chunk_size=8,
                                                    initial_state=start[None], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    y, final = delta_chunk(q, k, v, g, beta, 8, start)
    torch.testing.assert_close(y, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final[0], atol=1e-5, rtol=1e-5)
    state, steps = start[None], []
    for t in range(n):
        out, state = delta_step(state, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1])
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps), y, atol=1e-5, rtol=1e-5)
    y1, mid = delta_chunk(q[:13], k[:13], v[:13], g[:13], beta[:13], 8, start)
    y2, end = delta_chunk(q[13:], k[13:], v[13:], g[13:], beta[13:], 8, mid)
    torch.testing.assert_close(torch.cat([y1, y2]), y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)
