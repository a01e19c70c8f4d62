"""Decode and prefill attention in C++ for the CPU (csrc/attention/), read straight from the paged store.

The portable path gathers each sequence's blocks into a padded buffer before SDPA, which on CPU costs as much
memory traffic as the attention itself. paged_decode walks the block table instead, one block at a time with an
online softmax (flash-decoding): each block's keys and values are read once for all heads (the query heads of a KV
head share each read), the next block is prefetched, and quantized blocks are decoded as they are read. Each
sequence's context is cut into splits of SPLIT_TOKENS, run in parallel and combined, so that one long sequence
keeps every core busy; the splits depend on the sequence's own length only, so a row's arithmetic does not depend
on what else is in the batch. prefill_attention is causal flash attention on register tiles.

The kernels are built at install (setup.py) for each instruction-set variant, and kvcache.native loads the one this
CPU runs; they run on torch's own OpenMP pool (at::parallel_for).
"""
from __future__ import annotations

import torch

from kvcache import native

# Tokens of a sequence's context per work item (rounded down to whole blocks, at least one): a long context split
# into such items keeps every core busy on a lone sequence, which in one piece ran on one core, several times slower
# (docs/kernels.md).
SPLIT_TOKENS = 128

NO_RUNS = torch.empty(0, dtype=torch.int64)  # paged_decode's runs: none
FORMAT_CODES = {"int8": 1, "fp8_e4m3": 5, "fp8_e5m2": 6}  # the kernel's arithmetic decoders (KIVI: its bits)
# The C++ kernels of the variant this process runs, or None where they cannot (kvcache.native says why, once)
load = native.kernels


def paged_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None,
                 softcap: float | None = None, runs: torch.Tensor | None = None) -> None:
    """out[b] = attention of q[b] ([B, H, D], heads packed by D, rows of any stride: a view of the q/k/v product is
    read where it is) over the first context_lens[b] tokens of its block table in k_cache / v_cache (float32, or
    float16 / bfloat16 widened as they are read); scores
    soft-capped (c * tanh(s / c)) with `softcap`. `runs` (int64 [B], DecodeGroup.runs): runs[b] rows from b on are
    consecutive positions of one sequence (0 inside a run), attended together: each block is read once for all of
    them, and each row's output is what it would be alone."""
    load().paged_decode(out, q, k_cache, v_cache, block_tables, context_lens, scale, window or 0, softcap or 0.0,
                        SPLIT_TOKENS, NO_RUNS if runs is None else runs)


def paged_decode_quant(out: torch.Tensor, q: torch.Tensor, store, layer: int, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, scale: float, window: int | None,
                       full: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, softcap: float | None = None,
                       runs: torch.Tensor | None = None, code: int | None = None) -> None:
    """paged_decode over a QuantizedKVStore layer, dequantizing each token as it is read. Under KIVI `full` is
    (full-precision key rows [R, KVH, D], row of each sequence's current-group position [B, group], the position
    that group starts at [B]), and there are no runs. `code`: how bytes decode (default: the store's format; 0, the
    store's lookup table, serves any byte format)."""
    empty = torch.empty(0)
    src, rows, start = full if full is not None else (empty, empty, empty)
    if store.kivi_group:
        code = store.bits
    elif code is None:
        code = FORMAT_CODES.get(store.dtype, 0)
    load().paged_decode_quant(out, q, store.raw[layer], store.offsets, code, store.lut,
                               store.kivi_group or 1, store.value_group, store.block_size,
                               store.num_kv_heads, block_tables, context_lens, scale, window or 0, src, rows, start,
                               softcap or 0.0, SPLIT_TOKENS, NO_RUNS if runs is None else runs)


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> None:
    """out [n, H, D] = causal attention of the queries q [n, H, D], the last n positions of a context whose keys and
    values are k, v [L >= n, KVH, D] (float32; row strides free, heads packed by D; D a multiple of 32)."""
    load().prefill_attention(out, q, k, v, scale)
