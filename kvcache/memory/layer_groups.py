"""Per-layer-group block tables (vLLM's hybrid KV cache manager) for models that mix full-attention and
sliding-window layers (Gemma-2, Gemma-3, Qwen2 with max_window_layers), and for PyramidKV's per-layer budgets.

The layers are cut into groups of equal size (plan/kv_bytes.py's `table_groups`); one block of the pool holds
one group's layers for `block_size` tokens, whichever group it is lent to (the store aliases each layer to its
slot in the group: KVStore.alias / QuantizedKVStore.alias). A sequence has one table per group, each kept by a
KVCacheManager drawing from the one shared pool:

- a full-attention group keeps every block, as the single table does;
- a sliding group gives back each block whose tokens are all older than its window (`slide`, after every
  forward): a long sequence holds the window's blocks and one more there, however long it grows.

PyramidKV as the engine's eviction policy uses the same machinery with one full-attention layer per group: after
the prompt's compaction each layer's table gives back the whole blocks its smaller budget leaves dead.

Prefix caching (hash only: the radix tree owns its blocks and cannot share a pool) works per group: each group
registers its blocks under its own tag, and a cached prefix is a hit only as far as every group holds what it
needs there: full groups every block before the hit point, sliding groups the blocks the window before it
reaches (`window_prefix`; the blocks before are the null block). The hit is the longest prefix all groups agree
on.

Invariant: every group's table of a sequence has the same length (blocks for the same tokens); free (idle cached
included) + held blocks == the pool's usable blocks, across all groups.
"""
from __future__ import annotations

from kvcache.memory.block_pool import BlockPool, OutOfBlocksError
from kvcache.memory.kv_cache_manager import KVCacheManager, PrefixCacheStats


class GroupPrefix(list):
    """A prefix-cache hit in every group: as a list, the first group's blocks (what the scheduler counts);
    `tables` holds each group's starting table (sliding groups' with null entries before their window)."""

    def __init__(self, tables: list[list[int]]) -> None:
        super().__init__(tables[0])
        self.tables = tables


