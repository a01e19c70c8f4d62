"""The KV byte formula: the single place that says what one cached token costs.

Everything that sizes or reports the KV cache (the engine's block pool, its start-up log,
`LLM.kv_cache_info()`, `kvcache plan`, `kvcache simulate`) goes through these functions.
No torch here.

Per token and attention layer:
- MHA/GQA/MQA, full or sliding window: K and V, each `kv_heads x head_dim` values.
- MLA: one latent of `kv_lora_rank + qk_rope_head_dim` values (no K/V pair, no heads).
- linear-attention / state-space layers: nothing per token; a constant state per request.
Sliding-window layers hold at most `window` tokens of a sequence.

Quantized formats store scales beside the values (fp16 scales, as the store lays them out):
- fp8_e4m3, fp8_e5m2, int8: one scale per token and KV head (dynamic, set at write time).
- int4, int2 (KIVI): keys per channel over groups of 64 tokens, values per token over
  groups of 64 channels, each group with an fp16 scale and zero point. Values are quantized
  as they are written; a key group needs all 64 tokens, so each sequence keeps the keys of
  its newest tokens (at most 63: the 64th completes the group) in fp16: a residual buffer per
  sequence, counted per request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvcache.plan.shape import ModelShape

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class KVDtype:
    """How one cached value is stored, and what its scales cost."""

    name: str
    bits: int  # per stored value
    scales: Literal["none", "per-token-head", "kivi"] = "none"
    group: int = 0  # kivi: tokens per key-channel group, channels per value-token group
    residual_tokens: int = 0  # newest tokens per sequence whose keys stay fp16 until their group fills

    def describe(self) -> str:
        if self.scales == "none":
            return f"{self.name}: {self.bits // 8} bytes per value, no scales"
        if self.scales == "per-token-head":
            return f"{self.name}: 1 byte per value + one fp16 scale per token and KV head"
        return (f"{self.name}: {self.bits} bits per value (packed {8 // self.bits} per byte); KIVI scales: keys per channel "
                f"over {self.group}-token groups, values per token over {self.group}-channel groups, fp16 scale + zero "
                f"point per group; the keys of up to {self.residual_tokens} newest tokens per sequence kept in fp16")


KV_DTYPES: dict[str, KVDtype] = {d.name: d for d in (
    KVDtype("float32", 32), KVDtype("bfloat16", 16), KVDtype("float16", 16),
    KVDtype("fp8_e4m3", 8, "per-token-head"), KVDtype("fp8_e5m2", 8, "per-token-head"),
    KVDtype("int8", 8, "per-token-head"),
    KVDtype("int4", 4, "kivi", group=64, residual_tokens=63), KVDtype("int2", 2, "kivi", group=64, residual_tokens=63),
)}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "fp8_e4m3",
                 "fp8_e4m3fn": "fp8_e4m3"}
_SCALE_BYTES = 2  # fp16


def kv_dtype(name: str) -> KVDtype:
    """The storage format called `name` (aliases: fp32, bf16, fp16, fp8). Raises with the supported list."""
    spec = KV_DTYPES.get(DTYPE_ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"unknown KV cache dtype {name!r}; supported: {', '.join(KV_DTYPES)} "
                         f"(aliases {', '.join(DTYPE_ALIASES)})")
    return spec


def default_block_size(dtype: str) -> int:
    """Tokens per block when none is asked for: 16, or one KIVI key group (64) for int4/int2, whose groups
    must not straddle blocks."""
    return max(DEFAULT_BLOCK_SIZE, kv_dtype(dtype).group)


def _tensor_bytes(d: int, spec: KVDtype, key: bool) -> int:
    """Bytes per token of one head's `d` cached values, scales included."""
    data = d * spec.bits // 8
    if spec.scales == "per-token-head":
        return data + _SCALE_BYTES
    if spec.scales == "kivi":
        if key:  # one scale + zero per channel per `group` tokens, amortized per token
            if (d * 2 * _SCALE_BYTES) % spec.group:
                raise ValueError(f"{spec.name} needs head_dim x 4 divisible by {spec.group}, got head_dim {d}")
            return data + d * 2 * _SCALE_BYTES // spec.group
        return data + math.ceil(d / spec.group) * 2 * _SCALE_BYTES
    return data


