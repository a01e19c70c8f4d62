"""Capacity planning: how much of a GPU (or host) is left for the KV cache, and what it holds.

Per GPU, as vLLM budgets it:
    KV budget = memory x gpu_memory_utilization - weights - activation reserve
    weights   = parameters x weight bytes / num_gpus  (tensor x pipeline parallel shards)
Blocks are the same on every GPU: each holds `block_size` tokens of the layers and KV heads
that GPU owns (KV heads split across tensor-parallel ranks, replicated below one per rank;
an MLA latent is replicated; pipeline stages split the layers). No torch here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvcache.plan.kv_bytes import (DEFAULT_BLOCK_SIZE, CacheCapacity, cache_capacity, kv_bytes_per_token,
                                   longest_tokens)
from kvcache.plan.shape import ModelShape

DEFAULT_MAX_NUM_SEQS = 128  # the engine's defaults, which activation estimates assume
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
RUNTIME_RESERVE = 2**30  # CUDA context, cuBLAS/NCCL workspaces, CUDA graphs: about 1 GiB per GPU


def weight_dtype(name: str, shape: ModelShape) -> str:
    """The weight dtype `name` means; 'auto' is the checkpoint's, with float32 served as bfloat16 (vLLM's rule)."""
    if name == "auto":
        name = shape.weight_dtype if shape.weight_dtype in WEIGHT_BYTES else "bfloat16"
        return "bfloat16" if name == "float32" else name
    if name not in WEIGHT_BYTES:
        raise ValueError(f"unknown weight dtype {name!r}; supported: auto, {', '.join(WEIGHT_BYTES)}")
    return name


@dataclass(frozen=True, slots=True)
class DeviceBudget:
    """The KV budget of one device, vLLM's way, with every term (bytes):
    budget = utilization x total - weights - activations - non_torch."""

    total: int
    utilization: float
    weights: int
    activations: int  # peak of a forward at the step limits (measured by a profile run, or estimated)
    non_torch: int  # held outside the framework's allocator: the CUDA context, other processes, NCCL
    budget: int

    def terms(self) -> str:
        """'0.9 x 79.21 GiB - 14.96 GiB weights - ...': the right-hand side of the budget, in GiB."""
        def gib(b: int) -> str:
            return f"{b / 2**30:,.2f} GiB"
        return (f"{self.utilization:g} x {gib(self.total)} - {gib(self.weights)} weights - {gib(self.activations)} "
                f"activations - {gib(self.non_torch)} outside torch")


def device_budget(total: int, utilization: float, weights: int, activations: int, non_torch: int = 0) -> DeviceBudget:
    """The KV budget a device leaves (see DeviceBudget); ValueError naming every term and what to change if
    nothing is left. The engine calls it with measured figures, `kvcache plan` with estimates."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization) - weights - activations - non_torch
    if budget <= 0:
        raise ValueError(f"nothing is left for the KV cache: {utilization:g} x {total:,} bytes of device memory minus "
                         f"{weights:,} of weights, {activations:,} of activations and {non_torch:,} held outside "
                         f"torch is {budget:,}; raise --gpu-memory-utilization, lower --max-num-batched-tokens or "
                         "--max-num-seqs, use a smaller dtype, or free the device")
    return DeviceBudget(total, utilization, weights, activations, non_torch, budget)


def activation_reserve(shape: ModelShape, dtype: str, tensor_parallel_size: int,
                       max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                       max_num_seqs: int = DEFAULT_MAX_NUM_SEQS) -> int:
    """Estimated peak of one forward step per GPU, bytes: the hidden states and MLP intermediates of a full
    token budget, fp32 logits of the sampled rows (twice, for the sampler), plus RUNTIME_RESERVE."""
    per_token = 4 * shape.hidden_size + 2 * shape.intermediate_size // tensor_parallel_size
    hidden = int(max_num_batched_tokens * per_token * WEIGHT_BYTES[dtype])
    return hidden + 2 * max_num_seqs * shape.vocab_size * 4 + RUNTIME_RESERVE


def pipeline_stages(shape: ModelShape, pipeline_parallel_size: int) -> list[ModelShape]:
    """The layers each pipeline stage holds (contiguous, as even as possible)."""
    n, pp = shape.num_layers, pipeline_parallel_size
    if pp > n:
        raise ValueError(f"pipeline parallel size {pp} exceeds the {n} layers")
    stages, start = [], 0
    for i in range(pp):
        size = n // pp + (1 if i < n % pp else 0)
        kinds = shape.layer_kinds[start:start + size]
        stages.append(dataclasses.replace(shape, num_layers=size, layer_kinds=kinds))
        start += size
    return stages


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """What a deployment leaves for the KV cache and what that holds. Bytes are per GPU unless named total."""

    memory_per_gpu: int
    num_gpus: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpu_memory_utilization: float
    weight_dtype: str
    weight_bytes: int
    activation_bytes: int
    kv_budget: int
    capacity: CacheCapacity  # per GPU; its tokens and concurrency hold for the whole deployment
    kv_cache_bytes: int  # total over all GPUs
    batch: int
    max_num_seqs: int
    stage: ModelShape  # the layers of the fullest pipeline stage, whose bytes set the block size
    max_seq_len_for_batch: int  # longest context each of `batch` concurrent requests can have


def plan_device(shape: ModelShape, kv_dtype: str, *, memory_per_gpu: int | None = None, kv_cache_memory: int | None = None,
                num_gpus: int = 1, tensor_parallel_size: int | None = None, gpu_memory_utilization: float = 0.9,
                weights: str = "auto", activation_bytes: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                seq_len: int, batch: int = 1, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS) -> DevicePlan:
    """Plan from device memory (`memory_per_gpu`) or from a KV budget given directly (`kv_cache_memory`, per GPU)."""
    tp = tensor_parallel_size or num_gpus
    if num_gpus < 1 or tp < 1 or num_gpus % tp:
        raise ValueError(f"num_gpus ({num_gpus}) must be a positive multiple of tensor_parallel_size ({tp})")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be positive, got batch={batch}, seq_len={seq_len}")
    pp = num_gpus // tp
    stage = max(pipeline_stages(shape, pp), key=lambda s: kv_bytes_per_token(s, kv_dtype, tp))
    wdtype = weight_dtype(weights, shape)
    if kv_cache_memory is not None:
        weight_bytes = act = 0
        budget = kv_cache_memory
        memory_per_gpu = memory_per_gpu or 0
    else:
        if memory_per_gpu is None:
            raise ValueError("give the device memory (--gpu or --memory) or the KV budget (--kv-cache-memory)")
        if shape.num_parameters is None:
            raise ValueError("the parameter count of this model is unknown (hybrid layers): pass --num-parameters")
        weight_bytes = int(shape.num_parameters * WEIGHT_BYTES[wdtype] / num_gpus)
        act = activation_bytes if activation_bytes is not None else activation_reserve(
            shape, wdtype, tp, max_num_batched_tokens, max_num_seqs)
        budget = device_budget(memory_per_gpu, gpu_memory_utilization, weight_bytes, act).budget
    cap = cache_capacity(stage, kv_dtype, budget, block_size, seq_len, tp)
    longest = longest_tokens(stage, cap.num_blocks // batch - cap.seq_blocks, block_size)
    return DevicePlan(memory_per_gpu, num_gpus, tp, pp, gpu_memory_utilization, wdtype, weight_bytes, act, budget,
                      cap, cap.total_bytes * num_gpus, batch, max_num_seqs, stage, longest)