class GroupedKVCacheManager:
    """The KVCacheManager interface the engine, scheduler and runner use, over one manager per layer group.

    `block_tables` and the prefix-cache answers are the first group's (a full-attention one: its table has a block
    for every position); `groups` gives every group's manager for the runner (one batch per group) and for eviction
    (`compact` per group, then each layer's dead leading blocks given back in its own table: PyramidKV). Features
    that need one table of every layer (the radix cache, KIVI residuals, offload tiers, swap, KV events,
    speculative decoding) are not offered: the engine keeps a single table when one of them is on. Nor are recurrent
    layers' state slots and snapshots (no model mixes them with sliding windows yet)."""

    states = snapshots = None

    radix = None
    seq_blocks = 0
    events = None

    def __init__(self, num_blocks: int, block_size: int, windows: list[int | None],
                 prefix_caching: str | None = None) -> None:
        if prefix_caching not in (None, "hash"):
            raise ValueError(f"per-layer-group tables support hash prefix caching or none, got {prefix_caching!r}")
        if not windows or windows[0] is not None:
            raise ValueError(f"the first layer group must be a full-attention one, got windows {windows}")
        self.block_size, self.prefix_caching, self.windows = block_size, prefix_caching, list(windows)
        self.pool = BlockPool(num_blocks)
        self.groups = [KVCacheManager(num_blocks, block_size, prefix_caching, pool=self.pool,
                                      tag=(("layer_group", g),) if g else ()) for g in range(len(windows))]
        self.stats = PrefixCacheStats()
        self.private_blocks: dict[int, list[int]] = {}  # never filled: no KIVI residual with groups

    # ---- what the single manager answers from its one table ----------------------------------

    @property
    def block_tables(self) -> dict[int, list[int]]:
        return self.groups[0].block_tables

    def tables(self, seq_id: int) -> list[list[int]]:
        """Every group's table of `seq_id`, in group order ([] if it holds none)."""
        return [m.block_tables[seq_id] for m in self.groups if seq_id in m.block_tables]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def num_idle_cached_blocks(self) -> int:
        held = {b for m in self.groups for table in m.block_tables.values() for b in table}
        return self.pool.num_cached - sum(1 for b in held if self.pool.keys[b] is not None)

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def take_changed(self) -> set[int]:
        raise TypeError("per-layer-group tables: take each group's changes from its own manager (groups[g])")

    def blocks_needed(self, seq_id: int, num_tokens: int, prefix: list[int] = ()) -> int:
        """Blocks that leave the available set if `seq_id` grows to `num_tokens` tokens in every group."""
        starts = self._starts(prefix)
        return sum(m.blocks_needed(seq_id, num_tokens, p) for m, p in zip(self.groups, starts))

    def _starts(self, prefix: list[int]) -> list[list[int]]:
        if isinstance(prefix, GroupPrefix):
            return prefix.tables
        if prefix:
            raise ValueError("per-layer-group tables start from a GroupPrefix (find_prefix's), not a list of blocks")
        return [[] for _ in self.groups]

    def block_hashes(self, seq_id: int, token_ids: list[int], extra: tuple = ()) -> list[int]:
        return self.groups[0].block_hashes(seq_id, token_ids, extra)

    def find_prefix(self, seq_id: int, token_ids: list[int], extra: tuple = (), max_tokens: int | None = None
                    ) -> GroupPrefix:
        """The longest block-aligned prefix every group holds what it needs of (see the module docstring);
        takes no reference: pass it to `allocate` in the same step."""
        if self.prefix_caching is None or seq_id in self.block_tables:
            return GroupPrefix([[] for _ in self.groups])
        full = {g: m.find_prefix(seq_id, token_ids, extra, max_tokens)
                for g, (m, w) in enumerate(zip(self.groups, self.windows)) if w is None}
        n = min(len(f) for f in full.values())
        while n > 0:  # the longest hit every sliding group agrees with
            tables = [full[g][:n] if w is None else m.window_prefix(seq_id, token_ids, extra, n, w)
                      for g, (m, w) in enumerate(zip(self.groups, self.windows))]
            if all(t is not None for t in tables):
                return GroupPrefix(tables)
            n -= 1
        return GroupPrefix([[] for _ in self.groups])

    def allocate(self, seq_id: int, num_tokens: int, prefix: list[int] = ()) -> bool:
        """Grow every group's table of `seq_id` to `num_tokens` tokens; False (and no change) if blocks are short."""
        starts = self._starts(prefix)
        if self.blocks_needed(seq_id, num_tokens, prefix) > self.num_free_blocks:
            return False
        # Every group takes its cached prefix blocks out of the free list before any group draws fresh blocks from
        # it: a fresh allocation reuses idle cached blocks, and another group's prefix may be among them.
        for m, p in zip(self.groups, starts):
            if seq_id not in m.block_tables:
                m.allocate(seq_id, len(p) * self.block_size, p)
        for m in self.groups:
            if not m.allocate(seq_id, num_tokens):  # cannot happen: the sum was checked
                raise RuntimeError(f"a layer group's allocation failed with {self.num_free_blocks} blocks free")
        return True

    def cache_blocks(self, seq_id: int, token_ids: list[int], num_computed_tokens: int, extra: tuple = ()) -> range:
        """Register each group's computed full blocks; returns the first group's indices registered."""
        done = [m.cache_blocks(seq_id, token_ids, num_computed_tokens, extra) for m in self.groups]
        return done[0]

    def slide(self, seq_id: int, num_computed_tokens: int) -> list[int]:
        """Give back, in each sliding group, the blocks no query from the next token on can see (all their tokens
        at least `window` positions behind it). Returns the blocks given back."""
        freed: list[int] = []
        for m, w in zip(self.groups, self.windows):
            if w is not None:
                freed += m.release_leading(seq_id, num_computed_tokens - w + 1)
        return freed

    def num_released(self, seq_id: int) -> int:
        return self.groups[0].num_released(seq_id)

    def record_lookup(self, num_tokens: int, num_hits: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hits

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> list[tuple[int, int]]:
        """Every group's fork (see KVCacheManager.fork); OutOfBlocksError, and no change, if copies do not fit."""
        partial = 1 if num_tokens % self.block_size else 0
        if self.num_free_blocks < partial * len(self.groups):
            raise OutOfBlocksError(f"{partial * len(self.groups)} free blocks needed to fork a sequence over "
                                   f"{len(self.groups)} layer groups, {self.num_free_blocks} free")
        return [pair for m in self.groups for pair in m.fork(parent_id, child_id, num_tokens)]

    def compact(self, seq_id: int, num_tokens: int) -> list[tuple[list[int], list[int]]] | None:
        """Every group's KVCacheManager.compact, as one: (old table, new table) per group, or None (and no change)
        when the fresh blocks they need together are short (the single table's fallback of taking its own cached
        blocks out of the prefix index is not tried here)."""
        if sum(m.compact_needs(seq_id, num_tokens) for m in self.groups) > self.num_free_blocks:
            return None
        freed: list[int] = []  # freed once every group has its fresh blocks: no group writes into another's old ones
        pairs = [m.compact(seq_id, num_tokens, freed) for m in self.groups]
        self.pool.free(freed)
        return pairs

    def is_compacted(self, seq_id: int) -> bool:
        return self.groups[0].is_compacted(seq_id)

    def release_scrubbed(self, seq_id: int) -> list[int]:
        return [b for m in self.groups for b in m.release_scrubbed(seq_id)]

    def free(self, seq_id: int) -> None:
        for m in self.groups:
            m.free(seq_id)

    def reset_prefix_cache(self) -> int:
        if self.block_tables:
            raise RuntimeError(f"cannot reset the prefix cache while {len(self.block_tables)} sequences hold blocks")
        return self.pool.clear_cache()

    def __getattr__(self, name: str):
        if name in ("trim", "mark_compacted", "release_leading"):
            raise TypeError(f"{name} needs one table of every layer; per-layer-group tables do not offer it")
        raise AttributeError(name)
