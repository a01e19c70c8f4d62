"""The one description of a forward batch that the model and every attention layer read.

Tokens of all scheduled sequences are flattened into one row per token: decode rows
(one new token each) and prefill chunks (many). Everything attention needs per step
(slot mapping, gather indices, masks) is built here once, not per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


@dataclass(slots=True)
class DecodeGroup:
    """Decode rows of similar context length, attended in one padded call."""

    rows: torch.Tensor  # [B] batch rows of these sequences' tokens
    block_table: torch.Tensor  # [B, num_blocks] padded with the null block
    context_lens: torch.Tensor  # [B] tokens each sequence attends to (the new one included)
    masks: dict[int | None, torch.Tensor]  # sliding window -> [B, 1, 1, num_blocks * block_size] bool

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


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    logits_indices: torch.Tensor  # rows whose next-token logits are wanted
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_kernel: bool = False  # decode rows go through the C++ CPU kernel (no groups, no masks)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def _window_ok(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def build_batch(chunks: list[SeqChunk], block_size: int, windows: tuple[int | None, ...] = (None,),
                device: str | torch.device = "cpu", decode_kernel: bool = False) -> ForwardBatch:
    """Flatten `chunks` into a ForwardBatch.

    Chunks of one token on a non-empty cache are decode rows. For the padded torch path they
    are split into groups of similar length, each with padding masks; with `decode_kernel`
    (a kernel that walks block tables) they form one group and need no masks.
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    decodes: list[tuple[int, int, list[int]]] = []  # (row, context_len, table)
    prefills: list[PrefillSpan] = []
    for c in chunks:
        row, n = len(ids), len(c.token_ids)
        ids.extend(c.token_ids)
        p = range(c.start, c.start + n)
        pos.extend(p)
        slots.extend(c.block_table[i // block_size] * block_size + i % block_size for i in p)
        if c.needs_logits:
            logit_rows.append(row + n - 1)
        ctx = c.start + n
        if n == 1 and c.start > 0:
            decodes.append((row, ctx, c.block_table))
            continue
        nb = -(-ctx // block_size)
        q_pos = torch.arange(c.start, ctx, device=device)[:, None]
        k_pos = torch.arange(ctx if c.start == 0 else nb * block_size, device=device)[None, :]
        pmasks: dict[int | None, torch.Tensor | None] = {}
        for w in windows:
            plain = c.start == 0 and (w is None or w >= ctx)
            pmasks[w] = None if plain else _window_ok(q_pos, k_pos, w)
        block_ids = None if c.start == 0 else torch.tensor(c.block_table[:nb], device=device)
        prefills.append(PrefillSpan(row, n, ctx, block_ids, pmasks))
    decodes.sort(key=lambda d: -d[1])
    groups: list[DecodeGroup] = []
    i = 0
    while i < len(decodes):
        longest = decodes[i][1]
        j = i + 1
        while j < len(decodes) and (decode_kernel or decodes[j][1] >= _GROUP_FILL * longest):
            j += 1
        members = decodes[i:j]
        nb = -(-longest // block_size)
        table = [t[:nb] + [0] * (nb - len(t[:nb])) for _, _, t in members]
        ctx = torch.tensor([m[1] for m in members], device=device)[:, None]
        k_pos = torch.arange(nb * block_size, device=device)[None, :]
        dmasks = {w: _window_ok(ctx - 1, k_pos, w)[:, None, None, :] for w in windows} if not decode_kernel else {}
        groups.append(DecodeGroup(torch.tensor([m[0] for m in members], device=device),
                                  torch.tensor(table, device=device), ctx[:, 0].contiguous(), dmasks))
        i = j
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return ForwardBatch(as_long(ids), as_long(pos), as_long(slots), as_long(logit_rows), groups, prefills,
                        decode_kernel)
