"""Where the engine runs and how big its KV cache is: device and dtype, and the KV budget from what the device
has left once the weights are loaded, stated term by term.

- `--kv-cache-memory` given: that many bytes, or that share of the device's memory (CUDA) or of the RAM
  available (CPU).
- CUDA, not given (vLLM's sizing): gpu_memory_utilization x total memory - what the model keeps resident (weights,
  RoPE tables) - the peak of a profile step at the limits (plus, on the torch attention path, the K/V it gathers
  and the scores it keeps: portable_attention_bytes; plus the decode CUDA graphs' buffers and pool, measured by a
  capture over a stand-in store: cuda_graphs.estimate_bytes) - memory held outside torch (plan/capacity.py's
  device_budget, which `kvcache plan` uses too).
- CPU, not given: CPU_DEFAULT_KV_BYTES, at most half of the RAM available after the weights.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from kvcache.attention.metadata import SeqChunk, build_batch
from kvcache.config import EngineConfig
from kvcache.engine.sampler import SamplingRow, sample
from kvcache.engine.sampling_params import SamplingParams
from kvcache.models.llama import LlamaModel
from kvcache.plan.capacity import device_budget
from kvcache.plan.kv_bytes import (KV_DTYPES, CacheCapacity, TableGroup, cache_capacity, kv_bytes_per_token,
                                   paged_window, table_groups)
from kvcache.plan.report import human
from kvcache.plan.shape import ModelShape
from kvcache.plan.sizes import parse_bytes
from kvcache.store.kv_store import KVStore
from kvcache.store.state_store import StateBatch, StateSpan, StateStore

log = logging.getLogger("kvcache")
CPU_DEFAULT_KV_BYTES = 2 * 2**30  # half of vLLM CPU backend's 4 GiB: zeroing 4 GiB takes ~6 s here
GiB = 2**30


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype `auto` stands for: the KVCACHE_DEVICE environment variable's device if set
    (cpu or cuda), else CUDA where torch sees a GPU, else the CPU; bfloat16 on CUDA, float32 on the CPU (the
    dtype CPUs without native half-precision units run fastest)."""
    device = config.device
    if device == "auto":
        device = os.environ.get("KVCACHE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"KVCACHE_DEVICE must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device), getattr(torch, dtype)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def slow_half_precision(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `dtype` will be slow on this device (a CPU without native bf16/fp16 units), or None."""
    if device.type != "cpu" or dtype == torch.float32:
        return None
    native = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}[dtype]
    flags = _cpu_flags()
    if not flags or any(f in flags for f in native):
        return None
    return (f"{str(dtype).removeprefix('torch.')} compute on a CPU without {' or '.join(native)}: matrix products run "
            "many times slower than in float32 (about 1 GFLOP/s); --dtype float32 is the fast choice here")


@dataclass(frozen=True, slots=True)
class KVBudget:
    """The KV cache's bytes and how they were arrived at."""

    bytes: int
    how: str  # what follows the figure in the start-up log: ': --kv-cache-memory' or ' = 0.9 x ...'
    derived: bool  # computed from the device, not given: then it must hold at least one max_model_len request

    def __str__(self) -> str:
        return f"{human(self.bytes)}{self.how}"


def kv_budget(config: EngineConfig, device: torch.device, model: LlamaModel, portable_attention: Callable[[int], int],
              graphs: Callable[[], int] | None = None) -> KVBudget:
    """The KV budget for `model`, already loaded on `device` (see the module docstring). `portable_attention(budget)`
    is what the torch attention path needs beside the profile step with a pool of `budget` bytes (0 on other
    backends); `graphs()`, what the decode steps' CUDA graphs will take (cuda_graphs.estimate_bytes)."""
    given = config.kv_cache_memory
    weights = model.weight_bytes
    cuda = device.type == "cuda"
    if isinstance(given, str):  # a share, of the device's memory or of the RAM available now
        of = torch.cuda.mem_get_info(device)[1] if cuda else psutil.virtual_memory().available
        where = "the GPU's memory" if cuda else "the RAM available after the weights"
        return KVBudget(parse_bytes(given, of=of), f": --kv-cache-memory {given} of {where} ({of / GiB:,.2f} GiB)",
                        False)
    if given is not None:
        return KVBudget(given, ": --kv-cache-memory", False)
    if cuda:
        resident = torch.cuda.memory_allocated(device)  # the weights and every buffer the model keeps (RoPE tables)
        activations = profile_forward(model, config, device)
        graph_bytes = graphs() if graphs else 0
        activations += graph_bytes
        free, total = torch.cuda.mem_get_info(device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
        b = device_budget(total, config.gpu_memory_utilization, resident, activations, non_torch)
        extra = portable_attention(b.budget)
        if extra:
            b = device_budget(total, config.gpu_memory_utilization, resident, activations + extra, non_torch)
        return KVBudget(b.budget, f" = {b.terms()} (activations profiled at {config.max_num_batched_tokens:,} tokens "
                                  f"and {config.max_num_seqs} sampled rows"
                                  + (f", plus {extra / GiB:,.2f} GiB the torch attention path gathers into"
                                     if extra else "")
                                  + (f", plus {graph_bytes / GiB:,.2f} GiB for the decode steps' CUDA graphs"
                                     if graph_bytes else "") + ")", True)
    available = psutil.virtual_memory().available
    budget = min(CPU_DEFAULT_KV_BYTES, available // 2)
    return KVBudget(budget, f": the CPU default of {CPU_DEFAULT_KV_BYTES / GiB:g} GiB, at most half of the "
                            f"{available / GiB:,.2f} GiB of RAM available after {weights / GiB:,.2f} GiB of weights", True)


def portable_attention_bytes(config: EngineConfig, shape: ModelShape, max_model_len: int, compute_bytes: int,
                             pool_tokens: int) -> int:
    """What the torch attention path allocates beyond the profile step (a fresh prefill): decode rows gathered into
    padded K/V buffers (up to max_num_seqs sequences of max_model_len tokens, never more than the pool holds), and a
    chunk over a cached prefix attended under a mask (SDPA's math kernel keeps its scores and their softmax)."""
    per_token = shape.kv_lora_rank + shape.qk_rope_head_dim if "mla" in shape.layer_kinds else \
        shape.num_kv_heads * shape.head_dim * 2  # an MLA latent is gathered once, read as K and V
    gathered = min(config.max_num_seqs * max_model_len, pool_tokens) * per_token
    chunk = min(config.max_num_batched_tokens, max_model_len)
    scores = 2 * shape.num_attention_heads * chunk * max_model_len
    return (gathered + scores) * compute_bytes


def kv_capacity(config: EngineConfig, device: torch.device, model: LlamaModel, shape: ModelShape, kv_dtype: str,
                max_model_len: int, backend: str = "torch", draft_bytes_per_token: int = 0,
                graphs: Callable[[], int] | None = None) -> tuple[KVBudget, CacheCapacity]:
    """The budget and what it buys in `kv_dtype` with attention `backend`; ValueError if a budget computed from the
    device cannot hold one request of max_model_len tokens (a given one is the user's choice: such requests are
    refused one by one). With a draft model (`draft_bytes_per_token` > 0) the budget holds both caches with as
    many blocks each (vLLM's way): the capacity returned is the target's share."""
    tp = config.tensor_parallel_size
    per_token = kv_bytes_per_token(shape, kv_dtype, tp)  # one rank's: its KV heads
    compute_bytes = model.compute_dtype.itemsize

    def portable(budget: int) -> int:
        return 0 if backend != "torch" or not per_token else portable_attention_bytes(
            config, shape, max_model_len, compute_bytes, budget // per_token)
    budget = kv_budget(config, device, model, portable, graphs)
    if draft_bytes_per_token:
        both = config.block_size * (per_token + draft_bytes_per_token)
        if budget.bytes < both:
            raise ValueError(f"KV cache budget of {budget.bytes:,} bytes{budget.how} holds no block of the target "
                             f"and the draft model together ({config.block_size} tokens x ({per_token:,} + "
                             f"{draft_bytes_per_token:,}) bytes = {both:,} bytes): raise --kv-cache-memory, or use a "
                             "smaller draft model")
        share = budget.bytes * per_token // (per_token + draft_bytes_per_token)
        budget = KVBudget(budget.bytes, f"{budget.how}; with the draft model's cache: {share / GiB:,.2f} GiB the "
                          f"target's, {(budget.bytes - share) / GiB:,.2f} GiB the draft's, as many blocks each",
                          budget.derived)
    else:
        share = budget.bytes
    groups = layer_groups_for(shape, config, kv_dtype)
    release = release_window(shape, config) is not None or bool(groups)
    capacity = cache_capacity(shape, kv_dtype, share, config.block_size, max_model_len, release=release,
                              groups=groups if groups else None, tensor_parallel_size=tp,
                              state_dtype=str(model.compute_dtype).removeprefix("torch."),
                              state_slots=state_slots(shape, config), running_slots=config.max_num_seqs)
    one_request = peak_blocks(max_model_len, [g.window for g in groups] or [None], config) + capacity.seq_blocks
    if budget.derived and capacity.num_blocks < one_request:
        raise ValueError(f"the KV cache this device leaves ({budget}) holds {capacity.num_blocks:,} blocks, fewer than "
                         f"the {one_request:,} of one request of max_model_len {max_model_len:,}: lower "
                         "--max-model-len, or give --kv-cache-memory"
                         + (" or raise --gpu-memory-utilization" if device.type == "cuda" else ""))
    return budget, capacity


def check_recurrent(config: EngineConfig, shape: ModelShape, kv_dtype: str) -> None:
    """ValueError naming what cannot work with linear-attention / SSM layers (their state is one per sequence, as of
    its last token: nothing can drop, move or guess tokens under it), before anything loads."""
    refused = {"kv_eviction " + str(config.kv_eviction): config.eviction.enabled,
               f"kv_cache_dtype {kv_dtype} (KIVI)": KV_DTYPES[kv_dtype].scales == "kivi",
               "speculative decoding": config.speculative is not None,
               "--preemption-mode swap": config.preemption_mode == "swap",
               "the KV offload tiers": config.offload_tiers,
               f"tensor_parallel_size {config.tensor_parallel_size}": config.tensor_parallel_size > 1,
               f"--quantization {config.quantization}": config.quantization != "none",
               "the radix prefix cache (use --prefix-caching-algo hash)":
                   config.enable_prefix_caching and config.prefix_caching_algo == "radix"}
    on = [name for name, yes in refused.items() if yes]
    if on:
        raise ValueError(f"{shape.model_type or 'this model'} has {shape.count('linear')} linear-attention / SSM "
                         f"layers: {' and '.join(on)} cannot run on their per-sequence state yet (turn "
                         f"{'them' if len(on) > 1 else 'it'} off)")


def state_slots(shape: ModelShape, config: EngineConfig) -> int:
    """Slots of the state pool of a model with linear-attention / SSM layers (0 for other models): one per sequence
    a step can run (max_num_seqs), so that the pool never stops an admission the blocks allow; then, with prefix
    caching, the snapshots' (snapshot_slots)."""
    return config.max_num_seqs + snapshot_slots(config) if "linear" in shape.layer_kinds else 0


def snapshot_slots(config: EngineConfig) -> int:
    """State slots for snapshots (prefix caching of a recurrent model's state): num_state_snapshots, by default
    max_num_seqs; 0 without prefix caching."""
    if not config.enable_prefix_caching:
        return 0
    return config.num_state_snapshots if config.num_state_snapshots is not None else config.max_num_seqs


def release_window(shape: ModelShape, config: EngineConfig) -> int | None:
    """The window whose out-of-window blocks the engine gives back: the planner's paged_window (every layer slides
    with that one window; one block table serves all layers, so a full-attention layer keeps every block), unless
    the prefix cache is the radix tree's, which holds its blocks under the sequence's lock. None: every block kept."""
    if config.enable_prefix_caching and config.prefix_caching_algo == "radix":
        return None
    return paged_window(shape)


def peak_blocks(tokens: int, windows: list[int | None], config: EngineConfig) -> int:
    """The most blocks a sequence of `tokens` tokens holds at once over tables of `windows` (one per table; None:
    every block kept): all of them, or in a table whose out-of-window blocks are given back, with chunked prefill,
    a window behind the largest chunk (window - 1 tokens before it, one block more for the alignment)."""
    bs = config.block_size
    every = -(-tokens // bs)
    held = [every if w is None or not config.enable_chunked_prefill else
            min(every, -(-(w - 1 + config.max_num_batched_tokens) // bs) + 1) for w in windows]
    return sum(held)


def single_table_reason(config: EngineConfig, kv_dtype: str) -> str | None:
    """Why a model mixing full and sliding layers must keep one block table of every layer under `config` (a
    feature that reads or moves a sequence's KV through one table), or None: per-layer-group tables."""
    if config.disable_hybrid_kv_cache_manager:
        return "--disable-hybrid-kv-cache-manager asks for one block table of every layer"
    if config.enable_prefix_caching and config.prefix_caching_algo == "radix":
        return "the radix prefix cache holds its blocks (use --prefix-caching-algo hash to free them)"
    reasons = {"kv_cache_dtype " + kv_dtype + "'s fp16 key residual (KIVI)": KV_DTYPES[kv_dtype].scales == "kivi",
               "the KV offload tiers": config.offload_tiers,
               "--preemption-mode swap": config.preemption_mode == "swap",
               "KV events": bool(config.kv_events_endpoint), "speculative decoding": config.speculative is not None}
    on = [name for name, yes in reasons.items() if yes]
    return f"{' and '.join(on)} need one block table of every layer" if on else None


def layer_groups_for(shape: ModelShape, config: EngineConfig, kv_dtype: str) -> list[TableGroup]:
    """The per-layer-group tables the engine keeps, or [] for one table of every layer: plan's table_groups for a
    model mixing full and sliding layers; with PyramidKV as the engine's eviction policy (--kv-eviction
    pyramidkv), one table per layer, so that the upper layers' smaller budgets give back their blocks."""
    groups = table_groups(shape)
    if not groups and config.eviction.enabled and config.eviction.policy == "pyramidkv" \
            and set(shape.layer_kinds) == {"full"}:
        groups = [TableGroup(None, (i,)) for i in range(shape.num_layers)]
    return groups if groups and single_table_reason(config, kv_dtype) is None else []


def why_every_block_is_kept(shape: ModelShape, config: EngineConfig, kv_dtype: str) -> str:
    """The start-up's line for a sliding-window model that keeps one table of every layer, every block."""
    if table_groups(shape):
        return f"every block is kept: {single_table_reason(config, kv_dtype)}"
    if paged_window(shape) is None:
        return ("every block is kept: its layers do not all slide with one window, and one block table serves "
                "every layer")
    return "every block is kept: the radix prefix cache holds its blocks (use --prefix-caching-algo hash to free them)"


def profile_forward(model: LlamaModel, config: EngineConfig, device: torch.device) -> int | None:
    """Peak bytes (CUDA allocator) one step at the limits adds: max_num_batched_tokens tokens of prefill (prompts
    of max_model_len tokens at most) whose last max_num_seqs rows go through the LM head and the sampler (a top-p
    draw, its widest path). Elsewhere the step runs the same way but no allocator keeps a peak: None."""
    cfg = model.config
    dtype = model.compute_dtype
    block = config.block_size
    cuda = device.type == "cuda"
    # Two blocks: the null block and one that every token's slot wraps into (their K/V are never read back).
    kv_heads, head_dim, latent = model.kv_layout
    store = KVStore(cfg.num_hidden_layers, 2, block, kv_heads, head_dim, dtype, device, latent=latent)
    tokens = config.max_num_batched_tokens
    rows = min(config.max_num_seqs, tokens)
    longest = min(tokens, model.max_positions)  # prompts of at most max_model_len tokens share the step
    chunks = [SeqChunk([0] * min(longest, tokens - s), 0, [1] * -(-longest // block)) for s in range(0, tokens, longest)]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    batch = build_batch(chunks, block, model.windows, device)
    batch.logits_indices = torch.arange(tokens - rows, tokens, device=device)
    if getattr(model, "num_recurrent_layers", 0):  # each chunk a fresh sequence in a slot of its own
        states = StateStore(model.num_recurrent_layers, len(chunks), model.state_shapes, dtype, device)
        firsts = itertools.accumulate((len(c.token_ids) for c in chunks[:-1]), initial=0)
        none = torch.zeros(0, dtype=torch.long, device=device)
        batch.states = StateBatch(states, [StateSpan(first, len(c.token_ids), i, 0, [])
                                           for i, (first, c) in enumerate(zip(firsts, chunks))], none, none)
    logits = model(batch, store).float()
    sample(logits, [SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), None, [], 0) for _ in range(rows)])
    if not cuda:
        return None
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del store, batch, logits
    torch.cuda.empty_cache()
    return peak
