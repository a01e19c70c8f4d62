"""The one description of a forward batch that the model and every attention layer read.

Tokens of all scheduled sequences are flattened into one row per token: decode rows
(one new token each) and prefill chunks (many). Everything attention needs per step
(slot mapping, gather indices, masks) is built here once, not per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcache.memory.device_tables import upload
from kvcache.store.quantized_store import KiviPlan

# A decode group pads its sequences to the longest of them; start a new group when a
# sequence is shorter than this fraction of the group's longest, so padding stays small.
_GROUP_FILL = 0.75


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: `token_ids` at positions [start, start + len) with this block table."""

    token_ids: list[int]
    start: int  # tokens already in the cache before this step
    block_table: list[int]
    needs_logits: bool = True
    private_blocks: list[int] = field(default_factory=list)  # KIVI: blocks holding the key residual
    # Eviction: `start` counts cache slots; the tokens' positions are slots + pos_offset (tokens evicted so far)
    pos_offset: int = 0
    capture: range = range(0)  # chunk offsets whose queries the batch keeps (eviction scoring)
    layer_start: list[int] | None = None  # per layer, block-aligned first live slot (PyramidKV)
    seq_id: int | None = None  # the KVCacheManager's id of the table (the runner reads its device copy)
    num_logits: int = 1  # with needs_logits: logits of this many last rows (a speculating decode verifies each)
    # Each token attends as a decode row of its own length (speculative verification: plain decoding's arithmetic,
    # so the tokens it accepts, and the K/V later layers compute from them, are exactly plain decoding's)
    as_decodes: bool = False
    # Recurrent layers with prefix caching: (position, snapshot key) of each block boundary this chunk reaches where
    # the state is snapshotted (memory/state_snapshots.py)
    state_saves: list = field(default_factory=list)


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar context length, attended in one padded call."""

    rows: torch.Tensor  # [B] batch rows of these sequences' tokens
    block_table: torch.Tensor  # [B, num_blocks] padded with the null block
    context_lens: torch.Tensor  # [B] tokens each sequence attends to (the new one included)
    masks: dict[int | None, torch.Tensor]  # sliding window -> [B, 1, 1, num_blocks * block_size] bool
    # KIVI: (row in group, position, src row) of the full-precision keys that replace dequantized ones
    overlay: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # KIVI with the decode kernel: src rows of each sequence's current-group keys [B, F] (padded), and the
    # position that group starts at [B]
    full: tuple[torch.Tensor, torch.Tensor] | None = None
    # Eviction with per-layer live ranges: per layer, (block table, context lengths) that skip dead leading blocks
    layer_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # The decode kernel: runs[b] rows from row b on are one sequence's consecutive positions (a speculating
    # sequence's verification rows), 0 inside a run, attended together; None: no run of more than one row
    runs: torch.Tensor | None = None

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block table and context lengths of this group in `layer`."""
        return self.layer_views[layer] if self.layer_views else (self.block_table, self.context_lens)

    @property
    def num_blocks(self) -> int:
        return self.block_table.shape[1]


@dataclass(slots=True)
class PrefillSpan:
    """A chunk of one sequence's prompt: rows [start, start + length) of the batch."""

    start: int
    length: int
    context_len: int  # cached tokens after this step, the chunk included
    block_ids: torch.Tensor | None  # None: the chunk is the whole context, attend to the fresh K/V
    masks: dict[int | None, torch.Tensor | None]  # None mask means plain causal
    # KIVI: src rows of the full-precision keys of positions [full_start, context_len), attended after the
    # dequantized blocks (masks then cover num_blocks * block_size + context_len - full_start keys)
    full_src: torch.Tensor | None = None
    full_start: int = 0


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    logits_indices: torch.Tensor  # rows whose next-token logits are wanted
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_kernel: bool = False  # decode rows go through a kernel that walks block tables (no groups, no masks)
    kivi: KiviPlan | None = None
    capture_rows: torch.Tensor | None = None  # rows whose post-RoPE queries each layer appends to captured_q
    captured_q: list[torch.Tensor] = field(default_factory=list)
    backend: str = "cpu"  # whose kernels decode_kernel means, and (triton) who attends cached prefills
    # Per-layer-group block tables (memory/layer_groups.py): layer i reads and writes through layer_batches[i], the
    # batch built on its group's tables (same tokens, other slots and blocks); None: this batch serves every layer
    layer_batches: list[ForwardBatch] | None = None
    # Recurrent layers (models/hybrid.py): which state slot each row reads and writes (store/state_store.StateBatch,
    # set by the model runner); None for models without them
    states: object | None = None

    def for_layer(self, i: int) -> ForwardBatch:
        """The batch layer i attends with."""
        return self.layer_batches[i] if self.layer_batches else self

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def _window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


