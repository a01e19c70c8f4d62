"""bfloat16 and float16 compute against transformers on the same weights, in the same dtype, on the CPU.

Tolerance: two correct implementations of a half-precision model differ by where they round, which is a
few units in the last place of the largest activations. We allow 2 x eps(dtype) x max|reference logit|
(bf16: eps 2^-7, about 0.01 on these models' logits of ~0.7; fp16: eps 2^-10, about 0.0013). For scale,
transformers' own half-precision logits differ from its float32 ones by 0.003-0.005 (bf16) and
0.0004-0.0008 (fp16) on the same models, and a real defect (RoPE or a norm in the wrong dtype, a missing
bias) moves them by far more. Greedy tokens must agree wherever the reference's top-2 margin is above that
tolerance: below it, a rounding difference may legitimately flip the argmax (bf16 logits tie outright)."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import OVERFLOW_TOKEN, TINY_ARCHS, hf_greedy, make_fp16_overflow_model
from kvcache import LLM, RequestFailedError, SamplingParams
from kvcache.attention.metadata import SeqChunk, build_batch
from kvcache.models.llama import head_dim_of
from kvcache.models.loader import build_model, read_checkpoint
from kvcache.store.kv_store import KVStore

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK = 4


def tolerance(ref: torch.Tensor, dtype: torch.dtype) -> float:
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
    store = KVStore(cfg.num_hidden_layers, 64, BLOCK, cfg.num_key_value_heads, head_dim_of(cfg), p.dtype, p.device)
    table = list(range(1, 1 + -(-len(ids) // BLOCK)))[::-1]  # scattered blocks
    out = []
    for s in range(0, len(ids), chunk):
        batch = build_batch([SeqChunk(ids[s:s + chunk], s, table)], BLOCK, model.windows, p.device)
        batch.logits_indices = torch.arange(batch.num_tokens, device=p.device)
        out.append(model(batch, store).float().cpu())
    return torch.cat(out)


def assert_close_and_same_greedy(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = tolerance(ref, dtype)
    assert (got - ref).abs().max().item() <= tol, f"max |diff| {(got - ref).abs().max().item():.5f} > {tol:.5f}"
    top2 = ref.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.fixture(scope="module")
def pairs(tiny_model_dirs):
    """(arch, dtype, device) -> (kvcache model, transformers model), both in that dtype on that device."""
    cache = {}

    def get(arch: str, dtype: str, device: str):
        if (arch, dtype, device) not in cache:
            d = tiny_model_dirs[arch]
            cache[arch, dtype, device] = (build_model(read_checkpoint(d), 256, device, DTYPES[dtype]),
                                          AutoModelForCausalLM.from_pretrained(d, dtype=DTYPES[dtype]).to(device).eval())
        return cache[arch, dtype, device]
    return get


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_teacher_forced_logits_and_greedy_tokens_match_transformers(pairs, arch, dtype, device):
    """A prompt and transformers' own greedy continuation, fed as one prefill, in chunks of 7, and one token at a
    time (the decode path): logits within the tolerance, argmax equal where the margin is clear."""
    model, hf = pairs(arch, dtype, device)
    prompt = prompt_of(33, seed=sum(map(ord, arch)))  # longer than mistral-swa's window of 24 with the continuation
    ids = prompt + hf_greedy(hf, prompt, 24)
    ref = hf_logits(hf, ids)
    for chunk in (len(ids), 7, 1):
        assert_close_and_same_greedy(kv_logits(model, ids, chunk), ref, DTYPES[dtype])


def test_weights_are_stored_in_the_compute_dtype_once(pairs):
    model, hf = pairs("llama-mqa-tied", "bfloat16", "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.embed is None  # tied: the head's weight serves the lookups
    cfg = model.config
    assert model.weight_bytes == 2 * sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())  # tied once
    assert model.lm_head.weight.shape == (cfg.hidden_size, cfg.vocab_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_engine_generates_transformers_greedy_tokens(tiny_model_dirs, dtype, device):
    """Through LLM: a mixed batch with chunked prefill gives each prompt transformers' greedy continuation, up to
    the first step whose margin is within the tolerance (after it the two may part ways legitimately)."""
    path = tiny_model_dirs["qwen3"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    llm = LLM(path, dtype=dtype, device=device, kv_cache_memory="8MiB", max_num_batched_tokens=24, max_model_len=256)
    prompts = [prompt_of(n, seed=n) for n in (5, 40, 17)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        expected = hf_greedy(hf, p, 16)
        ref = hf_logits(hf, p + expected)[len(p) - 1:-1]
        top2 = ref.topk(2, -1).values
        clear = ((top2[:, 0] - top2[:, 1]) > tolerance(ref, DTYPES[dtype])).tolist()
        agreed = clear.index(False) if False in clear else len(clear)
        assert agreed > 0
        assert out.outputs[0].token_ids[:agreed] == expected[:agreed]
    llm.engine.check_no_leaks()


@pytest.mark.demo
def test_demo_model_in_bfloat16_matches_transformers(demo_path, demo_hf):
    """The real SmolLM2 GGUF: transformers' dequantized weights cast to bfloat16 against kvcache's bfloat16 load.

    A prefill of the prompt and transformers' greedy continuation gives its logits within the tolerance (here,
    exactly). One token at a time, both engines take other SDPA kernels (bfloat16 attention on the CPU rounds
    differently for other query lengths), and over 30 layers that moves logits of ~35 by up to ~0.75 in
    transformers itself: its own cached decode against its prefill. So the decode path is held to that
    measured distance, against transformers' own decode, and to the same greedy tokens where the margin
    clears it."""
    hf32, tok = demo_hf
    hf = copy.deepcopy(hf32).to(torch.bfloat16)
    # from_pretrained(dtype=bfloat16) keeps RoPE's inverse frequencies in float32; .to() would round them too
    hf.model.rotary_emb.inv_freq = hf32.model.rotary_emb.inv_freq.clone()
    model = build_model(read_checkpoint(demo_path), 512, "cpu", torch.bfloat16)
    for text in ("The capital of France is", "def fibonacci(n):", "A KV cache stores"):
        prompt = tok.encode(text)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        ids = out.sequences[0].tolist()
        full = hf_logits(hf, ids)
        assert_close_and_same_greedy(kv_logits(model, ids, len(ids)), full, torch.bfloat16)
        steps = slice(len(prompt) - 1, len(ids) - 1)  # the positions transformers decoded
        hf_decode = torch.stack([lg[0].float() for lg in out.logits])
        drift = (hf_decode - full[steps]).abs().max().item()
        got = kv_logits(model, ids, 1)[steps]
        tol = max(tolerance(hf_decode, torch.bfloat16), drift)
        assert (got - hf_decode).abs().max().item() <= tol
        top2 = hf_decode.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > tol
        assert clear.any() and torch.equal(got.argmax(-1)[clear], hf_decode.argmax(-1)[clear])


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
