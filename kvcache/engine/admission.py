"""Requests into LLMEngine: each checked whole before it is queued (RequestAdmission, a base of LLMEngine).

A request that can never run (an id in use, an empty or out-of-vocabulary prompt, lengths past max_model_len,
more blocks than the whole pool, settings its eviction policy refuses) raises ValueError and changes nothing.
"""
from __future__ import annotations

import time

import torch

from kvcache.compress.spec import EvictionSpec
from kvcache.engine.outputs import Request, RequestMetrics
from kvcache.engine.sampling_params import SamplingParams
from kvcache.engine.sequence import Sequence
from kvcache.memory.kv_cache_manager import blocks_for
from kvcache.messages import describe

MAX_CACHE_SALT_CHARS = 256


class RequestAdmission:
    """add_request, abort_request and tokenize of LLMEngine."""

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    stream: bool = False, add_special_tokens: bool = True, cache_salt: str | None = None,
                    eviction: EvictionSpec | None = None) -> None:
        """Validate and queue a request. Raises ValueError (and changes nothing) if it can never run.

        `cache_salt`: prefixes are shared only between requests with the same salt (None is a salt
        of its own), so one tenant cannot learn another's prompts from cache timing.
        `eviction`: this request's token eviction policy and budget (default: the engine's, --kv-eviction).
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                       or len(cache_salt) > MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters; "
                             f"got {type(cache_salt).__name__} of length {len(cache_salt) if isinstance(cache_salt, str) else '-'}")
        if params.kv_retention is not None:
            self.kv.check_retention()
        text, ids = self._prompt_ids(prompt, add_special_tokens)
        max_tokens = self._check_lengths(len(ids), params)
        spec = eviction if eviction is not None else self.config.eviction
        state = None
        # Eviction or not, a request must fit whole: after a preemption it is recomputed from its tokens.
        peak = len(ids) + max_tokens
        need = self.peak_blocks(peak) + self.kv.seq_blocks
        if spec.enabled:
            self._check_eviction(spec)
            if params.n > 1:
                raise ValueError(f"n must be 1 with kv_eviction {spec.policy}, got {params.n}: the samples would "
                                 "share a prompt cache that each compacts differently")
            state = self.evictor.new_state(spec, len(ids), params.seed if params.seed is not None else self.config.seed)
            if self.kv.radix:  # the prompt's blocks are in the tree: the survivors need fresh blocks beside them
                kept = max(state.policy.budgets(state, len(ids)))
                need = max(need, blocks_for(len(ids), self.config.block_size) +
                           blocks_for(min(kept, len(ids)), self.config.block_size) + self.kv.seq_blocks)
        if need > self.kv.pool.num_usable:
            raise ValueError(f"request needs {need:,} KV blocks ({peak:,} tokens) but the whole "
                             f"pool has {self.kv.pool.num_usable:,}; raise --kv-cache-memory or lower max_tokens")
        req = Request(request_id, text, ids, params, [], RequestMetrics(time.monotonic()), stream, cache_salt)
        req.seqs.append(self._new_seq(req, 0, max_tokens))
        req.seqs[0].eviction = state
        self.requests[request_id] = req
        self.stats.prompt_tokens += len(ids)
        self.scheduler.add(req.seqs[0])

    def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or ids; ValueError if it is empty or an id is
        outside the vocabulary."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt, add_special_tokens)
        else:
            text, ids = None, list(prompt)
            vocab = self.model.config.vocab_size
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {describe(bad[:5])}")
        if not ids:
            raise ValueError("the prompt is empty" if not text else f"the prompt ({len(text):,} characters) tokenizes "
                             "to no tokens with this model's tokenizer")
        return text, ids

    def _check_lengths(self, n_prompt: int, params: SamplingParams) -> int:
        """The request's output token limit; ValueError if prompt and output cannot fit max_model_len, or the
        prompt can never be scheduled."""
        if n_prompt >= self.max_model_len:
            raise ValueError(f"prompt has {n_prompt:,} tokens; max_model_len is {self.max_model_len:,} "
                             "(at least one output token must fit)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if max_tokens > self.max_model_len:  # checked first: a client's number may have thousands of digits
            raise ValueError(f"max_tokens {describe(max_tokens)} is above max_model_len {self.max_model_len:,}")
        if n_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"prompt has {n_prompt:,} tokens and max_tokens is {max_tokens:,}: "
                             f"{n_prompt + max_tokens:,} is above max_model_len {self.max_model_len:,}")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens {describe(params.min_tokens)} is above the {max_tokens:,} output tokens this "
                             "request can have")
        if params.min_tokens and self._stops_cover_vocab(params):
            raise ValueError(f"min_tokens {params.min_tokens} cannot be honoured: stop_token_ids and EOS are every "
                             "token of the vocabulary, so nothing is left to sample before min_tokens")
        if not self.config.enable_chunked_prefill and n_prompt > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt has {n_prompt:,} tokens but chunked prefill is off and a step takes at most "
                             f"max_num_batched_tokens={self.config.max_num_batched_tokens:,}")
        return max_tokens

    def _stops_cover_vocab(self, params: SamplingParams) -> bool:
        """Whether masking EOS and stop_token_ids (as min_tokens does) leaves no token to sample."""
        vocab = self.model.config.vocab_size
        stops = {t for t in params.stop_token_ids if t < vocab} | {self._sampler_eos}
        return len(stops - {None}) >= vocab

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError if the tokenizer cannot encode it (a lone surrogate, for one)."""
        return encode_prompt(self.tokenizer, text, add_special_tokens)

    def _new_seq(self, req: Request, index: int, max_tokens: int) -> Sequence:
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator(self.device).manual_seed(req.params.seed + index)
        return Sequence(next(self._seq_ids), req.request_id, index, list(req.prompt_token_ids),
                        len(req.prompt_token_ids), req.params, max_tokens, gen,
                        extra_key=(req.cache_salt,) if req.cache_salt is not None else ())

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if it is unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
            if self.drafter is not None:
                self.drafter.free(seq.seq_id)
        self._count_finished("abort")
        return True


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer`'s ids of `text`; ValueError if it cannot encode it (a lone surrogate, for one)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:  # tokenizers raise TypeError/exceptions of their own on bad text
        raise ValueError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}") from None
