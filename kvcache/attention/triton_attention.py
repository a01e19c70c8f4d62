"""Triton kernels for attention over the paged KV store (the CUDA backend; tested on CPU under TRITON_INTERPRET=1).

- `paged_decode`: one query token per sequence, K/V read straight from the store through the block table, online
  softmax in float32, GQA-aware (a program serves all the query heads of one KV head, so each K/V load is shared),
  split-K over long contexts with a reduction kernel (each sequence's own live blocks shared among the splits, so
  that the launch depends on the batch size and the table's width only: CUDA graphs replay it), sliding windows and
  per-layer dead blocks (the caller passes that layer's table and lengths). Tiles of 64 tokens (16 query-head
  rows) on the tensor cores. Reads float32/bf16/fp16 blocks, and fp8/int8 blocks as their codes (bitcast in
  registers, exact in bf16/fp16) with the per-token fp16 scales multiplying the products.
- `paged_prefill`: a chunk of a sequence's prompt attending, causally, to everything cached before it plus
  itself (its K/V are written first), tiles of queries sharing each K/V load (tl.dot), for chunked prefill and
  prefix-cache hits.
- `write_quantized`: the step's new K/V quantised (fp8/int8, one fp16 scale per token and KV head, the codecs'
  arithmetic) and scattered into their slots in one kernel. (Triton's CPU interpreter converts to fp8 wrongly
  near powers of two, so the fp8 variant is checked against the codec on a GPU only.)

KIVI (int4/int2) stores are not read here: the backend sends them to the portable PyTorch path (stated at
start-up). Block sizes of at least 16 are needed by tl.dot for the prefill kernel; smaller ones take that path too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (the tests' way to run these kernels without a GPU) gives wrong results for bfloat16
# tl.dot operands (seen with triton 3.9): there the prefill kernel takes its products in float32, as for float32 models.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The running max starts here, not at -inf, so that a tile with every score masked stays finite; a constexpr, as
# every global a kernel reads must be (the interpreter reads any, the compiler refuses the rest)
NEG = tl.constexpr(-1.0e30)
MIN_BLOCKS_PER_SPLIT = 16  # a split-K part reads at least this many blocks of its sequence


@triton.jit
def _softcap(scores, cap):
    """cap * tanh(scores / cap) (Gemma-2's attn_logit_softcapping), tanh from exp of -2|x|: no overflow."""
    x = scores / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x >= 0, t, -t)


