"""`kvcache eval eviction`: quality against the full cache, split passkey prompts and their answers, the
memory/throughput runner, argument checks and the command end to end (tiny random-weight model)."""
from __future__ import annotations

import json

import pytest
import torch

from kvcache.cli import main
from kvcache.compress.pyramidkv import layer_budgets
from kvcache.compress.spec import EvictionSpec
from kvcache.engine.sampling_params import SamplingParams
from kvcache.bench.corpus import (PASSKEY_ANSWER, PASSKEY_FILLER, PASSKEY_QUESTION, passkey_prompt,
                                 passkey_sentence)
from kvcache.eval.eviction import (check_budgets, evaluate_passkey, evaluate_quality, held_tokens, measure_throughput,
                                   parse_budgets, parse_policies, reproduces)
from kvcache.eval.harness import (SplitTrial, answer_tokens, build_engine, passkey_trials, pool_bytes, random_prompts,
                                  split_passkey_text, split_passkey_trials)
from kvcache.models.loader import read_checkpoint
from word_tokenizer import WordTokenizer


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama):
    return read_checkpoint(tiny_llama)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- quality ----------------------------------------------------------------------------------------------

def test_quality_is_exact_without_eviction_and_drops_with_a_small_budget(tiny_loaded):
    docs = [_tokens(112, 1), _tokens(112, 2)]
    engine = build_engine(tiny_loaded, "float32", pool_bytes(tiny_loaded, "float32", 1, 112), 112)
    specs = [EvictionSpec("snapkv", 1.0), EvictionSpec("streaming", 0.25), EvictionSpec("random", 0.125)]
    base, (whole, streaming, rand) = evaluate_quality(engine, docs, 96, specs, chunk_size=32)
    assert base.positions == whole.positions == 2 * 16  # the continuation tokens only
    assert base.kl == 0.0 and base.top1 == 1.0
    # snapkv keeps the whole 96-token prompt and never evicts while decoding: the full cache, up to the
    # rounding of decodes against one prefill
    assert whole.kl < 1e-5 and whole.top1 == 1.0
    assert whole.ppl == pytest.approx(base.ppl, rel=1e-5)
    assert streaming.kl > 1e-6 and rand.kl > 1e-6
    assert streaming.ppl_ref == pytest.approx(base.ppl, rel=1e-6)
    engine.check_no_leaks()
    assert engine.kv_cache_info()["evicted_tokens"] > 0
    with pytest.raises(ValueError, match="must leave continuation tokens"):
        evaluate_quality(engine, docs, 112, specs[:1])


def test_held_tokens_is_the_budget_and_pyramidkv_holds_its_layers_whole_blocks():
    assert held_tokens(EvictionSpec("none"), 1024, 30) == 1024
    assert held_tokens(EvictionSpec("snapkv", 0.125), 1024, 30) == 128
    assert held_tokens(EvictionSpec("h2o", 100), 1024, 30) == 100
    budgets = layer_budgets(128, 1024, 30)
    # token by token: the mean of its per-layer budgets (128, the budget asked for)
    assert held_tokens(EvictionSpec("pyramidkv", 0.125), 1024, 30) == round(sum(budgets) / 30) == 128
    # in 16-token blocks a layer gives back only whole dead blocks: between the mean and layer 0's budget
    pyramid = held_tokens(EvictionSpec("pyramidkv", 0.125), 1024, 30, 16)
    assert 128 < pyramid < budgets[0]
    assert held_tokens(EvictionSpec("snapkv", 0.125), 256, 30) == 33  # floored at snapkv's minimum


# ---- passkey ----------------------------------------------------------------------------------------------

def test_split_passkey_prompt_cuts_before_the_question():
    text = passkey_prompt(12345, 0.5, 300, lambda s: len(s.split()))
    context, question = split_passkey_text(text)
    assert context + question == text
    assert context.endswith(PASSKEY_FILLER) and "12345" in context
    assert question == f" {PASSKEY_QUESTION} {PASSKEY_ANSWER}"
    with pytest.raises(ValueError, match="has no 'What is the pass key\\?'"):
        split_passkey_text("no question here")

    tok = WordTokenizer()
    (t,) = split_passkey_trials(tok, [1.0], 1, 300, seed=5)
    assert t.joint  # word tokens do not merge across the cut
    assert tok.decode(t.question_ids) == "What is the pass key? <assistant> The pass key is"
    assert tok.decode(t.context_ids).startswith("<user> There is an important info")
    assert tok.decode(t.context_ids).endswith(PASSKEY_FILLER + " " + passkey_sentence(t.key))  # depth 1: last
    assert 300 - 18 < len(t.token_ids) <= 300


