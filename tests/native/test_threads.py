"""The kernels split their work between OpenMP threads, and the result does not depend on how many there are: the
linear kernels give the same floats at 1 to 4 threads (each output is one thread's), and so does decode attention
(a sequence's splits follow its length, not the threads); prefill attention stays within its reference's bound.
The suite's xdist workers run on a share of the cores each (tests/conftest.py), often one thread: these tests set
their own counts, more than the cores included (an uneven share for the last thread)."""
from __future__ import annotations

import pytest
import torch
from paged_kv import random_paged_kv

from kvcache import native
from kvcache.attention import cpu_kernel
from kvcache.models import cpu_kernels
from kvcache.models.quant_linear import Int4Dense, exact_codes, quantize_groups

THREADS = (1, 2, 3, 4)


@pytest.fixture
def kernels():
    return native.require()  # the suite requires a build (conftest)


@pytest.fixture
def threads():
    """Runs a callable at each thread count and gives back its results; torch's count restored afterwards."""
    saved = torch.get_num_threads()

    def at_each(fn):
        out = []
        for t in THREADS:
            torch.set_num_threads(t)
            out.append(fn())
        return out
    yield at_each
    torch.set_num_threads(saved)


def _same(results):
    for t, r in zip(THREADS[1:], results[1:]):
        assert torch.equal(r, results[0]), f"{t} threads gave other floats than 1"


@pytest.mark.parametrize("rows", [1, 5, 8, 64, 600])  # 600: chunks of rows (227 at K = 576) times panels
def test_linear_kernels_give_the_same_floats_at_every_thread_count(kernels, threads, rows):
    n, k = 232, 576  # 7.25 panels of 32: no even split between 2, 3 or 4 threads
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    panels = cpu_kernels.pack_panels(w, kernels)

    def panel():
        out = torch.empty(rows, n)
        kernels.panel_linear(out, x, panels)
        return out
    floats = threads(panel)
    _same(floats)
    ref = x.double() @ w.double().t()
    torch.testing.assert_close(floats[0].double(), ref, atol=1e-6 * k ** 0.5 * ref.abs().max().item(), rtol=0)

    codes, d, m = quantize_groups(w)
    grid = d.float().repeat_interleave(32, 1) * codes.float() + m.float().repeat_interleave(32, 1)
    code_panels = cpu_kernels.pack_code_panels(*exact_codes(grid))

    def code():
        out = torch.empty(rows, n)
        kernels.code_panel_linear(out, x, *code_panels)
        return out
    _same(threads(code))

    wg = torch.randn(256, k, generator=g)  # gate 128 | up 128: 4 pairs of panels
    gate_up = cpu_kernels.pack_panels(wg, kernels)

    def silu():
        act = torch.empty(rows, 128)
        kernels.gate_up_silu(act, x, gate_up)
        return act
    acts = threads(silu)
    _same(acts)
    gate, up = (x.double() @ wg.double().t()).split(128, 1)
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(acts[0].double(), ref, atol=1e-5 * k ** 0.5 * ref.abs().max().item(), rtol=0)

    layer = Int4Dense(k, n, bias=False)
    with torch.no_grad():
        layer.load_rows(0, w)

    def int4():
        out = torch.empty(rows, n)
        kernels.int4_linear(out, x, layer.qweight, layer.scale, layer.minimum)
        return out
    _same(threads(int4))


def test_decode_attention_gives_the_same_floats_at_every_thread_count(kernels, threads):
    g = torch.Generator().manual_seed(0)
    bs, kvh, heads, d = 16, 2, 6, 64
    lens = [700, 1, 129, 3000, 17]  # one long sequence split in many items, short ones in one
    k, v, tables, nb = random_paged_kv(lens, bs, kvh, d, g)
    q = torch.randn(len(lens), heads, d, generator=g)

    def decode():
        out = torch.empty_like(q)
        cpu_kernel.paged_decode(out, q, k, v, tables, torch.tensor(lens), 0.125, None)
        return out
    floats = threads(decode)
    _same(floats)
    i = 3  # the longest, against float64
    keys = k[tables[i, :nb[i]]].flatten(0, 1)[:lens[i]].double().repeat_interleave(heads // kvh, 1)
    values = v[tables[i, :nb[i]]].flatten(0, 1)[:lens[i]].double().repeat_interleave(heads // kvh, 1)
    want = torch.einsum("ht,thd->hd", torch.softmax(torch.einsum("hd,thd->ht", q[i].double(), keys) * 0.125, -1),
                        values)
    torch.testing.assert_close(floats[0][i].double(), want, atol=1e-5, rtol=1e-5)


def test_prefill_attention_matches_its_reference_at_every_thread_count(kernels, threads):
    g = torch.Generator().manual_seed(1)
    n, heads, kvh, d = 150, 8, 2, 64
    qkv = torch.randn(n, heads + 2 * kvh, d, generator=g)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]

    def prefill():
        out = torch.empty(n, heads, d)
        cpu_kernel.prefill_attention(out, q, k, v, d ** -0.5)
        return out
    rep = heads // kvh
    scores = torch.einsum("nhd,thd->hnt", q.double(), k.double().repeat_interleave(rep, 1)) * d ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hnt,thd->nhd", torch.softmax(scores, -1), v.double().repeat_interleave(rep, 1))
    for out in threads(prefill):
        torch.testing.assert_close(out.double(), want, atol=3e-6, rtol=0)
