"""Speculative decoding, verified inside the continuous batch: n-gram prompt lookup (vLLM's `ngram` method, here)
or a draft model (`draft_model`, engine/draft.py: a smaller checkpoint with the target's tokenizer proposes its
most likely tokens; verified as below).

Each step, before scheduling, a decoding sequence looks for the last n of its tokens (n from prompt_lookup_max down
to prompt_lookup_min) earlier in its prompt and output, most recent match first, and proposes up to
num_speculative_tokens tokens that followed it. The scheduler gives it 1 + k tokens (its last token and the
proposal) like a short prefill chunk, in the same step as plain decodes and prefills; the step keeps the logits of
all 1 + k rows. Verification (engine): row j's token is sampled as plain decoding would sample it with draft[:j]
counted as output (penalties, min_tokens, the request's temperature, top-k/top-p/min-p); the longest run of rows
whose token equals the proposal is accepted, plus the token of the row after it, so a step appends 1 to k + 1
tokens.

Why that is exact for sampled requests too: the proposal is one token per position, a proposal distribution q that
puts all its mass on it. The standard rule (accept d with probability min(1, p(d)/q(d)) = p(d); on rejection draw
from the residual max(0, p - q) normalised, which is p without d) gives each token the target's probability p;
drawing x from p and accepting iff x = d is that rule (x = d has probability p(d); otherwise x is distributed as p
without d). Greedy is the case where p is one-hot. A seeded request's generator is put back after verification to
where the rows it kept leave it (sampler.skip_draws), so its tokens are the very tokens plain decoding draws from
the same seed, not only the same distribution.

KV rollback: the rows of rejected tokens were written to slots past the sequence's accepted length. Those slots
are overwritten before anything reads them (attention reads a sequence's first num_computed_tokens slots), the
blocks holding only rejected slots go back to the pool in the same step (KVCacheManager.trim), and the prefix
cache registers only blocks of accepted tokens (cache_blocks runs on the accepted count).

Verification costs k more rows per speculating sequence: where many sequences decode together the step is no
longer bound by reading the weights and the rows cost more than the accepted tokens save (`kvcache bench
spec-decode`: a loss at batch 8 on two CPU cores); `disable_by_batch_size` (vLLM's) stops proposing while more
sequences than that are running.

Refused with speculation: KIVI caches (int4/int2: a rejected key would stay in the fp16 residual), token eviction
(its scores would count rejected queries) and sliding windows that give blocks back (a rejected token's window
moves too far).
"""
from __future__ import annotations

import numpy as np

def mean_acceptance_length(drafts: float, accepted: float) -> float:
    """Tokens a verifying step appends on average: the accepted proposed tokens and the model's own (0: none)."""
    return 1 + accepted / drafts if drafts else 0.0


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the last n tokens of `tokens`, for the
    largest n in [n_min, n_max] that occurs; [] if none does."""
    size = len(tokens)
    if k < 1 or size < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = arr[size - n:]
        # windows starting at 0 .. size - n - 1: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return []
