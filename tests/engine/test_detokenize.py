"""Incremental detokenization (StopChecker.detokenize): at every step the text equals decoding the whole output at
once, for the decoders the field uses (byte-level BPE with characters split over tokens, SentencePiece's metaspace,
WordPiece), with and without special tokens; and each call decodes a few tokens, not the whole output."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvcache.engine.sampling_params import SamplingParams
from kvcache.engine.sequence import Sequence
from kvcache.engine.stop_checker import StopChecker
from kvcache.models.random_checkpoint import write_tokenizer


def _byte_level() -> PreTrainedTokenizerFast:
    """GPT-2's scheme: one token per byte (so a character's bytes can arrive in separate tokens) plus merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("h", "e"), ("he", "l"), ("Ġ", "w")]  # 'Ġ' is the byte-level space
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def _metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece's scheme: '▁' marks a word's start, and the decoder strips the text's leading space."""
    words = ["▁the", "▁cat", "▁sat", "s", "at", "▁", "ing", "▁on", "mat", "▁é", "è"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _word_level(tmp_path) -> PreTrainedTokenizerFast:
    write_tokenizer(str(tmp_path), 40)  # the tiny test models' tokenizer
    return PreTrainedTokenizerFast.from_pretrained(str(tmp_path))


def _check(tok, ids: list[int], skip: bool) -> None:
    stop = StopChecker(tok, set(), 1 << 20)
    prompt = [1, 2, 3]
    seq = Sequence(0, "r", 0, list(prompt), len(prompt), SamplingParams(skip_special_tokens=skip), len(ids))
    for i, t in enumerate(ids):
        seq.token_ids.append(t)
        whole = tok.decode(ids[:i + 1], skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert stop.detokenize(seq) == whole, (ids[:i + 1], i)
        if i % 7 == 3:  # called twice at one length (a streamed step, then the finished output): the same text
            assert stop.detokenize(seq) == whole


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", ["byte-level", "metaspace", "word-level"])
def test_incremental_text_is_the_whole_decode_at_every_step(kind, skip, tmp_path):
    tok = {"byte-level": _byte_level, "metaspace": _metaspace}[kind]() if kind != "word-level" else _word_level(
        tmp_path)
    rng = random.Random(0)
    n = len(tok)
    if kind == "byte-level":  # whole characters, split over byte tokens: 'é' (2 bytes), '€' (3), emoji (4)
        text = "hello wé€ 🙂 hel" * 3
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) > len(text)  # characters were split into bytes
        assert tok.decode(ids) == text
        _check(tok, ids + [tok.eos_token_id] + ids[:5], skip)
    for _ in range(20):  # random ids: stray continuation bytes, cut characters, special tokens anywhere
        _check(tok, [rng.randrange(n) for _ in range(rng.randrange(1, 40))], skip)


def test_each_call_decodes_a_few_tokens_not_the_whole_output():
    tok = _byte_level()
    decoded = []
    real = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or real(ids, **kw)
    stop = StopChecker(tok, set(), 1 << 20)
    ids = tok.encode("hello wé€ 🙂 " * 60, add_special_tokens=False)
    seq = Sequence(0, "r", 0, [1], 1, SamplingParams(), len(ids))
    for t in ids:
        seq.token_ids.append(t)
        stop.detokenize(seq)
    tok.decode = real
    assert stop.detokenize(seq) == tok.decode(ids, clean_up_tokenization_spaces=False)
    # decoding the whole output at every step would decode n (n + 1) / 2 tokens; incrementally a window of a few
    assert len(ids) > 500 and max(decoded) <= 8 and sum(decoded) < 10 * len(ids), (max(decoded), sum(decoded))


@pytest.mark.demo
def test_the_demo_tokenizer_decodes_incrementally_as_a_whole(demo_llm):
    tok = demo_llm.get_tokenizer()
    rng = random.Random(1)
    for _ in range(5):
        _check(tok, [rng.randrange(len(tok)) for _ in range(60)], True)
    _check(tok, tok.encode("Le café coûte 3€ 🙂, naïve façade.", add_special_tokens=False), True)
