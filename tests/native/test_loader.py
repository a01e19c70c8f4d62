"""kvcache.native: the variant chosen from the CPU's features (KVCACHE_CPU_ISA forcing one, refused with what the CPU
has where it cannot run), a build that is stale, damaged or missing never loaded (a checkout rebuilds it; elsewhere
the engine falls back to torch with one warning, or refuses where the configuration needs the kernels), and the
install's refusal to build without torch or a compiler, with the message that says what to do."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil

import pytest

from kvcache import native
from kvcache.native import manifest


@pytest.fixture
def fresh(monkeypatch):
    """native's choice forgotten before and after the test (the environment restored by monkeypatch)."""
    native.reset()
    yield
    monkeypatch.undo()
    native.reset()


def _built_dir() -> str:
    """The build this process loads (a test that needs one fails where the install did not build it)."""
    native.require()
    return native._state.directory


def test_the_variant_is_the_best_the_cpu_runs_and_says_so(fresh, monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    k = native.require()
    runnable = native.runnable_isas()
    assert k.isa == runnable[0] and "scalar" in runnable
    assert all(native.runs_here(i) for i in runnable)
    assert native.describe().startswith(f"{k.isa} (the best this CPU runs")


def test_an_isa_the_cpu_lacks_is_refused_with_what_it_has(tiny_llama, fresh, monkeypatch):
    """As on an AVX2-only machine (the CPU's features replaced by AVX2's): KVCACHE_CPU_ISA=avx512 is refused at the
    choice, naming what is missing and what the CPU has, and the engine's start-up raises it."""
    monkeypatch.setattr(native, "cpu_features", lambda: ["avx2", "f16c", "fma", "x86-64-v3"])
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=r"KVCACHE_CPU_ISA=avx512: this \S+ CPU lacks avx512f, avx512bw, avx512vl, "
                                         r"avx512dq, avx512_vnni, x86-64-v4 \(it has avx2, f16c, fma, x86-64-v3\); "
                                         r"use avx2 or scalar"):
        native.kernels()
    from kvcache import LLM
    with pytest.raises(ValueError, match="KVCACHE_CPU_ISA=avx512: .* lacks avx512f"):
        LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=128)


def test_a_value_that_names_no_variant_is_refused(fresh, monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "avx3")
    with pytest.raises(ValueError, match=r"KVCACHE_CPU_ISA='avx3': use auto \(the default: the best variant this "
                                         r"CPU runs\) or one of avx512, avx2, scalar"):
        native.kernels()


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_a_forced_variant_is_the_one_that_runs(fresh, monkeypatch, isa):
    if isa not in native.runnable_isas():
        pytest.skip(f"this CPU cannot run {isa}")
    monkeypatch.setenv(native.ISA_ENV, isa)
    assert native.kernels().isa == isa == native.isa()
    assert native.describe() == f"{isa} (KVCACHE_CPU_ISA={isa})"


def test_the_engine_reports_its_variant(tiny_llama, fresh, caplog):
    from kvcache import LLM
    with caplog.at_level(logging.INFO, logger="kvcache"):
        llm = LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=128)
    assert llm.kv_cache_info()["cpu_isa"] == native.require().isa
    assert any(r.getMessage() == f"CPU kernels: {native.describe()}" for r in caplog.records)


def _copy_build(tmp_path) -> str:
    directory = str(tmp_path / "build")
    shutil.copytree(_built_dir(), directory)
    return directory


def test_a_damaged_module_is_found_before_it_is_loaded(tmp_path):
    directory = _copy_build(tmp_path)
    data = manifest.read(directory)
    assert native._verify(directory, data) is None
    path = os.path.join(directory, data["modules"]["_C_scalar"]["file"])
    with open(path, "r+b") as f:  # one byte of the module's code
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert native._verify(directory, data) == f"damaged: a module's bytes are not the ones built ({path})"
    os.remove(path)
    assert native._verify(directory, data) == f"missing its module _C_scalar ({path})"


