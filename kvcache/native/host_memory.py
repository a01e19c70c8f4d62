"""Host memory for the CPU engine: glibc's malloc kept from handing freed activations back (keep_freed_host_memory,
trim_heap), and tensors on 2 MiB pages for what a step streams from memory (huge_page_zeros)."""
from __future__ import annotations

import functools
import os
import platform

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
    page of them each time, a share of every prefill step that this saves (measured: docs/kernels.md). The cost:
    the process keeps up to `nbytes` of freed heap (its peak activations) instead of returning it; what start-up
    left free is handed back first (trim_heap).
    Linux with glibc only; KVCACHE_KEEP_FREED_MEMORY=0 leaves malloc as it is. Whether it applied."""
    libc = _libc()
    if os.environ.get("KVCACHE_KEEP_FREED_MEMORY", "1") == "0" or libc is None:
        return False
    libc.malloc_trim(0)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, nbytes))


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim). Loading calls it as weights move into
    their packed copies on mappings of their own (huge_page_zeros): the heap memory they leave would otherwise stay
    resident, unused, until start-up ends, raising the peak of loading (the demo model's: docs/kernels.md)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype, touch: bool = True):
    """A zeroed CPU tensor on its own anonymous mapping, 2 MiB-aligned and marked MADV_HUGEPAGE, so that where
    transparent huge pages are enabled for madvise (Debian's default) the kernel backs it with 2 MiB pages: one TLB
    entry where 4 KiB pages take 512. For what a step streams from memory and no cache holds (the packed weights,
    the KV blocks), which both read faster from huge pages on the machines measured (`kvcache bench linear`,
    `kvcache bench attention`; figures in docs/kernels.md). Below 2 MiB, off Linux, or
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