def test_split_trials_are_kv_quality_prompts_tokenized_in_two_parts(tiny_loaded):
    tok = tiny_loaded.tokenizer
    split = split_passkey_trials(tok, [0.0, 1.0], 2, 200, seed=3)
    whole = passkey_trials(tok, [0.0, 1.0], 2, 200, "chat", seed=3)
    assert [(t.depth, t.key) for t in split] == [(t.depth, t.key) for t in whole]
    assert [t.token_ids for t in split] == [t.token_ids for t in whole]  # the concatenation matches
    assert all(t.joint and len(t.question_ids) >= 9 for t in split)  # question + template end + answer start

    class NoTemplate:
        chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        split_passkey_trials(NoTemplate(), [0.5], 1, 200)


def test_answer_is_cut_after_the_token_that_completes_the_key():
    class Digits:
        pieces = [" ", "1", "2", "3", "4", "5", ".", " Remember"]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self.pieces[i] for i in ids)

    out = list(range(8))
    assert answer_tokens(Digits(), 12345, out) == [0, 1, 2, 3, 4, 5]
    assert answer_tokens(Digits(), 12346, out) is None
    assert answer_tokens(Digits(), 12345, out[:5]) is None  # the reply stopped a digit short


def test_passkey_correct_iff_greedy_decoding_reproduces_the_answer(tiny_loaded):
    trial = SplitTrial(0.5, 12345, _tokens(100, 3), _tokens(12, 4))
    engine = build_engine(tiny_loaded, "float32", pool_bytes(tiny_loaded, "float32", 1, 128), 128)
    engine.add_request("g", trial.token_ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
    answer = list(outs[0].outputs[0].token_ids)
    wrong = answer[:-1] + [answer[-1] % 300 + 4]
    assert wrong != answer
    for setting in ("query_agnostic", "query_aware"):
        assert reproduces(engine, trial, answer, setting)
        assert not reproduces(engine, trial, wrong, setting)
    # snapkv at budget 1.0 of context + question evicts nothing: the full cache
    assert reproduces(engine, trial, answer, "query_aware", EvictionSpec("snapkv", 1.0))
    with pytest.raises(ValueError, match="setting must be one of"):
        reproduces(engine, trial, answer, "aware")

    other = SplitTrial(1.0, 54321, _tokens(100, 5), _tokens(12, 6))
    specs = [EvictionSpec("snapkv", 1.0), EvictionSpec("streaming", 0.125)]
    full, runs = evaluate_passkey(engine, [trial, other], [answer, None], specs)  # `other` is a baseline miss
    assert full == {"acc": 1.0, "correct": 1, "by_depth": {"0.5": 1.0}}
    # a budget of the whole prompt, and snapkv never evicts while decoding: nothing is evicted in either setting
    assert runs[0]["query_agnostic"]["acc"] == runs[0]["query_aware"]["acc"] == 1.0
    assert set(runs[1]) == {"query_agnostic", "query_aware"}
    assert all(r[s]["acc"] in (0.0, 1.0) and list(r[s]["by_depth"]) == ["0.5"] for r in runs for s in r)
    engine.check_no_leaks()


# ---- memory and throughput -------------------------------------------------------------------------------

def test_a_small_budget_decodes_more_requests_at_once_in_the_same_pool(tiny_loaded):
    measured = {}
    for name, spec in (("none", None), ("snapkv", EvictionSpec("snapkv", 0.125))):
        # 24 blocks of 16 tokens: one 300-token prompt (19 blocks) fits, two do not
        e = build_engine(tiny_loaded, "float32", 192 * 1024, 308, max_num_seqs=256, enable_prefix_caching=False)
        prompts = random_prompts(e, 4, 300, seed=0)
        assert all(len(p) == 300 and min(p) >= 3 for p in prompts)  # no <unk>, <s>, </s>
        m = measure_throughput(e, prompts, 8, spec)  # checks for leaked blocks at the end
        assert e.kv_cache_info()["free_blocks"] == m["num_blocks"] == 24
        assert m["output_tokens"] == 4 * 8 and m["preemptions"] == 0
        with pytest.raises(ValueError, match="needs a fresh engine"):
            measure_throughput(e, prompts, 8, spec)
        measured[name] = m
    none, snap = measured["none"], measured["snapkv"]
    assert none["concurrent_requests"] == 1 and none["evicted_tokens"] == 0
    assert snap["concurrent_requests"] > none["concurrent_requests"]
    assert snap["evicted_tokens"] == 4 * (300 - 37)  # one compaction per request, to int(0.125 * 300)
    assert snap["freed_blocks"] == 4 * (19 - 3) and snap["compactions"] == 4
    # the whole prompt is cached before its compaction, so the peak holds one prompt plus the compacted others
    assert none["peak_used_blocks"] == 20 and 19 + 3 <= snap["peak_used_blocks"] <= 24


# ---- arguments ------------------------------------------------------------------------------------------------

def test_arguments_are_checked_with_the_numbers():
    assert parse_policies(" h2o, snapkv ") == ["h2o", "snapkv"]
    with pytest.raises(ValueError, match="unknown eviction policy 'lru'.*supported: streaming, h2o, snapkv, tova, "
                                         "pyramidkv, random"):
        parse_policies("h2o,lru")
    with pytest.raises(ValueError, match="names h2o twice"):
        parse_policies("h2o,h2o")
    assert parse_budgets("0.5,0.125") == [0.5, 0.125]
    with pytest.raises(ValueError, match=r"in \(0, 1\]; got 0, 1.5"):
        parse_budgets("0,0.5,1.5")
    with pytest.raises(ValueError, match="separated by commas"):
        parse_budgets("half")
    with pytest.raises(ValueError, match="--context-len 128: kv.budget 0.125 of a 128-token prompt .* below "
                                         "snapkv's minimum of 33"):
        check_budgets(["streaming", "snapkv"], [0.5, 0.125], 128, "--context-len 128")


# ---- the command --------------------------------------------------------------------------------------------

def _tiny_corpus(path) -> str:
    docs = [" ".join(f"w{i}" for i in _tokens(150, 10 + i)) for i in range(2)]
    path.write_text("".join(f"=== doc {i} ===\n\n{d}\n" for i, d in enumerate(docs)))
    return str(path)


def test_command_end_to_end_on_a_tiny_model(tiny_llama, tmp_path, capsys):
    out, png = tmp_path / "e.json", tmp_path / "e.png"
    rc = main(["eval", "eviction", "--model", tiny_llama, "--corpus", _tiny_corpus(tmp_path / "c.txt"),
               "--policies", "streaming,snapkv,pyramidkv", "--budgets", "0.5,0.25", "--num-docs", "1",
               "--context-len", "136", "--continuation", "8", "--chunk-size", "64", "--depths", "0,1",
               "--passkey-len", "160", "--capacity-memory", "96KiB", "--capacity-requests", "3",
               "--capacity-prompt-len", "160", "--capacity-max-tokens", "4", "--capacity-budget", "0.25",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert set(r) == {"quality", "passkey", "capacity", "settings", "machine"}
    assert r["machine"]["cpu"] and r["machine"]["torch"]  # a figure is never read without its machine
    q = r["quality"]
    assert q["full"]["kl"] == 0.0 and q["full"]["top1"] == 1.0
    assert [(x["policy"], x["budget"]) for x in q["runs"]] == [
        (p, b) for p in ("streaming", "snapkv", "pyramidkv") for b in (0.5, 0.25)]
    for x in q["runs"]:
        assert x["kl"] >= 0 and 0 <= x["top1"] <= 1
        assert x["ppl_delta_pct"] == pytest.approx((x["ppl"] / q["full"]["ppl"] - 1) * 100)
        assert x["budget_tokens"] == int(x["budget"] * 136)
    p = r["passkey"]
    # the tiny tokenizer has no digits: the full cache never says the key, so every trial is a baseline miss
    assert p["trials"] == 2 and p["baseline_misses"] == 2 and p["scored_trials"] == 0
    assert p["split_differs"] == 0 and p["runs"][0]["query_agnostic"]["acc"] is None
    c = r["capacity"]
    assert [(x["policy"], x["budget"]) for x in c["runs"]] == [
        ("none", None), ("streaming", 0.25), ("snapkv", 0.25), ("pyramidkv", 0.25), ("snapkv", 0.5)]
    none = c["runs"][0]
    assert none["requests_ratio"] == 1.0 and none["throughput_ratio"] == 1.0 and none["held_tokens"] == 160
    for x in c["runs"][1:]:
        assert x["evicted_tokens"] > 0 and x["output_tokens"] == 3 * 4
        assert x["concurrent_requests"] >= none["concurrent_requests"]
    assert c["runs"][2]["held_tokens"] == 40 and c["runs"][4]["held_tokens"] == 80
    top, low = layer_budgets(40, 160, 2)
    assert c["runs"][3]["held_tokens"] == round((top + top - (top - low) // 16 * 16) / 2)
    assert r["settings"]["scored_positions"] == 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "full cache" in table and "held tok/req" in table and "no trial scored" in table


def test_command_skips_parts_and_reports_bad_input(tiny_llama, tmp_path, capsys):
    small = ["--model", tiny_llama, "--corpus", _tiny_corpus(tmp_path / "c.txt"), "--num-docs", "1",
             "--context-len", "64", "--continuation", "4", "--policies", "h2o", "--budgets", "0.5", "--plot", ""]
    out = tmp_path / "e.json"
    assert main(["eval", "eviction", *small, "--skip-passkey", "--skip-capacity", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["passkey"] is None and r["capacity"] is None and len(r["quality"]["runs"]) == 1
    assert not (tmp_path / "e.png").exists()
    capsys.readouterr()
    assert main(["eval", "eviction", *small, "--policies", "lru", "--json", ""]) == 2
    assert "unknown eviction policy 'lru' in --policies; supported: streaming" in capsys.readouterr().err
    assert main(["eval", "eviction", *small, "--budgets", "0.5,2", "--json", ""]) == 2
    assert "ratios of the prompt in (0, 1]; got 2" in capsys.readouterr().err
    assert main(["eval", "eviction", *small, "--policies", "snapkv", "--budgets", "0.25", "--json", ""]) == 2
    assert "below snapkv's minimum of 33" in capsys.readouterr().err
    assert main(["eval", "eviction", *small, "--json", ""]) == 2  # default capacity requests: 1,024 + 64 tokens
    assert "--capacity-prompt-len 1,024 + --capacity-max-tokens 64 is above the model's context length 512" in \
        capsys.readouterr().err
    assert main(["eval", "eviction", *small, "--skip-capacity", "--num-docs", "9", "--json", ""]) == 2
    assert "asked for 9" in capsys.readouterr().err


# ---- the real demo model ---------------------------------------------------------------------------------

@pytest.mark.demo
def test_demo_model_at_half_budget(tmp_path):
    out = tmp_path / "e.json"
    rc = main(["eval", "eviction", "--policies", "snapkv", "--budgets", "0.5", "--num-docs", "1",
               "--context-len", "192", "--continuation", "8", "--depths", "1", "--passkey-len", "256",
               "--skip-capacity", "--json", str(out), "--plot", ""])
    assert rc == 0
    r = json.loads(out.read_text())
    (q,) = r["quality"]["runs"]
    assert 0 < q["kl"] < 0.1 and q["top1"] >= 0.75
    p = r["passkey"]
    assert p["baseline_misses"] == 0 and p["full"]["acc"] == 1.0  # teacher-forced, the full cache says its reply
    assert p["split_differs"] == 0  # BPE does not merge across " What is the pass key?"
    assert 230 < p["context_tokens"][0] + p["question_tokens"][0] <= 256
    # the key sits right before the question, next to snapkv's observation window
    assert p["runs"][0]["query_aware"]["acc"] == 1.0
