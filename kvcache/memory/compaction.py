"""Token eviction's side of the block tables: compacting a sequence's table to the tokens it keeps, without writing a
block that is shared or in the prefix cache. KVCacheManager (kv_cache_manager.py) inherits these operations; they
read its tables, pool, prefix index and the set of compacted sequences."""
from __future__ import annotations

from kvcache.memory.block_pool import blocks_for


class TableCompaction:
    """KVCacheManager's compaction operations (eviction: engine/eviction.py)."""

    def compact(self, seq_id: int, num_tokens: int, freed: list[int] | None = None,
                fixed_blocks: int = 0) -> tuple[list[int], list[int]] | None:
        """Shrink the table of `seq_id` to `num_tokens` tokens for eviction's compaction.

        Returns (old table, new table): the caller moves the surviving tokens from slots of the old
        table to the first `num_tokens` slots of the new one before anything else is allocated. A block
        of the old table is written in place only if the sequence holds it alone and it is not in the
        prefix cache; a shared or cached block is never written (its survivors go to a fresh block and
        it stays in the prefix cache, findable and reclaimable). Blocks short: in the hash index, own
        cached blocks are taken out of it and written in place; None (and no change) if still short.
        Afterwards the sequence's blocks no longer match its tokens, so none of them is cached again.
        With `freed`, the old blocks it lets go are appended there for the caller to free (after other tables that
        share the pool have taken their fresh blocks: those must not be blocks whose survivors are still to move).
        The first `fixed_blocks` keep their tokens in place (the caller moves none into or out of them): they stay
        in the table, shared or cached as they are, and take no fresh block.
        """
        table = self.block_tables[seq_id]
        n = blocks_for(num_tokens, self.block_size)
        if n > len(table):
            raise ValueError(f"cannot compact sequence {seq_id} to {num_tokens} tokens: it holds {len(table)} blocks")
        if self._released.get(seq_id):
            raise ValueError(f"cannot compact sequence {seq_id}: its leading blocks were given back")
        pool = self.pool
        own = [True] * min(fixed_blocks, n) + self._own(table[min(fixed_blocks, n):n])
        short = own.count(False) - self.num_free_blocks
        if short > 0 and not self.radix:
            cached_own = [i for i in range(n) if not own[i] and pool.ref_counts[table[i]] == 1]
            if len(cached_own) < short:
                return None
            for i in cached_own[:short]:
                pool.uncache(table[i])
                own[i] = True
        elif short > 0:
            return None
        fresh = iter(self._take_free(own.count(False)))
        new = [b if ok else next(fresh) for b, ok in zip(table, own)]
        kept = set(new)
        gone = [b for b in table[::-1] if b not in kept]
        if freed is None:
            pool.free(gone)
        else:
            freed.extend(gone)
        self.block_tables[seq_id] = new
        self._changed.add(seq_id)
        entry = self._seqs.get(seq_id)
        if entry is not None and not (self.radix and fixed_blocks):  # fixed blocks stay in the table, locked
            del self._seqs[seq_id]
            if self.radix:
                self._release(seq_id, entry)
        self._compacted.add(seq_id)
        return table, new

    def _own(self, blocks: list[int]) -> list[bool]:
        """Per block: whether the sequence holds it alone, outside the prefix cache (compaction may write it)."""
        return [self.pool.ref_counts[b] == 1 and self.pool.keys[b] is None for b in blocks]

    def compact_needs(self, seq_id: int, num_tokens: int) -> int:
        """Fresh blocks `compact(seq_id, num_tokens)` takes: one per block it may not write in place."""
        return self._own(self.block_tables[seq_id][:blocks_for(num_tokens, self.block_size)]).count(False)

    def is_compacted(self, seq_id: int) -> bool:
        """Whether eviction compacted `seq_id`'s table (its blocks no longer match its tokens)."""
        return seq_id in self._compacted

    def mark_compacted(self, seq_id: int) -> None:
        """Record that `seq_id`'s table holds compacted KV (a swapped sequence restored into fresh blocks): none of
        its blocks is ever cached."""
        if seq_id not in self.block_tables:
            raise ValueError(f"sequence {seq_id} has no block table")
        self._compacted.add(seq_id)