@triton.jit
def _load_tile(x_ptr, raw16_ptr, phys, off, kh, d, tmask, dmask, row_bytes, data_off, scale_off,
               BS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, QUANT: tl.constexpr):
    """K or V of BLOCK_N tokens, token i at slot off[i] of physical block phys[i], KV head kh, channels d:
    [BLOCK_N, BLOCK_D] values (a quantized store's codes as their values, unscaled, float32) and, for a
    quantized store, the tokens' scales [BLOCK_N] (ones otherwise): the scores' dot product takes K's codes and
    the scales multiply its results; V is scaled in registers. QUANT: 0 a full-precision store, 1 fp8 e4m3 codes,
    2 fp8 e5m2, 3 int8 (each value exact in bf16 and fp16), converted by bitcast in registers (a 256-entry table
    gathered per value reached a small fraction of the memory bandwidth on the GPU measured: docs/kernels.md)."""
    m = tmask[:, None] & dmask[None, :]
    if QUANT > 0:
        codes = tl.load(x_ptr + phys[:, None] * row_bytes + data_off + (off[:, None] * KVH + kh) * D + d[None, :],
                        mask=m, other=0)
        if QUANT == 1:
            x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif QUANT == 2:
            x = codes.to(tl.float8e5, bitcast=True).to(tl.float32)
        else:
            x = codes.to(tl.int8, bitcast=True).to(tl.float32)
        scales = tl.load(raw16_ptr + phys * (row_bytes // 2) + scale_off + off * KVH + kh, mask=tmask,
                         other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + ((phys[:, None] * BS + off[:, None]) * KVH + kh) * D + d[None, :], mask=m, other=0.0)
        scales = tl.full([x.shape[0]], 1.0, tl.float32)
    return x, scales


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, raw16_ptr, table_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
                   table_stride, row_bytes, kd_off, vd_off, ks_off, vs_off, scale, window, min_per_split, softcap,
                   H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                   SPLIT: tl.constexpr, F32_DOT: tl.constexpr):
    """Sequence program_id(0), KV head program_id(1), split program_id(2): its G query heads (rows of a
    [BLOCK_G >= 16, D] tile, the rest zero) over tiles of BLOCK_N tokens (BLOCK_N / BS blocks, each token's block
    looked up in the table), scores and outputs on the tensor cores (tl.dot), online softmax in float32."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    nb = (ctx + BS - 1) // BS
    lo = nb * 0  # the first block a query can see
    if window > 0:
        lo = tl.maximum(ctx - window, 0) // BS
    # The sequence's own live blocks, split among the split-K programs (at least min_per_split each): the launch
    # depends on the batch and the table's width only, never on this step's lengths (a CUDA graph replays it)
    nsplit = tl.num_programs(2)
    per = tl.maximum((nb - lo + nsplit - 1) // nsplit, min_per_split)
    first = lo + s * per
    last = tl.minimum(first + per, nb)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    dmask = d < D
    heads = kh * G + g
    q = tl.load(q_ptr + (b * H + heads[:, None]) * D + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], NEG, tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    n = tl.arange(0, BLOCK_N)
    for b0 in range(first, last, BLOCK_N // BS):
        pos = b0 * BS + n
        blk = pos // BS
        valid = (blk < last) & (pos < ctx)
        if window > 0:
            valid = valid & (pos >= ctx - window)
        phys = tl.load(table_ptr + b * table_stride + blk, mask=blk < last, other=0)
        off = pos % BS
        k, kscale = _load_tile(k_ptr, raw16_ptr, phys, off, kh, d, valid, dmask, row_bytes, kd_off, ks_off,
                               BS, KVH, D, QUANT)
        v, vscale = _load_tile(v_ptr, raw16_ptr, phys, off, kh, d, valid, dmask, row_bytes, vd_off, vs_off,
                               BS, KVH, D, QUANT)
        if F32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)))
        if QUANT > 0:  # a constexpr: a full-precision store's path has no scales to apply
            scores = scores * (kscale * scale)[None, :]  # [BLOCK_G, BLOCK_N]
        else:
            scores = scores * scale
        if softcap > 0:
            scores = _softcap(scores, softcap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # V dequantized in registers, not its scale folded into p: p times a small scale (fp8_e5m2's are ~1e-4)
        # underflows float16 over long contexts
        if QUANT > 0:
            v = v.to(tl.float32) * vscale[:, None]
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        row = (b * H + heads) * nsplit + s  # [BLOCK_G]
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=omask)
        tl.store(ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + (b * H + heads[:, None]) * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _reduce_kernel(acc_ptr, ml_ptr, out_ptr, S, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Combine the split-K parts of one (sequence, head) row: their maxima, sums and unnormalised outputs."""
    row = tl.program_id(0)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = sp < S
    m = tl.load(ml_ptr + (row * S + sp) * 2, mask=smask, other=NEG)
    l = tl.load(ml_ptr + (row * S + sp) * 2 + 1, mask=smask, other=0.0)
    acc = tl.load(acc_ptr + (row * S + sp[:, None]) * D + d[None, :], mask=smask[:, None] & (d[None, :] < D),
                  other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, raw16_ptr, table_ptr, out_ptr, row0, n, ctx, row_bytes, kd_off,
                    vd_off, ks_off, vs_off, scale, window, softcap, H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr,
                    D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_D: tl.constexpr, QUANT: tl.constexpr, F32_DOT: tl.constexpr):
    """Queries `row0 + [tile * BLOCK_M, ...)` (chunk rows < n; position ctx - n + i) of one KV head's G query heads,
    as one [BLOCK_M * BLOCK_G, D] tile, over the sequence's blocks up to the tile's last position."""
    tile = tl.program_id(0)
    kh = tl.program_id(1)
    idx = tl.arange(0, BLOCK_M * BLOCK_G)
    i = tile * BLOCK_M + idx // BLOCK_G
    g = idx % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    rmask = (i < n) & (g < G)
    dmask = d < D
    qpos = ctx - n + i
    q = tl.load(q_ptr + ((row0 + i[:, None]) * H + kh * G + g[:, None]) * D + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M * BLOCK_G], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    last_pos = tl.minimum(ctx - n + tile * BLOCK_M + BLOCK_M, ctx)  # one past the tile's last query position
    first = 0
    if window > 0:
        first = tl.maximum(ctx - n + tile * BLOCK_M - window + 1, 0) // BS
    t = tl.arange(0, BS)
    for blk in range(first, (last_pos + BS - 1) // BS):
        phys = tl.load(table_ptr + blk)
        kpos = blk * BS + t
        kvalid = kpos < ctx
        phys = phys + t * 0  # the block of each of its tokens, as _load_tile takes them
        k, ks = _load_tile(k_ptr, raw16_ptr, phys, t, kh, d, kvalid, dmask, row_bytes, kd_off, ks_off, BS, KVH, D,
                           QUANT)
        v, vs = _load_tile(v_ptr, raw16_ptr, phys, t, kh, d, kvalid, dmask, row_bytes, vd_off, vs_off, BS, KVH, D,
                           QUANT)
        if QUANT > 0:
            k = k.to(tl.float32) * ks[:, None]
            v = v.to(tl.float32) * vs[:, None]
        k, v = k.to(q.dtype), v.to(q.dtype)
        if F32_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if softcap > 0:
            scores = _softcap(scores, softcap)
        ok = (kpos[None, :] <= qpos[:, None]) & kvalid[None, :]
        if window > 0:
            ok = ok & (qpos[:, None] - kpos[None, :] < window)
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + ((row0 + i[:, None]) * H + kh * G + g[:, None]) * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _write_quant_kernel(x_ptr, slot_ptr, raw_ptr, raw16_ptr, row_bytes, data_off, scale_off, qmax,
                        KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_D: tl.constexpr,
                        FP8: tl.constexpr, FP8_E5M2: tl.constexpr):
    """Token `program_id(0)`, KV head `program_id(1)`: amax scale (rounded to fp16, floored at fp16's smallest
    normal), codes, both stored at the token's slot, as store/codecs.py's quantize_per_token does."""
    tok = tl.program_id(0)
    kh = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    x = tl.load(x_ptr + (tok * KVH + kh) * D + d, mask=dmask, other=0.0).to(tl.float32)
    # Divisions rounded as IEEE's (div_rn): Triton's `/` is the GPU's approximate division, off by an ulp, which
    # changes a code now and then against the torch codec
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), qmax), 6.103515625e-05).to(tl.float16)
    y = tl.math.div_rn(x, scale.to(tl.float32))
    slot = tl.load(slot_ptr + tok)
    blk = slot // BS
    off = slot % BS
    if FP8:
        if FP8_E5M2:
            codes = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        else:
            codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        r = tl.floor(y + 0.5)  # round half to even, as torch.round does
        r = tl.where(((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
        codes = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8).to(tl.uint8, bitcast=True)
    tl.store(raw_ptr + blk * row_bytes + data_off + (off * KVH + kh) * D + d, codes, mask=dmask)
    tl.store(raw16_ptr + blk * (row_bytes // 2) + scale_off + off * KVH + kh, scale)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _store_args(store, layer: int) -> tuple:
    """(k, v, raw as fp16, row bytes, K code offset, V code offset, K scale offset, V scale offset, QUANT) of a
    layer: offsets in bytes for codes, in fp16 elements for scales; dummies for a full-precision store. QUANT is
    _load_tile's: 0 full precision, 1 fp8 e4m3, 2 fp8 e5m2, 3 int8."""
    if store.exact or not hasattr(store, "raw"):
        k, v = store.k[layer], store.v[layer]
        return k, v, k, 0, 0, 0, 0, 0, 0
    raw = store.raw[layer]
    kd, vd, ks, vs = store.offsets[:4]
    code = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}[store.dtype]
    return raw, raw, raw.view(torch.float16), store.row_bytes, kd, vd, ks // 2, vs // 2, code


def paged_decode(out: torch.Tensor, q: torch.Tensor, store, layer: int, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None, num_splits: int | None = None,
                 softcap: float | None = None) -> None:
    """out[b] ([B, H, D]) = attention of q[b] over the first context_lens[b] tokens of block_tables[b] in `layer`
    of `store` (a full-precision KVStore, or a per-token fp8/int8 QuantizedKVStore); scores soft-capped with
    `softcap`."""
    B, H, D = q.shape
    KVH = store.num_kv_heads if hasattr(store, "num_kv_heads") else store.k[layer].shape[2]
    G = H // KVH
    bs = store.block_size
    k, v, raw16, row_bytes, kd, vd, ks, vs, quant = _store_args(store, layer)
    q = q.contiguous()
    table = block_tables.contiguous()
    per_split = 1  # asked for a number of splits (the tests): each takes its share of a sequence, however small
    if num_splits is None:
        num_splits, per_split = _num_splits(B * KVH, table.shape[1], q.device), MIN_BLOCKS_PER_SPLIT
    # tl.dot wants every side >= 16: the G query heads of a KV head are a tile of at least 16 rows (the rest
    # zero, free where decode waits on memory); tiles of 64 tokens (fewer for wide heads, to stay in registers)
    block_d = max(16, _pow2(D))
    block_n = max(16, bs, min(64, 8192 // block_d))
    args = dict(H=H, KVH=KVH, G=G, D=D, BS=bs, BLOCK_G=max(16, _pow2(G)), BLOCK_D=block_d, BLOCK_N=block_n,
                QUANT=quant, F32_DOT=q.dtype == torch.float32 or INTERPRETED)
    if num_splits == 1:
        _decode_kernel[(B, KVH, 1)](q, k, v, raw16, table, context_lens, out, out, out, table.stride(0),
                                    row_bytes, kd, vd, ks, vs, scale, window or 0, per_split, softcap or 0.0,
                                    SPLIT=False, **args)
        return
    acc = torch.empty(B * H * num_splits, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * H * num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(B, KVH, num_splits)](q, k, v, raw16, table, context_lens, out, acc, ml, table.stride(0),
                                         row_bytes, kd, vd, ks, vs, scale, window or 0, per_split, softcap or 0.0,
                                         SPLIT=True, **args)
    # the number of splits a runtime argument: eager steps' table widths vary it, each would compile anew
    _reduce_kernel[(B * H,)](acc, ml, out, num_splits, D=D, BLOCK_S=_pow2(num_splits), BLOCK_D=_pow2(D))


def _num_splits(programs: int, max_blocks: int, device: torch.device) -> int:
    """Split long contexts so that at least four programs run per streaming multiprocessor: decode waits on
    memory, and only programs in flight keep loads in flight."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-4 * sms // max(1, programs)), max_blocks // MIN_BLOCKS_PER_SPLIT))


def paged_prefill(out: torch.Tensor, q: torch.Tensor, store, layer: int, block_table: torch.Tensor, row0: int,
                  n: int, context_len: int, scale: float, window: int | None, softcap: float | None = None) -> None:
    """out[row0:row0+n] = causal attention of those query rows (positions context_len - n ...) over the first
    context_len tokens of `block_table` (the chunk's own K/V already written); scores soft-capped with `softcap`."""
    H, D = q.shape[1], q.shape[2]
    if not (q.is_contiguous() and out.is_contiguous()):
        raise ValueError("paged_prefill indexes q and out as contiguous [T, H, D] tensors")
    KVH = store.num_kv_heads if hasattr(store, "num_kv_heads") else store.k[layer].shape[2]
    G = H // KVH
    k, v, raw16, row_bytes, kd, vd, ks, vs, quant = _store_args(store, layer)
    block_g = _pow2(G)
    block_m = max(1, 64 // block_g)  # 64 query rows (tokens x heads of this KV head) share each K/V load
    _prefill_kernel[(-(-n // block_m), KVH)](
        q, k, v, raw16, block_table, out, row0, n, context_len, row_bytes, kd, vd, ks, vs, scale, window or 0,
        softcap or 0.0, H=H, KVH=KVH, G=G, D=D, BS=store.block_size, BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_D=_pow2(D),
        QUANT=quant, F32_DOT=q.dtype == torch.float32 or INTERPRETED)


def write_quantized(store, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantise k, v ([T, KVH, D]) into a per-token fp8/int8 QuantizedKVStore layer at `slot_mapping`."""
    T, KVH, D = k.shape
    if T == 0:
        return
    raw = store.raw[layer]
    kd, vd, ks, vs = store.offsets[:4]
    fp8 = store.dtype.startswith("fp8")
    qmax = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}.get(store.dtype, 127.0)
    for x, data, sc in ((k, kd, ks),) if store.latent else ((k, kd, ks), (v, vd, vs)):  # a latent: V is K
        _write_quant_kernel[(T, KVH)](x.contiguous(), slot_mapping, raw, raw.view(torch.float16), store.row_bytes, data,
                                      sc // 2, qmax, KVH=KVH, D=D, BS=store.block_size, BLOCK_D=_pow2(D), FP8=fp8,
                                      FP8_E5M2=store.dtype == "fp8_e5m2")
