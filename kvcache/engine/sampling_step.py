"""A step's logits into tokens (SamplingStep, a base of LLMEngine): the sampler over every row at once (a batch
that raises is sampled again row by row), the forks of n > 1 requests whose prompt just finished, speculative
proposals and their verification (greedy match or the rejection rule), then each token appended and its stop
conditions checked. A row that fails fails its request alone (LLMEngine._fail).
"""
from __future__ import annotations

import itertools
import logging
import time

import torch

from kvcache.engine.sampler import (SamplingRow, logprob_dicts, probabilities, rejection_sample, sample,
                                    skip_draws)
from kvcache.engine.sequence import Sequence
from kvcache.engine.spec_decode import ngram_propose
from kvcache.memory.block_pool import OutOfBlocksError

log = logging.getLogger("kvcache")


class SamplingStep:
    """Proposing, sampling, verifying and appending for LLMEngine's step."""

    def _propose(self) -> None:
        """Each decoding sequence's proposal for this step (n-gram: engine/spec_decode.py; the draft model, batched:
        engine/draft.py); at most what its max_tokens and max_model_len leave after the token the target adds. A
        request with its own token eviction does not speculate (its scores would count rejected queries)."""
        spec = self.spec
        off = spec.disable_by_batch_size is not None and len(self.scheduler.running) > spec.disable_by_batch_size
        wanted = []
        for seq in self.scheduler.running:
            seq.draft, seq.draft_probs = [], None
            if off or seq.num_tokens - seq.num_computed_tokens != 1 or seq.eviction:
                continue
            k = min(spec.num_speculative_tokens, seq.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)
            if k <= 0:
                continue
            if self.drafter is None:
                seq.draft = ngram_propose(seq.token_ids, k, spec.prompt_lookup_max, spec.prompt_lookup_min)
            else:
                wanted.append((seq, k))
        if wanted:
            self.drafter.propose(wanted, self._sampler_eos)

    def _sample_and_append(self, sampled: list[Sequence], logits: torch.Tensor) -> set[str]:
        seqs, rows, forks = self._sampling_rows(sampled)
        if not seqs:
            return set()
        # Logits rows: 1 + len(draft) per sampled sequence, in order; a fork samples from its parent's (a prompt's)
        first = list(itertools.accumulate([1 + len(s.draft) for s in sampled], initial=0))
        row_seqs, row_ids, tokens = [], [], []
        drawn = {}  # a sampled draft-model proposal's rows go to the rejection rule, not the plain draw
        for seq, i in zip(seqs, rows):
            if seq.draft and seq.draft_probs is not None:
                drawn[seq.seq_id] = self._rejection_sample(seq, logits[first[i]:first[i] + 1 + len(seq.draft)])
                continue
            for j in range(1 + len(seq.draft)):  # a speculating sequence: row j verifies draft[j] (draft[:j] before it)
                row_seqs.append(seq)
                row_ids.append(first[i] + j)
                tokens.append(seq.token_ids + seq.draft[:j] if seq.draft else None)
        batch_logits = logits if row_ids == list(range(logits.shape[0])) else \
            logits.index_select(0, torch.tensor(row_ids, dtype=torch.long).to(logits.device, non_blocking=True))
        # a seeded speculating sequence's generator, before its rows draw (rewound to what its accepted rows drew)
        rewind = {seq.seq_id: seq.generator.get_state() for seq in seqs if seq.draft and seq.generator is not None
                  and not seq.params.greedy and seq.seq_id not in drawn}
        results = self._sample(row_seqs, batch_logits, tokens) if row_seqs else []
        for parent, child in forks:
            if parent.is_finished or child.is_finished:  # its request failed
                continue
            child.num_computed_tokens = parent.num_computed_tokens
            try:
                copies = self.kv.fork(parent.seq_id, child.seq_id, parent.num_computed_tokens)
            except OutOfBlocksError:
                child.num_computed_tokens = 0  # no block for its copy: recompute it later
                self.scheduler.add(child)
                continue
            # Copied now, before anything can preempt the child: a swap-out reads its blocks as they are.
            self.scheduler.add_running(child)
            self._isolated(child, "copying the KV blocks of its sample", self.store.copy_blocks, copies)
        now = time.monotonic()
        touched = set()
        to_store: list[tuple[int, int | None, tuple[int, ...], int]] = []  # accepted blocks for the offload tiers
        at = 0
        for seq in seqs:
            if seq.seq_id in drawn:
                pairs, accepted = drawn[seq.seq_id]
            else:
                pairs = results[at:at + 1 + len(seq.draft)]
                at += len(pairs)
                accepted = self._verify(seq, pairs) if seq.draft and not seq.is_finished else 0
            touched.add(seq.request_id)
            if seq.is_finished:
                seq.draft = []
                continue
            appended = 0
            for token, lp in pairs[:accepted + 1]:
                appended += 1
                if self._append(seq, token, lp, now):
                    break
            if seq.seq_id in rewind:
                skip_draws(seq.generator, rewind[seq.seq_id], appended)
            if seq.draft and not seq.is_finished:
                self._isolated(seq, "rolling back its rejected tokens", self._accept, seq, accepted, to_store)
            seq.draft, seq.draft_probs = [], None
        if to_store:
            self.offload.store(to_store)
        return touched

    def _append(self, seq: Sequence, token: int, lp: dict | None, now: float) -> bool:
        """Append one sampled token and check the stop conditions; whether the sequence finished."""
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp[token]
        self.stats.generation_tokens += 1
        req = self.requests[seq.request_id]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        try:
            reason = self.stop.stop_reason(seq, token)
        except Exception as e:  # a tokenizer that cannot decode what was sampled
            self._fail(req, "the engine failed while checking this request's stop conditions", e)
            return True
        if reason:
            self.scheduler.finish(seq, reason)
        return bool(reason)

    def _verify(self, seq: Sequence, pairs: list[tuple[int, dict | None]]) -> int:
        """How many of the sequence's proposed tokens the target's own tokens (`pairs`, one per row) confirm: the
        longest run from the first; the token after the run is the target's. Counted in the stats."""
        accepted = 0
        while accepted < len(seq.draft) and pairs[accepted][0] == seq.draft[accepted]:
            accepted += 1
        self.stats.count_draft(len(seq.draft), accepted)
        return accepted

    def _rejection_sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[list[tuple[int, dict | None]], int]:
        """A sampled draft-model proposal verified by speculative sampling's rule (sampler.rejection_sample) on
        the target's distributions of its 1 + k rows (`logits`): the (token, logprobs) pairs to append and how many
        proposed tokens were accepted; ([(-1, None)], 0) with the request failed if its logits are not finite."""
        req = self.requests[seq.request_id]
        if not bool(torch.isfinite(logits).all()):
            self._fail(req, "the model produced non-finite logits (NaN or inf) for this sequence")
            return [(-1, None)], 0
        k, n = len(seq.draft), seq.num_prompt_tokens
        rows = [SamplingRow(seq.params, None, seq.token_ids + seq.draft[:j], n) for j in range(k + 1)]
        try:
            target = probabilities(logits, rows, self._sampler_eos)
            tokens, accepted = rejection_sample(target, seq.draft_probs[:k], seq.draft, seq.generator)
            count = seq.params.logprobs
            lps = [None] * len(tokens) if count is None else logprob_dicts(logits[:len(tokens)], tokens, count)
        except Exception as e:
            self._fail(req, "the engine failed while sampling this request's next token", e)
            return [(-1, None)], 0
        self.stats.count_draft(len(seq.draft), accepted)
        return list(zip(tokens, lps)), accepted

    def _accept(self, seq: Sequence, accepted: int, to_store: list[tuple[int, int | None, tuple[int, ...], int]]
                ) -> None:
        """After verification: the accepted tokens' K/V (written this step) count as computed, their full blocks
        join the prefix cache (and `to_store`, for the offload tiers), and blocks that held only rejected tokens go
        back to the pool."""
        seq.num_computed_tokens += accepted
        self._cache_blocks(seq, to_store)
        self.kv.trim(seq.seq_id, seq.num_tokens - seq.num_evicted)

    def _sampling_rows(self, sampled: list[Sequence]) -> tuple[list[Sequence], list[int], list[tuple[Sequence, Sequence]]]:
        """The sequences to sample, their rows of the logits, and the (parent, child) forks of n > 1 requests
        whose prompt just finished: each child samples from its parent's row."""
        seqs, rows, forks = [], [], []
        for i, seq in enumerate(sampled):
            if seq.is_finished:  # failed earlier in this step
                continue
            seqs.append(seq)
            rows.append(i)
            if seq.params.n > 1 and not seq.forked and seq.index == 0:
                seq.forked = True
                req = self.requests[seq.request_id]
                for j in range(1, seq.params.n):
                    child = self._new_seq(req, j, seq.max_tokens)
                    req.seqs.append(child)
                    forks.append((seq, child))
                    seqs.append(child)
                    rows.append(i)
        return seqs, rows, forks

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[list[int] | None] | None = None
                ) -> list[tuple[int, dict | None]]:
        """(token, logprobs) per row: row i is seqs[i]'s, with tokens[i] (when given and not None) as its tokens so
        far (a speculating sequence's row after proposed tokens). A row the sampler refuses, or that raises when
        sampled alone after the whole batch raised, fails its request; its pair is then (-1, None)."""
        tokens = tokens or [None] * len(seqs)
        rows = [SamplingRow(s.params, s.generator, s.token_ids if t is None else t, s.num_prompt_tokens)
                for s, t in zip(seqs, tokens)]
        eos = self._sampler_eos
        # A batch that raises is sampled again row by row, each seeded row from where its generator was.
        states = [r.generator.get_state() if r.generator is not None else None for r in rows]
        try:
            result = sample(logits, rows, eos)
            pairs, errors = list(zip(result.token_ids, result.logprobs)), result.errors
        except Exception as e:
            log.warning("sampling a batch of %d rows failed (%s: %s); sampling them one by one", len(rows),
                        type(e).__name__, e)
            pairs, errors, restored = [], {}, set()
            for i, (row, state) in enumerate(zip(rows, states)):
                # once per generator: a speculating sequence's rows draw one after another from it
                if state is not None and id(row.generator) not in restored:
                    restored.add(id(row.generator))
                    row.generator.set_state(state)
                try:
                    one = sample(logits[i:i + 1], [row], eos)
                    pairs.append((one.token_ids[0], one.logprobs[0]))
                    if one.errors:
                        errors[i] = one.errors[0]
                except Exception as row_error:
                    pairs.append((-1, None))
                    self._fail(self.requests[seqs[i].request_id], "the engine failed while sampling this request's "
                               "next token", row_error)
        for i, message in errors.items():
            self._fail(self.requests[seqs[i].request_id], message)
        return pairs
