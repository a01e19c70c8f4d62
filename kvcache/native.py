"""Builds the project's C++ CPU kernels (torch.utils.cpp_extension.load_inline, cached under
~/.cache/torch_extensions after the first build) with bindings that release the GIL while a kernel runs: a server's
HTTP thread then runs during the engine's kernels instead of waiting for Python's switch interval (5 ms)."""
from __future__ import annotations

import hashlib
import logging
import os
import platform

log = logging.getLogger(__name__)


def cpu_tag() -> str:
    """A short tag of this CPU's instruction sets: the builds use -march=native, so a build cached by another CPU (a
    shared home or volume) must not be loaded here, where it could stop on an illegal instruction."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags += platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def build(name: str, source: str, functions: list[str], flags: list[str], what: str):
    """The compiled module `name` exporting `functions` of `source`, or None where it cannot be built (no compiler,
    no AVX-512, or KVCACHE_CPU_KERNEL=0); `what` names the fallback in the warning."""
    if os.environ.get("KVCACHE_CPU_KERNEL", "1") == "0":
        return None
    binds = "\n".join(f'  m.def("{f}", &{f}, py::call_guard<py::gil_scoped_release>());' for f in functions)
    full = source + f"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}\n}}\n"
    # Named by the source too: two checkouts (or versions) sharing the cache each keep their own build, instead of
    # rebuilding over each other's, and one never loads the other's functions
    tag = hashlib.sha256(full.encode()).hexdigest()[:8]
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline(f"{name}_{cpu_tag()}_{tag}", cpp_sources=[full],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                           verbose=False)
    except Exception as e:  # no compiler, no headers, no AVX-512
        log.warning("C++ CPU kernels %s unavailable (%s); %s", name, str(e).splitlines()[0], what)
        return None