@dataclass(frozen=True, slots=True)
class KiviLayout:
    """What build_batch needs to know of a KIVI store: key group (tokens), fp16 elements per token's keys
    (kv_heads x head_dim) and per private-block row."""

    group: int
    token_elems: int
    row_elems: int


class _KiviBuilder:
    """Collects a step's KIVI key plan, chunk by chunk (see store/quantized_store.py for the scheme)."""

    def __init__(self, layout: KiviLayout, block_size: int, num_rows: int) -> None:
        self.l, self.bs, self.num_rows = layout, block_size, num_rows
        # Residual keys are addressed by whole tokens where no token straddles two private blocks (a block's fp16
        # elements a multiple of a token's): one gathered row per token instead of one index per element
        self.unit = layout.token_elems if layout.row_elems % layout.token_elems == 0 else 1
        self.resid_read: list[torch.Tensor] = []
        self.num_read = 0
        self.group_src: list[int] = []
        self.group_slots: list[tuple[int, int]] = []
        self.scales: list[tuple[int, int]] = []
        self.resid_rows: list[int] = []
        self.resid_write: list[torch.Tensor] = []

    def _elems(self, private: list[int], slots: range) -> torch.Tensor:
        """Indices, in units of `self.unit` fp16 elements, of residual token slots `slots` in a sequence's private
        blocks: each token's row where a unit is a token, else each of its elements."""
        e, r = self.l.token_elems, self.l.row_elems
        if self.unit == e:
            return torch.tensor([(private[i * e // r] * r + i * e % r) // e for i in slots], dtype=torch.long)
        flat = torch.arange(slots.start * e, slots.stop * e)
        rows = torch.tensor(private)[flat // r]
        return rows * r + flat % r

    def add(self, c: SeqChunk, row: int) -> list[int]:
        """Plan chunk `c` (batch rows from `row`); returns the src rows of positions [full_start, end)."""
        g, s, end = self.l.group, c.start, c.start + len(c.token_ids)
        full_start = s - s % g
        src = []
        if full_start < s:  # the current group's earlier keys wait in the residual
            if len(c.private_blocks) * self.l.row_elems < (g - 1) * self.l.token_elems:
                raise ValueError("a KIVI sequence needs private blocks for its key residual")
            self.resid_read.append(self._elems(c.private_blocks, range(0, s - full_start)))
            src = list(range(self.num_rows + self.num_read, self.num_rows + self.num_read + s - full_start))
            self.num_read += s - full_start
        src += range(row, row + end - s)
        for g0 in range(full_start, end - end % g, g):  # groups this chunk completes
            self.group_src += src[g0 - full_start:g0 - full_start + g]
            self.group_slots += [(c.block_table[i // self.bs], i % self.bs) for i in range(g0, g0 + g)]
            self.scales.append((c.block_table[g0 // self.bs], g0 % self.bs // g))
        last = end - end % g
        if last < end:  # the last group is not complete: its new keys go to the residual
            first = max(last, s)
            self.resid_rows += range(row + first - s, row + end - s)
            self.resid_write.append(self._elems(c.private_blocks, range(first - last, end - last)))
        return src[:end - full_start]

    def plan(self, device: str | torch.device) -> KiviPlan:
        long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        cat = lambda ts: torch.cat(ts).to(device) if ts else long([])  # noqa: E731
        return KiviPlan(cat(self.resid_read), long(self.group_src), long([b for b, _ in self.group_slots]),
                        long([o for _, o in self.group_slots]), long([b for b, _ in self.scales]),
                        long([i for _, i in self.scales]), long(self.resid_rows), cat(self.resid_write), self.unit)


def build_batch(chunks: list[SeqChunk], block_size: int, windows: tuple[int | None, ...] = (None,),
                device: str | torch.device = "cpu", decode_kernel: bool = False, read_cache: bool = False,
                kivi: KiviLayout | None = None, tables: torch.Tensor | None = None,
                table_rows: list[int] | None = None) -> ForwardBatch:
    """Flatten `chunks` into a ForwardBatch.

    Chunks of one token on a non-empty cache are decode rows. For the padded torch path they
    are split into groups of similar length, each with padding masks; with `decode_kernel`
    (a kernel that walks block tables) they form one group and need no masks.
    With `read_cache` (a lossy store) every prefill chunk attends to what the cache holds, not to its
    fresh K/V, so that a token's output does not depend on how its prompt was chunked.
    With `kivi` the batch also carries the KIVI key plan and the full-precision key positions.
    With `tables`, the device copy of the block tables (DeviceBlockTables.table, synced for these chunks) and
    `table_rows`, each chunk's row in it, block tables are read on the device instead of copied from the
    chunks' lists. The step's integer inputs go to the device in one copy (device_tables.upload).
    """
    rows = _flatten(chunks, block_size, kivi, tables, table_rows)
    members_of = _decode_groups_of(rows.decodes, decode_kernel)
    up = iter(upload(_integer_parts(rows, members_of, block_size, decode_kernel, read_cache, tables), device))
    input_ids, positions, slot_mapping, logits_indices, capture_rows = (next(up) for _ in range(5))
    groups = [_decode_group(members, up, block_size, windows, device, decode_kernel, rows.kb, tables)
              for members in members_of]
    prefills = [_prefill_span(p, up, block_size, windows, device, read_cache, kivi, tables) for p in rows.pre]
    return ForwardBatch(input_ids, positions, slot_mapping, logits_indices, groups, prefills, decode_kernel,
                        rows.kb.plan(device) if rows.kb else None, capture_rows if rows.capture else None)


@dataclass(slots=True)
class _Rows:
    """A step's chunks flattened to rows (build_batch's first pass): the integer lists, then the decode rows and the
    prefill chunks that the groups and spans are built from."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    capture: list[int] = field(default_factory=list)
    # (row, context_len, table, full src rows, layer starts, row in `tables`, rows of the run it starts or 0)
    decodes: list[tuple[int, int, list[int], list[int], list[int] | None, int | None, int]] = field(
        default_factory=list)
    # (chunk, row, context_len, full src rows, row in `tables`)
    pre: list[tuple[SeqChunk, int, int, list[int], int | None]] = field(default_factory=list)
    kb: _KiviBuilder | None = None


def _flatten(chunks: list[SeqChunk], block_size: int, kivi: KiviLayout | None, tables: torch.Tensor | None,
             table_rows: list[int] | None) -> _Rows:
    """Each chunk's token ids, positions, cache slots and logit rows, in batch order; its decode rows or its
    prefill span."""
    r = _Rows(kb=_KiviBuilder(kivi, block_size, sum(len(c.token_ids) for c in chunks)) if kivi else None)
    ids, pos, slots, logit_rows, decodes, kb = r.ids, r.pos, r.slots, r.logit_rows, r.decodes, r.kb
    for i, c in enumerate(chunks):
        row, n = len(ids), len(c.token_ids)
        t_row = table_rows[i] if tables is not None else None
        if n == 1 and c.start > 0 and c.num_logits == 1 and not kb and not c.capture:
            # a decode row (most rows of a busy step): the general path below without its ranges and generators
            s, table = c.start, c.block_table
            ids.append(c.token_ids[0])
            pos.append(s + c.pos_offset)
            slots.append(table[s // block_size] * block_size + s % block_size)
            if c.needs_logits:
                logit_rows.append(row)
            decodes.append((row, s + 1, table, [], c.layer_start, t_row, 1))
            continue
        ids.extend(c.token_ids)
        p = range(c.start, c.start + n)
        pos.extend(range(c.start + c.pos_offset, c.start + c.pos_offset + n))
        r.capture.extend(row + i for i in c.capture)
        slots.extend(c.block_table[i // block_size] * block_size + i % block_size for i in p)
        if c.needs_logits:
            logit_rows.extend(range(row + n - c.num_logits, row + n))
        full = kb.add(c, row) if kb else []
        if (n == 1 or c.as_decodes) and c.start > 0:
            decodes.extend((row + j, c.start + j + 1, c.block_table, full, c.layer_start, t_row, 0 if j else n)
                           for j in range(n))
        else:
            r.pre.append((c, row, c.start + n, full, t_row))
    return r


def _decode_groups_of(decodes: list, decode_kernel: bool) -> list[list]:
    """The decode rows' groups: one in batch order for a kernel that walks each row's own table; else groups of
    similar length (the padded path pads each group to its longest)."""
    if decode_kernel:
        return [decodes] if decodes else []
    decodes.sort(key=lambda d: -d[1])
    members_of, i = [], 0
    while i < len(decodes):
        j = i + 1
        while j < len(decodes) and decodes[j][1] >= _GROUP_FILL * decodes[i][1]:
            j += 1
        members_of.append(decodes[i:j])
        i = j
    return members_of


def _integer_parts(rows: _Rows, members_of: list[list], block_size: int, decode_kernel: bool, read_cache: bool,
                   tables: torch.Tensor | None) -> list[list[int]]:
    """Every integer list of the step, in the order _decode_group and _prefill_span take them from the upload."""
    kb = rows.kb
    parts: list[list[int]] = [rows.ids, rows.pos, rows.slots, rows.logit_rows, rows.capture]
    for members in members_of:
        nb = -(-max(m[1] for m in members) // block_size)
        parts.append([m[0] for m in members])
        parts.append([m[1] for m in members])
        if tables is not None:
            parts.append([m[5] for m in members])
        else:
            parts.append([b for m in members for b in m[2][:nb] + [0] * (nb - len(m[2][:nb]))])
        if decode_kernel and not kb and any(m[6] > 1 for m in members):
            parts.append([m[6] for m in members])
        if kb and decode_kernel:
            width = max(len(m[3]) for m in members)
            parts.append([r for m in members for r in m[3] + [0] * (width - len(m[3]))])
            parts.append([m[1] - len(m[3]) for m in members])
        elif kb:
            parts.append([b for b, m in enumerate(members) for _ in m[3]])
            parts.append([m[1] - len(m[3]) + k for m in members for k in range(len(m[3]))])
            parts.append([r for m in members for r in m[3]])
    for c, _, ctx, full, t_row in rows.pre:
        from_cache = c.start > 0 or read_cache
        parts.append(c.block_table[:-(-ctx // block_size)] if from_cache and tables is None else [])
        parts.append(full)
    return parts


def _decode_group(members: list, up, block_size: int, windows: tuple[int | None, ...], device, decode_kernel: bool,
                  kb: _KiviBuilder | None, tables: torch.Tensor | None) -> DecodeGroup:
    """One group of decode rows from its uploaded tensors (taken from `up` in _integer_parts' order)."""
    nb = -(-max(m[1] for m in members) // block_size)
    rows_t, ctx, tab = next(up), next(up), next(up)
    table = tables[tab, :nb].contiguous() if tables is not None else tab.view(len(members), nb)
    k_pos = torch.arange(nb * block_size, device=device)[None, :]
    dmasks = {w: _window_ok(ctx[:, None] - 1, k_pos, w)[:, None, None, :] for w in windows} \
        if not decode_kernel else {}
    overlay = full = runs = None
    if decode_kernel and not kb and any(m[6] > 1 for m in members):
        runs = next(up)
    if kb and decode_kernel:
        full = (next(up).view(len(members), max(len(m[3]) for m in members)), next(up))
    elif kb:
        overlay = (next(up), next(up), next(up))
    views = None
    if any(m[4] for m in members):
        padded = [m[2][:nb] + [0] * (nb - len(m[2][:nb])) for m in members]
        views = _layer_views(members, padded, block_size, device)
    return DecodeGroup(rows_t, table, ctx, dmasks, overlay, full, views, runs)


def _prefill_span(pre: tuple, up, block_size: int, windows: tuple[int | None, ...], device, read_cache: bool,
                  kivi: KiviLayout | None, tables: torch.Tensor | None) -> PrefillSpan:
    """One prefill chunk's span: its cached blocks (where it reads the cache) and a mask per window."""
    c, row, ctx, full, t_row = pre
    n = len(c.token_ids)
    nb = -(-ctx // block_size)
    from_cache = c.start > 0 or read_cache
    block_ids, full_t = next(up), next(up)
    if from_cache and tables is not None:
        block_ids = tables[t_row, :nb]
    q_pos = torch.arange(c.start, ctx, device=device)[:, None]
    k_pos = torch.arange(nb * block_size if from_cache else ctx, device=device)[None, :]
    full_start = ctx - len(full)
    pmasks: dict[int | None, torch.Tensor | None] = {}
    for w in windows:
        if kivi:  # dequantized keys of earlier groups, then full-precision keys of the query's own group
            g = kivi.group
            f_pos = torch.arange(full_start, ctx, device=device)[None, :]
            pmasks[w] = torch.cat([_window_ok(q_pos, k_pos, w) & (k_pos // g < q_pos // g),
                                   _window_ok(q_pos, f_pos, w) & (f_pos // g == q_pos // g)], dim=1)
        else:
            plain = not from_cache and (w is None or w >= ctx)
            pmasks[w] = None if plain else _window_ok(q_pos, k_pos, w)
    return PrefillSpan(row, n, ctx, block_ids if from_cache else None, pmasks, full_t if kivi else None, full_start)


def _layer_views(members: list, table: list[list[int]], block_size: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the group's block tables and context lengths with each sequence's dead leading blocks cut off."""
    num_layers = len(next(m[4] for m in members if m[4]))
    views = []
    for layer in range(num_layers):
        skips = [(m[4][layer] if m[4] else 0) // block_size for m in members]
        views.append((torch.tensor([t[s:] + [0] * s for t, s in zip(table, skips)], device=device),
                      torch.tensor([m[1] - s * block_size for m, s in zip(members, skips)], device=device)))
    return views
