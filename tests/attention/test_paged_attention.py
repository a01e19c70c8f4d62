"""paged_attention over a KVStore filled through build_batch's slot mapping, against a float64 reference."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from paged_kv import random_paged_kv

from kvcache.attention import cpu_kernel
from kvcache.attention.metadata import SeqChunk, build_batch
from kvcache.attention.paged import Workspace, paged_attention
from kvcache.store.kv_store import KVStore


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
              window: int | None, softcap: float | None = None) -> torch.Tensor:
    """softmax(QK^T * scale + mask) V in float64 for one sequence, the scores soft-capped (c tanh(s / c)) first
    with `softcap`.

    q [n, H, D] at positions [start, start + n); k, v [start + n, KVH, D] the whole history.
    """
    n, H, D = q.shape
    L, KVH, _ = k.shape
    rep = H // KVH
    qd = q.double().transpose(0, 1)  # [H, n, D]
    kd = k.double().repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, L, D]
    vd = v.double().repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = qd @ kd.transpose(1, 2) * scale  # [H, n, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(L)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (q_pos - k_pos) < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vd).transpose(0, 1)  # [n, H, D]


def run_case(seqs: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, head_dim: int,
             window: int | None, seed: int, windows_in_batch: tuple[int | None, ...] | None = None,
             spare_blocks: int = 3, kernel: bool = False, softcap: float | None = None):
    """Fill a store with each sequence's cached K/V, then attend one step of new tokens.

    `seqs` is a list of (cached tokens, new tokens). Returns (paged output, reference output, batch).
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = 1 + sum(need) + spare_blocks
    perm = list(range(1, num_blocks))
    rng.shuffle(perm)  # scattered, non-monotonic block tables; block 0 (null) never used
    tables, at = [], 0
    for k in need:
        tables.append(perm[at:at + k])
        at += k
    store = KVStore(1, num_blocks, block_size, kv_heads, head_dim)
    # Poison every slot with large finite values, so that attending to a slot not written for
    # this sequence breaks the result (finite: masked-out padding may be read, weighted 0).
    store.k[0][1:] = 1e3
    store.v[0][1:] = 1e4
    hist_k = [torch.randn(c + n, kv_heads, head_dim, generator=g) for c, n in seqs]
    hist_v = [torch.randn(c + n, kv_heads, head_dim, generator=g) for c, n in seqs]
    qs = [torch.randn(n, heads, head_dim, generator=g) for c, n in seqs]

    # the cached prefix of each sequence goes in through build_batch's own slot mapping
    pre = [SeqChunk([0] * c, 0, t) for (c, n), t in zip(seqs, tables) if c > 0]
    if pre:
        pb = build_batch(pre, block_size)
        store.write(0, pb.slot_mapping, torch.cat([hk[:c] for hk, (c, _) in zip(hist_k, seqs) if c > 0]),
                    torch.cat([hv[:c] for hv, (c, _) in zip(hist_v, seqs) if c > 0]))

    windows = windows_in_batch if windows_in_batch is not None else (window,)
    chunks = [SeqChunk([5] * n, c, t) for (c, n), t in zip(seqs, tables)]
    batch = build_batch(chunks, block_size, windows, decode_kernel=kernel)
    k_new = torch.cat([hk[c:] for hk, (c, _) in zip(hist_k, seqs)])
    v_new = torch.cat([hv[c:] for hv, (c, _) in zip(hist_v, seqs)])
    q = torch.cat(qs)
    store.write(0, batch.slot_mapping, k_new, v_new)
    scale = head_dim ** -0.5
    out = paged_attention(q, k_new, v_new, store, 0, batch, scale, window, Workspace(), softcap=softcap)
    ref = torch.cat([reference(qi, hk, hv, c, scale, window, softcap)
                     for qi, hk, hv, (c, _) in zip(qs, hist_k, hist_v, seqs)])
    return out, ref, batch


seq_strategy = st.tuples(
    st.integers(0, 40),  # cached tokens
    st.one_of(st.just(1), st.integers(1, 20)),  # new tokens; 1 with a cache is a decode row
)
head_configs = st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3), (8, 1), (2, 2)])  # MHA, GQA, MQA


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(seq_strategy, min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4, 8, 16]),
       heads=head_configs,
       head_dim=st.sampled_from([8, 16]),
       window=st.one_of(st.none(), st.integers(1, 30)),
       seed=st.integers(0, 2**16), softcap=st.sampled_from([None, None, 0.5, 3.0]))
