"""Prompt logprobs (SamplingParams.prompt_logprobs): the log probability of each prompt token given the tokens
before it, from the logits of every prompt position, computed as the prompt's chunks run.

A sequence that wants them (its first sample's, until every entry is recorded) has each prompt chunk's every row
through the LM head; position p's row gives entry p + 1 (entry 0, the first token's, is None, as in vLLM). The
prefix cache may only hand it the positions already recorded (Sequence.max_cached_prefix), so a preempted sequence
recomputes from where its entries stop, and no entry is recorded twice. The step's sampling rows (each chunk's
last, where the chunk ends the sequence's tokens) are handed back as the step's logits, in order.
"""
from __future__ import annotations

import torch

from kvcache.attention.metadata import SeqChunk
from kvcache.engine.sampler import logprob_dicts
from kvcache.engine.sequence import Sequence

SLICE = 256  # rows whose log-softmax is taken at once


def want_every_row(seq: Sequence, spec: SeqChunk) -> bool:
    """Ask for every row of this chunk's logits if its sequence still needs prompt entries from it; whether so."""
    if not seq.wants_prompt_logits or seq.draft:
        return False
    spec.num_logits, spec.needs_logits = len(spec.token_ids), True
    return True


def take(chunks: list[tuple[Sequence, int]], specs: list[SeqChunk], every_row: dict[int, bool],
         logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt entries of the chunks in `every_row` (chunk index -> whether it also samples) from their
    rows of `logits`; returns the rows the step samples from, in chunk order."""
    keep, row = [], 0
    for i, ((seq, _), spec) in enumerate(zip(chunks, specs)):
        if not spec.needs_logits:
            continue
        k = spec.num_logits
        if i in every_row:
            _record(seq, seq.num_computed_tokens, logits[row:row + k])
            if every_row[i]:
                keep.append(row + k - 1)
        else:
            keep.extend(range(row, row + k))
        row += k
    return logits.index_select(0, torch.tensor(keep, dtype=torch.long, device=logits.device))


def _record(seq: Sequence, start: int, rows: torch.Tensor) -> None:
    """Entries from the logits `rows` of positions [start, start + len(rows)) that the sequence lacks."""
    entries, ranks = seq.prompt_logprobs, seq.prompt_ranks
    if not entries:
        entries.append(None)  # the first prompt token has no tokens before it
        ranks.append(None)
    first = len(entries) - 1 - start  # the row of the first missing entry
    stop = min(rows.shape[0], seq.num_prompt_tokens - 1 - start)
    if first < 0:
        raise RuntimeError(f"prompt logprobs of sequence {seq.seq_id}: a chunk from position {start} skips the "
                           f"entries from {len(entries)} on")
    for a in range(first, stop, SLICE):  # a slice at a time: log_softmax's copy stays small beside the logits
        b = min(stop, a + SLICE)
        entries.extend(logprob_dicts(rows[a:b], seq.token_ids[start + a + 1:start + b + 1], seq.params.prompt_logprobs,
                                     ranks))