def test_a_build_for_another_torch_or_other_sources_is_stale(tmp_path, monkeypatch):
    import torch
    directory = _copy_build(tmp_path)
    data = manifest.read(directory)
    assert native._verify(directory, {**data, "torch": "2.0.0"}) == \
        f"built against torch 2.0.0, and this is torch {torch.__version__}"
    if native.in_checkout():  # a checkout's own build is held to its sources too
        assert native._verify(directory, {**data, "sources": "0" * 64}) == \
            "built from other sources (csrc/ or setup.py changed since)"


def test_a_stale_build_in_a_checkout_is_rebuilt_never_loaded(tmp_path, monkeypatch, fresh):
    """The environment's build in a checkout, found stale, is handed to rebuild (under its lock) and loaded only once
    it checks; where the rebuild fails, nothing is loaded and the reason is the build's log."""
    directory = _copy_build(tmp_path)
    data = manifest.read(directory)
    with open(os.path.join(directory, manifest.MANIFEST), "w") as f:
        json.dump({**data, "torch": "2.0.0"}, f)
    monkeypatch.setattr(native, "build_dirs", lambda: [directory])
    monkeypatch.setattr(native, "in_checkout", lambda: True)
    calls = []

    def rebuild(why):
        calls.append(why)
        with open(os.path.join(directory, manifest.MANIFEST), "w") as f:
            json.dump(data, f)  # what a successful build writes
    monkeypatch.setattr(native, "rebuild", rebuild)
    assert native._find_build() == (directory, None)
    assert calls == [f"built against torch 2.0.0, and this is torch {data['torch']}"]

    def failed(why):
        raise native.KernelsUnavailable("rebuilding the C++ kernels failed (exit 1); the log is ...")
    with open(os.path.join(directory, manifest.MANIFEST), "w") as f:
        json.dump({**data, "torch": "2.0.0"}, f)
    monkeypatch.setattr(native, "rebuild", failed)
    assert native._find_build() == (None, "rebuilding the C++ kernels failed (exit 1); the log is ...")


def test_without_a_build_the_engine_falls_back_once_or_refuses(tmp_path, tiny_llama, fresh, monkeypatch, caplog):
    """No build for this environment: kernels() says so once, naming what is lost and how to build, and the engine
    runs on torch; --attention-backend cpu and --quantization int4 are refused with that reason."""
    monkeypatch.setattr(native, "build_dirs", lambda: [str(tmp_path / "none")])
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    native.reset(forget_build=True)
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert native.kernels() is None and native.kernels() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the C++ CPU kernels are not built for this environment" in warnings[0]
    assert "Running on PyTorch's ops instead" in warnings[0]
    with pytest.raises(native.KernelsUnavailable, match="not built for this environment"):
        native.require()
    from kvcache import LLM
    for kwargs, what in (({"attention_backend": "cpu"}, "attention_backend cpu cannot run here: the C++ CPU kernels "
                                                        "are not built"),
                         ({"quantization": "int4"}, "--quantization int4 needs the C++ CPU kernels")):
        with pytest.raises(ValueError, match=re.escape(what)):
            LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=128, **kwargs)
    llm = LLM(tiny_llama, kv_cache_memory="4MiB", max_model_len=128)
    assert llm.kv_cache_info()["cpu_isa"] is None and llm.kv_cache_info()["attention_backend"] == "torch"
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.skipif(not native.in_checkout(), reason="setup.py is a checkout's")
def test_the_install_says_what_to_do_without_a_compiler_or_torch(monkeypatch):
    """setup.py's reasons not to build (it then installs without the kernels, and kvcache runs on torch)."""
    spec = importlib.util.spec_from_file_location("kvcache_setup", os.path.join(native.CHECKOUT, "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # not __main__: defines, does not build
    assert setup.why_not_build() is None
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert setup.why_not_build().startswith("no C++ compiler ('/nonexistent/c++' is not on PATH): install one "
                                            "(Debian/Ubuntu: apt-get install g++")
    monkeypatch.setenv("KVCACHE_BUILD_KERNELS", "0")
    assert setup.why_not_build() == "KVCACHE_BUILD_KERNELS=0"
    assert set(setup.isa_variants()) == set(native.ISAS) if native.platform.machine() == "x86_64" else {"scalar"}
