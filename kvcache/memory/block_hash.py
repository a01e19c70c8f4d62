"""Hash-chained keys of full KV blocks (vLLM's prefix-caching scheme).

Block i of a sequence is keyed by SHA-256(key of block i-1, its token ids, extra keys), so equal
keys mean equal prefixes. The chain is cryptographic and unsalted (Python's hash() salts strings per
process), so every process computes the same keys for the same prompt: the offload tiers shared
between processes and machines are addressed by them (scoped by a model fingerprint, offload/).
A key is the first 128 bits of the digest, as an int. The extra keys hold the request's `cache_salt` (and have room for an
adapter id): requests with different salts never share. A hash alone could collide, so a
cached block also records its tokens and the exact block (id and generation) before it.
A lookup accepts a block only if all of them match, and a sequence registers a block only
on top of blocks it verified the same way, so a collision cannot hand out another prompt's KV.
"""
from __future__ import annotations

import array
import hashlib
from dataclasses import dataclass

ROOT_HASH = int.from_bytes(hashlib.sha256(b"kvcache-prefix-root").digest()[:16], "little")


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a cached block holds: its chain hash, tokens, extra keys and the block before it."""

    hash: int
    tokens: tuple[int, ...]
    extra: tuple
    parent: tuple[int, int] | None  # (block id, generation) of the previous block; None for the first


def chain_hashes(token_ids: list[int], block_size: int, extra: tuple, start: list[int]) -> list[int]:
    """Extend `start` (the hashes of the first blocks, already computed) over every full block of `token_ids`."""
    hashes = list(start)
    prev = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        prev = block_hash(prev, token_ids[i * block_size:(i + 1) * block_size], extra)
        hashes.append(prev)
    return hashes


def block_hash(parent: int, tokens, extra: tuple) -> int:
    """The key of a block holding `tokens` after the block keyed `parent` (ROOT_HASH for the first)."""
    h = hashlib.sha256(parent.to_bytes(16, "little"))
    h.update(array.array("q", tokens).tobytes())
    if extra:
        h.update(repr(extra).encode())  # str, int and tuple reprs are the same in every process
    return int.from_bytes(h.digest()[:16], "little")
