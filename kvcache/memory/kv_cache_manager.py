"""Per-sequence block tables on top of the block pool, with prefix caching (hash chain or radix tree).

A sequence's table lists its blocks in token order. With prefix caching, full blocks that
have been computed are registered in a prefix index; a new sequence whose prompt starts with
cached blocks takes them by reference and starts computing after them. Only full blocks are
shared and a shared block is never written: new tokens go to blocks the sequence owns alone
(a fork copies a partly filled block first). The last prompt token is always recomputed, so
there are logits to sample from.

A sliding-window model (every layer the same window) gives back the blocks no future query can see
(`release_leading`): their entries in the table become the null block, so every position keeps its place in
the table and the table's length still counts the sequence's tokens; whatever walks a table skips null entries.

A sequence may also hold `seq_blocks` private blocks besides its table: scratch memory drawn from
the same pool (the fp16 key residual of the KIVI formats, see store/quantized_store.py). They are
taken with its first blocks, never cached or shared, and freed with its table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvcache.memory.block_hash import BlockKey, chain_hashes
from kvcache.memory.block_pool import BlockPool, OutOfBlocksError, blocks_for
from kvcache.memory.state_slots import StateSlots
from kvcache.memory.state_snapshots import SnapshotKey, StateSnapshots
from kvcache.memory.compaction import TableCompaction
from kvcache.memory.kv_events import KVEventLog, stored_runs
from kvcache.memory.radix_cache import RadixCache, RadixNode

PrefixCaching = Literal["hash", "radix"]


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's counting: tokens looked up and tokens found, over requests' first admissions."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class _SeqCache:
    """What the manager remembers of one sequence for prefix caching."""

    extra: tuple
    hashes: list[int]  # chain hashes of its full blocks, computed so far
    num_cached: int = 0  # leading blocks of its table registered in the index (or taken from it)
    node: RadixNode | None = None  # radix: the node its prefix ends at
    locked: bool = False  # radix: it holds a lock on `node`
    stopped: bool = False  # a block under one of its hashes is held with another chain: none more is registered
    snapshot: int | None = None  # recurrent state: the snapshot slot its prefix (find_prefix's) starts from
    family: list[int] | None = None  # radix: the sequences forked from one another, which share blocks (one list)
    extra_locks: dict[int, RadixNode] = field(default_factory=dict)  # radix: by family member, see _lock_family


class KVCacheManager(TableCompaction):
    """Owns every sequence's block table: grows it as tokens arrive, shares it on fork and on
    prefix-cache hits, frees it on finish."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: PrefixCaching | None = None,
                 seq_blocks: int = 0, events: KVEventLog | None = None, pool: BlockPool | None = None,
                 tag: tuple = (), states: StateSlots | None = None, snapshots: StateSnapshots | None = None) -> None:
        """`pool`: draw from this pool (shared with other managers: per-layer-group tables, memory/layer_groups.py)
        instead of a new one of `num_blocks`. `tag` joins every sequence's extra keys, so that managers sharing a
        pool never find each other's blocks in the prefix cache (their blocks hold other layers). `states` (a model
        with linear-attention / SSM layers): a sequence takes a state slot with its first blocks and gives it back
        with them; a fork copies the parent's. With a prefix cache they also need `snapshots` of states at block
        boundaries: a prefix is found only as deep as a snapshot of it, which the sequence's slot starts from."""
        if prefix_caching not in (None, "hash", "radix"):
            raise ValueError(f"prefix_caching must be None, 'hash' or 'radix', got {prefix_caching!r}")
        if pool is not None and prefix_caching == "radix":
            raise ValueError("a shared pool cannot serve the radix prefix cache (the tree owns its blocks)")
        if states is not None and prefix_caching is not None and (snapshots is None or prefix_caching == "radix"):
            raise ValueError("a prefix cache of sequences with recurrent state needs the hash prefix cache and "
                             "snapshots of their states (a hit would otherwise skip the tokens the state needs)")
        self.block_size = block_size
        self.seq_blocks = seq_blocks
        self.states, self.snapshots = states, snapshots
        self.tag = tag
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.private_blocks: dict[int, list[int]] = {}  # seq_id -> its `seq_blocks` scratch blocks
        self.prefix_caching = prefix_caching
        self.radix = RadixCache(self.pool, block_size) if prefix_caching == "radix" else None
        # KV events (kv_events.py): the pool and the tree record what stops being findable, cache_blocks what starts
        self.events = events
        self.pool.events = events
        if self.radix:
            self.radix.events = events
        self.stats = PrefixCacheStats()
        self._seqs: dict[int, _SeqCache] = {}
        self._compacted: set[int] = set()  # sequences whose blocks no longer match their tokens (eviction)
        self._released: dict[int, int] = {}  # seq_id -> leading table entries given back (release_leading)
        # Sequences whose table was rewritten other than by appending (a dedup swap, a compaction, a free) since the
        # last take_changed(): the device copy of their tables (device_tables.py) is written again in full.
        self._changed: set[int] = set()

    def tables(self, seq_id: int) -> list[list[int]]:
        """Every table of `seq_id` ([] if it holds none): its one table here (layer_groups.py has one per group)."""
        return [self.block_tables[seq_id]] if seq_id in self.block_tables else []

    def take_changed(self) -> set[int]:
        """Sequences whose table changed in place, or was freed, since the last call (tables otherwise only grow)."""
        changed, self._changed = self._changed, set()
        return changed

    # ---- capacity -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: free ones, plus cached ones nobody runs on (radix evicts them)."""
        return self.pool.num_free + (self.radix.evictable_blocks if self.radix else 0)

    @property
    def num_cached_blocks(self) -> int:
        return self.radix.num_blocks if self.radix else self.pool.num_cached

    @property
    def num_idle_cached_blocks(self) -> int:
        """Cached blocks no sequence holds: reusable by a prefix hit until an allocation evicts them."""
        if self.radix:
            return self.radix.evictable_blocks
        held = {b for table in self.block_tables.values() for b in table}
        return self.pool.num_cached - sum(1 for b in held if self.pool.keys[b] is not None)

    @property
    def num_evictions(self) -> int:
        return self.radix.num_evictions if self.radix else self.pool.num_evictions

    def blocks_needed(self, seq_id: int, num_tokens: int, prefix: list[int] = ()) -> int:
        """Blocks that leave the available set if `seq_id` grows to `num_tokens` tokens, starting from
        the cached `prefix` blocks when it has no table yet (idle cached blocks count: they stop being free)."""
        have = len(self.block_tables.get(seq_id, ())) or len(prefix)
        new = max(0, blocks_for(num_tokens, self.block_size) - have)
        if seq_id in self.block_tables:
            return new
        new += self.seq_blocks
        if not prefix:
            return new
        if self.radix:
            return new + self.radix.locked_blocks_on_path(self._seqs[seq_id].node)
        return new + sum(1 for b in prefix if b != BlockPool.NULL_BLOCK and self.pool.ref_counts[b] == 0)

    # ---- prefix lookup ---------------------------------------------------------------------------

    def _entry(self, seq_id: int, extra: tuple) -> _SeqCache:
        if seq_id not in self._seqs:
            self._seqs[seq_id] = _SeqCache(extra + self.tag, [])
        return self._seqs[seq_id]

    def block_hashes(self, seq_id: int, token_ids: list[int], extra: tuple = ()) -> list[int]:
        """Chain hashes of the full blocks of `token_ids` (memoized per sequence)."""
        entry = self._entry(seq_id, extra)
        if len(entry.hashes) < len(token_ids) // self.block_size:
            entry.hashes = chain_hashes(token_ids, self.block_size, entry.extra, entry.hashes)
        return entry.hashes

    def find_prefix(self, seq_id: int, token_ids: list[int], extra: tuple = (), max_tokens: int | None = None) -> list[int]:
        """Cached blocks holding the longest block-aligned prefix of `token_ids`, short of its last token
        (which is recomputed so that there are logits to sample from), and of at most `max_tokens` tokens.

        Takes no reference: pass the result to `allocate` in the same step.
        """
        if self.prefix_caching is None or seq_id in self.block_tables:
            return []
        limit = len(token_ids) - 1 if max_tokens is None else max(0, min(len(token_ids) - 1, max_tokens))
        max_blocks = limit // self.block_size
        bs = self.block_size
        if self.radix:
            blocks, node = self.radix.match(token_ids[:max_blocks * bs], extra)
            self._entry(seq_id, extra).node = node
        else:
            blocks, parent = [], None
            for i, h in enumerate(self.block_hashes(seq_id, token_ids, extra)[:max_blocks]):
                b = self._cached(seq_id, token_ids, i, h)
                if b is None or self.pool.keys[b].parent != parent:
                    break
                blocks.append(b)
                parent = (b, self.pool.generation[b])
        if self.snapshots is not None:
            blocks = blocks[:self._snapshot_depth(seq_id, token_ids, extra, len(blocks))]
        return blocks

    def snapshot_key(self, seq_id: int, token_ids: list[int], extra: tuple, end: int) -> SnapshotKey:
        """The key of a state snapshot after `end` tokens (a multiple of the block size) of `token_ids`."""
        hashes, k, bs = self.block_hashes(seq_id, token_ids, extra), end // self.block_size, self.block_size
        return hashes[k - 1], hashes[k - 2] if k > 1 else None, tuple(token_ids[end - bs:end])

    def _snapshot_depth(self, seq_id: int, token_ids: list[int], extra: tuple, cached: int) -> int:
        """The most of the `cached` leading blocks that a snapshot of the state covers (0: none); the sequence's
        entry remembers its slot."""
        per = self.snapshots.interval // self.block_size
        for k in range(cached - cached % per, 0, -per):
            slot = self.snapshots.find(self.snapshot_key(seq_id, token_ids, extra, k * self.block_size))
            if slot is not None:
                self._entry(seq_id, extra).snapshot = slot
                return k
        return 0

    def _cached(self, seq_id: int, token_ids: list[int], i: int, block_hash: int) -> int | None:
        """The cached block with block i's chain hash, extra keys and tokens (its parent unchecked), or None."""
        b = self.pool.lookup(block_hash)
        key = self.pool.keys[b] if b is not None else None
        bs = self.block_size
        if key is None or key.extra != self._seqs[seq_id].extra or key.tokens != tuple(token_ids[i * bs:(i + 1) * bs]):
            return None
        return b

    def window_prefix(self, seq_id: int, token_ids: list[int], extra: tuple, num_blocks: int, window: int) -> list[int] | None:
        """A table for the first `num_blocks` blocks of `token_ids` that a sliding window of `window` tokens needs
        cached: the null block where no query from position num_blocks x block_size on can see (vLLM's sliding
        window lookup), the cached blocks from the first one the window reaches; None if one of those is not
        cached. Each block after the first is checked against its predecessor (id and generation); the first one's
        predecessor may be gone (given back and reused), so it is taken on its 128-bit chain hash, tokens and
        extra keys. Hash prefix caching only; takes no reference."""
        if self.prefix_caching != "hash" or seq_id in self.block_tables:
            raise ValueError("window_prefix needs hash prefix caching and a sequence without a table")
        bs = self.block_size
        first = max(0, num_blocks * bs - window + 1) // bs
        hashes = self.block_hashes(seq_id, token_ids, extra)
        table, parent = [BlockPool.NULL_BLOCK] * first, None
        for i in range(first, num_blocks):
            b = self._cached(seq_id, token_ids, i, hashes[i])
            if b is None or (parent is not None and self.pool.keys[b].parent != parent):
                return None
            table.append(b)
            parent = (b, self.pool.generation[b])
        return table

    # ---- tables --------------------------------------------------------------------------------

    def _take_free(self, n: int) -> list[int]:
        if self.radix and n > self.pool.num_free:
            self.radix.evict(n - self.pool.num_free)
        return self.pool.allocate(n)

    def _lock_family(self, seq_id: int, entry: _SeqCache, node) -> None:
        """Lock `node`, the node the prefix of `seq_id` now ends at, for it and for its fork family. Forks share their
        full blocks by reference, so when one of them hands those blocks to the radix tree, the others hold tree
        blocks too and must lock them, or the tree would count as evictable blocks that evicting does not free.
        A member that locks nothing or an ancestor of `node` moves its lock to `node`; one that locks another branch
        (forked elsewhere, and cached its own) takes an extra lock on `node`, one per member that caused it, replaced
        as that member goes deeper. A lock may cover more than its holder holds: that only protects more."""
        self._move_lock(entry, node)
        for other in entry.family or ():
            e = self._seqs.get(other)
            if e is None or e is entry or (e.locked and (e.node is node or self.radix.is_above(node, e.node))):
                continue  # gone, or it locks `node`'s path already
            if not e.locked or self.radix.is_above(e.node, node):
                self._move_lock(e, node)
            else:
                self.radix.lock(node)
                old = e.extra_locks.get(seq_id)
                if old is not None:
                    self.radix.unlock(old)
                e.extra_locks[seq_id] = node

    def _release(self, seq_id: int, entry: _SeqCache) -> None:
        """Let go of every lock `entry` holds and leave its fork family."""
        if entry.locked:
            self.radix.unlock(entry.node)
        for node in entry.extra_locks.values():
            self.radix.unlock(node)
        if entry.family:
            entry.family.remove(seq_id)

    def _move_lock(self, entry: _SeqCache, node) -> None:
        """Lock `node` for `entry` and let go of the node it locked before (lock first: the paths may share)."""
        self.radix.lock(node)
        if entry.locked:
            self.radix.unlock(entry.node)
        entry.node, entry.locked = node, True

    def allocate(self, seq_id: int, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Grow the table of `seq_id` to cover `num_tokens` tokens, starting a new table from the cached
        `prefix` blocks; False (and no change) if blocks are short."""
        table = self.block_tables.get(seq_id)
        if table is not None and len(table) * self.block_size >= num_tokens:  # covered (most decodes)
            return True
        if self.blocks_needed(seq_id, num_tokens, prefix) > self.num_free_blocks:
            return False
        if table is None and self.states is not None:
            if not self.states.num_free:
                return False
            self.states.allocate(seq_id)
            if prefix:  # it starts after its cached prefix: from the snapshot of the state there
                self.states.load(seq_id, self._seqs[seq_id].snapshot)
                self.snapshots.stats.hits += 1
        if table is None:
            table = self.block_tables[seq_id] = list(prefix)
            held = [b for b in prefix if b != BlockPool.NULL_BLOCK]  # a window_prefix starts with null entries
            for b in held:  # a sequence starting from cached blocks: a hit on each (the KV page shows them)
                self.pool.hits[b] += 1
            if prefix:
                entry = self._seqs[seq_id]
                entry.num_cached = len(prefix)
                if len(held) < len(prefix):
                    self._released[seq_id] = len(prefix) - len(held)
                    self._changed.add(seq_id)
                if self.radix:
                    self.radix.lock(entry.node)
                    entry.locked = True
                    self.pool.share(table)
                else:
                    self.pool.touch(held)
            if self.seq_blocks:  # after taking the prefix: a fresh allocation may evict idle cached blocks
                self.private_blocks[seq_id] = self._take_free(self.seq_blocks)
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need > 0:
            table.extend(self._take_free(need))
        return True

    def cache_blocks(self, seq_id: int, token_ids: list[int], num_computed_tokens: int, extra: tuple = ()) -> range:
        """Register the full blocks of `seq_id` whose K/V are now computed, so later requests can share them.
        Returns the indices (in its table) of the blocks registered by this call."""
        if self.prefix_caching is None or seq_id in self._compacted:
            return range(0)
        entry = self._entry(seq_id, extra)
        table = self.block_tables[seq_id]
        full = min(num_computed_tokens // self.block_size, len(table))
        first = entry.num_cached
        if full <= first or entry.stopped:
            return range(0)
        bs = self.block_size
        if self.radix:
            hashes = self.block_hashes(seq_id, token_ids, extra)[:full] if self.events is not None else ()
            node, tree_blocks = self.radix.insert(token_ids[:full * bs], table[:full], entry.extra, hashes)
            self._lock_family(seq_id, entry, node)
            for i in range(entry.num_cached, full):
                if table[i] != tree_blocks[i]:
                    self._swap(seq_id, i, tree_blocks[i])
        else:
            hashes = self.block_hashes(seq_id, token_ids, extra)
            stored = []
            for i in range(entry.num_cached, full):
                b = table[i]
                if self.pool.keys[b] is not None:
                    continue  # taken from the cache (or shared by a fork): already the cached block
                tokens = tuple(token_ids[i * bs:(i + 1) * bs])
                # Blocks before i are the cached ones by now, so the parent is our own table's, or, given back by
                # release_leading, the block its hash still finds (none: the chain is broken, cache no more)
                parent = None
                if i:
                    prev = table[i - 1]
                    if prev == BlockPool.NULL_BLOCK:
                        prev = self.pool.lookup(hashes[i - 1])
                        if prev is None:
                            full, entry.stopped = i, True
                            break
                    parent = (prev, self.pool.generation[prev])
                key = BlockKey(hashes[i], tokens, entry.extra, parent)
                other = self.pool.lookup(hashes[i])
                if other is None:
                    self.pool.cache(b, key)
                    stored.append(i)
                elif self.pool.keys[other] == key:
                    self._swap(seq_id, i, other)  # computed twice (same step): keep one copy
                elif self.pool.ref_counts[other] == 0:
                    # an idle block under this hash with another parent (its own was reused and this block
                    # recomputed since, or a real collision): nobody holds it, so this block takes its place
                    self.pool.uncache(other)
                    self.pool.cache(b, key)
                    stored.append(i)
                else:  # another sequence holds a block under this hash with another chain (a collision, or its
                    full, entry.stopped = i, True  # parent reused and recomputed): cache nothing more of this one
                    break
            stored_runs(self.events, stored, hashes, token_ids, bs)
        entry.num_cached = full
        return range(first, full)

    def _swap(self, seq_id: int, i: int, cached: int) -> None:
        """Replace the sequence's full block i by the cached block with the same content, freeing its own."""
        table = self.block_tables[seq_id]
        self._changed.add(seq_id)
        if self.radix:
            self.pool.share([cached])  # held by the tree
        else:
            self.pool.touch([cached])  # may be idle in the free list
        self.pool.free([table[i]])
        table[i] = cached

    def release_leading(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give back the blocks of `seq_id` that hold nothing but its first `num_tokens` tokens (a sliding window
        has left them behind: no future query sees them); their table entries become the null block. With hash
        prefix caching only blocks already registered go (a block's key names its predecessor, so a successor
        still to be registered needs it in place); freed cached blocks stay findable, as on `free`. The radix tree
        holds its blocks under the sequence's lock, so there nothing would be freed: not supported with it.
        Returns the blocks given back (in table order)."""
        if self.radix:
            raise ValueError("release_leading is not supported with radix prefix caching (the tree keeps its blocks)")
        table = self.block_tables[seq_id]
        end = min(num_tokens // self.block_size, len(table))
        if self.prefix_caching is not None and seq_id not in self._compacted:  # a compacted table holds no cached block
            entry = self._seqs.get(seq_id)  # (nor one that stopped caching: no successor will need its blocks)
            if entry is None or not entry.stopped:
                end = min(end, entry.num_cached if entry is not None else 0)
        start = self._released.get(seq_id, 0)
        if end <= start:
            return []
        freed = [b for b in table[start:end] if b != BlockPool.NULL_BLOCK]
        table[start:end] = [BlockPool.NULL_BLOCK] * (end - start)
        self._released[seq_id] = end
        self._changed.add(seq_id)
        self.pool.free(freed)
        return freed

    def trim(self, seq_id: int, num_tokens: int) -> list[int]:
        """Give back the trailing blocks of `seq_id` past those its first `num_tokens` tokens need (speculative
        decoding's rollback: blocks that held only rejected tokens). They were taken fresh this step and never
        registered in the prefix cache (only computed tokens' blocks are). Returns the blocks given back."""
        table = self.block_tables[seq_id]
        keep = blocks_for(num_tokens, self.block_size)
        if len(table) <= keep:
            return []
        freed = table[keep:]
        del table[keep:]
        self._changed.add(seq_id)
        self.pool.free(freed[::-1])
        return freed

    def num_released(self, seq_id: int) -> int:
        """Leading table entries of `seq_id` given back by release_leading (null now)."""
        return self._released.get(seq_id, 0)

    def record_lookup(self, num_tokens: int, num_hits: int) -> None:
        """Count one request's prefix lookup in the hit rate (tokens looked up, tokens found cached)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hits

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Give `child_id` the parent's first `num_tokens` tokens of KV.

        Full blocks are shared by reference. A partially filled last block would be written
        by both, so the child gets a fresh block, and fresh private blocks; the caller must copy
        the returned (src, dst) pairs before the next write. Raises OutOfBlocksError (and changes
        nothing) if too few blocks are free for the copies.
        """
        parent = self.block_tables[parent_id]
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        if blocks_for(num_tokens, self.block_size) > len(parent):
            raise ValueError(f"cannot fork {num_tokens} tokens: sequence {parent_id} holds {len(parent)} blocks")
        n_full = num_tokens // self.block_size
        shared = parent[:n_full]  # null entries (released) included: they stay null in the child
        partial = 1 if num_tokens % self.block_size else 0
        private = self.private_blocks.get(parent_id, [])
        if self.num_free_blocks < partial + len(private):
            raise OutOfBlocksError(f"{partial + len(private)} free blocks needed to fork a sequence, "
                                   f"{self.num_free_blocks} free")
        if self.states is not None:
            self.states.fork(parent_id, child_id)  # OutOfStateSlotsError (nothing changed) if no slot is free
        self.pool.share([b for b in shared if b != BlockPool.NULL_BLOCK])
        dst = self._take_free(partial + len(private))
        copies = list(zip(parent[n_full:n_full + partial] + private, dst))
        if private:
            self.private_blocks[child_id] = dst[partial:]
        self.block_tables[child_id] = list(shared) + dst[:partial]
        self._changed.add(child_id)
        if parent_id in self._compacted:  # its blocks hold the compacted KV: none of them may be cached
            self._compacted.add(child_id)
        if self._released.get(parent_id, 0):
            self._released[child_id] = min(self._released[parent_id], n_full)
        if parent_id in self._seqs:
            p = self._seqs[parent_id]
            # Hashes and cached blocks only up to the fork point: after it the child's tokens are its own.
            child = _SeqCache(p.extra, p.hashes[:n_full], min(p.num_cached, n_full), p.node, p.locked,
                              stopped=p.stopped)  # (its leading blocks may be given back past num_cached)
            if self.radix:
                p.family = p.family or [parent_id]
                child.family = p.family
                child.family.append(child_id)
            self._seqs[child_id] = child
            if child.locked:
                self.radix.lock(p.node)
            for source, node in p.extra_locks.items():  # it holds the blocks those locks protect for its parent
                self.radix.lock(node)
                child.extra_locks[source] = node
        return copies

    def release_scrubbed(self, seq_id: int) -> list[int]:
        """Free `seq_id` (a sequence the engine failed: its K/V may be NaN or garbage) and return the blocks that no
        one holds any more, made unfindable in the prefix cache: the caller zeroes them before anyone reuses them,
        since attention reads whole blocks and 0 x NaN is NaN even in a masked slot. Blocks others still hold
        (shared prefixes, the radix tree's) keep their content: it is what the same tokens compute."""
        held = self.block_tables.get(seq_id, []) + self.private_blocks.get(seq_id, [])
        counts: dict[int, int] = {}
        for b in held:
            if b == BlockPool.NULL_BLOCK:
                continue
            counts[b] = counts.get(b, 0) + 1
        alone = [b for b, n in counts.items() if self.pool.ref_counts[b] == n]
        for b in alone:
            self.pool.uncache(b)
        self.free(seq_id)
        return alone

    def check_retention(self) -> None:
        """ValueError where blocks cannot carry a retention priority (block_pool.BlockPool.retain)."""
        if self.radix is not None:
            raise ValueError("kv_retention needs prefix caching with --prefix-caching-algo hash (the radix tree "
                             "evicts by its own LRU)")
        if self.prefix_caching is None:
            raise ValueError("kv_retention needs prefix caching: nothing is kept after a request without it")

    def retain(self, seq_id: int, priority: int, ttl_s: float | None) -> None:
        """Give the cached blocks `seq_id` holds retention `priority` for `ttl_s` seconds (BlockPool.retain), before
        it frees them."""
        table = self.block_tables.get(seq_id)
        if table:
            self.pool.retain(table, priority, ttl_s)

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id` (no-op if it holds none); cached blocks stay findable."""
        table = self.block_tables.pop(seq_id, None)
        entry = self._seqs.pop(seq_id, None)
        self._compacted.discard(seq_id)
        if table is not None:
            self._changed.add(seq_id)
            if self._released.pop(seq_id, 0):
                table = [b for b in table if b != BlockPool.NULL_BLOCK]
        private = self.private_blocks.pop(seq_id, None)
        if private:
            self.pool.free(private)
        if self.states is not None:
            self.states.free(seq_id)
        if table:
            # Free newest first, so that a sequence's last blocks are evicted before its first ones.
            self.pool.free(table[::-1])
        if entry is not None:
            self._release(seq_id, entry)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence holds; returns how many. Refuses while sequences hold blocks."""
        if self.block_tables:
            raise RuntimeError(f"cannot reset the prefix cache while {len(self.block_tables)} sequences hold blocks")
        n = self.radix.reset() if self.radix else self.pool.clear_cache()
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.events is not None:
            self.events.cleared()
        return n
