"""Shared fixtures: tiny random-weight checkpoints (built by tiny_models.py), and the real demo model
with its transformers oracle (loaded once per run)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import settings

# xdist's workers share the cores: each takes its share of OpenMP threads (subprocesses inherit it), never more in
# all than the machine has. Oversubscribed, every parallel region's barrier waits for the scheduler (a test of 6 s
# alone took 175 s beside another worker). Tests of the kernels' threading set their own count (tests/native).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

# Triton reads TRITON_INTERPRET when a kernel is defined, and transformers can import triton in any test: set it
# before anything does, so that where there is no GPU the Triton kernel tests run interpreted whatever ran first.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from redis_server import RedisServer
from tiny_models import TINY_ARCHS, hf_model, make_tiny_model

# No example fails for its time (hypothesis' default deadline is 200 ms): on a loaded machine a slow example is still
# a right one. Tests never assert on time.
settings.register_profile("kvcache", deadline=None)
settings.load_profile("kvcache")

# Tests pin their device: `auto` means the CPU for the whole suite (subprocesses included), where the oracles
# and the exact float32 comparisons run; tests marked cuda ask for device="cuda" themselves.
os.environ["KVCACHE_DEVICE"] = "cpu"

# GGUF metadata (gguf_meta) is cached in a directory of this run's, not the user's: the tests write many small GGUF
# files. The process that makes it (the xdist controller, whose workers and subprocesses inherit it) removes it.
if not os.environ.get("KVCACHE_GGUF_CACHE"):
    os.environ["KVCACHE_GGUF_CACHE"] = tempfile.mkdtemp(prefix="kvcache-gguf-test-")
    _GGUF_CACHE_OWNER = os.getpid()


def pytest_unconfigure(config):
    if globals().get("_GGUF_CACHE_OWNER") == os.getpid():
        shutil.rmtree(os.environ["KVCACHE_GGUF_CACHE"], ignore_errors=True)


def pytest_sessionstart(session):
    """The C++ kernels checked before any test (built at install; a stale build in a checkout is rebuilt here, once,
    before the workers start): a build that cannot load fails the run here, not as slowdowns in the tests."""
    from kvcache import native
    if os.environ.get(native.OFF_ENV, "1") != "0":
        native.require()


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda run only where torch sees a CUDA device (the GPU check); elsewhere they are skipped."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """KVCACHE_FAILURE_LOG=path appends each failure's report to that file as it happens (by the controller where
    xdist runs workers): the GPU check keeps the failures of a test step that runs out of time before pytest's
    summary."""
    path = os.environ.get("KVCACHE_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@pytest.fixture(autouse=True)
def _device_memory_given_back(request):
    """Tests marked gpu_memory derive the KV budget from the device's free memory: what earlier tests of this process
    left in torch's cache is given back to the device first."""
    if request.node.get_closest_marker("gpu_memory"):
        import gc

        import torch
        gc.collect()
        torch.cuda.empty_cache()
    yield


def _variant_or_skip(isa: str):
    """The C++ kernels of variant `isa`, or a skip that says why this machine cannot run it. A build that is
    missing or broken fails instead (CI must build the kernels), unless KVCACHE_CPU_KERNEL=0 turned them off."""
    from kvcache import native
    if os.environ.get(native.OFF_ENV, "1") == "0":
        pytest.skip(f"{native.OFF_ENV}=0: the C++ kernels are off")
    native.require()  # the chosen variant: raises where the build is missing or broken
    if isa not in native.runnable_isas():
        pytest.skip(f"this machine cannot run the {isa} variant: {native._cpu_lacks(isa)}")
    return native.kernels(isa)


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa_kernels(request):
    """Each instruction-set variant's kernels in turn, for tests of the kernels themselves (an AVX-512 machine tests
    the AVX2 and scalar paths too; a variant the CPU cannot run is skipped with the reason)."""
    return _variant_or_skip(request.param)


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def cpu_isa(request, monkeypatch):
    """Each variant in turn as the one this process runs (KVCACHE_CPU_ISA), for tests that reach the kernels through
    the engine's own calls; the choice is undone afterwards."""
    from kvcache import native
    _variant_or_skip(request.param)
    monkeypatch.setenv(native.ISA_ENV, request.param)
    native.reset()
    yield request.param
    monkeypatch.undo()
    native.reset()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {a: make_tiny_model(str(root / a), a) for a in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def demo_path() -> str:
    from kvcache.models.loader import demo_model_path
    return demo_model_path()


@pytest.fixture(scope="session")
def demo_hf(demo_path):
    """transformers' own load of the demo GGUF: the oracle for the real model (about a minute)."""
    from transformers import AutoTokenizer
    d, name = os.path.split(demo_path)
    return hf_model(demo_path), AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.fixture(scope="session")
def demo_llm(demo_path):
    from kvcache import LLM
    return LLM(demo_path, kv_cache_memory="256MiB", max_model_len=2048)


def _scaled_norm(src: str, directory, factor: float) -> str:
    """A copy of the tiny llama at `src` with its final norm scaled by `factor` (its logits too)."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, directory, dirs_exist_ok=True)
    weights = directory / "model.safetensors"
    w = load_file(weights)
    w["model.norm.weight"] = w["model.norm.weight"] * factor
    save_file(w, weights, metadata={"format": "pt"})
    return str(directory)


@pytest.fixture(scope="session")
def sharp_llama(tiny_llama, tmp_path_factory) -> str:
    """The tiny llama with its final norm scaled 40x: its next-token distributions are as peaked as a trained
    model's (the random one's are nearly flat over 320 ids, so a sampled proposal would almost never be accepted
    and a test of sampled speculation would test nothing)."""
    return _scaled_norm(tiny_llama, tmp_path_factory.mktemp("sharp_llama"), 40)


@pytest.fixture(scope="session")
def blunt_llama(tiny_llama, tmp_path_factory) -> str:
    """The same scaled 10x: sharp_llama's distributions at 4x the temperature, a draft for it that is often
    right and often wrong (its rejections' residual carries much of the output's probability)."""
    return _scaled_norm(tiny_llama, tmp_path_factory.mktemp("blunt_llama"), 10)


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server (tests/redis_server.py) on a free port, for this test only."""
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.stop()
