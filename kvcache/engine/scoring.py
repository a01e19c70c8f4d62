"""Teacher-forced scoring through the paged KV cache (LLMEngine.score): the logits of every position of a token
sequence, as its prompt's prefill (and, with an eviction policy, its decodes) would compute them. What `kvcache
eval` measures KV formats, eviction policies and weight formats with, and `bench kv-cache-on-off`'s uncached path."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvcache.compress.spec import EvictionSpec
from kvcache.engine.eviction import seq_chunk

if TYPE_CHECKING:
    from kvcache.engine.llm_engine import LLMEngine


@torch.inference_mode()
def score(engine: LLMEngine, token_ids: list[int], start: int = 0, chunk_size: int | None = None,
          eviction: EvictionSpec | None = None) -> torch.Tensor:
    """Teacher-forced logits: row i is the next-token distribution after `token_ids[:start + i + 1]`
    (fp32, [len(token_ids) - start, vocab]).

    The tokens go through the paged KV cache in prefill chunks of `chunk_size` (default
    max_num_batched_tokens), in the cache's storage format, as a request's prompt does; this is what
    `kvcache eval` measures quantization with. With `eviction`, `token_ids[:start + 1]` is the prompt:
    prefilled in chunks and compacted as a request's would be; the other tokens then run one per step,
    as decodes, so that decode-time policies evict as they go. Only while no request is unfinished; the
    blocks are freed afterwards and nothing is added to the prefix cache.
    """
    if engine.requests:
        raise RuntimeError(f"score needs an idle engine; {len(engine.requests)} requests are unfinished")
    n = len(token_ids)
    vocab = engine.model.config.vocab_size
    if not 0 < n <= engine.max_model_len or not 0 <= start < n:
        raise ValueError(f"score needs 1..{engine.max_model_len:,} tokens and 0 <= start < {n:,}; got start {start:,}")
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
        raise ValueError(f"token ids must be ints in [0, {vocab})")
    chunk = chunk_size or engine.config.max_num_batched_tokens
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk}")
    state = None
    if eviction is not None and eviction.enabled:
        engine._check_eviction(eviction)
        state = engine.evictor.new_state(eviction, start + 1, engine.config.seed)
    seq_id = next(engine._seq_ids)
    try:
        out, done = [], 0
        while done < n:
            if state is None:
                e = min(n, done + chunk)
            else:
                e = min(start + 1, done + chunk) if done <= start else done + 1
            evicted = state.num_evicted if state else 0
            need = n if state is None else e - evicted  # without eviction, all blocks before any forward
            if not engine.kv.allocate(seq_id, need):
                raise ValueError(f"{need:,} tokens need {engine.kv.blocks_needed(seq_id, need):,} KV blocks; "
                                 f"{engine.kv.num_free_blocks:,} are free")
            c = seq_chunk(seq_id, token_ids[done:e], done - evicted, engine.kv.block_tables[seq_id], True,
                          engine.kv.private_blocks.get(seq_id, []), state)
            # a chunk wholly before `start` gets an empty range of logit rows
            out.append(engine.runner.run_chunk(c, range(max(done, start) - done, e - done), state is not None))
            done = e
            if state is not None:
                engine.evictor.after_forward(seq_id, state, c, engine.runner.captured, done)
        return torch.cat(out)
    finally:
        engine.kv.free(seq_id)
