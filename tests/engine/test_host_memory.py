"""keep_freed_host_memory (native.py, applied by a CPU engine at start-up): large tensors freed by one step are
reused by the next without the kernel faulting in fresh pages."""
from __future__ import annotations

import platform
import resource

import pytest
import torch

from kvcache import native


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's mallopt")
def test_freed_host_memory_is_reused_without_page_faults(monkeypatch):
    assert native.keep_freed_host_memory()
    for n in (24 * 2**20, 24 * 2**20, 16 * 2**20):  # as steps do: tensors of 96 and 64 MiB allocated, written, freed
        torch.ones(n).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.ones(16 * 2**20).sum()
    # fresh pages each time would be 3 x 16,384 faults of 4 KiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 2000
    monkeypatch.setenv("KVCACHE_KEEP_FREED_MEMORY", "0")
    assert not native.keep_freed_host_memory()
