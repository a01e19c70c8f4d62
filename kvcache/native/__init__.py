"""The C++ CPU kernels (csrc/), built at install by setup.py, and the instruction-set variant this process runs.

setup.py builds every kernel once per variant (`avx512`: AVX-512 F/BW/VL/DQ with VNNI; `avx2`: AVX2 + FMA + F16C;
`scalar`: plain C++, the only one off x86) into modules of their own, beside a bindings module and a manifest.
`kernels()` checks the manifest (the torch it was built against, the sources, each module's SHA-256), imports the
variant chosen once per process and returns its kernels, whose calls release the GIL.

The variant: `KVCACHE_CPU_ISA=auto` (the default) takes the best one this CPU runs; `avx512`, `avx2` or `scalar`
forces one and is refused, with what the CPU has, where it cannot run. `KVCACHE_CPU_KERNEL=0` turns the kernels off.

Where the kernels cannot be had (not built: no compiler or no torch at install; a build for another torch; a
rebuild that failed), `kernels()` returns None after one warning naming what is lost and how to get it back, and
the engine runs on PyTorch's ops; `require()` raises the same reason instead (`--attention-backend cpu`,
`--quantization int4`, or an explicit `KVCACHE_CPU_ISA`). In a source checkout a stale or damaged build (the sources
or torch changed since, a module whose bytes do not match) is rebuilt in place, once, under a lock, and never loaded.
"""
from __future__ import annotations

import fcntl
import importlib.machinery
import importlib.util
import logging
import os
import platform
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from kvcache.native import manifest

log = logging.getLogger("kvcache")

ISAS = ("avx512", "avx2", "scalar")  # best first
# What each variant's build flags (setup.py: -march=x86-64-v4 -mavx512vnni, -march=x86-64-v3) assume the CPU has,
# as /proc/cpuinfo and csrc/bindings.cpp name it (x86-64-v3 and -v4: the psABI's levels, which add BMI, LZCNT, MOVBE
# and AVX-512 CD to these)
REQUIRES = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "x86-64-v4"),
            "avx2": ("avx2", "fma", "f16c", "x86-64-v3"),
            "scalar": ()}
