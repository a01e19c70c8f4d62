"""`kvcache eval kv-quality`: the metrics, the corpus, passkey prompts, capacity and the command end to end
(tiny random-weight model), and the real demo model with small settings."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from kvcache.cli import main
from kvcache.bench.corpus import (CORPUS_FILE, PASSKEY_FILLER, PASSKEY_QUESTION, Document, document_windows,
                                 load_corpus, passkey_keys, passkey_prompt, passkey_sentence)
from kvcache.eval.harness import (QualityStats, build_engine, evaluate_engines, passkey_trials, pool_bytes,
                                  ppl_delta_pct, token_metrics)
from kvcache.eval.kv_quality import measure_capacity
from kvcache.memory.kv_cache_manager import blocks_for
from kvcache.models.loader import read_checkpoint
from word_tokenizer import WordTokenizer

REQUIRED = {"kl", "top1", "ppl", "ppl_delta_pct", "bytes_per_token", "passkey_acc", "pool_tokens",
            "concurrent_requests", "capacity_ratio_tokens", "capacity_ratio_requests"}


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama):
    return read_checkpoint(tiny_llama)


# ---- metrics ----------------------------------------------------------------------------------------------

def test_identical_distributions_have_zero_kl_full_agreement_and_no_ppl_change():
    torch.manual_seed(0)
    logits = torch.randn(300, 50) * 3  # more rows than one metric chunk
    targets = torch.randint(0, 50, (300,))
    kl, top1, nll_ref, nll = token_metrics(logits, logits.clone(), targets)
    assert kl == 0.0
    assert top1 == 300
    assert nll_ref == nll > 0
    assert ppl_delta_pct(math.exp(nll / 300), math.exp(nll_ref / 300)) == 0.0


def test_metrics_on_a_small_example():
    # row 0: P = (0.6, 0.4), Q = (0.4, 0.6): KL = 0.6 ln 1.5 + 0.4 ln(2/3) = 0.2 ln 1.5, argmaxes differ
    # row 1: P = Q = (0.9, 0.1): KL 0, argmaxes agree
    ref = torch.log(torch.tensor([[0.6, 0.4], [0.9, 0.1]]))
    q = torch.log(torch.tensor([[0.4, 0.6], [0.9, 0.1]]))
    targets = torch.tensor([0, 1])
    kl, top1, nll_ref, nll = token_metrics(ref, q, targets)
    assert kl == pytest.approx(0.2 * math.log(1.5), rel=1e-5)
    assert top1 == 1
    assert nll_ref == pytest.approx(-math.log(0.6) - math.log(0.1), rel=1e-6)
    assert nll == pytest.approx(-math.log(0.4) - math.log(0.1), rel=1e-6)
    s = QualityStats()
    s.add(ref, q, targets)
    s.add(ref, ref, targets)
    assert s.positions == 4
    assert s.kl == pytest.approx(0.2 * math.log(1.5) / 4, rel=1e-5)
    assert s.top1 == 0.75
    assert s.ppl_ref == pytest.approx(math.sqrt(1 / (0.6 * 0.1)), rel=1e-6)  # exp(mean NLL)
    assert s.ppl == pytest.approx((1 / (0.4 * 0.1) * 1 / (0.6 * 0.1)) ** 0.25, rel=1e-6)
    assert ppl_delta_pct(2.2, 2.0) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="shapes must match"):
        token_metrics(ref, q[:1], targets)


def test_baseline_against_itself_and_a_quantized_cache(tiny_loaded):
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 320, (80,), generator=g).tolist() for _ in range(2)]
    def engine(dtype):
        return build_engine(tiny_loaded, dtype, pool_bytes(tiny_loaded, dtype, 1, 80), 80)

    base_engine, again, int2 = engine("float32"), engine("float32"), engine("int2")
    base, stats = evaluate_engines(base_engine, {"float32": again, "int2": int2}, docs, warmup=8, chunk_size=24)
    assert base.positions == 2 * (80 - 1 - 8)
    assert base.kl == 0.0 and base.top1 == 1.0 and base.ppl == base.ppl_ref
    same = stats["float32"]  # a second float32 engine: the same numbers
    assert same.kl < 1e-9 and same.top1 == 1.0
    assert same.ppl == pytest.approx(base.ppl, rel=1e-6)
    assert stats["int2"].kl > same.kl  # 2-bit keys and values change the distributions
    assert stats["int2"].ppl_ref == pytest.approx(base.ppl, rel=1e-6)
    for e in (base_engine, again, int2):
        e.check_no_leaks()


# ---- corpus and passkey prompts -----------------------------------------------------------------------------

def test_shipped_corpus_is_modest_prose_in_documents():
    from importlib import resources
    data = resources.files("kvcache.bench").joinpath("data", CORPUS_FILE)
    assert len(data.read_bytes()) <= 200_000
    docs = load_corpus()
    assert len(docs) >= 6
    assert all(len(d.text) >= 10_000 and "===" not in d.text for d in docs)  # ~2,000+ tokens each
    assert docs[0].title.startswith("logging")
    words = docs[0].text.split()
    assert sum(w.strip(".,;:()'\"").isalpha() for w in words) > 0.8 * len(words)


def test_document_windows_take_the_first_tokens_and_refuse_short_corpora():
    docs = [Document("a", "w1 w2 w3 w4 w5"), Document("short", "w1 w2"), Document("b", "w6 w7 w8 w9")]
    tokenize = str.split
    assert document_windows(tokenize, 2, 4, docs) == [["w1", "w2", "w3", "w4"], ["w6", "w7", "w8", "w9"]]
    with pytest.raises(ValueError, match="2 documents of at least 4 tokens .*asked for 3"):
        document_windows(tokenize, 3, 4, docs)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_prompt_hides_the_key_at_its_depth(depth):
    count = lambda s: len(s.split())  # one token per word
    text = passkey_prompt(12345, depth, 600, count)
    assert text.count("12345") == 2 and passkey_sentence(12345) in text
    assert text.endswith(PASSKEY_QUESTION + " The pass key is")
    before, after = text.split(passkey_sentence(12345))
    n_before, n_after = before.count(PASSKEY_FILLER), after.count(PASSKEY_FILLER)
    assert n_before == round(depth * (n_before + n_after))
    per_filler = count(PASSKEY_FILLER)
    assert 600 - per_filler < count(text) <= 600


def test_passkey_trials_with_a_chat_template_are_near_the_target_length(tiny_loaded):
    tok = tiny_loaded.tokenizer
    trials = passkey_trials(tok, [0.0, 0.5, 1.0], 2, 200, "chat", seed=3)
    assert [(t.depth, t.key) for t in trials] == passkey_keys([0.0, 0.5, 1.0], 2, seed=3)
    assert len({t.key for t in trials}) == 6 and all(10_000 <= t.key <= 99_999 for t in trials)
    for t in trials:
        assert 200 - 20 < len(t.token_ids) <= 200  # a filler line is 18 word tokens here
    raw = passkey_trials(tok, [0.0, 0.5, 1.0], 2, 200, "raw", seed=3)
    assert [t.key for t in raw] == [t.key for t in trials]  # the same keys whatever the prompting
    assert all(200 - 20 < len(t.token_ids) <= 200 for t in raw)
    with pytest.raises(ValueError, match="no room for filler"):
        passkey_trials(tok, [0.5], 1, 30, "chat")


def test_passkey_chat_prompt_starts_the_answer_after_the_template():
    tok = WordTokenizer()
    (chat,) = passkey_trials(tok, [0.5], 1, 300, "chat", seed=5)
    (raw,) = passkey_trials(tok, [0.5], 1, 300, "raw", seed=5)
    text = tok.decode(chat.token_ids)
    assert text.startswith("<user> There is an important info")
    assert text.endswith("What is the pass key? <assistant> The pass key is")
    assert text.count(str(chat.key)) == 2 and 300 - 18 < len(chat.token_ids) <= 300
    assert tok.decode(raw.token_ids).endswith("What is the pass key? The pass key is")
    assert raw.key == chat.key and "<user>" not in tok.decode(raw.token_ids)


# ---- capacity ---------------------------------------------------------------------------------------------

def test_capacity_counts_requests_the_pool_really_holds(tiny_loaded):
    held = {}
    for d in ("float32", "float16", "int8"):
        e = build_engine(tiny_loaded, d, 256 * 1024, 108, max_num_seqs=256, enable_prefix_caching=False)
        info = e.kv_cache_info()
        fits = info["num_blocks"] // (blocks_for(108, info["block_size"]) + info["seq_blocks"])
        m = measure_capacity(e, 100, 8, seed=0)  # aborts everything and checks for leaked blocks
        assert m["pool_tokens"] == info["num_tokens"]
        assert 1 <= m["concurrent_requests"] <= fits < m["submitted"]
        assert not e.has_unfinished_requests()
        held[d] = m["concurrent_requests"]
    assert held["float32"] < held["float16"] < held["int8"]


# ---- the command --------------------------------------------------------------------------------------------

def _tiny_corpus(path) -> str:
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(f"w{i}" for i in torch.randint(3, 320, (150,), generator=g).tolist()) for _ in range(3)]
    path.write_text("".join(f"=== doc {i} ===\n\n{d}\n" for i, d in enumerate(docs)))
    return str(path)


def test_command_end_to_end_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    rc = main(["eval", "kv-quality", "--model", tiny_llama, "--corpus", _tiny_corpus(tmp_path / "c.txt"),
               "--kv-cache-dtypes", "int8,int4", "--num-docs", "2", "--context-len", "96", "--warmup", "16",
               "--chunk-size", "32", "--depths", "0,1", "--passkeys-per-depth", "1", "--passkey-len", "128",
               "--capacity-memory", "256KiB", "--capacity-prompt-len", "100", "--capacity-max-tokens", "8",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r) == {"baseline", "dtypes", "settings", "machine"}
    assert r["machine"]["cpu"] and r["machine"]["torch"]  # a figure is never read without its machine
    assert list(r["dtypes"]) == ["int8", "int4"]
    base = r["baseline"]
    assert base["name"] == "fp32 (baseline)" and base["kv_cache_dtype"] == "float32"
    assert base["kl"] == 0.0 and base["top1"] == 1.0 and base["ppl_delta_pct"] == 0.0
    assert base["bytes_per_token"] == 512  # 2 layers x 2 (K, V) x 2 kv heads x 16 dims x 4 bytes
    for d, v in r["dtypes"].items():
        assert REQUIRED <= set(v), d
        assert v["kl"] >= 0 and 0 <= v["top1"] <= 1 and v["passkey_acc"] in (0.0, 0.5, 1.0)
        assert v["ppl_delta_pct"] == pytest.approx((v["ppl"] / base["ppl"] - 1) * 100)
        assert v["bytes_per_token"] < base["bytes_per_token"]
        assert v["capacity_ratio_tokens"] > 1 and v["concurrent_requests"] >= 1
    assert r["dtypes"]["int4"]["residual_blocks_per_request"] > 0  # KIVI's fp16 key residual
    assert r["dtypes"]["int8"]["residual_blocks_per_request"] == 0
    s = r["settings"]
    assert s["scored_positions"] == 2 * (96 - 1 - 16)
    assert s["capacity"]["baseline_dtype"] == "float16"  # measured although not asked for
    assert base["capacity_ratio_tokens"] == pytest.approx(0.5)
    assert len(s["passkey"]["prompt_tokens"]) == 2 and max(s["passkey"]["prompt_tokens"]) <= 128
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "fp32 (baseline)" in table and "int4" in table and "early positions barely use the cache" in table


def test_command_skips_parts_and_reports_bad_input(tiny_llama, tmp_path, capsys):
    corpus = _tiny_corpus(tmp_path / "c.txt")
    small = ["--model", tiny_llama, "--corpus", corpus, "--num-docs", "1", "--context-len", "64", "--warmup", "8",
             "--plot", ""]
    out = tmp_path / "q.json"
    assert main(["eval", "kv-quality", *small, "--kv-cache-dtypes", "fp16", "--skip-passkey", "--skip-capacity",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["dtypes"]) == ["float16"]  # aliases resolve to the format's name
    assert r["dtypes"]["float16"]["passkey_acc"] is None and r["dtypes"]["float16"]["pool_tokens"] is None
    assert r["settings"]["passkey"] is None and r["settings"]["capacity"] is None
    assert not (tmp_path / "q.png").exists()
    capsys.readouterr()
    assert main(["eval", "kv-quality", *small, "--kv-cache-dtypes", "int3", "--json", ""]) == 2
    assert "unknown KV cache dtype 'int3'" in capsys.readouterr().err
    assert main(["eval", "kv-quality", *small, "--warmup", "63", "--json", ""]) == 2
    assert "--warmup 63 must be below --context-len 64" in capsys.readouterr().err
    assert main(["eval", "kv-quality", *small, "--num-docs", "9", "--json", ""]) == 2
    assert "asked for 9" in capsys.readouterr().err


# ---- the real demo model ---------------------------------------------------------------------------------

@pytest.mark.demo
def test_demo_model_int8_cache_is_close_to_fp32(tmp_path):
    out = tmp_path / "q.json"
    rc = main(["eval", "kv-quality", "--kv-cache-dtypes", "int8", "--num-docs", "1", "--context-len", "512",
               "--warmup", "128", "--depths", "0,1", "--passkeys-per-depth", "1", "--passkey-len", "384",
               "--skip-capacity", "--json", str(out), "--plot", str(tmp_path / "q.png")])
    assert rc == 0
    r = json.loads(out.read_text())
    int8 = r["dtypes"]["int8"]
    assert int8["top1"] > 0.9
    assert abs(int8["ppl_delta_pct"]) < 2
    assert 0 < int8["kl"] < 0.01
    assert r["baseline"]["passkey_acc"] == 1.0  # the chat-template prompt works at fp32
    assert r["baseline"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 4  # layers x (K, V) x kv heads x head_dim x fp32
    assert int8["bytes_per_token"] == 30 * 2 * 3 * (64 + 2)  # int8 codes plus an fp16 scale per token and head
    assert all(352 < n <= 384 for n in r["settings"]["passkey"]["prompt_tokens"])


@pytest.mark.demo
def test_demo_corpus_documents_are_long_enough(demo_path):
    from transformers import AutoTokenizer
    d, name = os.path.split(demo_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    lengths = [len(tok.encode(doc.text)) for doc in load_corpus()]
    assert min(lengths) >= 2_000 and len(lengths) >= 4
    assert len(document_windows(tok.encode, 4, 1536)) == 4
