"""The device's copy of the block tables, kept up to date by what changed instead of rebuilt every step.

The KVCacheManager owns every sequence's table as a Python list. Tables mostly grow at the end (a new block
every `block_size` tokens), so the device copy, one row per sequence in a [rows, cols] int64 tensor, is updated
by writing only the entries past what it already holds: a decode step of B sequences uploads at most B new
entries, not B whole tables. The manager rewrites a table in place in three cases (a prefix-cache dedup swaps a
computed block for the cached copy, eviction compacts a table, a sequence is freed and its id's table built
anew); it names those sequences in `take_changed()`, and their rows are written again in full. Every entry of
a row past its sequence's table is 0 (the null block), as in build_batch's padded host tables, so that a
padded read of a row never sees another sequence's blocks.

`sync` stages the step's writes (flat indices and values) through one host buffer, pinned on CUDA, copies it
with `non_blocking=True` and scatters it into the table on the device: one transfer per step.
"""
from __future__ import annotations

import array
import itertools
from collections.abc import Iterable, Sequence

import torch

from kvcache.memory.kv_cache_manager import KVCacheManager


def upload(parts: Sequence[Sequence[int]], device: torch.device | str) -> list[torch.Tensor]:
    """Integer lists as int64 tensors on `device`, with one host-to-device copy for all of them (staged in
    pinned memory on CUDA, copied without blocking: torch's pinned-memory cache keeps the staging buffer until
    the copy has run). On CPU, views of one host tensor."""
    flat = array.array("q", itertools.chain.from_iterable(parts))
    host = torch.frombuffer(flat, dtype=torch.long) if len(flat) else torch.empty(0, dtype=torch.long)
    device = torch.device(device)
    if device.type == "cuda":
        pinned = torch.empty(host.numel(), dtype=torch.long, pin_memory=True)
        pinned.copy_(host)
        host = pinned.to(device, non_blocking=True)
    out, at = [], 0
    for p in parts:
        out.append(host[at:at + len(p)])
        at += len(p)
    return out


class DeviceBlockTables:
    """One row per sequence: row r holds the block ids of the sequence it is assigned to, then zeros.

    Invariant (after `sync` for a sequence): `table[row_of[s], :len(t)] == t` and the rest of the row is 0, where
    t is the manager's table of s. Rows of sequences the manager freed return to the free list at the next sync; their entries are
    overwritten or zeroed when the row is given to another sequence (one write per entry per sync).
    """

    def __init__(self, device: torch.device | str, rows: int = 16, cols: int = 16) -> None:
        self.device = torch.device(device)
        self.table = torch.zeros(rows, cols, dtype=torch.long, device=self.device)
        self.row_of: dict[int, int] = {}
        self._valid: dict[int, int] = {}  # per sequence: leading entries of its row known to match its table
        self._extent: dict[int, int] = {}  # per row: entries that may be non-zero
        self._free_rows = list(range(rows - 1, -1, -1))
        self.entries_written = 0  # entries uploaded so far (diffs and zeroing): what the tests and metrics read

    def sync(self, kv: KVCacheManager, seq_ids: Iterable[int]) -> list[int]:
        """Bring the rows of `seq_ids` up to date with `kv`'s tables; returns their rows."""
        idx: list[int] = []
        vals: list[int] = []
        for s in kv.take_changed():
            if s not in self.row_of:
                continue
            if s in kv.block_tables:
                self._valid[s] = 0  # rewritten in place: write the whole row again
            else:
                del self._valid[s]  # its row's entries stay until the next sequence given it overwrites them
                self._free_rows.append(self.row_of.pop(s))
        seq_ids = list(seq_ids)
        longest = max((len(kv.block_tables[s]) for s in seq_ids), default=0)
        if longest > self.table.shape[1]:  # before any write is queued: flat indices depend on the width
            self._grow(rows=self.table.shape[0], cols=max(longest, 2 * self.table.shape[1]))
        rows = []
        width, tables, row_of = self.table.shape[1], kv.block_tables, self.row_of
        valid, extent = self._valid, self._extent
        for s in seq_ids:
            t = tables[s]
            n = len(t)
            row = row_of.get(s)
            if row is None:
                row = row_of[s] = self._take_row()
                valid[s] = 0
            rows.append(row)
            have = valid[s]
            if n == have and extent.get(row, 0) == n:  # unchanged (most rows of a decode step)
                continue
            if n > have:
                base = row * width
                idx.extend(range(base + have, base + n))
                vals.extend(t[have:])
            self._zero(row, n, idx, vals)
            extent[row] = n
            valid[s] = n
        if idx:
            idx_dev, vals_dev = upload([idx, vals], self.device)
            self.table.view(-1).index_copy_(0, idx_dev, vals_dev)
            self.entries_written += len(idx)
        return rows

    def _zero(self, row: int, start: int, idx: list[int], vals: list[int]) -> None:
        """Queue zeros for entries [start, extent) of `row`."""
        end = self._extent.get(row, 0)
        if end > start:
            base = row * self.table.shape[1]
            idx.extend(range(base + start, base + end))
            vals.extend([0] * (end - start))
            self._extent[row] = start

    def _take_row(self) -> int:
        if not self._free_rows:
            n = self.table.shape[0]
            self._grow(rows=2 * n, cols=self.table.shape[1])
        return self._free_rows.pop()

    def _grow(self, rows: int, cols: int) -> None:
        """A larger table holding the same rows (a device-side copy; rare: tables double). Flat indices of queued
        writes stay valid only if the width does not change (sync grows the width before queuing any)."""
        old = self.table
        self.table = torch.zeros(rows, cols, dtype=torch.long, device=self.device)
        self.table[:old.shape[0], :old.shape[1]] = old
        self._free_rows = list(range(rows - 1, old.shape[0] - 1, -1)) + self._free_rows

    def check(self, kv: KVCacheManager, seq_ids: Iterable[int]) -> None:
        """Assert the invariant for `seq_ids`, just synced (tests and debugging)."""
        host = self.table.cpu()
        for s in seq_ids:
            row, t = self.row_of[s], kv.block_tables[s]
            got = host[row].tolist()
            if got[:len(t)] != t or any(got[len(t):]):
                raise AssertionError(f"device row {row} of sequence {s} is {got}, its table is {t}")
