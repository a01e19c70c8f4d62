"""keep_freed_host_memory (kvcache.native.host_memory, applied by a CPU engine at start-up): large tensors freed by one step are
reused by the next without the kernel faulting in fresh pages."""
from __future__ import annotations

import os
import platform
import resource

import pytest
import torch

from kvcache.native import host_memory


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's mallopt")
def test_freed_host_memory_is_reused_without_page_faults(monkeypatch):
    assert host_memory.keep_freed_host_memory()
    for n in (24 * 2**20, 24 * 2**20, 16 * 2**20):  # as steps do: tensors of 96 and 64 MiB allocated, written, freed
        torch.ones(n).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.ones(16 * 2**20).sum()
    # fresh pages each time would be 3 x 16,384 faults of 4 KiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 2000
    monkeypatch.setenv("KVCACHE_KEEP_FREED_MEMORY", "0")
    assert not host_memory.keep_freed_host_memory()


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages (KiB) of the mapping that holds t's memory, from /proc/self/smaps."""
    addr = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise and /proc/self/smaps")
def test_huge_page_zeros_is_zeroed_aligned_and_on_huge_pages_where_the_os_gives_them(monkeypatch):
    monkeypatch.delenv("KVCACHE_HUGE_PAGES", raising=False)
    shape = (5 * 2**20 // 4 + 123,)  # float32: 5 MiB and a tail, so two whole huge pages and small ones after
    t = host_memory.huge_page_zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and not t.any()
    assert not host_memory.huge_page_zeros(shape, torch.float32, touch=False).any()  # a fresh mapping reads as zeros
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert not t.untyped_storage().resizable()  # its own mapping, not the allocator's memory
    t += 1  # writable, and the memory outlives the call that mapped it
    assert t.sum().item() == t.numel()
    thp_setting = "/sys/kernel/mm/transparent_hugepage/enabled"  # absent: a kernel without huge pages
    thp = open(thp_setting).read() if os.path.exists(thp_setting) else "[never]"
    if "[never]" not in thp:
        assert _huge_kib(t) in (0, 2048, 4096)  # never the tail's page: at most the two whole ones
        if _huge_kib(t) == 0:
            pytest.skip("the kernel had no free huge pages")
    small = host_memory.huge_page_zeros((3, 5), torch.int64)  # under one huge page: torch.zeros
    assert small.untyped_storage().resizable() and not small.any()
    monkeypatch.setenv("KVCACHE_HUGE_PAGES", "0")
    off = host_memory.huge_page_zeros(shape, torch.float32)
    assert off.untyped_storage().resizable() and not off.any()
