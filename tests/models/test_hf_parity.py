"""The kvcache model matches transformers on the same weights; GGUF tensors round-trip; loader errors."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tiny_models import TINY_ARCHS, hf_model
from kvcache.attention.metadata import SeqChunk, build_batch
from kvcache.models.loader import LoadedModel, ModelLoadError, build_model, read_checkpoint, read_config
from kvcache.models.weights import GGUFSource, read_all
from kvcache.store.kv_store import KVStore

ATOL = 1e-4
BLOCK_SIZE = 4
PROMPT_LEN = 41  # longer than mistral-swa's window of 24, not a multiple of the block size or of 7


def _prompt(n: int, seed: int, vocab: int = 320) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]


class Runner:
    """A kvcache model with its own store; sequences get scattered block tables."""

    def __init__(self, model, num_blocks: int = 64, seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        kv_heads, head_dim, latent = model.kv_layout
        self.store = KVStore(cfg.num_hidden_layers, num_blocks, BLOCK_SIZE, kv_heads, head_dim, latent=latent)
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // BLOCK_SIZE)
        t, self.free = self.free[:n], self.free[n:]
        return t

    def step(self, chunks: list[SeqChunk], all_rows: bool = True) -> torch.Tensor:
        batch = build_batch(chunks, BLOCK_SIZE, self.model.windows)
        if all_rows:  # logits for every row, not only the last of each chunk
            batch.logits_indices = torch.arange(batch.num_tokens)
        return self.model(batch, self.store)


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    """arch -> (kvcache model, transformers model), loaded once for this module."""
    out = {}
    for arch, d in tiny_model_dirs.items():
        loaded = read_checkpoint(d)
        out[arch] = (build_model(loaded, max_positions=256), hf_model(d))
    return out


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_prefill_matches_hf(models, arch):
    model, hf = models[arch]
    ids = _prompt(PROMPT_LEN, seed=1)
    ref = _hf_logits(hf, ids)
    r = Runner(model)
    got = r.step([SeqChunk(ids, 0, r.table(len(ids)))])
    assert got.shape == ref.shape == (PROMPT_LEN, model.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [7, 1], ids=["chunked-prefill", "token-by-token-decode"])
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_incremental_matches_hf(models, arch, chunk):
    """The prompt fed `chunk` tokens at a time on top of the cache gives transformers' logits."""
    model, hf = models[arch]
    ids = _prompt(PROMPT_LEN, seed=1 + chunk)
    ref = _hf_logits(hf, ids)
    r = Runner(model, seed=chunk)
    table = r.table(len(ids))
    got = torch.cat([r.step([SeqChunk(ids[s:s + chunk], s, table)]) for s in range(0, len(ids), chunk)])
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral-swa", "qwen3"])
def test_mixed_batch_matches_hf(models, arch):
    """Decodes of different lengths and prefill chunks in one step, each row as if alone."""
    model, hf = models[arch]
    prompts = [_prompt(n, seed=10 + n) for n in (40, 9, 30, 17)]
    r = Runner(model, num_blocks=64, seed=3)
    tables = [r.table(len(p)) for p in prompts]
    # step 1: bring each sequence to its cached length (everything but the tail)
    cached = [len(prompts[0]) - 1, len(prompts[1]) - 1, 20, 0]
    r.step([SeqChunk(p[:c], 0, t, False) for p, t, c in zip(prompts, tables, cached) if c], all_rows=False)
    # step 2: two decodes (40 and 9 tokens of context), a chunk on a cache, a fresh prefill
    chunks = [SeqChunk(p[c:], c, t) for p, t, c in zip(prompts, tables, cached)]
    got = r.step(chunks)
    at = 0
    for p, c in zip(prompts, cached):
        n = len(p) - c
        torch.testing.assert_close(got[at:at + n], _hf_logits(hf, p)[c:], atol=ATOL, rtol=0)
        at += n


