"""bfloat16 and float16 compute against transformers on the same weights, in the same dtype, on the CPU.

Tolerance: two correct implementations of a half-precision model differ by where they round, which is a
few units in the last place of the largest activations. We allow 2 x eps(dtype) x max|reference logit|
(bf16: eps 2^-7, about 0.01 on these models' logits of ~0.7; fp16: eps 2^-10, about 0.0013). That alone
would not notice a model that computed in float32 (transformers' own bfloat16 logits differ from its float32
ones by only 0.003-0.005 here), so a full bfloat16 prefill, where kvcache and transformers take the same
kernels, must also be within a quarter of that bfloat16-to-float32 gap (it is exact on the reference
machine). Greedy tokens must agree wherever the reference's top-2 margin is above the tolerance: below it, a
rounding difference may legitimately flip the argmax (bf16 logits tie outright). The tiny models have random
norm weights and biases (transformers initialises them to 1 and 0), so the order of a norm's operations and
every bias count."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import OVERFLOW_TOKEN, TINY_ARCHS, hf_greedy, hf_load, make_fp16_overflow_model
from kvcache import LLM, RequestFailedError, SamplingParams
from kvcache.attention.metadata import SeqChunk, build_batch
from kvcache.models.loader import build_model, read_checkpoint
from kvcache.store.kv_store import KVStore

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BLOCK = 4


def tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
    if dtype == torch.float32:  # on CUDA: two float32 implementations, the CPU parity tests' 1e-4
        return 1e-4
    return 2 * torch.finfo(dtype).eps * ref.abs().max().item()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 320) for _ in range(n - 1)]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids], device=hf.device)).logits[0].float().cpu()


def kv_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits of every position, the ids fed `chunk` at a time through a paged cache in the model's dtype."""
    cfg = model.config
    p = next(model.parameters())
    kv_heads, head_dim, latent = model.kv_layout
    store = KVStore(cfg.num_hidden_layers, 64, BLOCK, kv_heads, head_dim, model.compute_dtype, p.device, latent=latent)
    table = list(range(1, 1 + -(-len(ids) // BLOCK)))[::-1]  # scattered blocks
    out = []
    for s in range(0, len(ids), chunk):
        batch = build_batch([SeqChunk(ids[s:s + chunk], s, table)], BLOCK, model.windows, p.device)
        batch.logits_indices = torch.arange(batch.num_tokens, device=p.device)
        out.append(model(batch, store).float().cpu())
    return torch.cat(out)


def assert_close_and_same_greedy(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, routed: bool = False
                                 ) -> None:
    """Every row within the tolerance and the same argmax where the margin is clear. `routed` (a mixture of experts):
    a token whose expert scores tie within rounding may take another expert, a step in its logits: up to one row in
    twenty may then be off by up to 4x the tolerance (and is left out of the argmax check)."""
    tol = tolerance(ref, dtype)
    err = (got - ref).abs().amax(-1)
    off = err > tol
    if routed:
        assert off.float().mean() <= 0.05 and err.max().item() <= 4 * tol, f"rows off {off.sum()}, max {err.max():.5f}"
    else:
        assert not off.any(), f"max |diff| {err.max().item():.5f} > {tol:.5f}"
    top2 = ref.topk(2, -1).values
    clear = ((top2[:, 0] - top2[:, 1]) > tol) & ~off
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.fixture(scope="module")
def pairs(tiny_model_dirs):
    """(arch, dtype, device) -> (kvcache model, transformers model), both in that dtype on that device."""
    cache = {}

    def get(arch: str, dtype: str, device: str):
        if (arch, dtype, device) not in cache:
            d = tiny_model_dirs[arch]
            # MoE: transformers' reference loop over experts ("eager"), which kvcache computes bit for bit in one
            # prefill; its default grouped_mm kernel rounds half precision differently
            moe = {"experts_implementation": "eager"} if arch.startswith("deepseek") else {}
            cache[arch, dtype, device] = (build_model(read_checkpoint(d), 256, device, DTYPES[dtype]),
                                          hf_load(d, DTYPES[dtype], **moe)
                                          .to(device).eval())
        return cache[arch, dtype, device]
    return get


@pytest.mark.parametrize("device, dtype", [("cpu", "bfloat16"), ("cpu", "float16")] + [
    pytest.param("cuda", t, marks=pytest.mark.cuda) for t in ("bfloat16", "float16", "float32")])
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_teacher_forced_logits_and_greedy_tokens_match_transformers(pairs, arch, dtype, device):
    """A prompt and transformers' own greedy continuation, fed as one prefill, in chunks of 7, and one token at a
    time (the decode path): logits within the tolerance, argmax equal where the margin is clear."""
    model, hf = pairs(arch, dtype, device)
    prompt = prompt_of(33, seed=sum(map(ord, arch)))  # longer than mistral-swa's window of 24 with the continuation
    ids = prompt + hf_greedy(hf, prompt, 24)
    ref = hf_logits(hf, ids)
    for chunk in (len(ids), 7, 1):
        assert_close_and_same_greedy(kv_logits(model, ids, chunk), ref, DTYPES[dtype],
                                     routed=bool(getattr(model.config, "n_routed_experts", 0)))
    if (device, dtype) == ("cpu", "bfloat16"):
        # In one prefill both take the same kernels: far closer to transformers' bfloat16 than bfloat16 is to
        # float32 (here bit for bit), so a layer computed in the wrong dtype shows.
        ref32 = hf_logits(pairs(arch, "float32", device)[1], ids)
        gap = (ref - ref32).abs().max().item()
        assert (kv_logits(model, ids, len(ids)) - ref).abs().max().item() <= 0.25 * gap


def test_weights_are_stored_in_the_compute_dtype_once(pairs):
    model, hf = pairs("llama-mqa-tied", "bfloat16", "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.embed is None  # tied: the head's weight serves the lookups
    cfg = model.config
    assert model.weight_bytes == 2 * sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())  # tied once
    assert model.lm_head.weight.shape == (cfg.hidden_size, cfg.vocab_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_engine_generates_transformers_greedy_tokens(tiny_model_dirs, dtype, device):
    """Through LLM: a mixed batch with chunked prefill gives each prompt transformers' greedy continuation, up to
    the first step whose margin is within the tolerance (after it the two may part ways legitimately)."""
    path = tiny_model_dirs["qwen3"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    llm = LLM(path, dtype=dtype, device=device, kv_cache_memory="8MiB", max_num_batched_tokens=24, max_model_len=256)
    prompts = [prompt_of(n, seed=n) for n in (5, 40, 17, 9, 23, 31, 12, 50)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    compared = 0
    for p, out in zip(prompts, outs):
        expected = hf_greedy(hf, p, 16)
        ref = hf_logits(hf, p + expected)[len(p) - 1:-1]
        top2 = ref.topk(2, -1).values
        clear = ((top2[:, 0] - top2[:, 1]) > tolerance(ref, DTYPES[dtype])).tolist()
        agreed = clear.index(False) if False in clear else len(clear)
        assert out.outputs[0].token_ids[:agreed] == expected[:agreed]
        compared += agreed
    assert compared >= 24  # of 128: the check is not vacuous
    llm.engine.check_no_leaks()


@pytest.mark.demo
def test_demo_model_in_bfloat16_matches_transformers(demo_path, demo_hf):
    """The real SmolLM2 GGUF: transformers' dequantized weights cast to bfloat16 against kvcache's bfloat16 load.

    One token at a time, both engines take other SDPA kernels (bfloat16 attention on the CPU rounds differently
    for other query lengths), and over 30 layers that moves logits of ~35 by up to ~0.75 in transformers itself:
    its own cached decode against its prefill; and transformers' prefill through PyTorch's math SDPA instead of
    its default one moves them by up to 0.75 on an Intel Xeon with AMX. Both paths are held to the larger of
    the measured decode drift and 3 x eps(bfloat16) x the largest logit (about 1.0 here: four units in the last
    place of the largest logits), and to the same greedy tokens where the margin clears it: the decode path
    against transformers' own decode, and a prefill of the prompt and its greedy continuation against
    transformers' prefill (exactly equal on an AMD EPYC, 0.69 apart on that Xeon)."""
    hf32, tok = demo_hf
    hf = copy.deepcopy(hf32).to(torch.bfloat16)
    # from_pretrained(dtype=bfloat16) keeps RoPE's inverse frequencies in float32; .to() would round them too
    hf.model.rotary_emb.inv_freq = hf32.model.rotary_emb.inv_freq.clone()
    model = build_model(read_checkpoint(demo_path), 512, "cpu", torch.bfloat16)
    for text in ("The capital of France is", "def fibonacci(n):"):  # bfloat16 matmuls run at ~1 GFLOP/s here
        prompt = tok.encode(text)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0].tolist()
        full = hf_logits(hf, ids)
        steps = slice(len(prompt) - 1, len(ids) - 1)  # the positions transformers decoded
        hf_decode = torch.stack([lg[0].float() for lg in out.logits])
        drift = (hf_decode - full[steps]).abs().max().item()
        for got, ref in ((kv_logits(model, ids, len(ids)), full), (kv_logits(model, ids, 1)[steps], hf_decode)):
            tol = max(1.5 * tolerance(ref, torch.bfloat16), drift)
            assert (got - ref).abs().max().item() <= tol, ((got - ref).abs().max().item(), tol)
            top2 = ref.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1]) > tol
            assert clear.any() and torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_float16_overflow_fails_only_the_requests_it_hits(tiny_llama, tmp_path):
    """A model whose float16 activations overflow on one token: requests holding it fail with the reason, the
    others run on and produce float32's tokens; offline, generate raises once all are done, with every output."""
    path = make_fp16_overflow_model(tiny_llama, str(tmp_path / "overflow"))
    prompts = [[5, 6, OVERFLOW_TOKEN, 8], [5, 6, 8, 9], [OVERFLOW_TOKEN], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fp32 = LLM(path, dtype="float32", kv_cache_memory="4MiB", max_model_len=128).generate(prompts, params,
                                                                                         use_tqdm=False)
    llm = LLM(path, dtype="float16", kv_cache_memory="4MiB", max_model_len=128)
    with pytest.raises(RequestFailedError, match="2 of 4 requests failed") as e:
        llm.generate(prompts, params, use_tqdm=False)
    for prompt, ref, out in zip(prompts, fp32, e.value.outputs):
        if OVERFLOW_TOKEN in prompt:
            assert out.outputs[0].finish_reason == "error" and "non-finite logits" in out.error
        else:
            assert out.error is None and out.outputs[0].token_ids == ref.outputs[0].token_ids
    llm.engine.check_no_leaks()
    assert llm.generate([[5, 6, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids == fp32[1].outputs[0].token_ids


@pytest.mark.cuda
@pytest.mark.parametrize("kv", ["auto", "float32", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_every_kv_format_and_feature_runs_on_cuda(tiny_model_dirs, kv, backend):
    """bfloat16 on the GPU with each KV format on each backend (auto: the Triton kernels where they read the format):
    a mixed batch with chunked prefill, prefix-cache hits, n > 1 and eviction gives transformers' greedy tokens up to
    a near tie, and leaks nothing."""
    path = tiny_model_dirs["llama"]
    if backend == "auto" and kv in ("int4", "int2"):
        pytest.skip("auto takes the torch path for KIVI formats (tested with backend torch)")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    block = 64 if kv in ("int4", "int2") else 16
    llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_dtype=kv, attention_backend=backend, block_size=block,
              kv_cache_memory="64MiB", max_num_batched_tokens=48, max_model_len=256)
    prompts = [prompt_of(n, seed=n) for n in (5, 70, 33, 70)]
    prompts[3][:64] = prompts[1][:64]  # a prefix-cache hit on the second pass
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for _ in range(2):
        for p, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            expected = hf_greedy(hf, p, 12)
            if kv in ("auto", "float32"):  # the same bf16 model: equal up to a near tie
                ref = hf_logits(hf, p + expected)[len(p) - 1:-1]
                top2 = ref.topk(2, -1).values
                clear = ((top2[:, 0] - top2[:, 1]) > tolerance(ref, torch.bfloat16)).tolist()
                agreed = clear.index(False) if False in clear else len(clear)
                assert out.outputs[0].token_ids[:agreed] == expected[:agreed]
            assert len(out.outputs[0].token_ids) == 12
    assert llm.kv_cache_info()["prefix_cache_hits"] > 0
    samples = llm.generate(prompts[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)
    assert len(samples[0].outputs) == 3
    if kv not in ("int4", "int2"):
        from kvcache.compress.spec import EvictionSpec
        llm.engine.add_request("ev", prompts[1], params, eviction=EvictionSpec("h2o", 40))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    llm.engine.check_no_leaks()


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_failed_requests_blocks_are_scrubbed_before_anyone_reuses_them(tiny_llama, tmp_path, kv):
    """A 3-block pool: the overflowing request's blocks (NaN K/V) are the next request's. Attention reads whole
    blocks and 0 x NaN is NaN in a masked slot, so unless they are cleared the innocent request fails too."""
    path = make_fp16_overflow_model(tiny_llama, str(tmp_path / "overflow"))
    per_token = LLM(path, dtype="float16", kv_cache_dtype=kv, kv_cache_memory="1MiB",
                    max_model_len=32).kv_cache_info()["bytes_per_token"]
    llm = LLM(path, dtype="float16", kv_cache_dtype=kv, kv_cache_memory=3 * 16 * per_token, max_model_len=32,
              enable_prefix_caching=False, attention_backend="torch")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate([[5, 6, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):  # the free list is LRU: two failures poison two of the three blocks
        with pytest.raises(RequestFailedError, match="non-finite"):
            llm.generate([list(range(10, 24)) + [OVERFLOW_TOKEN]], params, use_tqdm=False)
    for _ in range(3):  # so that one of these is handed a block the failures held
        assert llm.generate([[5, 6, 8, 9]], params, use_tqdm=False)[0].outputs[0].token_ids == before
    llm.engine.check_no_leaks()
