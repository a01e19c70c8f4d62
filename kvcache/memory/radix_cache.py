"""A radix tree of cached prefixes over block-aligned token spans (SGLang's RadixAttention).

Each edge holds a run of whole blocks: their tokens and block ids. A lookup walks the tree
from the root of the request's `cache_salt` and splits a node where a match ends inside it.
The tree holds one pool reference on each of its blocks. Running requests lock the path to
their deepest node (`lock_ref`); when the pool runs short, unlocked leaves are evicted in
least-recently-used order and their blocks go back to the free list.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from kvcache.memory.block_pool import BlockPool
from kvcache.memory.kv_events import KVEventLog


@dataclass(eq=False, slots=True)
class RadixNode:
    """An edge of the tree: `blocks` hold `tokens` (len(tokens) == len(blocks) x block_size)."""

    tokens: tuple[int, ...]
    blocks: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # keyed by first block's tokens
    lock_ref: int = 0
    last_access: int = 0
    hashes: list[int] = field(default_factory=list)  # chain keys of `blocks`, when KV events are recorded


class RadixCache:
    """Prefix tree over one block pool; one root per extra key (cache salt)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.roots: dict[tuple, RadixNode] = {}
        self.num_blocks = 0  # blocks the tree holds
        self.evictable_blocks = 0  # of those, in nodes no running request locks
        self.num_evictions = 0
        self._clock = itertools.count(1)
        self.events: KVEventLog | None = None  # records what the tree adopts and evicts (KV events), if set

    def _first(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        return tokens[:self.block_size]

    def _root(self, extra: tuple) -> RadixNode:
        if extra not in self.roots:
            self.roots[extra] = RadixNode((), [], None, lock_ref=1)  # a root is never evicted
        return self.roots[extra]

    def _split(self, node: RadixNode, n_blocks: int) -> RadixNode:
        """Cut `node` after its first `n_blocks` blocks; return the new upper part."""
        cut = n_blocks * self.block_size
        upper = RadixNode(node.tokens[:cut], node.blocks[:n_blocks], node.parent, lock_ref=node.lock_ref,
                          last_access=node.last_access, hashes=node.hashes[:n_blocks])
        node.parent.children[self._first(node.tokens)] = upper
        node.tokens, node.blocks, node.parent = node.tokens[cut:], node.blocks[n_blocks:], upper
        node.hashes = node.hashes[n_blocks:]
        upper.children[self._first(node.tokens)] = node
        return upper

    def match(self, token_ids: list[int], extra: tuple) -> tuple[list[int], RadixNode]:
        """Blocks of the longest cached block-aligned prefix of `token_ids`, and the node it ends at."""
        bs = self.block_size
        node, blocks = self._root(extra), []
        tokens = tuple(token_ids[:len(token_ids) // bs * bs])
        now = next(self._clock)
        node.last_access = now
        while tokens:
            child = node.children.get(self._first(tokens))
            if child is None:
                break
            k = 0  # whole blocks in common
            while k < len(child.blocks) and child.tokens[k * bs:(k + 1) * bs] == tokens[k * bs:(k + 1) * bs]:
                k += 1
            if k == 0:
                break
            if k < len(child.blocks):
                child = self._split(child, k)
            child.last_access = now
            blocks += child.blocks
            tokens = tokens[k * bs:]
            node = child
        return blocks, node

    def insert(self, token_ids: list[int], blocks: list[int], extra: tuple, hashes: list[int] = ()
               ) -> tuple[RadixNode, list[int]]:
        """Add the block-aligned `token_ids` held in `blocks` (chain keys `hashes`, for KV events); the part
        already cached keeps its blocks.

        The tree takes a pool reference on each block it adopts. Returns the node the prefix ends at
        and the tree's blocks for the whole prefix (the caller swaps its duplicates for them).
        """
        cached, node = self.match(token_ids, extra)
        depth = len(cached)
        if depth < len(blocks):
            new = RadixNode(tuple(token_ids[depth * self.block_size:len(blocks) * self.block_size]),
                            blocks[depth:], node, last_access=node.last_access, hashes=list(hashes[depth:len(blocks)]))
            if self.events is not None and new.hashes:
                self.events.stored(new.hashes, hashes[depth - 1] if depth else None, list(new.tokens))
            self.pool.share(new.blocks)
            node.children[self._first(new.tokens)] = new
            self.num_blocks += len(new.blocks)
            self.evictable_blocks += len(new.blocks)
            return new, cached + new.blocks
        return node, cached[:len(blocks)]

    def lock(self, node: RadixNode) -> None:
        """Protect `node` and its ancestors from eviction (a running request uses them)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
            node = node.parent

    @staticmethod
    def is_above(upper: RadixNode, node: RadixNode) -> bool:
        """Whether `upper` is a strict ancestor of `node` (its blocks lead to `node`'s)."""
        node = node.parent
        while node is not None and node is not upper:
            node = node.parent
        return node is upper

    def locked_blocks_on_path(self, node: RadixNode) -> int:
        """Blocks on the path to `node` that locking it would take out of the evictable set."""
        n = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                n += len(node.blocks)
            node = node.parent
        return n

    def evict(self, num_blocks: int, count: bool = True) -> int:
        """Free at least `num_blocks` blocks (if that many are evictable), oldest unlocked leaves first.
        `count` adds them to `num_evictions` (a reset does not)."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_blocks and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            del parent.children[self._first(node.tokens)]
            self.pool.free(node.blocks)
            if count and self.events is not None:
                self.events.removed(node.hashes)
            freed += len(node.blocks)
            self.num_blocks -= len(node.blocks)
            self.evictable_blocks -= len(node.blocks)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        if count:
            self.num_evictions += freed
        # a root per cache salt: drop the empty ones, or one per tenant would pile up
        for extra in [e for e, root in self.roots.items() if not root.children and e != ()]:
            del self.roots[extra]
        return freed

    def _nodes(self):
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                yield node

    def reset(self) -> int:
        """Drop every unlocked node; returns the blocks freed."""
        return self.evict(self.num_blocks, count=False)
