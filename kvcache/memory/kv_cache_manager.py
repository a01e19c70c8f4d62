"""Per-sequence block tables on top of the block pool."""
from __future__ import annotations

from kvcache.memory.block_pool import BlockPool, OutOfBlocksError


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns every sequence's block table: grows it as tokens arrive, shares it on fork, frees it on finish."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra blocks sequence `seq_id` needs so that its table covers `num_tokens` tokens."""
        have = len(self.block_tables.get(seq_id, ()))
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the table of `seq_id` to cover `num_tokens` tokens; False (and no change) if blocks are short."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(seq_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> tuple[int, int] | None:
        """Give `child_id` the parent's first `num_tokens` tokens of KV.

        Full blocks are shared by reference. A partially filled last block would be written
        by both, so the child gets a fresh block and the caller must copy (src, dst) before
        the next write. Returns that pair, or None when nothing needs copying. Raises
        OutOfBlocksError if no block is free for the copy.
        """
        parent = self.block_tables[parent_id]
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        if blocks_for(num_tokens, self.block_size) > len(parent):
            raise ValueError(f"cannot fork {num_tokens} tokens: sequence {parent_id} holds {len(parent)} blocks")
        n_full = num_tokens // self.block_size
        shared = parent[:n_full]
        self.pool.share(shared)
        table = list(shared)
        copy = None
        if num_tokens % self.block_size:
            try:
                (dst,) = self.pool.allocate(1)
            except OutOfBlocksError:
                self.pool.free(shared)
                raise
            table.append(dst)
            copy = (parent[n_full], dst)
        self.block_tables[child_id] = table
        return copy

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id` (no-op if it holds none)."""
        table = self.block_tables.pop(seq_id, None)
        if table:
            # Free newest first so that the oldest blocks are reused last.
            self.pool.free(table[::-1])
