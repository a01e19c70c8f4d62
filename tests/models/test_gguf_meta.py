"""The GGUF metadata cache (kvcache.models.gguf_meta): what it serves equals what the file gives, it is used on the
next load, and a changed file, a damaged entry or a cache that cannot be written never serves wrong metadata."""
from __future__ import annotations

import json
import logging
import os

import gguf
import numpy as np
import pytest
import torch

from kvcache.models import gguf_meta
from kvcache.models.loader import read_checkpoint


def _write(path, rows: int, seed: int) -> dict[str, np.ndarray]:
    """A small GGUF: an F32 tensor and a Q8_0 one (`rows` x 64), and some metadata."""
    rng = np.random.default_rng(seed)
    tensors = {"a": rng.standard_normal((rows, 64), dtype=np.float32),
               "b": rng.standard_normal((rows, 64), dtype=np.float32)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(rows)
    w.add_tensor("a", tensors["a"])
    w.add_tensor("b", gguf.quants.quantize(tensors["b"], gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def _same_as_reader(index, path) -> None:
    want = gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in index] == [t.name for t in want]
    for got, t in zip(index, want):
        assert got.tensor_type == t.tensor_type and list(got.shape) == list(t.shape)
        assert got.data.dtype == t.data.dtype and got.data.shape == t.data.shape
        assert np.array_equal(got.data, t.data)


def _refuse(*a, **k):
    raise AssertionError("parsed the GGUF again")


def _refuse_parsing(monkeypatch):
    monkeypatch.setattr(gguf, "GGUFReader", _refuse)


def test_tensor_index_is_the_readers_and_is_read_from_the_cache_next(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_GGUF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    _write(path, 4, 0)
    _same_as_reader(gguf_meta.tensor_index(str(path)), path)
    [entry] = (tmp_path / "cache").iterdir()
    assert json.loads((entry / "tensors" / "tensors.json").read_text())[1]["name"] == "b"
    with monkeypatch.context() as m:
        _refuse_parsing(m)
        index = gguf_meta.tensor_index(str(path))
    _same_as_reader(index, path)


def test_a_changed_file_gets_a_new_entry_and_its_old_one_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_GGUF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    _write(path, 4, 0)
    gguf_meta.tensor_index(str(path))
    [old] = (tmp_path / "cache").iterdir()
    tensors = _write(path, 6, 1)  # same path, other shapes and values
    index = gguf_meta.tensor_index(str(path))
    _same_as_reader(index, path)
    assert np.array_equal(index[0].data, tensors["a"])
    assert [e.name for e in (tmp_path / "cache").iterdir()] != [old.name] and not old.exists()


def test_a_damaged_entry_is_rebuilt(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVCACHE_GGUF_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    _write(path, 4, 0)
    gguf_meta.tensor_index(str(path))
    [entry] = (tmp_path / "cache").iterdir()
    (entry / "tensors" / "tensors.json").write_text('[{"name": "a"')  # cut short
    with caplog.at_level(logging.WARNING, logger="kvcache.models.gguf_meta"):
        _same_as_reader(gguf_meta.tensor_index(str(path)), path)
    assert "does not load" in caplog.text
    assert json.loads((entry / "tensors" / "tensors.json").read_text())[0]["name"] == "a"


def test_a_cache_that_cannot_be_written_is_said_once_and_loading_goes_on(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVCACHE_GGUF_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(gguf_meta, "_warned", set())
    path = tmp_path / "m.gguf"
    _write(path, 4, 0)
    with caplog.at_level(logging.WARNING, logger="kvcache.models.gguf_meta"):
        _same_as_reader(gguf_meta.tensor_index(str(path)), path)
        _same_as_reader(gguf_meta.tensor_index(str(path)), path)
    assert caplog.text.count("cannot cache GGUF metadata") == 1


def test_no_cache_with_0(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_GGUF_CACHE", "0")
    monkeypatch.setenv("KVCACHE_CACHE", str(tmp_path / "home"))
    path = tmp_path / "m.gguf"
    _write(path, 4, 0)
    _same_as_reader(gguf_meta.tensor_index(str(path)), path)
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_the_demo_models_config_and_tokenizer_from_the_cache_are_the_files(demo_path, tmp_path, monkeypatch):
    """The demo GGUF loaded twice through a fresh cache: the second load parses nothing (gguf's reader and
    transformers' GGUF loader refuse), and both give transformers' own config and tokenizer, and the same tensors."""
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from transformers import AutoConfig, AutoTokenizer
    monkeypatch.setenv("KVCACHE_GGUF_CACHE", str(tmp_path / "cache"))
    d, name = os.path.split(demo_path)
    want_config = AutoConfig.from_pretrained(d, gguf_file=name)
    want_tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    first = read_checkpoint(demo_path)
    with monkeypatch.context() as m:
        _refuse_parsing(m)
        m.setattr(hf_gguf, "load_gguf_checkpoint", _refuse)
        second = read_checkpoint(demo_path)
    text = "<|im_start|>user\nWhat is the capital of France? Ünïcode, emoji 🙂 and  spaces.<|im_end|>"
    chat = [{"role": "user", "content": "Hi"}]
    for loaded in (first, second):
        assert loaded.config.to_dict() == want_config.to_dict()
        tok = loaded.tokenizer
        assert tok(text).input_ids == want_tok(text).input_ids and len(tok) == len(want_tok)
        assert tok.decode(want_tok(text).input_ids) == want_tok.decode(want_tok(text).input_ids)
        assert tok.all_special_ids == want_tok.all_special_ids and tok.eos_token_id == want_tok.eos_token_id
        assert (tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                == want_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    name = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(first.weights.read(name), second.weights.read(name))
    assert first.weights.names() == second.weights.names()


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(gguf_meta, "_warned", set())