def test_mistral_window_matters(models):
    """The sliding-window prompt is long enough that a full-attention model would differ."""
    model, hf = models["mistral-swa"]
    assert model.config.sliding_window == 24
    assert set(model.windows) == {24}
    ids = _prompt(PROMPT_LEN, seed=1)
    ref = _hf_logits(hf, ids)
    saved = [layer.window for layer in model.layers]
    try:
        for layer in model.layers:
            layer.window = None
        r = Runner(model)
        batch = build_batch([SeqChunk(ids, 0, r.table(len(ids)))], BLOCK_SIZE, (None,))
        batch.logits_indices = torch.arange(batch.num_tokens)
        full = model(batch, r.store)
    finally:
        for layer, w in zip(model.layers, saved):
            layer.window = w
    torch.testing.assert_close(full[:24], ref[:24], atol=ATOL, rtol=0)
    assert (full[24:] - ref[24:]).abs().max() > 1e-3


# ---- GGUF round trip -------------------------------------------------------------------------------

_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TO_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF_GLOBAL:
        return _TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")
    assert parts[:2] == ["model", "layers"], hf_name
    return f"blk.{parts[2]}.{_TO_GGUF_LAYER['.'.join(parts[3:])]}"


def _write_llama_gguf(path: str, directory: str, qtype) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Write the HF llama in `directory` as GGUF; returns (HF tensors, what each should dequantize to)."""
    import gguf

    cfg = json.load(open(os.path.join(directory, "config.json")))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hf = load_file(os.path.join(directory, "model.safetensors"))
    expected: dict[str, np.ndarray] = {}
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    for name, t in hf.items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = _permute(a, n_head)
        elif name.endswith("k_proj.weight"):
            a = _permute(a, n_kv)
        a = np.ascontiguousarray(a)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            if qtype == gguf.GGMLQuantizationType.F16:
                w.add_tensor(_gguf_name(name), a.astype(np.float16))
                stored = a.astype(np.float16).astype(np.float32)
            else:
                q = gguf.quants.quantize(a, qtype)
                w.add_tensor(_gguf_name(name), q, raw_dtype=qtype)
                stored = gguf.quants.dequantize(q, qtype)
        else:  # norms stay F32, as llama.cpp keeps them
            w.add_tensor(_gguf_name(name), a)
            stored = a
        expected[name] = stored
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, expected


@pytest.mark.parametrize("arch", ["llama", "llama-mqa-tied"])
def test_gguf_f32_round_trip_is_exact(tiny_model_dirs, tmp_path, arch):
    import gguf

    d = tiny_model_dirs[arch]
    cfg = json.load(open(os.path.join(d, "config.json")))
    path = str(tmp_path / "tiny-f32.gguf")
    hf, _ = _write_llama_gguf(path, d, gguf.GGMLQuantizationType.F32)
    got = read_all(GGUFSource(path, "llama", cfg["num_attention_heads"], cfg["num_key_value_heads"]))
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert got[name].dtype == torch.float32, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t.float()), name


def test_gguf_f32_model_matches_hf(tiny_model_dirs, tmp_path, models):
    """Weights read back from GGUF drive the kvcache model to transformers' logits."""
    import gguf

    d = tiny_model_dirs["llama"]
    path = str(tmp_path / "tiny.gguf")
    _write_llama_gguf(path, d, gguf.GGMLQuantizationType.F32)
    cfg = models["llama"][0].config
    model = build_model(LoadedModel(cfg, None, GGUFSource(path, "llama", cfg.num_attention_heads,
                                                          cfg.num_key_value_heads), path), max_positions=64)
    ids = _prompt(20, seed=5)
    r = Runner(model)
    got = r.step([SeqChunk(ids, 0, r.table(len(ids)))])
    torch.testing.assert_close(got, _hf_logits(models["llama"][1], ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("qname", ["Q8_0", "F16"])
def test_gguf_quantized_round_trip(tiny_model_dirs, tmp_path, qname):
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, qname)
    d = tiny_model_dirs["llama"]
    cfg = json.load(open(os.path.join(d, "config.json")))
    path = str(tmp_path / f"tiny-{qname}.gguf")
    hf, expected = _write_llama_gguf(path, d, qtype)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    got = read_all(GGUFSource(path, "llama", n_head, n_kv))
    assert set(got) == set(hf)
    for name, t in hf.items():
        g = got[name]
        assert g.dtype == torch.float32 and g.shape == t.shape, name
        # what the file holds, un-permuted back to the HF layout, exactly
        want = expected[name]
        if name.endswith("q_proj.weight"):
            want = _unpermute_ref(want, n_head)
        elif name.endswith("k_proj.weight"):
            want = _unpermute_ref(want, n_kv)
        assert torch.equal(g, torch.from_numpy(np.ascontiguousarray(want))), name
        # and close to the original weights: Q8_0 errs by at most half a step of max|block| / 127
        tol = t.abs().max().item() / 127 if qname == "Q8_0" else 1e-3 * t.abs().max().item()
        torch.testing.assert_close(g, t.float(), atol=tol, rtol=0, msg=name)
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, hf["model.layers.0.self_attn.q_proj.weight"])  # really quantized