def test_paged_attention_matches_reference(seqs, block_size, heads, head_dim, window, seed, softcap):
    _check_case(seqs, block_size, heads, head_dim, window, seed, kernel=False, softcap=softcap)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seqs=st.lists(seq_strategy, min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4, 8, 16]),
       heads=head_configs,
       head_dim=st.sampled_from([8, 16, 64, 128]),
       window=st.one_of(st.none(), st.integers(1, 30)),
       seed=st.integers(0, 2**16), softcap=st.sampled_from([None, None, 0.5, 3.0]),
       split=st.sampled_from([1, 3, 16, cpu_kernel.SPLIT_TOKENS]))
# head size 128 (Llama's): the AVX2 weighted sum in two passes of 64; 4 query heads a KV head
@example(seqs=[(100, 1), (17, 1)], block_size=16, heads=(8, 2), head_dim=128, window=None, seed=0, softcap=None,
         split=cpu_kernel.SPLIT_TOKENS)
def test_cpu_kernel_matches_reference(cpu_isa, seqs, block_size, heads, head_dim, window, seed, softcap, split):
    """The C++ decode kernel reads blocks straight from the store: same answers, no padding; soft-capped scores
    (Gemma-2) too; contexts cut into splits of `split` tokens (whole blocks) and combined."""
    saved, cpu_kernel.SPLIT_TOKENS = cpu_kernel.SPLIT_TOKENS, split
    try:
        _check_case(seqs, block_size, heads, head_dim, window, seed, kernel=True, softcap=softcap)
    finally:
        cpu_kernel.SPLIT_TOKENS = saved