def heads_per_gpu(kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads each GPU stores: split across tensor-parallel ranks, replicated (not split) below one per rank."""
    tp = tensor_parallel_size
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} must divide the {kv_heads} KV heads or be a multiple of them")
    return max(1, kv_heads // tp)


def layer_bytes_per_token(shape: ModelShape, dtype: str, kind: str, tensor_parallel_size: int = 1) -> int:
    """Bytes one token costs in one layer of `kind` (on one GPU under tensor parallelism)."""
    spec = kv_dtype(dtype)
    if kind == "linear":
        return 0
    if kind == "mla":  # the latent is replicated on every tensor-parallel rank
        return _tensor_bytes(shape.kv_lora_rank + shape.qk_rope_head_dim, spec, key=False)
    heads = heads_per_gpu(shape.num_kv_heads, tensor_parallel_size)
    return heads * (_tensor_bytes(shape.head_dim, spec, key=True) + _tensor_bytes(shape.head_dim, spec, key=False))


def kv_bytes_per_token(shape: ModelShape, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes one token occupies in the cache across all attention layers (scales included).

    This is what a paged pool charges per token slot: every attention layer stores the token (a sliding-window
    layer only while it is in the window: kvcache's pool gives back out-of-window blocks only where every layer
    slides with one window, see `paged_window`).
    """
    return sum(layer_bytes_per_token(shape, dtype, k, tensor_parallel_size) for k in shape.layer_kinds)


def mha_equivalent_bytes_per_token(shape: ModelShape, dtype: str) -> int | None:
    """What an MLA model's tokens would cost cached expanded, as multi-head attention: every head's key
    (qk_nope_head_dim + qk_rope_head_dim) and value (v_head_dim) in every MLA layer. None for other models."""
    n = shape.count("mla")
    if not n:
        return None
    spec = kv_dtype(dtype)
    per_head = _tensor_bytes(shape.qk_nope_head_dim + shape.qk_rope_head_dim, spec, key=True) \
        + _tensor_bytes(shape.v_head_dim, spec, key=False)
    return n * shape.num_attention_heads * per_head


def residual_bytes_per_seq(shape: ModelShape, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes of the fp16 buffer holding a sequence's newest keys until their quantization group fills (KIVI).

    MLA latents are quantized per token like values, so they need no residual.
    """
    spec = kv_dtype(dtype)
    layers = shape.count("full") + shape.count("sliding")
    if not spec.residual_tokens or not layers:
        return 0
    heads = heads_per_gpu(shape.num_kv_heads, tensor_parallel_size)
    return spec.residual_tokens * layers * heads * shape.head_dim * 2


def state_bytes_per_seq(shape: ModelShape, state_dtype: str = "bfloat16", tensor_parallel_size: int = 1) -> int:
    """Constant state of the linear-attention / state-space layers for one request (heads split by TP)."""
    if not shape.linear_state_values:
        return 0
    per_layer = shape.linear_state_values // min(tensor_parallel_size, max(1, shape.linear_heads))
    return shape.count("linear") * per_layer * kv_dtype(state_dtype).bits // 8


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers of one kind that cost the same per token."""

    kind: str
    count: int
    bytes_per_token: int  # per layer
    window: int | None  # tokens cached at most; None = all


def paged_window(shape: ModelShape) -> int | None:
    """The window whose tokens alone kvcache's paged pool keeps per sequence: where every attention layer slides
    with that one window (one block table serves all layers, so a full-attention layer keeps every block); None
    where it keeps every token. The pool holds whole blocks: up to one block more, before the window's first."""
    kinds = {k for k in shape.layer_kinds if k != "linear"}
    return shape.layer_window("sliding") if kinds == {"sliding"} else None


@dataclass(frozen=True, slots=True)
class TableGroup:
    """Layers that share one block table per sequence in kvcache's pool (vLLM's KV cache groups): every group has
    the same number of layers, so one block of the pool holds `len(layers)` layers' K/V for `block_size` tokens,
    whichever group it is lent to. `window`: the group's sliding window (None: full attention, every block kept)."""

    window: int | None
    layers: tuple[int, ...]


def table_groups(shape: ModelShape) -> list[TableGroup]:
    """The per-layer-group block tables of a model that mixes full-attention and sliding-window layers (Gemma-2,
    Gemma-3): each kind's layers, in order (full attention first), cut into groups of G layers, G the greatest
    common divisor of the kinds' layer counts (no group padded: a block is exactly G layers). [] where one table
    serves every layer (one kind of attention: full, MLA, or every layer sliding with one window, see
    `paged_window`)."""
    if set(shape.layer_kinds) != {"full", "sliding"}:
        return []
    kinds = ["full", "sliding"]  # full groups first: the engine's first table has a block for every position
    size = math.gcd(*(shape.count(k) for k in kinds))
    groups = []
    for kind in kinds:
        layers = [i for i, k in enumerate(shape.layer_kinds) if k == kind]
        groups += [TableGroup(shape.layer_window(kind), tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
    return groups


def group_blocks(window: int | None, num_tokens: int, block_size: int) -> int:
    """Blocks one group's table holds at most for a sequence of `num_tokens` tokens: all of them, or with a window
    the window's and one more (the block before the window's first token is partly inside it)."""
    every = -(-num_tokens // block_size)
    return every if window is None else min(every, -(-window // block_size) + 1)


def longest_tokens(shape: ModelShape, blocks: int, block_size: int) -> int:
    """The longest sequence (tokens, whole blocks) whose tables fit in `blocks` blocks: every table holds one
    block per `block_size` tokens (one table), or with table_groups each group its own (sliding groups capped)."""
    groups = table_groups(shape)
    if not groups:
        return max(0, blocks) * block_size
    lo, hi = 0, max(0, blocks)  # in blocks of the full groups' tables
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(group_blocks(g.window, mid * block_size, block_size) for g in groups) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size


def check_latent_format(dtype: str) -> None:
    """ValueError unless `dtype` can store an MLA latent: KIVI (int4, int2) quantizes keys and values differently."""
    spec = kv_dtype(dtype)
    if spec.scales == "kivi":
        raise ValueError(f"kv_cache_dtype {spec.name} (KIVI) quantizes keys per channel over {spec.group}-token groups "
                         "and values per token; an MLA latent is both at once: use fp8 or int8 (one scale per token "
                         "for the latent and its RoPE key)")


def layer_groups(shape: ModelShape, dtype: str, tensor_parallel_size: int = 1) -> list[LayerGroup]:
    """The attention layers grouped by kind, in first-appearance order."""
    groups = []
    for kind in dict.fromkeys(k for k in shape.layer_kinds if k != "linear"):
        groups.append(LayerGroup(kind, shape.count(kind), layer_bytes_per_token(shape, dtype, kind, tensor_parallel_size),
                                 shape.layer_window(kind)))
    return groups


@dataclass(frozen=True, slots=True)
class CacheBytes:
    """Exact cache bytes for `batch` sequences of `seq_len` tokens."""

    batch: int
    seq_len: int
    attention_bytes: int  # per-token K/V (or MLA latent), sliding layers capped at their window
    residual_bytes: int  # fp16 buffers of quantization residuals (int4/int2)
    state_bytes: int  # linear-attention / SSM state
    total_bytes: int
    paged_bytes: int  # what kvcache's paged pool holds (paged_window: every token, or the window's)


def kv_cache_bytes(shape: ModelShape, dtype: str, batch: int, seq_len: int, tensor_parallel_size: int = 1,
                   state_dtype: str = "bfloat16") -> CacheBytes:
    """Cache of `batch` x `seq_len` tokens, counted layer by layer."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be positive, got batch={batch}, seq_len={seq_len}")
    tp = tensor_parallel_size
    attn = sum(g.count * g.bytes_per_token * min(seq_len, g.window or seq_len) for g in layer_groups(shape, dtype, tp))
    attn *= batch
    residual = batch * residual_bytes_per_seq(shape, dtype, tp)
    state = batch * state_bytes_per_seq(shape, state_dtype, tp)
    if table_groups(shape):  # a table per layer group: each holds its own window's tokens
        paged = attn + residual + state
    else:
        held = min(seq_len, paged_window(shape) or seq_len)
        paged = batch * held * kv_bytes_per_token(shape, dtype, tp) + residual + state
    return CacheBytes(batch, seq_len, attn, residual, state, attn + residual + state, paged)


def _term(d: int, spec: KVDtype, key: bool) -> str:
    """One head's bytes per token as a formula: '128 x 2' or '(64 + 4 scale)'."""
    if spec.scales == "none":
        return f"{d} x {spec.bits // 8}"
    data = d * spec.bits // 8
    return f"({data} + {_tensor_bytes(d, spec, key) - data} scale)"


def kv_formula(shape: ModelShape, dtype: str, tensor_parallel_size: int = 1) -> str:
    """Bytes per token with this model's numbers substituted, for logs and reports."""
    spec = kv_dtype(dtype)
    heads = heads_per_gpu(shape.num_kv_heads, tensor_parallel_size)
    terms = []
    for g in layer_groups(shape, dtype, tensor_parallel_size):
        if g.kind == "mla":
            what = f"({shape.kv_lora_rank} latent + {shape.qk_rope_head_dim} rope) values x {spec.bits / 8:g} bytes"
            if spec.scales != "none":
                what = f"{_term(shape.kv_lora_rank + shape.qk_rope_head_dim, spec, False)} bytes"
        elif spec.scales == "none":
            what = f"2 x {heads} kv_heads x {shape.head_dim} head_dim x {spec.bits // 8} bytes"
        else:
            what = (f"{heads} kv_heads x (K {_term(shape.head_dim, spec, True)} + "
                    f"V {_term(shape.head_dim, spec, False)}) bytes")
        terms.append(f"{g.count} {g.kind} layers x {what} = {g.count * g.bytes_per_token:,}")
    total = kv_bytes_per_token(shape, dtype, tensor_parallel_size)
    if not terms:
        return "no layer stores K/V: 0 bytes/token"
    return (" + ".join(terms) if len(terms) > 1 else terms[0].rsplit(" = ", 1)[0]) + f" = {total:,} bytes/token"


@dataclass(frozen=True, slots=True)
class CacheCapacity:
    """How a KV budget divides into blocks and tokens."""

    bytes_per_token: int
    block_size: int  # tokens per block
    num_blocks: int
    num_tokens: int
    total_bytes: int  # bytes the blocks take
    max_model_len: int
    max_concurrency: float  # requests of max_model_len tokens that fit at once
    seq_blocks: int = 0  # blocks each request also needs for its per-sequence buffers (residual keys, state)
    blocks_per_request: int = 0  # blocks one request of max_model_len tokens holds at most, seq_blocks included
    layers_per_block: int = 0  # with per-layer-group tables (table_groups): the layers one block holds; 0: all
    state_slots: int = 0  # sequences whose linear-attention / SSM state the state pool holds (0: no such pool)
    state_bytes: int = 0  # that pool's bytes (beside total_bytes, the blocks')


def pool_tokens(num_blocks: int, block_size: int, layers_per_block: int, num_layers: int) -> str:
    """'N blocks x B tokens = T tokens'; where a block holds one layer group's layers (per-layer-group tables), the
    tokens of every layer that many blocks hold (a token takes a block slot in each group's table)."""
    slots = num_blocks * block_size
    if not layers_per_block or layers_per_block >= num_layers:
        return f"{num_blocks:,} blocks x {block_size} tokens = {slots:,} tokens"
    return (f"{num_blocks:,} blocks x {block_size} tokens x {layers_per_block} of the {num_layers} layers = "
            f"{slots * layers_per_block // num_layers:,} tokens of every layer")


def sequence_blocks(shape: ModelShape, dtype: str, block_size: int, tensor_parallel_size: int = 1,
                    state_dtype: str | None = "bfloat16") -> int:
    """Blocks' worth of memory a request needs besides its tokens: quantization residual and linear-layer state
    (not the state where `state_dtype` is None: a pool of its own holds it)."""
    block_bytes = kv_bytes_per_token(shape, dtype, tensor_parallel_size) * block_size
    extra = residual_bytes_per_seq(shape, dtype, tensor_parallel_size)
    if state_dtype is not None:
        extra += state_bytes_per_seq(shape, state_dtype, tensor_parallel_size)
    return -(-extra // block_bytes) if block_bytes else 0


def check_kv_format(shape: ModelShape, dtype: str, block_size: int, tensor_parallel_size: int = 1) -> int:
    """Bytes per token of `dtype` on `shape`; ValueError if the format cannot store this model in blocks of
    `block_size` (a KIVI group straddling blocks, a head_dim the codec cannot pack)."""
    group = kv_dtype(dtype).group
    if group and block_size % group:
        raise ValueError(f"{kv_dtype(dtype).name} quantizes keys in groups of {group} tokens inside one block: "
                         f"block_size must be a multiple of {group}, got {block_size}")
    return kv_bytes_per_token(shape, dtype, tensor_parallel_size)


def cache_capacity(shape: ModelShape, dtype: str, budget_bytes: int, block_size: int, max_model_len: int,
                   tensor_parallel_size: int = 1, state_dtype: str = "bfloat16", release: bool = True,
                   groups: list[TableGroup] | None = None, state_slots: int = 0,
                   running_slots: int = 0) -> CacheCapacity:
    """Blocks, tokens and concurrency a budget of `budget_bytes` buys. Raises if not even one block fits.

    A request of L tokens takes ceil(L / block_size) blocks plus `sequence_blocks` for its
    per-sequence buffers, drawn from the same pool; where every layer slides with one window (paged_window), a
    decoding request holds that window's blocks and one more at most, however long it grows. A model mixing full
    and sliding layers (table_groups) has one table per layer group: a block holds one group's layers, and a
    request holds ceil(L / block_size) blocks in each full group's table and the window's in each sliding one's.
    Not `release` (the engine keeps every block: the radix prefix cache, or a feature that needs one table): one
    table of every layer, every block kept. `groups` gives the engine's layer groups where they are not the
    model's own (PyramidKV's one table per layer: every block kept until eviction frees some).
    `state_slots` (the engine's way with linear-attention / SSM layers): their state lives in a pool of that many
    sequences' states, taken from the budget first (the first `running_slots` of them for running sequences, the
    rest for snapshots; 0: all running); the blocks are bought with the rest, and at most `running_slots` requests
    run at once. A model of such layers only stores nothing per token: its blocks are bookkeeping (0 bytes), as many
    as that many requests of max_model_len tokens hold.
    """
    tp = tensor_parallel_size
    per_token = check_kv_format(shape, dtype, block_size, tp)
    if state_slots:
        return _capacity_with_state_pool(shape, dtype, budget_bytes, block_size, max_model_len, tp, state_dtype,
                                         state_slots, running_slots or state_slots)
    if groups is None:  # KIVI's fp16 key residual needs one table of every layer, as the engine keeps
        groups = table_groups(shape) if release and kv_dtype(dtype).scales != "kivi" else []
    if groups:  # a block holds one group's layers; a token costs that in each group's table
        per_token = sum(layer_bytes_per_token(shape, dtype, shape.layer_kinds[i], tp) for i in groups[0].layers)
    block_bytes = per_token * block_size
    num_blocks = budget_bytes // block_bytes if block_bytes else 0
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes:,} bytes is smaller than one block "
                         f"({block_size} tokens x {per_token:,} bytes = {block_bytes:,} bytes)")
    extra = sequence_blocks(shape, dtype, block_size, tp, state_dtype)
    if groups:
        blocks_per_request = sum(group_blocks(g.window, max_model_len, block_size) for g in groups) + extra
    else:
        blocks_per_request = group_blocks(paged_window(shape) if release else None, max_model_len, block_size) + extra
    return CacheCapacity(per_token, block_size, num_blocks, num_blocks * block_size, num_blocks * block_bytes,
                         max_model_len, num_blocks / blocks_per_request, extra, blocks_per_request,
                         len(groups[0].layers) if groups else 0)


def state_pool_bytes(shape: ModelShape, state_slots: int, state_dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes of a pool of `state_slots` sequences' linear-attention / SSM state."""
    return state_slots * state_bytes_per_seq(shape, state_dtype, tensor_parallel_size)


def _capacity_with_state_pool(shape: ModelShape, dtype: str, budget_bytes: int, block_size: int, max_model_len: int,
                              tp: int, state_dtype: str, state_slots: int, running: int) -> CacheCapacity:
    """cache_capacity where the state has a pool of its own (see there)."""
    state = state_pool_bytes(shape, state_slots, state_dtype, tp)
    per_token = kv_bytes_per_token(shape, dtype, tp)
    if budget_bytes <= state:
        raise ValueError(f"KV cache budget of {budget_bytes:,} bytes does not hold the state of {state_slots} "
                         f"sequences ({state_slots} x {state_bytes_per_seq(shape, state_dtype, tp):,} bytes = "
                         f"{state:,} bytes): raise it, or lower --max-num-seqs (or --num-state-snapshots)")
    extra = sequence_blocks(shape, dtype, block_size, tp, None)
    per_request = group_blocks(None, max_model_len, block_size) + extra
    if per_token:
        num_blocks = (budget_bytes - state) // (per_token * block_size)
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget_bytes:,} bytes holds the state of {state_slots} sequences "
                             f"({state:,} bytes) but no block beside it ({block_size} tokens x {per_token:,} bytes)")
    else:
        num_blocks = running * per_request
    return CacheCapacity(per_token, block_size, num_blocks, num_blocks * block_size, num_blocks * block_size * per_token,
                         max_model_len, min(num_blocks / per_request, running), extra, per_request, 0,
                         state_slots, state)
