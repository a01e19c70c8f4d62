"""The KV byte formula: the single place that says what one cached token costs.

Everything that sizes or reports the KV cache (the engine's block pool, its start-up
log, `LLM.kv_cache_info()`) goes through these functions. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What the KV cache of a decoder must hold per token and layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # tokens; None = full attention


def kv_bytes_per_token(shape: AttentionShape, dtype: str) -> int:
    """Bytes one token occupies in the cache across all layers: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


def kv_formula(shape: AttentionShape, dtype: str) -> str:
    """The formula with this model's numbers substituted, for logs and reports."""
    total = kv_bytes_per_token(shape, dtype)  # validates dtype
    return (f"2 x {shape.num_layers} layers x {shape.num_kv_heads} kv_heads x {shape.head_dim} head_dim"
            f" x {DTYPE_BYTES[dtype]} bytes = {total:,} bytes/token")


@dataclass(frozen=True, slots=True)
class CacheCapacity:
    """How a KV budget divides into blocks and tokens."""

    bytes_per_token: int
    block_size: int  # tokens per block
    num_blocks: int
    num_tokens: int
    total_bytes: int
    max_model_len: int
    max_concurrency: float  # requests of max_model_len tokens that fit at once


def cache_capacity(shape: AttentionShape, dtype: str, budget_bytes: int, block_size: int,
                   max_model_len: int) -> CacheCapacity:
    """Blocks, tokens and concurrency a budget of `budget_bytes` buys. Raises if not even one block fits."""
    per_token = kv_bytes_per_token(shape, dtype)
    block_bytes = per_token * block_size
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes:,} bytes is smaller than one block "
                         f"({block_size} tokens x {per_token:,} bytes = {block_bytes:,} bytes)")
    blocks_per_request = -(-max_model_len // block_size)
    return CacheCapacity(per_token, block_size, num_blocks, num_blocks * block_size, num_blocks * block_bytes,
                         max_model_len, num_blocks / blocks_per_request)
