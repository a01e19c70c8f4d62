"""Keeps prefix blocks beyond the pool: full blocks are written to the tiers as they enter the prefix cache, and
a prefix lookup that misses in the pool continues in the tiers and loads what it finds instead of recomputing it.

When: a block is stored when it is registered in the prefix cache (write-through), not when the pool evicts it.
The pool evicts inside an allocation, in the middle of scheduling, and the block's content must be copied out
before its new owner writes it; write-through copies each block once, right after the step that computed it,
so a later eviction costs nothing and the tiers already hold what the pool drops. The engine thread only takes
the snapshot (one gather of the blocks' bytes per step); serializing and writing run on a background thread, and
a full queue drops the store (counted) rather than wait.

A stored value is self-describing and checked on load: a header (magic, format version, the model fingerprint,
the block's chain key, its token ids, the payload size), the payload (the block's rows of every per-layer tensor
of the store: K and V, or codes and scales), and a CRC-32 of all of it. A value whose checks fail is a miss,
counted as an error, never loaded.

The fingerprint (`model_fingerprint`) scopes every key: the checkpoint's content (file sizes and the SHA-256 of
their first and last MiB), the compute dtype, weight quantization, KV format and block size, and the store's
row layout. Blocks of another model or format are never found.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections import deque

import numpy as np
import torch

from kvcache.memory.kv_events import KVEventLog
from kvcache.offload.tiers import CpuTier, DiskTier, RedisTier, Tier

log = logging.getLogger("kvcache")

MAGIC = b"KVCB"
VERSION = 1
STAGE_BYTES = 64 * 2**20  # load copies payloads into the pool through a staging buffer of at most this size
_HEADER = struct.Struct("<4sHH32s16sIQ")  # magic, version, reserved, fingerprint, chain key, tokens, payload bytes


def model_fingerprint(source: str, **fmt) -> bytes:
    """SHA-256 of the checkpoint's content identity and the KV format (`fmt`: dtypes, block size, layout...)."""
    files = [source] if os.path.isfile(source) else sorted(
        os.path.join(source, n) for n in os.listdir(source)
        if n.endswith((".safetensors", ".bin", ".gguf", ".json")))
    h = hashlib.sha256(json.dumps(fmt, sort_keys=True, default=str).encode())
    for path in files:
        size = os.path.getsize(path)
        h.update(os.path.basename(path).encode() + size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            h.update(f.read(2**20))
            if size > 2**21:
                f.seek(size - 2**20)
                h.update(f.read())
    return h.digest()


def encode_block(fingerprint: bytes, key: int, tokens: tuple[int, ...], payload) -> bytearray:
    """The stored value of a block: header, token ids, `payload` (a bytes-like of the block's rows), CRC-32, built in
    one buffer (values are ~1 MB: each copy of one costs)."""
    start = _HEADER.size + 8 * len(tokens)
    size = memoryview(payload).nbytes
    out = bytearray(start + size + 4)
    _HEADER.pack_into(out, 0, MAGIC, VERSION, 0, fingerprint, key.to_bytes(16, "little"), len(tokens), size)
    struct.pack_into(f"<{len(tokens)}q", out, _HEADER.size, *tokens)
    out[start:start + size] = memoryview(payload).cast("B")
    struct.pack_into("<I", out, start + size, zlib.crc32(memoryview(out)[:-4]))
    return out


def decode_block(value, fingerprint: bytes, key: int, tokens: tuple[int, ...], payload_bytes: int
                 ) -> tuple[memoryview | None, str]:
    """(payload, "") if `value` is this block of this model, the payload a view into `value`; else (None, why)."""
    n = _HEADER.size + 8 * len(tokens) + payload_bytes + 4
    if len(value) != n:
        return None, "truncated" if len(value) < n else "size"
    view = memoryview(value)
    if struct.unpack_from("<I", value, n - 4)[0] != zlib.crc32(view[:-4]):
        return None, "checksum"
    magic, version, _, fp, k, n_tok, n_pay = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        return None, "version"
    if fp != fingerprint:
        return None, "fingerprint"
    if k != key.to_bytes(16, "little") or n_tok != len(tokens) or n_pay != payload_bytes:
        return None, "key"
    if struct.unpack_from(f"<{n_tok}q", value, _HEADER.size) != tuple(tokens):
        return None, "tokens"
    start = _HEADER.size + 8 * n_tok
    return view[start:start + payload_bytes], ""


def tier_key(fingerprint: bytes, chain_hash: int) -> bytes:
    """A block's key in the tiers: the model fingerprint's first 16 bytes, then the chain hash's 16."""
    return fingerprint[:16] + chain_hash.to_bytes(16, "little")


def _write_loop(jobs: queue.Queue, tiers: list[Tier], fingerprint: bytes, events: KVEventLog | None) -> None:
    """The writer thread: serialize each queued snapshot of blocks and put it in every tier, until a None.

    Each job is written by `_write_job`, so no tensor of it is left in this frame while it waits: a thread that
    frees a tensor after the interpreter began finalizing is killed inside torch's C++ and aborts the process."""
    while True:
        job = jobs.get()
        try:
            if job is None:
                return
            _write_job(job, tiers, fingerprint, events)
        except Exception:  # a bug here must not kill the thread silently: log it and go on
            log.exception("offload writer failed on a batch of blocks")
        finally:
            job = None
            jobs.task_done()


def _write_job(job, tiers: list[Tier], fingerprint: bytes, events: KVEventLog | None) -> None:
    blocks, rows = job
    data = rows.cpu().numpy()
    for (h, parent, tokens), row in zip(blocks, data):
        value = encode_block(fingerprint, h, tokens, row)
        for tier in tiers:
            # recorded at once: a later put of this job may drop it again, and its event must follow
            if tier.put(tier_key(fingerprint, h), value) and events is not None:
                events.stored([h], parent, list(tokens), tier.medium)


def _stop_writer(jobs: queue.Queue, writer: threading.Thread, timeout: float) -> None:
    """Queue the writer's stop and wait for it to end (an Offloader's finalizer: at close, at collection, and at
    exit, before the interpreter finalizes, so what was queued is written and the thread is gone by then)."""
    if not writer.is_alive():
        return
    try:
        jobs.put(None, timeout=timeout)
    except queue.Full:  # the writer is stuck: leave it (a daemon) rather than hang the caller
        log.warning("offload writer did not drain its queue in %.0f s; stopping without it", timeout)
        return
    if writer is not threading.current_thread():
        writer.join(timeout)


def _chain_hash(key: bytes) -> int:
    """The chain hash in a tier key (Offloader.key)."""
    return int.from_bytes(key[16:], "little")


class Offloader:
    """Stores and loads whole blocks of a KV store (a KVStore or QuantizedKVStore) in `tiers`, top tier first."""

    def __init__(self, store, tiers: list[Tier], fingerprint: bytes, queue_blocks: int = 4096,
                 events: KVEventLog | None = None) -> None:
        if not tiers:
            raise ValueError("an offloader needs at least one tier")
        self.tensors: list[torch.Tensor] = store.block_tensors()
        self.device = self.tensors[0].device
        self.row_bytes = [t[0].numel() * t.element_size() for t in self.tensors]
        self.block_bytes = sum(self.row_bytes)
        self.tiers, self.fingerprint = tiers, fingerprint
        self.events = events  # KV events: what each tier newly stores or drops, by its medium
        if events is not None:
            for tier in tiers:
                tier.on_drop = lambda keys, medium=tier.medium: events.removed([_chain_hash(k) for k in keys], medium)
        self.loaded_blocks = 0
        self.load_seconds = 0.0
        self.dropped = 0  # stores dropped because the writer was behind
        # Seconds of each step's load since the last take_load_latencies (the newest 10,000): a metrics histogram
        self._load_latency: deque[float] = deque(maxlen=10_000)
        # Swap (--preemption-mode swap): preempted sequences' blocks go to the first tier that holds values
        self.swap_tier = next((t for t in tiers if t.name in ("cpu", "disk")), None)
        self._swap_prefix = b"swap" + os.urandom(12)  # this engine's: another process sharing the disk tier differs
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self._stage: torch.Tensor | None = None  # load's staging buffer (host memory), kept for the next step
        self.corrupt: dict[str, int] = {}  # reason -> values refused on load
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_blocks))
        # The writer holds the queue and the tiers, never the Offloader (whose store is the whole KV pool): an engine
        # dropped without close() is collected, and its finalizer ends the writer once the queue is written.
        self._writer = threading.Thread(target=_write_loop, args=(self._queue, tiers, fingerprint, events),
                                        name="kvcache-offload", daemon=True)
        self._writer.start()
        self._finalizer = weakref.finalize(self, _stop_writer, self._queue, self._writer, 30.0)

    def key(self, chain_hash: int) -> bytes:
        return tier_key(self.fingerprint, chain_hash)

    # ---- store (engine thread: a snapshot; writer thread: the rest) --------------------------------------------

    def store(self, items: list[tuple[int, int | None, tuple[int, ...], int]]) -> None:
        """Queue (chain hash, its parent's or None, token ids, block id) of blocks just cached for writing to every
        tier lacking them."""
        items = [it for it in items if not all(t.contains(self.key(it[0])) for t in self.tiers)]
        if not items:
            return
        rows = self._read_rows([it[-1] for it in items])
        try:
            self._queue.put_nowait(([it[:3] for it in items], rows))
        except queue.Full:
            self.dropped += len(items)

    def flush(self) -> None:
        """Wait until every queued store is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer thread (idempotent)."""
        if not self._writer.is_alive():
            return
        self.flush()
        if self._finalizer.detach() is not None:  # once: the finalizer then never runs
            _stop_writer(self._queue, self._writer, timeout)

    # ---- load (engine thread) -----------------------------------------------------------------------------------

    def lookup(self, hashes: list[int], token_ids: list[int], block_size: int, start: int, stop: int) -> list[bytes]:
        """Payloads of blocks start, start+1, ... (< stop) found in the tiers, up to the first miss. A block found
        below the top tier is copied into the tiers above it."""
        found = []
        for i in range(start, stop):
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            key = self.key(hashes[i])
            payload = None
            for depth, tier in enumerate(self.tiers):
                value = tier.get(key)
                if value is None:
                    continue
                payload, why = decode_block(value, self.fingerprint, hashes[i], tokens, self.block_bytes)
                if payload is None:
                    tier.stats.error(why)
                    self.corrupt[why] = self.corrupt.get(why, 0) + 1
                    continue
                for upper in self.tiers[:depth]:
                    if upper.put(key, value) and self.events is not None:
                        self.events.stored([hashes[i]], hashes[i - 1] if i else None, list(tokens), upper.medium)
                break
            if payload is None:
                break
            found.append(payload)
        return found

    def load(self, loads: list[tuple[list[int], list | torch.Tensor]]) -> None:
        """Fill pool blocks from what `lookup` found (payloads) or `swap_in` handed back (rows): `loads` are (blocks,
        their contents) pairs. Payloads go through a staging buffer reused from step to step (a fresh one of a
        hundred MB costs more in page faults than the copy), STAGE_BYTES at a time; each batch is one index_copy_
        per tensor of the store."""
        t0 = time.perf_counter()
        payloads: list[tuple[int, object]] = []
        for blocks, rows in loads:
            if isinstance(rows, torch.Tensor):
                self._scatter(blocks, rows)
            else:
                payloads += zip(blocks, rows)
        per_batch = max(1, STAGE_BYTES // self.block_bytes)
        for at in range(0, len(payloads), per_batch):
            batch = payloads[at:at + per_batch]
            if self._stage is None or len(self._stage) < len(batch):  # pinned for a CUDA pool: a faster copy up
                self._stage = torch.empty((min(per_batch, len(payloads)), self.block_bytes), dtype=torch.uint8,
                                          pin_memory=self.device.type == "cuda")
            stage = self._stage[:len(batch)]
            view = stage.numpy()
            for i, (_, payload) in enumerate(batch):
                view[i] = np.frombuffer(payload, dtype=np.uint8)
            self._scatter([b for b, _ in batch], stage)
        n = sum(len(blocks) for blocks, _ in loads)
        if not n:
            return
        took = time.perf_counter() - t0
        self.loaded_blocks += n
        self.load_seconds += took
        self._load_latency.append(took)

    def _scatter(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Write `rows` ([len(blocks), block_bytes] uint8) into pool `blocks`: one index_copy_ per tensor."""
        if not blocks:
            return
        rows = rows.to(self.device)
        idx = torch.tensor(blocks, device=self.device)
        at = 0
        for t, n in zip(self.tensors, self.row_bytes):
            t.index_copy_(0, idx, rows[:, at:at + n].view(t.dtype).unflatten(1, t.shape[1:]))
            at += n

    def take_load_latencies(self) -> list[float]:
        """Seconds each step's load took since the last call (safe from another thread: deque pops are atomic)."""
        out = []
        while self._load_latency:
            out.append(self._load_latency.popleft())
        return out

    # ---- swap (engine thread) -----------------------------------------------------------------------------------

    def _swap_key(self, seq_id: int) -> bytes:
        return self._swap_prefix + seq_id.to_bytes(16, "little")

    def swap_out(self, seq_id: int, blocks: list[int]) -> bool:
        """Copy the contents of `blocks` (a preempted sequence's table, then its private blocks) to the swap tier;
        False, and nothing kept, if the tier has no room for them (the sequence is recomputed instead)."""
        rows = self._read_rows(blocks).cpu()
        value = rows if self.swap_tier.name == "cpu" else rows.numpy()
        if not self.swap_tier.hold(self._swap_key(seq_id), value, rows.numel()):
            return False
        self.swapped_out_blocks += len(blocks)
        return True

    def swap_in(self, seq_id: int, skip: int = 0) -> torch.Tensor | None:
        """The rows `swap_out` kept for `seq_id`, without the first `skip` (blocks the pool still holds), for `load`;
        the tier lets them go. None if it cannot hand them back (a read error: the sequence is recomputed)."""
        value = self.swap_tier.take(self._swap_key(seq_id))
        if value is None:
            return None
        rows = value if isinstance(value, torch.Tensor) else \
            torch.frombuffer(bytearray(value), dtype=torch.uint8).view(-1, self.block_bytes)
        self.swapped_in_blocks += len(rows) - skip
        return rows[skip:]

    def swap_discard(self, seq_id: int) -> None:
        """Let go of what `seq_id` has swapped out, if anything (it finished or was aborted while waiting)."""
        self.swap_tier.take(self._swap_key(seq_id))

    def _read_rows(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), block_bytes] uint8 snapshot of the blocks (a copy: the pool may reuse them at once)."""
        idx = torch.tensor(blocks, device=self.device)
        parts = [t.index_select(0, idx).reshape(len(blocks), -1).view(torch.uint8) for t in self.tensors]
        return torch.cat(parts, 1)

    def info(self) -> dict:
        return {"tiers": [t.info() for t in self.tiers], "loaded_blocks": self.loaded_blocks,
                "load_seconds": self.load_seconds, "swap_tier": self.swap_tier.name if self.swap_tier else None,
                "swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks, "dropped_stores": self.dropped, "refused": dict(self.corrupt),
                "block_bytes": self.block_bytes, "fingerprint": self.fingerprint.hex()[:16]}


def offload_tiers(config) -> list[Tier]:
    """The tiers an EngineConfig asks for, top first (cpu, disk, redis); [] for none."""
    tiers: list[Tier] = []
    if config.kv_offload_memory is not None:
        tiers.append(CpuTier(config.kv_offload_memory))
    if config.kv_offload_dir is not None:
        tiers.append(DiskTier(config.kv_offload_dir, config.kv_offload_disk_size))
    if config.kv_remote is not None:
        tiers.append(RedisTier(config.kv_remote, timeout=config.kv_remote_timeout))
    if tiers and not config.enable_prefix_caching and config.preemption_mode != "swap":
        raise ValueError("the KV offload tiers hold prefix-cache blocks: they need prefix caching (drop "
                         "--no-enable-prefix-caching), unless they are there for --preemption-mode swap")
    return tiers


def make_offloader(tiers: list[Tier], store, source: str, events: KVEventLog | None = None, **fmt) -> Offloader | None:
    """An Offloader over `tiers` for `store`, keyed by the fingerprint of `source` and `fmt`, recording its tiers'
    KV events in `events` if given; None without tiers."""
    if not tiers:
        return None
    layout = [(str(t.dtype), tuple(t.shape[1:])) for t in store.block_tensors()]
    return Offloader(store, tiers, model_fingerprint(source, layout=layout, **fmt), events=events)