# the psABI levels from /proc/cpuinfo's flags (where the bindings' cpuid is not loaded)
LEVELS = {"x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
          "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}
ISA_ENV, OFF_ENV = "KVCACHE_CPU_ISA", "KVCACHE_CPU_KERNEL"

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # kvcache/
CHECKOUT = os.path.dirname(PACKAGE_DIR)  # a source checkout's root, where it has setup.py and csrc/
BUILD_MINUTES = 3  # a whole build on 2 cores


class KernelsUnavailable(RuntimeError):
    """The C++ kernels cannot run here; the message says why and what to do."""


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    loaded: bool = False
    directory: str | None = None  # where the build this process loaded lives
    bindings: object = None  # the _C module
    reason: str | None = None  # why the kernels are unavailable
    variants: dict = field(default_factory=dict)  # isa -> Kernels
    current: object = None  # the chosen variant's Kernels, once chosen
    fallback: bool = False  # kernels() has said it runs without them


_state = _State()


def in_checkout() -> bool:
    """Whether kvcache runs from a source checkout (setup.py and csrc/ beside the package), which can rebuild."""
    return os.path.isfile(os.path.join(CHECKOUT, "setup.py")) and os.path.isdir(os.path.join(CHECKOUT, "csrc"))


def build_dirs() -> list[str]:
    """Where a build for this environment may be: the environment's own directory (a build in place, in a
    checkout), then the installed package's."""
    base = os.path.join(PACKAGE_DIR, "_native")
    return [os.path.join(base, manifest.env_key()), base]


def cpu_features() -> list[str]:
    """The features of this CPU that the variants need (REQUIRES's names): from the bindings module's cpuid where it
    is loaded, else from /proc/cpuinfo (Linux), else none."""
    if _state.bindings is not None:
        return list(_state.bindings.cpu_features())
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split(":", 1)[-1].split()
    except OSError:
        return []
    have = set(flags)
    have |= {"x86-64-v3"} if all(f in have for f in LEVELS["x86-64-v3"]) else set()
    have |= {"x86-64-v4"} if "x86-64-v3" in have and all(f in have for f in LEVELS["x86-64-v4"]) else set()
    wanted = {name for names in REQUIRES.values() for name in names}
    return [name for name in sorted(wanted) if name in have]


def runs_here(isa: str) -> bool:
    """Whether this CPU runs variant `isa`'s instructions (the x86 variants on x86 only)."""
    if isa != "scalar" and platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    have = set(cpu_features())
    return all(name in have for name in REQUIRES[isa])


def requested_isa() -> str:
    """KVCACHE_CPU_ISA: `auto` (unset) or a variant's name; ValueError for anything else."""
    value = os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", *ISAS):
        raise ValueError(f"{ISA_ENV}={value!r}: use auto (the default: the best variant this CPU runs) or one of "
                         f"{', '.join(ISAS)}")
    return value


def _cpu_lacks(isa: str) -> str:
    have = cpu_features()
    missing = [name for name in REQUIRES[isa] if name not in have]
    what = platform.machine() or "this"
    return (f"this {what} CPU lacks {', '.join(missing) or 'the x86 instruction sets'} (it has "
            f"{', '.join(have) or 'none of ' + ', '.join(REQUIRES['avx2'])})")


def _built_modules(directory: str) -> dict:
    data = manifest.read(directory)
    return data["modules"] if data else {}


def _verify(directory: str, data: dict) -> str | None:
    """Why the build in `directory` (its manifest `data`) must not be loaded, or None."""
    import torch
    if data.get("torch") != torch.__version__:
        return f"built against torch {data.get('torch')}, and this is torch {torch.__version__}"
    if in_checkout() and directory != os.path.join(PACKAGE_DIR, "_native"):
        if data.get("sources") != manifest.sources_digest(CHECKOUT):
            return "built from other sources (csrc/ or setup.py changed since)"
    for name, entry in data["modules"].items():
        path = os.path.join(directory, entry.get("file", ""))
        if not os.path.isfile(path):
            return f"missing its module {name} ({path})"
        if manifest.file_digest(path) != entry.get("sha256"):
            return f"damaged: a module's bytes are not the ones built ({path})"
    if "_C" not in data["modules"]:
        return "missing its bindings module (_C)"
    return None


def _import(directory: str, name: str):
    """Module `name` of the build in `directory`, imported from its file (the manifest names it)."""
    full = f"kvcache._native.{name}"
    if full in sys.modules:
        return sys.modules[full]
    path = os.path.join(directory, _built_modules(directory)[name]["file"])
    loader = importlib.machinery.ExtensionFileLoader(full, path)
    spec = importlib.util.spec_from_file_location(full, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[full] = module
    return module


def rebuild(why: str) -> None:
    """Rebuild the kernels in place in this checkout (python setup.py build_ext --inplace), under a lock so that
    concurrent processes (pytest's workers) build once and the others wait for it. KernelsUnavailable if it fails."""
    directory = build_dirs()[0]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = manifest.read(directory)
        if data is not None and _verify(directory, data) is None:  # another process rebuilt it meanwhile
            return
        log.warning("the C++ CPU kernels in %s are not usable (%s): rebuilding them in place (python setup.py "
                    "build_ext --inplace, about %d minutes on 2 cores; the log: %s)", directory, why, BUILD_MINUTES,
                    os.path.join(directory, "build.log"))
        env = {k: v for k, v in os.environ.items() if k != "KVCACHE_BUILD_KERNELS"}
        with open(os.path.join(directory, "build.log"), "w") as out:
            done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=CHECKOUT, env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            with open(os.path.join(directory, "build.log")) as f:
                tail = "".join(f.readlines()[-15:])
            raise KernelsUnavailable(f"rebuilding the C++ kernels failed (exit {done.returncode}); the log is "
                                     f"{os.path.join(directory, 'build.log')}, ending:\n{tail}")


def _how_to_build() -> str:
    import shutil
    compiler = "" if shutil.which(os.environ.get("CXX", "c++")) else (
        "no C++ compiler is on PATH: install one (Debian/Ubuntu: apt-get install g++), then ")
    if in_checkout():
        return (f"{compiler}build them with `pip install --no-build-isolation -e .` (torch installed first), or "
                "`python setup.py build_ext --inplace`")
    return f"{compiler}reinstall kvcache from source with `pip install --no-build-isolation kvcache`"


def _find_build() -> tuple[str | None, str | None]:
    """(directory, None) for a build this process may load, rebuilding a stale or damaged one in a checkout; or
    (None, why not)."""
    for directory in build_dirs():
        data = manifest.read(directory)
        if data is None:
            continue
        why = _verify(directory, data)
        if why is None:
            return directory, None
        if in_checkout() and directory == build_dirs()[0]:
            try:
                rebuild(why)
            except KernelsUnavailable as e:
                return None, str(e)
            data = manifest.read(directory)
            why = _verify(directory, data) if data else "no manifest written"
            if why is None:
                return directory, None
            return None, f"the rebuilt C++ CPU kernels in {directory} are not usable ({why})"
        return None, f"the C++ CPU kernels in {directory} are not usable ({why}): {_how_to_build()}"
    return None, f"the C++ CPU kernels are not built for this environment ({sys.prefix}): {_how_to_build()}"


def _load() -> None:
    """Find, check and import the build once per process (the variants are imported when first asked for)."""
    if _state.loaded:
        return
    _state.loaded = True
    if os.environ.get(OFF_ENV, "1") == "0":
        _state.reason = f"{OFF_ENV}=0 turns them off"
        return
    directory, why = _find_build()
    if directory is None:
        _state.reason = why
        return
    try:
        _state.bindings = _import(directory, "_C")
        _state.directory = directory
    except ImportError as e:  # a build the manifest vouches for, that this Python cannot load
        _state.reason = f"the C++ kernels in {directory} do not load ({e}): {_how_to_build()}"


def _variant(isa: str):
    """Variant `isa`'s Kernels (imported on first use), or KernelsUnavailable."""
    if isa not in _state.variants:
        name = f"_C_{isa}"
        if name not in _built_modules(_state.directory):
            raise KernelsUnavailable(f"this build has no {isa} variant (built: "
                                     f"{', '.join(sorted(n for n in _built_modules(_state.directory) if n != '_C'))})")
        if not runs_here(isa):
            raise KernelsUnavailable(f"the {isa} variant cannot run here: {_cpu_lacks(isa)}")
        module = _import(_state.directory, name)
        _state.variants[isa] = _state.bindings.Kernels(module.ops)
    return _state.variants[isa]


def chosen_isa() -> str:
    """The variant this process runs: KVCACHE_CPU_ISA's, or the best one built that this CPU runs. ValueError where
    KVCACHE_CPU_ISA names one this CPU cannot run (with what it has)."""
    wanted = requested_isa()
    if wanted != "auto":
        if not runs_here(wanted):
            raise ValueError(f"{ISA_ENV}={wanted}: {_cpu_lacks(wanted)}; use "
                             f"{' or '.join(i for i in ISAS if runs_here(i))} (or auto)")
        return wanted
    built = _built_modules(_state.directory) if _state.directory else {f"_C_{i}": 1 for i in ISAS}
    return next(i for i in ISAS if f"_C_{i}" in built and runs_here(i))


def require(isa: str | None = None):
    """The kernels of `isa` (default: chosen_isa()); KernelsUnavailable saying why not (ValueError for a
    KVCACHE_CPU_ISA this CPU cannot run)."""
    if isa is None and _state.current is not None:
        return _state.current
    with _state.lock:
        _load()
        chosen = isa or chosen_isa()
        if _state.bindings is None:
            raise KernelsUnavailable(_state.reason)
        k = _variant(chosen)
        if isa is None:
            _state.current = k
        return k


def kernels(isa: str | None = None):
    """The kernels of `isa` (default: chosen_isa()), or None where they cannot run, after one warning that names
    what is lost (an explicitly asked-for variant raises instead: require)."""
    if isa is None and _state.current is not None:
        return _state.current
    if isa is not None or requested_isa() != "auto":
        return require(isa)
    if _state.fallback:
        return None
    try:
        return require()
    except KernelsUnavailable as e:
        with _state.lock:
            if not _state.fallback and _state.reason != f"{OFF_ENV}=0 turns them off":
                log.warning("%s. Running on PyTorch's ops instead: the float32 linear layers in oneDNN, "
                            "attention in SDPA, no int4 or fused layer kernels (several times slower).", e)
            _state.fallback = True
        return None


def describe() -> str:
    """One line for the start-up log and the benchmarks: the variant, or why there is none."""
    try:
        k = kernels()
    except (KernelsUnavailable, ValueError) as e:
        return f"none ({e})"
    if k is None:
        return f"none ({_state.reason})"
    how = f"{ISA_ENV}={requested_isa()}" if requested_isa() != "auto" else "the best this CPU runs"
    note = "" if platform.machine().lower() in ("x86_64", "amd64") else \
        f"; this is a {platform.machine()} CPU: the vector variants are x86's"
    return f"{k.isa} ({how}{note})"


def isa() -> str | None:
    """The variant's name where the kernels run, else None."""
    k = kernels()
    return None if k is None else k.isa


def runnable_isas() -> list[str]:
    """The variants built here that this CPU runs, best first (for tests and benchmarks)."""
    with _state.lock:
        _load()
        if _state.bindings is None:
            return []
        return [i for i in ISAS if f"_C_{i}" in _built_modules(_state.directory) and runs_here(i)]


def reset(forget_build: bool = False) -> None:
    """Forget the choice (tests that change KVCACHE_CPU_ISA or KVCACHE_CPU_KERNEL), and with `forget_build` which
    build was found (tests of the search); loaded modules stay loaded."""
    with _state.lock:
        variants, bindings, directory = _state.variants, _state.bindings, _state.directory
        _state.__init__()
        if not forget_build and os.environ.get(OFF_ENV, "1") != "0" and bindings is not None:
            _state.loaded, _state.bindings, _state.directory, _state.variants = True, bindings, directory, variants
