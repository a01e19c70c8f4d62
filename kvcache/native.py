"""Builds the project's C++ CPU kernels (torch.utils.cpp_extension.load_inline, cached under
~/.cache/torch_extensions after the first build) with bindings that release the GIL while a kernel runs: a server's
HTTP thread then runs during the engine's kernels instead of waiting for Python's switch interval (5 ms)."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
from concurrent.futures import ThreadPoolExecutor

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
    no AVX-512, or KVCACHE_CPU_KERNEL=0); `what` names the fallback in the warning. KVCACHE_CPU_ISA=avx2 builds the
    AVX2 + FMA paths on an AVX-512 CPU, as a module of its own."""
    if os.environ.get("KVCACHE_CPU_KERNEL", "1") == "0":
        return None
    binds = "\n".join(f'  m.def("{f}", &{f}, py::call_guard<py::gil_scoped_release>());' for f in functions)
    full = source + f"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{binds}\n}}\n"
    # Named by the source too: two checkouts (or versions) sharing the cache each keep their own build, instead of
    # rebuilding over each other's, and one never loads the other's functions
    tag = hashlib.sha256(full.encode()).hexdigest()[:8]
    if os.environ.get("KVCACHE_CPU_ISA", "native") == "avx2":  # the AVX2 + FMA paths on an AVX-512 CPU (to measure them)
        flags, name = [*flags, "-mno-avx512f"], f"{name}_avx2"
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline(f"{name}_{cpu_tag()}_{tag}", cpp_sources=[full],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
                           verbose=False)
    except Exception as e:  # no compiler, no headers, no AVX-512
        log.warning("C++ CPU kernels %s unavailable (%s); %s", name, str(e).splitlines()[0], what)
        return None


class Kernels:
    """A module of C++ kernels built on first use (`build`'s arguments), once: callers on other threads wait for
    the build instead of seeing None while it runs."""

    _all: list[Kernels] = []

    def __init__(self, *build_args) -> None:
        self._args = build_args
        self._lock = threading.Lock()
        self._done = False
        self._module = None
        Kernels._all.append(self)

    def __call__(self):
        """The compiled module, or None where it cannot be built."""
        with self._lock:
            if not self._done:
                self._module = build(*self._args)
                self._done = True
            return self._module


def build_all() -> None:
    """Builds (or loads from the cache) every module of kernels at once, one compiler per module in parallel: about
    a minute on two cores where one after the other takes two."""
    import kvcache.attention.cpu_kernel  # noqa: F401  (each defines its Kernels)
    import kvcache.models.cpu_kernels  # noqa: F401
    with ThreadPoolExecutor(len(Kernels._all)) as pool:
        list(pool.map(lambda k: k(), Kernels._all))


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HOST_HEAP_BYTES = 1 << 30


@functools.cache
def _libc():
    """glibc, or None (not Linux, or another C library: musl has no mallopt or malloc_trim)."""
    if platform.system() != "Linux":
        return None
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_host_memory(nbytes: int = HOST_HEAP_BYTES) -> bool:
    """Have glibc's malloc serve allocations below `nbytes` from its heap and keep up to `nbytes` of what is freed
    for reuse, instead of mapping fresh pages for each large tensor and handing them back when it is freed. A CPU
    step allocates its activations anew (tens of MB at 2,048 tokens), and the kernel zeroed and faulted in every
    page of them each time: ~2% of a prefill step in page faults (perf), and a prefill of 11,445 tokens on the demo
    model ran 13.7-14.0 s against 12.9-13.1 with this. The cost: the process keeps up to `nbytes` of freed heap
    (its peak activations) instead of returning it; what start-up left free is handed back first (trim_heap).
    Linux with glibc only; KVCACHE_KEEP_FREED_MEMORY=0 leaves malloc as it is. Whether it applied."""
    libc = _libc()
    if os.environ.get("KVCACHE_KEEP_FREED_MEMORY", "1") == "0" or libc is None:
        return False
    libc.malloc_trim(0)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, nbytes))


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Loading calls it as weights move into
    their packed copies on mappings of their own (huge_page_zeros): the heap memory they leave would otherwise stay
    resident, unused, until start-up ends (+350 MiB at the peak of the demo model's loading)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype, touch: bool = True):
    """A zeroed CPU tensor on its own anonymous mapping, 2 MiB-aligned and marked MADV_HUGEPAGE, so that where
    transparent huge pages are enabled for madvise (Debian's default) the kernel backs it with 2 MiB pages: one TLB
    entry where 4 KiB pages take 512. For what a step streams from memory and no cache holds (the packed weights,
    the KV blocks): on the demo model, its weights were read 1.04-1.28x faster at one row and 1.04-1.07x at 8
    (`kvcache bench linear`), decode attention 1.10-1.13x (`kvcache bench attention`). Below 2 MiB, off Linux, or
    with KVCACHE_HUGE_PAGES=0: torch.zeros; where the kernel refuses the advice, small pages. The pages are written
    here (`touch`), so the memory is resident from the start, as torch.zeros's is; a caller about to write every
    byte itself (pack_panels) passes touch=False: a fresh mapping reads as zeros already."""
    import ctypes
    import math
    import mmap

    import torch
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or os.environ.get("KVCACHE_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    # whole huge pages inside the tensor only: a tail page of 2 MiB would be resident for the few bytes it holds
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without transparent huge pages (EINVAL): the mapping works on small pages
        pass
    # the tensor holds a reference to the mapping (torch.frombuffer), which lives as long as it does
    out = torch.frombuffer(region, dtype=dtype, count=math.prod(shape), offset=start).view(shape)
    return out.zero_() if touch else out