def test_cpu_kernel_row_does_not_depend_on_its_batch(cpu_isa):
    """A row's output is bit for bit the same decoded alone or among other sequences of other lengths: its splits
    follow its own length, so batching (or speculative verification rows) cannot change a greedy token."""
    g = torch.Generator().manual_seed(3)
    bs, kvh, heads, d = 16, 2, 6, 64
    lens = [700, 1, 129, 300, 17]
    k, v, tables, nb = random_paged_kv(lens, bs, kvh, d, g)
    q = torch.randn(len(lens), heads, d, generator=g)
    together = torch.empty_like(q)
    cpu_kernel.paged_decode(together, q, k, v, tables, torch.tensor(lens), 0.125, None)
    for i, n in enumerate(lens):
        alone = torch.empty(1, heads, d)
        cpu_kernel.paged_decode(alone, q[i:i + 1].contiguous(), k, v, tables[i:i + 1].contiguous(),
                                torch.tensor([n]), 0.125, None)
        assert torch.equal(alone[0], together[i]), f"row {i} ({n} tokens) changed with its batch"
    ref = torch.softmax(torch.einsum("hd,thd->ht", q[0], k[tables[0, :nb[0]]].flatten(0, 1)[:700]
                                     .repeat_interleave(heads // kvh, 1)) * 0.125, -1)
    out = torch.einsum("ht,thd->hd", ref, v[tables[0, :nb[0]]].flatten(0, 1)[:700].repeat_interleave(heads // kvh, 1))
    torch.testing.assert_close(together[0], out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 12])
def test_cpu_kernel_reads_a_half_precision_store_as_its_float32_widening(cpu_isa, dtype, d):
    """Over a float16 or bfloat16 store the decode kernel widens each value as it reads it: every output is bit for
    bit what it gives over the same values stored in float32 (head size 12: the widening's tail past 8 lanes too),
    and a store of two formats or of another dtype is refused, naming what it takes."""
    g = torch.Generator().manual_seed(5)
    lens = [70, 1, 16, 33]
    k, v, tables, _ = random_paged_kv(lens, 16, 3, d, g)
    k, v = k.to(dtype), v.to(dtype)
    k[tables[3, 1], 5, 1, d - 1] = float("nan")  # a corrupt key of sequence 3 (33 tokens): its rows stay non-finite
    v[tables[2, 0], 3, 0, 0] = float("inf")
    q = torch.randn(len(lens), 9, d, generator=g)
    half, wide = torch.empty_like(q), torch.empty_like(q)
    cpu_kernel.paged_decode(half, q, k, v, tables, torch.tensor(lens), d ** -0.5, None)
    cpu_kernel.paged_decode(wide, q, k.float(), v.float(), tables, torch.tensor(lens), d ** -0.5, None)
    torch.testing.assert_close(half, wide, rtol=0, atol=0, equal_nan=True)
    assert half[3, 3:6].isnan().any() and not half[3, :3].isnan().any() and half[:2].isfinite().all()
    with pytest.raises(RuntimeError, match="both float32, float16 or bfloat16"):
        cpu_kernel.paged_decode(half, q, k, v.float(), tables, torch.tensor(lens), d ** -0.5, None)
    with pytest.raises(RuntimeError, match="both float32, float16 or bfloat16"):
        cpu_kernel.paged_decode(half, q, k.double(), v.double(), tables, torch.tensor(lens), d ** -0.5, None)


def test_cpu_kernel_reads_q_in_place_from_the_qkv_product(cpu_isa):
    """The decode kernel takes q as a view of the q/k/v product (rows strided, heads packed), as the layers hand it
    over, with the same floats as from a contiguous copy, over float32 and a quantized store; q whose heads are not
    packed is refused, naming what it needs."""
    from kvcache.store.quantized_store import QuantizedKVStore
    g = torch.Generator().manual_seed(11)
    bs, kvh, heads, d = 16, 2, 6, 64
    lens = torch.tensor([40, 1, 17])
    tables = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    k, v = torch.randn(7, bs, kvh, d, generator=g), torch.randn(7, bs, kvh, d, generator=g)
    qkv = torch.randn(3, heads + 2 * kvh, d, generator=g)
    q = qkv[:, :heads]
    assert not q.is_contiguous()
    store = QuantizedKVStore(1, 7, bs, kvh, d, "int8")
    store.write(0, torch.arange(7 * bs), k.flatten(0, 1), v.flatten(0, 1))
    for call in (lambda o, x: cpu_kernel.paged_decode(o, x, k, v, tables, lens, 0.125, None),
                 lambda o, x: cpu_kernel.paged_decode_quant(o, x, store, 0, tables, lens, 0.125, None, None)):
        strided, packed = torch.empty(3, heads, d), torch.empty(3, heads, d)
        call(strided, q)
        call(packed, q.contiguous())
        assert torch.equal(strided, packed)
    with pytest.raises(RuntimeError, match="heads packed by D"):
        cpu_kernel.paged_decode(torch.empty(3, heads, d), torch.randn(heads, 3, d).transpose(0, 1), k, v, tables,
                                lens, 0.125, None)


def _check_case(seqs, block_size, heads, head_dim, window, seed, kernel, softcap=None):
    h, kvh = heads
    out, ref, batch = run_case(seqs, block_size, h, kvh, head_dim, window, seed, kernel=kernel, softcap=softcap)
    if kernel:
        assert len(batch.decode_groups) <= 1
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    # every row was produced: decode rows and prefill rows partition the batch
    n_dec = sum(gr.rows.numel() for gr in batch.decode_groups)
    n_pre = sum(p.length for p in batch.prefills)
    assert n_dec + n_pre == sum(n for _, n in seqs)
    assert n_dec == sum(1 for c, n in seqs if c > 0 and n == 1)


@pytest.mark.parametrize("window", [None, 3, 24])
def test_one_batch_serves_layers_with_different_windows(window):
    """A model mixing full and sliding layers builds masks for both; each layer picks its own."""
    seqs = [(30, 1), (0, 17), (12, 9), (5, 1)]
    out, ref, batch = run_case(seqs, 4, 4, 2, 8, window, seed=3, windows_in_batch=(None, 3, 24))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_groups_split_very_different_lengths(window, block_size):
    seqs = [(200, 1), (9, 1), (150, 1), (2, 1), (40, 1), (0, 6), (10, 3)]
    out, ref, batch = run_case(seqs, block_size, 8, 2, 16, window, seed=11)
    assert len(batch.decode_groups) > 1
    grouped = sorted(r for gr in batch.decode_groups for r in gr.rows.tolist())
    assert grouped == [0, 1, 2, 3, 4]  # the five decode rows, each in exactly one group
    # the longest and the shortest decode never share a group
    for gr in batch.decode_groups:
        rows = set(gr.rows.tolist())
        assert not {0, 3} <= rows
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_workspace_reuse_across_calls():
    """The same workspace serving two differently shaped steps gives the same answers as fresh ones."""
    ws = Workspace()
    # one workspace, calls of growing and shrinking sizes: each result still correct
    out1, ref1, _ = _run_with_ws([(40, 1), (2, 1)], 4, ws)
    out2, ref2, _ = _run_with_ws([(3, 1)], 16, ws)
    out3, ref3, _ = _run_with_ws([(90, 1), (80, 1)], 2, ws)
    for o, r in ((out1, ref1), (out2, ref2), (out3, ref3)):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=1e-5)


def _run_with_ws(seqs, block_size, ws):
    g = torch.Generator().manual_seed(7)
    kvh, h, d = 2, 4, 8
    need = [-(-(c + n) // block_size) for c, n in seqs]
    store = KVStore(1, 1 + sum(need), block_size, kvh, d)
    tables, at = [], 1
    for k in need:
        tables.append(list(range(at, at + k))[::-1])
        at += k
    hist_k = [torch.randn(c + n, kvh, d, generator=g) for c, n in seqs]
    hist_v = [torch.randn(c + n, kvh, d, generator=g) for c, n in seqs]
    qs = [torch.randn(n, h, d, generator=g) for c, n in seqs]
    full = build_batch([SeqChunk([0] * (c + n), 0, t) for (c, n), t in zip(seqs, tables)], block_size)
    store.write(0, full.slot_mapping, torch.cat(hist_k), torch.cat(hist_v))
    batch = build_batch([SeqChunk([0] * n, c, t) for (c, n), t in zip(seqs, tables)], block_size)
    k_new = torch.cat([hk[c:] for hk, (c, _) in zip(hist_k, seqs)])
    v_new = torch.cat([hv[c:] for hv, (c, _) in zip(hist_v, seqs)])
    out = paged_attention(torch.cat(qs), k_new, v_new, store, 0, batch, d ** -0.5, None, ws)
    ref = torch.cat([reference(qi, hk, hv, c, d ** -0.5, None) for qi, hk, hv, (c, _) in zip(qs, hist_k, hist_v, seqs)])
    return out, ref, batch


def test_slot_mapping_follows_block_table():
    batch = build_batch([SeqChunk([1, 2, 3], 5, [7, 3, 9]), SeqChunk([4], 2, [6])], block_size=4)
    # positions 5,6,7 -> block 3 (table[1]) offsets 1,2,3; position 2 -> block 6 offset 2
    assert batch.slot_mapping.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 6 * 4 + 2]
    assert batch.positions.tolist() == [5, 6, 7, 2]
    assert batch.input_ids.tolist() == [1, 2, 3, 4]
    assert batch.logits_indices.tolist() == [2, 3]


def test_decode_rows_beside_prefill_chunks():
    """One-token chunks over a cache (decode rows, which build_batch takes on a short path) beside prefill chunks,
    a row without logits and a row of an evicting sequence (positions = slots + tokens evicted): slots, positions,
    logits rows and the decode group's rows and lengths, in batch order."""
    chunks = [SeqChunk([11], 5, [7, 3]), SeqChunk([12, 13], 0, [2]), SeqChunk([14], 8, [4, 6, 1], needs_logits=False),
              SeqChunk([15], 3, [9], pos_offset=10), SeqChunk([16], 0, [5])]
    for kernel in (False, True):
        batch = build_batch(chunks, block_size=4, decode_kernel=kernel)
        assert batch.input_ids.tolist() == [11, 12, 13, 14, 15, 16]
        assert batch.slot_mapping.tolist() == [3 * 4 + 1, 2 * 4, 2 * 4 + 1, 1 * 4, 9 * 4 + 3, 5 * 4]
        assert batch.positions.tolist() == [5, 0, 1, 8, 13, 0]
        assert batch.logits_indices.tolist() == [0, 2, 4, 5]
        rows = sorted(r for g in batch.decode_groups for r in g.rows.tolist())
        lens = {r: n for g in batch.decode_groups for r, n in zip(g.rows.tolist(), g.context_lens.tolist())}
        assert rows == [0, 3, 4] and lens == {0: 6, 3: 9, 4: 4}
        assert [(p.start, p.length, p.context_len) for p in batch.prefills] == [(1, 2, 2), (5, 1, 1)]
    kernel_batch = build_batch(chunks, block_size=4, decode_kernel=True)
    (group,) = kernel_batch.decode_groups  # one group, in batch order, its tables padded with the null block
    assert group.rows.tolist() == [0, 3, 4]
    assert group.block_table.tolist() == [[7, 3, 0], [4, 6, 1], [9, 0, 0]]


@pytest.mark.parametrize("split", [cpu_kernel.SPLIT_TOKENS, 16])
def test_cpu_kernel_runs_of_one_sequence_equal_rows_alone(cpu_isa, split):
    """Verification rows of one sequence (SeqChunk.as_decodes: consecutive positions, one block table) are attended
    as a run that reads each block once: each row's output is bit for bit what it is alone, runs that cross a block
    or a split edge included, next to plain decode rows."""
    g = torch.Generator().manual_seed(5)
    bs, kvh, heads, d = 16, 3, 9, 64
    # (cached tokens, rows): runs ending past a block edge (126 + 5), a split edge (254 + 5 with 128-token splits)
    seqs = [(126, 5), (40, 1), (254, 5), (7, 3), (300, 1)]
    tables, at = [], 1
    for c, n in seqs:
        nb = -(-(c + n) // bs)
        tables.append(list(range(at, at + nb)))
        at += nb
    k = torch.randn(at, bs, kvh, d, generator=g)
    v = torch.randn(at, bs, kvh, d, generator=g)
    chunks = [SeqChunk([1] * n, c, t, as_decodes=n > 1, num_logits=n) for (c, n), t in zip(seqs, tables)]
    batch = build_batch(chunks, bs, decode_kernel=True)
    (group,) = batch.decode_groups
    assert group.runs.tolist() == [5, 0, 0, 0, 0, 1, 5, 0, 0, 0, 0, 3, 0, 0, 1]
    T = sum(n for _, n in seqs)
    q = torch.randn(T, heads, d, generator=g)
    saved, cpu_kernel.SPLIT_TOKENS = cpu_kernel.SPLIT_TOKENS, split
    try:
        together = torch.empty_like(q)
        cpu_kernel.paged_decode(together, q, k, v, group.block_table, group.context_lens, 0.125, None,
                                runs=group.runs)
        alone = torch.empty_like(q)
        cpu_kernel.paged_decode(alone, q, k, v, group.block_table, group.context_lens, 0.125, None)
    finally:
        cpu_kernel.SPLIT_TOKENS = saved
    assert torch.equal(together, alone)
    row = 0
    for (c, n), t in zip(seqs, tables):
        keys = k[t].flatten(0, 1).repeat_interleave(heads // kvh, 1)
        vals = v[t].flatten(0, 1).repeat_interleave(heads // kvh, 1)
        for j in range(n):
            L = c + j + 1
            p = torch.softmax(torch.einsum("hd,thd->ht", q[row], keys[:L]) * 0.125, -1)
            torch.testing.assert_close(together[row], torch.einsum("ht,thd->hd", p, vals[:L]), atol=1e-5, rtol=1e-5)
            row += 1


def test_cpu_kernel_refuses_runs_that_are_not_one_sequence(cpu_isa):
    """Runs the kernel cannot trust (lengths not consecutive, a run past the rows, a row left out) are refused
    before anything is read or written."""
    k = v = torch.randn(4, 16, 1, 64)
    tables = torch.tensor([[1, 2], [1, 2], [3, 0]])
    q, out = torch.randn(3, 2, 64), torch.zeros(3, 2, 64)
    for runs, lens, msg in (([2, 0, 1], [20, 22, 5], "consecutive"), ([2, 0, 2], [20, 21, 5], "with 3 rows"),
                            ([0, 1, 1], [20, 21, 5], "runs\\[0\\] = 0")):
        with pytest.raises(RuntimeError, match=msg):
            cpu_kernel.paged_decode(out, q, k, v, tables, torch.tensor(lens), 0.125, None, runs=torch.tensor(runs))
        assert not out.any()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 70), cached=st.sampled_from([0, 0, 1, 31, 32, 33, 90]), heads=head_configs,
       head_dim=st.sampled_from([32, 64, 128]), seed=st.integers(0, 2**16))
@example(n=13, cached=0, heads=(4, 4), head_dim=128, seed=957)  # 2.3e-6: over the 2e-6 once used for every head_dim
def test_cpu_prefill_kernel_matches_reference(cpu_isa, n, cached, heads, head_dim, seed):
    """The C++ causal prefill kernel: the last n of n + cached positions, on views of one q/k/v product (the rows'
    stride is the product's), across its 16-query and 32-key blocks and their edges. The bound grows with
    sqrt(head_dim): a score's float32 rounding is a sum of head_dim terms' (the scale keeps the scores themselves
    O(1)); the largest errors over 200 seeds of each head shape were 1.1e-6, 1.4e-6 and 2.3e-6 at 32, 64, 128."""
    H, KVH = heads
    L = n + cached
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(L, H + 2 * KVH, head_dim, generator=g)
    q, k, v = qkv[cached:, :H], qkv[:, H:H + KVH], qkv[:, H + KVH:]
    out = torch.empty(n, H, head_dim)
    cpu_kernel.prefill_attention(out, q, k, v, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), reference(q, k, v, cached, head_dim ** -0.5, None),
                               atol=2e-6 * (head_dim / 32) ** 0.5, rtol=0)


def test_cpu_prefill_kernel_weights_past_float32_exp_range(cpu_isa):
    """Scores hundreds apart (a large scale) put most weights below float32's exp range: they must come out exactly
    0, so a query whose best key outscores its next by over 100 returns that key's value bit for bit, wherever the
    key falls among the 32-key blocks (a later block's maximum then rescales the earlier blocks' sums to exactly 0,
    an earlier one's makes the later weights 0)."""
    g = torch.Generator().manual_seed(3)
    n, H, KVH, D, scale = 128, 4, 2, 64, 40.0
    q = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(2, n, KVH, D, generator=g)
    out = torch.empty(n, H, D)
    cpu_kernel.prefill_attention(out, q, k, v, scale)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k.double().repeat_interleave(H // KVH, 1)) * scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    top = scores.topk(2, -1)
    one_hot = [(h, i) for h in range(H) for i in range(1, n) if top.values[h, i, 0] - top.values[h, i, 1] > 100]
    assert len(one_hot) > 100 and {top.indices[h, i, 0].item() // 32 for h, i in one_hot} == {0, 1, 2, 3}
    for h, i in one_hot:
        assert torch.equal(out[i, h], v[top.indices[h, i, 0], h // (H // KVH)]), (h, i)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cpu_prefill_kernel_passes_a_non_finite_key_on(cpu_isa, bad):
    """A non-finite key (a corrupt value) makes every query that sees it non-finite, not silently weight 0 (the
    kernel is built with -ffast-math, whose comparisons may drop a NaN); the queries before it stay exact."""
    g = torch.Generator().manual_seed(5)
    n, H, KVH, D = 70, 4, 2, 64
    q = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(2, n, KVH, D, generator=g)
    k[40, 1, 3] = bad
    out = torch.empty(n, H, D)
    cpu_kernel.prefill_attention(out, q, k, v, D ** -0.5)
    assert not torch.isfinite(out[40:, 2:]).any(dim=-1).any()  # heads 2, 3 read KV head 1
    assert torch.isfinite(out[:40]).all() and torch.isfinite(out[:, :2]).all()


def test_cpu_prefill_kernel_refuses_what_it_cannot_read():
    q, k = torch.randn(4, 2, 48), torch.randn(4, 1, 48)  # head size not a multiple of 32
    with pytest.raises(RuntimeError, match="prefill_attention: q"):
        cpu_kernel.prefill_attention(torch.empty(4, 2, 48), q, k, k, 0.1)
    q, k = torch.randn(5, 2, 32), torch.randn(4, 1, 32)  # more queries than keys
    with pytest.raises(RuntimeError, match="prefill_attention: q"):
        cpu_kernel.prefill_attention(torch.empty(5, 2, 32), q, k, k, 0.1)


@pytest.mark.parametrize("window, softcap, backend, used", [
    (None, None, "cpu", True), (100, None, "cpu", True),  # a window wider than the context masks nothing
    (5, None, "cpu", False), (None, 3.0, "cpu", False), (None, None, "torch", False)])
def test_prefill_takes_the_kernel_only_where_its_mask_is_plain_causal(monkeypatch, window, softcap, backend, used):
    calls = []
    real = cpu_kernel.prefill_attention
    monkeypatch.setattr(cpu_kernel, "prefill_attention", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    g = torch.Generator().manual_seed(0)
    store = KVStore(1, 9, 4, 1, 32)
    chunks = [SeqChunk([5] * 7, 0, [1, 2]), SeqChunk([5] * 6, 0, [3, 4])]
    batch = build_batch(chunks, 4, (window,))
    batch.backend = backend
    q, k, v = (torch.randn(13, h, 32, generator=g) for h in (2, 1, 1))
    store.write(0, batch.slot_mapping, k, v)
    out = paged_attention(q, k, v, store, 0, batch, 32 ** -0.5, window, Workspace(), softcap=softcap)
    assert calls == ([7, 6] if used else [])
    want = torch.cat([reference(q[a:b], k[a:b], v[a:b], 0, 32 ** -0.5, window, softcap) for a, b in ((0, 7), (7, 13))])
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)
