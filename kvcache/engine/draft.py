"""The `draft_model` proposer: a smaller checkpoint with the target's vocabulary guesses each speculating
sequence's next k tokens, with its own paged KV cache.

The draft has its own model, store, KVCacheManager and runner (the same code as the target's); the KV budget
holds both caches with as many blocks each (vLLM's way: sizing.kv_capacity splits it). Per target sequence it
remembers the tokens whose K/V its cache holds (`DraftSeq`);
each step it compares them with the sequence's tokens (the accepted tokens may differ from what it guessed), keeps
the common prefix, gives back the blocks past it, and runs k forwards batched over every speculating sequence: the
first computes what the draft has not seen yet (the tokens verified since its last step, the last one included)
and proposes one token; each following forward feeds the token just proposed and proposes the next. A sequence
with a shorter k leaves the batch earlier.

For a greedy request the draft proposes its most likely tokens, verified as n-gram proposals are
(engine/spec_decode.py), so the outputs are plain decoding's. For a sampled request it draws each token from its own
distribution q under the request's sampling parameters (temperature, top-k/top-p/min-p, penalties: q close to the
target's p is what makes proposals accepted), and the engine applies speculative sampling's rule
(sampler.rejection_sample: accept with min(1, p/q), else draw from the normalised max(0, p - q)), so every token
has the target's distribution whatever the draft proposes. A seeded request draws all of that from its generator:
the same workload run again gives the same tokens, but not plain decoding's draws (n-gram's are), and anything
that changes its proposals (a draft-pool miss, disable_by_batch_size, a trimmed proposal) changes its draws.

Its blocks go back when the target sequence leaves the running set (finished, aborted, preempted): `retain`
after every step. A sequence the draft pool has no room for does not speculate in that step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvcache.attention.metadata import SeqChunk
from kvcache.engine.model_runner import ModelRunner
from kvcache.engine.sampler import SamplingRow, draw, probabilities
from kvcache.memory.kv_cache_manager import KVCacheManager
from kvcache.models.loader import LoadedModel, build_model, read_checkpoint
from kvcache.plan.kv_bytes import kv_bytes_per_token
from kvcache.plan.shape import shape_from_config
from kvcache.store.quantized_store import check_latent_format, make_store

log = logging.getLogger("kvcache")


@dataclass(slots=True)
class DraftSeq:
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the draft's cache holds, in order


def read_draft(path: str, target: LoadedModel, max_model_len: int) -> LoadedModel:
    """The draft checkpoint at `path` (its tensors not read yet), or ValueError unless it can propose for `target`:
    the same vocabulary (size and token -> id map) and a context of at least max_model_len tokens."""
    draft = read_checkpoint(path)
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise ValueError(f"speculative_config model {draft.source} has a vocabulary of {dv:,} tokens, the target "
                         f"{tv:,}: a draft model must share the target's tokenizer")
    dmap, tmap = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dmap != tmap:
        differ = sorted(set(dmap.items()) ^ set(tmap.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(f"speculative_config model {draft.source} has another tokenizer than the target: "
                         f"{len(set(dmap.items()) ^ set(tmap.items())):,} (token, id) pairs differ, e.g. {differ}")
    context = getattr(draft.config, "max_position_embeddings", None) or 2048
    if context < max_model_len:
        raise ValueError(f"speculative_config model {draft.source} has a context of {context:,} tokens, below the "
                         f"target's max_model_len {max_model_len:,}: lower --max-model-len")
    return draft


class DraftProposer:
    """Owns the draft model and its KV cache; `propose` fills `seq.draft` for the sequences it is given."""

    def __init__(self, loaded: LoadedModel, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 kv_dtype: str, quantization: str, backend: str, max_tokens: int = 2048) -> None:
        """`loaded`: the draft checkpoint, passed by read_draft; its weights are read here (before the KV budget
        is split), its cache is made by make_cache."""
        self.shape = shape_from_config(loaded.config.to_dict(), name=loaded.source)
        if "mla" in self.shape.layer_kinds:
            check_latent_format(kv_dtype)
        self.device, self.dtype, self.kv_dtype = device, dtype, kv_dtype
        self.max_tokens = max_tokens  # tokens per draft forward at most (the target's max_num_batched_tokens)
        self.backend = backend  # the target's, resolved for the same device, dtype, KV format and block size
        # the engine keeps a proposal inside max_model_len, so the draft feeds no position beyond it
        self.model = build_model(loaded, max_model_len, device, dtype, quantization)
        self.bytes_per_token = kv_bytes_per_token(self.shape, kv_dtype)
        self.source = loaded.source
        self.seqs: dict[int, DraftSeq] = {}

    def make_cache(self, num_blocks: int, block_size: int) -> None:
        """Its paged cache: `num_blocks` blocks (the null block included, as the target's pool)."""
        self.kv = KVCacheManager(num_blocks, block_size, None)
        kv_heads, head_dim, latent = self.model.kv_layout
        self.store = make_store(self.shape.num_layers, num_blocks, block_size, kv_heads, head_dim, self.kv_dtype,
                                self.dtype, self.device, self.bytes_per_token, latent)
        self.runner = ModelRunner(self.model, self.store, self.kv, self.device, self.backend)
        log.info("draft model %s: %.2f GiB of weights; its KV cache (%s) %s blocks x %d tokens, %.2f GiB",
                 self.source, self.model.weight_bytes / 2**30, self.kv_dtype, f"{num_blocks - 1:,}", block_size,
                 self.store.nbytes / 2**30)

    def info(self) -> dict:
        kv = self.kv
        return {"model": self.source, "weight_bytes": self.model.weight_bytes, "kv_bytes": self.store.nbytes,
                "num_blocks": kv.pool.num_usable, "used_blocks": kv.pool.num_usable - kv.num_free_blocks}

    def propose(self, wanted: list[tuple[object, int]], eos_token_id: int | None) -> None:
        """For each (sequence, k) with k >= 1, set seq.draft to k tokens of the draft's (left empty for a sequence
        the draft pool has no room for): greedy requests its most likely ones; sampled requests draw each from
        the draft's distribution under the request's sampling parameters, kept in seq.draft_probs for the
        rejection rule."""
        live = []
        for seq, k in wanted:
            if self._prepare(seq, k):
                live.append((seq, k))
        if not live:
            return
        probs: dict[int, list[torch.Tensor]] = {seq.seq_id: [] for seq, _ in live if not seq.params.greedy}
        self._catch_up(live)
        # first proposing forward: what each sequence's draft cache still lacks (its last token at least)
        chunks = [(seq, seq.token_ids[len(self.seqs[seq.seq_id].tokens):]) for seq, _ in live]
        for j in range(max(k for _, k in live)):
            for (seq, fed), token in zip(chunks, self._forward(chunks, probs, eos_token_id)):
                self.seqs[seq.seq_id].tokens.extend(fed)
                seq.draft.append(token)
            chunks = [(seq, [seq.draft[-1]]) for seq, k in live if k > j + 1]
        for seq, _ in live:
            if seq.seq_id in probs:
                seq.draft_probs = torch.stack(probs[seq.seq_id])

    def _catch_up(self, live: list[tuple[object, int]]) -> None:
        """Compute what the sequences' draft caches lack, in forwards of at most `max_tokens` tokens that need no
        logits, until the first proposing forward (the rest and each last token) fits in `max_tokens` (a new
        request's prompt, or one back from a preemption, is the draft's prefill: chunked as the target's is, so no
        draft forward is larger than a target step)."""
        budget = self.max_tokens
        while True:
            # tokens before each one's last that the draft has not computed, the largest first
            lags = sorted(((len(seq.token_ids) - len(self.seqs[seq.seq_id].tokens) - 1, seq) for seq, _ in live),
                          key=lambda x: -x[0])
            if sum(lag + 1 for lag, _ in lags) <= budget:  # the first proposing forward fits as it is
                return
            chunks, left = [], budget
            for lag, seq in lags:
                if lag > 0 and left > 0:
                    done, n = len(self.seqs[seq.seq_id].tokens), min(lag, left)
                    chunks.append((seq, seq.token_ids[done:done + n]))
                    left -= n
            if not chunks:  # more sequences than the budget has tokens: one token each is the floor
                return
            specs = [SeqChunk(fed, len(self.seqs[seq.seq_id].tokens), self.kv.block_tables[seq.seq_id],
                              needs_logits=False, seq_id=seq.seq_id) for seq, fed in chunks]
            self.runner.forward(specs)
            for seq, fed in chunks:
                self.seqs[seq.seq_id].tokens.extend(fed)

    def _prepare(self, seq, k: int) -> bool:
        """Keep the draft's cached tokens that agree with `seq`'s (always fewer than it has: its last token is new
        to the draft), and allocate slots for the k - 1 proposals fed back; False if the pool has no room (the
        sequence's draft state is dropped then)."""
        state = self.seqs.setdefault(seq.seq_id, DraftSeq())
        tokens, cached = seq.token_ids, state.tokens
        keep = 0
        limit = min(len(cached), len(tokens) - 1)
        while keep < limit and cached[keep] == tokens[keep]:
            keep += 1
        del cached[keep:]
        if seq.seq_id in self.kv.block_tables:
            self.kv.trim(seq.seq_id, keep)
        if not self.kv.allocate(seq.seq_id, len(tokens) + k - 1):
            self.free(seq.seq_id)
            return False
        return True

    def _forward(self, chunks: list[tuple[object, list[int]]], probs: dict[int, list[torch.Tensor]],
                 eos_token_id: int | None) -> list[int]:
        """One draft forward over `chunks` (sequence, tokens fed); the next token of each: the most likely, or for
        a sampled request (in `probs`) a draw from its distribution, appended to probs[seq_id]."""
        specs = [SeqChunk(fed, len(self.seqs[seq.seq_id].tokens), self.kv.block_tables[seq.seq_id],
                          seq_id=seq.seq_id) for seq, fed in chunks]
        logits = self.runner.forward(specs)
        tokens = logits.argmax(-1).tolist()
        sampled = [i for i, (seq, _) in enumerate(chunks) if seq.seq_id in probs]
        if sampled:
            # non-finite draft logits would make no distribution: such a row proposes its argmax, one-hot
            rows = [SamplingRow(seq.params, seq.generator, seq.token_ids + seq.draft, seq.num_prompt_tokens)
                    for seq, _ in (chunks[i] for i in sampled)]
            mine = logits[sampled]
            q = probabilities(mine, rows, eos_token_id)
            bad = ~torch.isfinite(q).all(-1)
            if bad.any():
                q[bad] = torch.nn.functional.one_hot(mine[bad].argmax(-1), q.shape[1]).to(q.dtype)
            for i, token in zip(sampled, draw(q, [r.generator for r in rows])):
                tokens[i] = token
            for i, row in zip(sampled, q):
                probs[chunks[i][0].seq_id].append(row)
        return tokens

    def retain(self, seq_ids: set[int]) -> None:
        """Give back the blocks of sequences no longer running."""
        for sid in [s for s in self.seqs if s not in seq_ids]:
            self.free(sid)

    def free(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        if seq_id in self.kv.block_tables:
            self.kv.free(seq_id)

    def check_no_leaks(self) -> None:
        if self.seqs or self.kv.block_tables or self.kv.num_free_blocks != self.kv.pool.num_usable:
            raise AssertionError(f"the draft model holds {len(self.kv.block_tables)} block tables and "
                                 f"{self.kv.pool.num_usable - self.kv.num_free_blocks} blocks with no request running")
