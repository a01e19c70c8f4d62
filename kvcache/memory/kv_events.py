"""KV cache events for routers: which prefix blocks an engine can serve from where, as vLLM reports them.

The block pool, the radix tree and the offload tiers record here what becomes findable (`BlockStored`: a run of
blocks, each the child of the one before, the first the child of `parent_block_hash`), what stops being findable
(`BlockRemoved`) and a reset (`AllBlocksCleared`), each with the `medium` that holds it. The engine takes them once
per step and publishes them (engine/kv_events.py); nothing here does I/O. Recording is thread-safe: the offload
tiers record from their writer thread.

Block hashes are the low 64 bits of the chain keys (memory/block_hash.py): SHA-256 over the tokens and the
`cache_salt`, the same in every process, so a router sees the same hash for the same prefix from every instance.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

MEDIUM_POOL = "GPU"  # the engine's own pool, on whatever device (vLLM's name for it; routers key on it)
_LOW64 = (1 << 64) - 1


def external_hash(chain_hash: int) -> int:
    """The hash a block is published under: the low 64 bits of its chain key (msgpack's widest integer)."""
    return chain_hash & _LOW64


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events recorded since the last `take`, in order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int], medium: str = MEDIUM_POOL) -> None:
        """`hashes` (chain keys of a run of full blocks holding `token_ids`) became findable in `medium`."""
        if not hashes:
            return
        if len(token_ids) != len(hashes) * self.block_size:
            raise ValueError(f"{len(hashes)} blocks of {self.block_size} tokens cannot hold {len(token_ids)} tokens")
        event = BlockStored([external_hash(h) for h in hashes], None if parent is None else external_hash(parent),
                            list(token_ids), self.block_size, medium)
        with self._lock:
            self._events.append(event)

    def removed(self, hashes: list[int], medium: str = MEDIUM_POOL) -> None:
        """`hashes` (chain keys) are no longer findable in `medium`."""
        if hashes:
            event = BlockRemoved([external_hash(h) for h in hashes], medium)
            with self._lock:
                self._events.append(event)

    def cleared(self) -> None:
        """Nothing is findable in the pool any more (a reset of the prefix cache)."""
        with self._lock:
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out


def stored_runs(log: KVEventLog | None, indices: list[int], hashes: list[int], token_ids: list[int], block_size: int,
                medium: str = MEDIUM_POOL) -> None:
    """Record blocks `indices` of a sequence (ascending; `hashes` are its chain keys) as BlockStored events, one per
    run of consecutive blocks, each run's parent the block before it."""
    if log is None or not indices:
        return
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        log.stored(hashes[start:prev + 1], hashes[start - 1] if start else None,
                   token_ids[start * block_size:(prev + 1) * block_size], medium)
        if i is not None:
            start = prev = i