def test_gguf_llama_qk_biases_are_unpermuted(tmp_path):
    """llama.cpp's converter permutes q/k *biases* of a Llama the same way as the weights
    (`name.endswith(("q_proj.weight", "q_proj.bias"))`), so reading them back must undo it too."""
    import gguf

    n_head, n_kv, hd, d = 4, 2, 16, 64
    g = torch.Generator().manual_seed(0)
    hf = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(n_head * hd, d, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(n_head * hd, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(n_kv * hd, d, generator=g),
        "model.layers.0.self_attn.k_proj.bias": torch.randn(n_kv * hd, generator=g),
        "model.layers.0.self_attn.v_proj.bias": torch.randn(n_kv * hd, generator=g),
    }
    path = str(tmp_path / "bias.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name, t in hf.items():
        a = t.numpy()
        heads = n_head if ".q_proj." in name else n_kv
        if ".q_proj." in name or ".k_proj." in name:
            a = _permute(a, heads)
        gname = f"blk.0.attn_{name.split('.')[-2][0]}.{name.split('.')[-1]}"
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_all(GGUFSource(path, "llama", n_head, n_kv))
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert torch.equal(got[name], t), name


def _unpermute_ref(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of _permute, written independently: head-wise, de-interleave the rotary pairs."""
    rows, rest = w.shape[0], w.shape[1:]
    hd = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        block = w[h * hd:(h + 1) * hd]
        out[h * hd:h * hd + hd // 2] = block[0::2]
        out[h * hd + hd // 2:(h + 1) * hd] = block[1::2]
    return out.reshape(rows, *rest)


def test_permutation_helpers_are_inverse():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    assert np.array_equal(_unpermute_ref(_permute(w, 4), 4), w)
    assert not np.array_equal(_permute(w, 4), w)


# ---- loader errors ---------------------------------------------------------------------------------

def test_missing_path(tmp_path):
    p = str(tmp_path / "no-such-model")
    for fn in (read_checkpoint, read_config):
        with pytest.raises(ModelLoadError) as e:
            fn(p)
        assert p in str(e.value) and "does not exist" in str(e.value)


def test_a_gemma_gguf_is_refused_before_its_tensors_are_read(tiny_model_dirs, tmp_path, monkeypatch):
    """Gemma's GGUF tensors (names, norms stored as 1 + w) are not mapped: refused by name, not loaded wrongly."""
    import gguf
    from transformers import AutoConfig
    from kvcache.models import loader
    path = str(tmp_path / "m.gguf")
    _write_llama_gguf(path, tiny_model_dirs["llama"], gguf.GGMLQuantizationType.F32)
    gemma = AutoConfig.from_pretrained(tiny_model_dirs["gemma3"])
    monkeypatch.setattr(loader, "read_config", lambda p: gemma)
    monkeypatch.setattr(loader, "GGUFSource", lambda *a: pytest.fail("the tensors were opened"))
    with pytest.raises(ModelLoadError, match="GGUF checkpoints of gemma3_text are not supported"):
        loader.read_checkpoint(path)


def test_text_file_is_not_gguf(tmp_path):
    p = tmp_path / "model.txt"
    p.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        read_checkpoint(str(p))
    assert str(p) in str(e.value)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_checkpoint(str(empty))


def test_gguf_magic_with_garbage(tmp_path):
    p = tmp_path / "broken.gguf"
    p.write_bytes(b"GGUF" + b"\x00\x01garbage" * 10)
    with pytest.raises(ModelLoadError) as e:
        read_config(str(p))
    assert str(p) in str(e.value)


def test_directory_without_config(tmp_path):
    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="config.json") as e:
        read_checkpoint(str(d))
    assert str(d) in str(e.value)


def test_directory_without_weights(tmp_path, tiny_model_dirs):
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(tiny_model_dirs["llama"], "config.json")).read())
    with pytest.raises(ModelLoadError, match="safetensors"):
        read_checkpoint(str(d))


def test_unsupported_model_type(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4,
                                               "vocab_size": 320}))
    for fn in (read_config, read_checkpoint):
        with pytest.raises(ModelLoadError) as e:
            fn(str(d))
        msg = str(e.value)
        assert "gpt2" in msg and "not supported" in msg
        assert "llama" in msg  # names what is supported


def test_unknown_model_type(tmp_path):
    d = tmp_path / "mystery"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "no-such-architecture-xyz"}))
    with pytest.raises(ModelLoadError) as e:
        read_config(str(d))
    assert str(d) in str(e.value)


@pytest.mark.parametrize("arch, change, field", [
    ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types"),  # 1 entry for 2 layers
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ("gemma3", {"sliding_window": 0}, "sliding_window"),
    ("qwen2-swa", {"sliding_window": -4}, "sliding_window"),
    ("gemma2", {"attn_logit_softcapping": 0.0}, "attn_logit_softcapping"),
    ("gemma2", {"final_logit_softcapping": -30.0}, "final_logit_softcapping"),
    ("gemma3", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_activation"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_inconsistent_layer_kinds_and_gemma_fields_are_refused_before_loading(tiny_model_dirs, tmp_path, arch,
                                                                               change, field):
    """Read from config.json as transformers parses it (which checks none of these), refused naming the field."""
    import shutil
    d = tmp_path / arch
    shutil.copytree(tiny_model_dirs[arch], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    for fn in (read_config, read_checkpoint):
        with pytest.raises(ModelLoadError, match=field):
            fn(str(d))


def test_model_load_error_is_value_error():
    assert issubclass(ModelLoadError, ValueError)


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_last_layer_runs_the_logits_rows_only(models, arch, monkeypatch):
    """A step that wants logits for a few rows runs the last layer's output projection and MLP on those rows only
    (LlamaModel.forward), and gives those rows what a step that wants every row gives them, to the bit: each row's
    arithmetic does not depend on the rows beside it. The cache the step writes is the same too."""
    model, _ = models[arch]
    prompts = [_prompt(n, seed=30 + n) for n in (23, 9, 17)]
    runs = []
    for all_rows in (True, False):
        r = Runner(model, seed=5)
        seen = []
        last = model.layers[-1]
        real = type(last).forward
        monkeypatch.setattr(last, "forward", lambda *a, **kw: (seen.append(a[-1]), real(last, *a, **kw))[1])
        logits = r.step([SeqChunk(p, 0, r.table(len(p))) for p in prompts], all_rows)
        monkeypatch.undo()
        runs.append((logits, seen[0], [t.clone() for t in r.store.k + r.store.v]))
    (full, full_rows, full_kv), (few, few_rows, few_kv) = runs
    ends = torch.tensor([22, 22 + 9, 22 + 9 + 17])
    assert full_rows is None and torch.equal(few_rows, ends)  # the last layer was handed the 3 logits rows
    assert few.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(few, full[ends], atol=0, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(few_kv, full_kv))
    r = Runner(model, seed=5)  # a step that samples nothing (a chunk of a longer prompt): no rows, the same cache
    none = r.step([SeqChunk(p, 0, r.table(len(p)), False) for p in prompts], all_rows=False)
    assert none.shape == (0, model.config.vocab_size)
    assert all(torch.equal(a, b) for a, b in zip(r.store.k + r.store.v, full_kv))
