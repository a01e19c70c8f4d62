"""LLMEngine: requests in, one scheduled step at a time, outputs out.

A failure is contained to the requests it can be blamed on. An error in one sequence's sampling, eviction,
prefix caching or stop check fails that request alone (finish_reason "error", its blocks freed); the others
carry on in the same step. An error no request can be blamed on (the batch's forward, the scheduler) fails
the requests of that batch; after MAX_CONSECUTIVE_FAILURES such steps in a row the engine raises
EngineDeadError and must be rebuilt.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import torch

from kvcache.attention.metadata import SeqChunk
from kvcache.compress.spec import EvictionSpec
from kvcache.config import EngineConfig
from kvcache.parallel.errors import RankDiedError
from kvcache.engine.admission import RequestAdmission
from kvcache.engine.eviction import seq_chunk
from kvcache.engine.outputs import CompletionOutput, Request, RequestOutput, request_output
from kvcache.engine.pressure import PressureStats
from kvcache.engine.sampling_step import SamplingStep
from kvcache.engine.sequence import Sequence
from kvcache.engine.startup import EngineStartup
from kvcache.memory.state_snapshots import SnapshotStats
from kvcache.models.loader import LoadedModel
from kvcache.plan.kv_bytes import residual_bytes_per_seq

log = logging.getLogger("kvcache")
MAX_CONSECUTIVE_FAILURES = 3  # steps in a row that fail with no request to blame before the engine gives up

__all__ = ["CompletionOutput", "EngineDeadError", "LLMEngine", "RequestOutput"]


class EngineDeadError(RuntimeError):
    """The engine failed MAX_CONSECUTIVE_FAILURES steps in a row with no request to blame; it cannot go on."""


class LLMEngine(EngineStartup, RequestAdmission, SamplingStep):
    """Continuous-batching engine over a paged KV cache.

    `add_request` validates and queues; every `step()` runs one batch (decodes and
    prefill chunks together) and returns the outputs of requests that finished, and
    of streaming requests that received tokens.

    Its parts: start-up (startup.py's EngineStartup), admission of requests (admission.py), the step's logits
    into tokens (sampling_step.py); here the step itself, failures and their containment, outputs, introspection.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.tp = None
        try:
            self._build(config, loaded)
        except BaseException:
            if self.tp is not None:  # the workers stop with the engine that failed to start
                self.tp.close()
            raise

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def steps(self) -> Iterator[list[RequestOutput]]:
        """Each step's outputs until no request is unfinished: the loop every driver of the engine runs."""
        while self.has_unfinished_requests():
            yield self.step()

    def run_to_completion(self) -> dict[str, RequestOutput]:
        """Step until every request has finished; their final outputs by request id."""
        return {o.request_id: o for outs in self.steps() for o in outs if o.finished}

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return outputs (see the class docstring). A request that
        fails in this step is among the outputs, finished, with finish_reason "error" (the module docstring).
        Raises EngineDeadError after MAX_CONSECUTIVE_FAILURES steps in a row failed with no request to blame."""
        try:
            return self._step()
        finally:
            if self.event_publisher is not None:
                self.event_publisher.notify()  # the step's KV events go out as one batch

    @torch.inference_mode()
    def _step(self) -> list[RequestOutput]:
        self._failed = set()
        if self.spec is not None:
            started = time.perf_counter()
            try:
                self._propose()
            except Exception:  # no request to blame (a draft forward failed): this step does not speculate
                log.exception("proposing speculative tokens failed; this step decodes without them")
                for seq in self.scheduler.running:
                    seq.draft, seq.draft_probs = [], None
                if self.drafter is not None:
                    self.drafter.retain(set())  # its caches may be half written: every sequence starts over
            self.stats.spec_propose_seconds += time.perf_counter() - started
        try:
            sched = self.scheduler.schedule()
        except Exception as e:  # its bookkeeping may be half done: fail what it was working on
            self._batch_failed(list(self.scheduler.running), e)
            return self._collect_outputs(set())
        if not sched.chunks:
            if self.scheduler.waiting and not self.scheduler.running:  # alone in an empty pool and still no room
                seq = self.scheduler.waiting[0]
                self._fail(self.requests[seq.request_id], "the request cannot be scheduled: its blocks do not fit "
                           "in the free KV pool", RuntimeError("scheduler made no progress"))
            return self._collect_outputs(set())
        try:
            touched = self._run(sched.chunks)
        except RankDiedError as e:  # the ranks cannot go on together: nothing this engine runs can succeed
            self._batch_failed([seq for seq, _ in sched.chunks], e)
            raise EngineDeadError(f"tensor parallelism failed: {e}") from e
        except Exception as e:  # the forward, or a fault outside any one request's share of the step
            self.runner.captured = []
            self._batch_failed([seq for seq, _ in sched.chunks], e)
            return self._collect_outputs(set())
        self._consecutive_failures = 0
        return self._collect_outputs(touched)

    def _run(self, chunks: list[tuple[Sequence, int]]) -> set[str]:
        """The forward of the scheduled `chunks`, then each sequence's bookkeeping (prefix caching, eviction,
        sampling, stop checks), isolated per request; returns the requests that got tokens."""
        now = time.monotonic()
        for seq, n in chunks:
            req = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if n - len(seq.draft) > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:  # not a decode
                self.stats.prefill_tokens_computed += n
        loads, self.scheduler.loads = self.scheduler.loads, []
        if loads:
            self.offload.load(loads)
        sampled, logits, specs = self.runner.execute(chunks)
        to_store: list[tuple[int, int | None, tuple[int, ...], int]] = []
        for seq, n in chunks:
            seq.num_computed_tokens += n - len(seq.draft)  # a proposal's tokens count once accepted
            self._isolated(seq, "caching its prefix blocks", self._cache_blocks, seq, to_store)
        if to_store:
            self.offload.store(to_store)
        if self.layer_groups:  # after cache_blocks, as below
            for seq, _ in chunks:
                if seq.seq_id in self.kv.block_tables:
                    self._isolated(seq, "giving back its out-of-window blocks", self.kv.slide, seq.seq_id,
                                   seq.num_computed_tokens)
        if self.release_window:  # after cache_blocks: hash mode gives back registered blocks only
            for seq, _ in chunks:
                if seq.seq_id in self.kv.block_tables:
                    self._isolated(seq, "giving back its out-of-window blocks", self.kv.release_leading, seq.seq_id,
                                   seq.num_computed_tokens - self.release_window + 1)
        self.stats.steps += 1
        used = self.kv.pool.num_usable - self.kv.num_free_blocks  # before eviction: the step's true peak
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, used)
        if any(seq.eviction for seq, _ in chunks):  # after cache_blocks: a compaction leaves the prompt's blocks
            self._evict(chunks, specs)  # to the prefix cache
        return self._sample_and_append(sampled, logits)

    def _evict(self, chunks: list[tuple[Sequence, int]], specs: list[SeqChunk]) -> None:
        """Each evicting sequence's eviction after the step's forward, in eviction.py's two phases. Under tensor
        parallelism a failure in the second fails the engine: the ranks' collectives would be out of step."""
        works, row = [], 0  # row: into the queries captured for eviction, in chunk order
        for (seq, _), spec in zip(chunks, specs):
            if seq.eviction:
                if not seq.is_finished:
                    self._isolated(seq, "evicting its KV tokens", lambda s=seq, c=spec, r=row: works.append(
                        (s, self.evictor.plan(s.seq_id, s.eviction, c, s.num_computed_tokens, r))))
                row += len(spec.capture)
        live = [s.seq_id for r in self.requests.values() for s in r.seqs if s.eviction and not s.is_finished]
        self.evictor.send([w for _, w in works], live)
        for seq, work in works:
            queries = [q[work.rows.start:work.rows.stop] for q in self.runner.captured]
            if self.tp is None:
                self._isolated(seq, "evicting its KV tokens", self.evictor.apply, work, seq.eviction, queries)
            else:
                self.evictor.apply_in_step(work, seq.eviction, queries)

    def _isolated(self, seq: Sequence, what: str, fn, *args) -> None:
        """fn(*args); if it raises, only `seq`'s request fails."""
        try:
            fn(*args)
        except Exception as e:
            self._fail(self.requests[seq.request_id], f"the engine failed while {what}", e)

    def _fail(self, req: Request, message: str, exc: BaseException | None = None) -> None:
        """Finish every sequence of `req` with finish_reason "error" and free its blocks. `message` is for the
        client; `exc` (with its traceback) goes to the log only, under the request id."""
        if req.error is not None:
            return
        log.error("request %s failed: %s", req.request_id, message, exc_info=exc)
        req.error = message
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error", release=self._release_scrubbed)
            seq.finish_reason = "error"  # also on a sequence that had finished
        self._failed.add(req.request_id)

    def _release_scrubbed(self, seq_id: int) -> None:
        """Free a failed sequence's blocks, zeroing those nobody else holds (see KVCacheManager.release_scrubbed)."""
        self.store.zero_blocks(self.kv.release_scrubbed(seq_id))

    def _batch_failed(self, seqs: list[Sequence], exc: Exception) -> None:
        """A failure no single request explains: fail the requests of `seqs`, or give up after
        MAX_CONSECUTIVE_FAILURES in a row."""
        self._consecutive_failures += 1
        rids = sorted({s.request_id for s in seqs})
        log.error("step failed (%d in a row); failing its %d requests: %s", self._consecutive_failures, len(rids),
                  ", ".join(rids), exc_info=exc)
        for rid in rids:
            if rid in self.requests:
                self._fail(self.requests[rid], "the engine failed while running this request's batch")
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            self._collect_outputs(set())  # forget the failed requests: nobody will step this engine again
            raise EngineDeadError(f"{self._consecutive_failures} steps in a row failed with no request to blame; "
                                  f"the last: {type(exc).__name__}: {exc}") from exc

    def _cache_blocks(self, seq: Sequence, to_store: list[tuple[int, int | None, tuple[int, ...], int]]) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache; with offload tiers, add them to
        `to_store` as (chain hash, its parent's, token ids, block)."""
        new = self.kv.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, seq.extra_key)
        if self.offload is None or not new:
            return
        bs, table = self.kv.block_size, self.kv.block_tables[seq.seq_id]
        hashes = self.kv.block_hashes(seq.seq_id, seq.token_ids, seq.extra_key)
        to_store.extend((hashes[i], hashes[i - 1] if i else None, tuple(seq.token_ids[i * bs:(i + 1) * bs]), table[i])
                        for i in new)

    def _count_finished(self, reason: str) -> None:
        self.stats.requests_finished[reason] = self.stats.requests_finished.get(reason, 0) + 1

    def _collect_outputs(self, touched: set[str]) -> list[RequestOutput]:
        if self.drafter is not None:  # the draft's blocks of sequences that finished or were preempted go back
            self.drafter.retain({s.seq_id for s in self.scheduler.running})
        outs = []
        for rid in touched | self._failed:
            req = self.requests[rid]
            finished = req.finished
            if not (finished or req.stream):
                continue
            try:
                outs.append(request_output(req, finished, self.stop.detokenize))
            except Exception as e:  # its text cannot be decoded: it ends here, without text
                self._fail(req, "the engine failed while detokenizing this request's output", e)
                finished = True
                outs.append(request_output(req, True, lambda _: ""))
            if finished:
                req.metrics.finished_time = time.monotonic()
                self._count_finished("error" if req.error else req.seqs[0].finish_reason or "stop")  # like vLLM
                del self.requests[rid]
        return outs

    @torch.inference_mode()
    def score(self, token_ids: list[int], start: int = 0, chunk_size: int | None = None,
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
        if self.requests:
            raise RuntimeError(f"score needs an idle engine; {len(self.requests)} requests are unfinished")
        n = len(token_ids)
        vocab = self.model.config.vocab_size
        if not 0 < n <= self.max_model_len or not 0 <= start < n:
            raise ValueError(f"score needs 1..{self.max_model_len:,} tokens and 0 <= start < {n:,}; "
                             f"got start {start:,}")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"token ids must be ints in [0, {vocab})")
        chunk = chunk_size or self.config.max_num_batched_tokens
        if chunk < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk}")
        state = None
        if eviction is not None and eviction.enabled:
            self._check_eviction(eviction)
            state = self.evictor.new_state(eviction, start + 1, self.config.seed)
        return self._score_chunks(token_ids, start, chunk, state)

    def _score_chunks(self, token_ids: list[int], start: int, chunk: int, state) -> torch.Tensor:
        """score's forwards: the tokens in prefill chunks of `chunk` (with an eviction `state`, the prompt in
        chunks, then one token a step), under a sequence id of its own whose blocks are freed at the end."""
        n = len(token_ids)
        seq_id = next(self._seq_ids)
        try:
            out, done = [], 0
            while done < n:
                if state is None:
                    e = min(n, done + chunk)
                else:
                    e = min(start + 1, done + chunk) if done <= start else done + 1
                evicted = state.num_evicted if state else 0
                need = n if state is None else e - evicted  # without eviction, all blocks before any forward
                if not self.kv.allocate(seq_id, need):
                    raise ValueError(f"{need:,} tokens need {self.kv.blocks_needed(seq_id, need):,} KV blocks; "
                                     f"{self.kv.num_free_blocks:,} are free")
                c = seq_chunk(seq_id, token_ids[done:e], done - evicted, self.kv.block_tables[seq_id], True,
                              self.kv.private_blocks.get(seq_id, []), state)
                # a chunk wholly before `start` gets an empty range of logit rows
                out.append(self.runner.run_chunk(c, range(max(done, start) - done, e - done), state is not None))
                done = e
                if state is not None:
                    self.evictor.after_forward(seq_id, state, c, self.runner.captured, done)
            return torch.cat(out)
        finally:
            self.kv.free(seq_id)

    # ---- introspection ------------------------------------------------------------------------

    def _snapshot_info(self) -> dict:
        """The recurrent state's snapshots (prefix caching of a hybrid model): held, slots, saved, hit, evicted."""
        snaps = self.snapshots
        stats = snaps.stats if snaps is not None else SnapshotStats()
        return {"state_snapshots": len(snaps) if snaps is not None else 0,
                "state_snapshot_slots": snaps.num_slots if snaps is not None else 0,
                "state_snapshots_saved": stats.saved, "state_snapshot_hits": stats.hits,
                "state_snapshots_evicted": stats.evicted}

    def kv_cache_info(self) -> dict:
        """KV cache figures (bytes, blocks, tokens) as sized at start-up, plus current usage and prefix caching.

        Cached blocks that no request holds count as free: an allocation takes them (evicting them).
        """
        c, kv = self.capacity, self.kv
        free = kv.num_free_blocks
        return {
            "device": str(self.device), "compute_dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend, "cuda_graphs": self.graphs.info(),
            "quantization": self.config.quantization, "cpu_isa": self.cpu_isa,
            "weight_bytes": self.model.weight_bytes, "weight_read_bytes": self.model.weight_read_bytes,
            "kv_cache_budget": str(self.budget),
            "block_size": c.block_size, "num_blocks": c.num_blocks, "num_tokens": c.num_tokens,
            "bytes_per_token": c.bytes_per_token, "total_bytes": c.total_bytes, "dtype": self.kv_dtype,
            "seq_blocks": c.seq_blocks, "residual_bytes_per_seq": residual_bytes_per_seq(self.shape, self.kv_dtype),
            "max_model_len": c.max_model_len, "max_concurrency": c.max_concurrency,
            "formula": self._kv_formula(),
            "layer_groups": [{"window": g.window, "layers": list(g.layers)} for g in self.layer_groups],
            "layers_per_block": c.layers_per_block or self.shape.num_layers,
            "kv_layers": self.shape.num_kv_layers,
            "state_layers": self.shape.count("linear"), "state_slots": c.state_slots, "state_bytes": c.state_bytes,
            "state_bytes_per_seq": self.state_store.bytes_per_slot if self.state_store is not None else 0,
            "free_state_slots": self.state_slots.num_free if self.state_slots is not None else 0,
            **self._snapshot_info(),
            "blocks_per_request": c.blocks_per_request,
            "free_blocks": free, "used_blocks": kv.pool.num_usable - free,
            "usage": 1 - free / kv.pool.num_usable, "peak_used_blocks": self.stats.peak_used_blocks,
            "num_preemptions": self.scheduler.num_preemptions, "preemption_mode": self.config.preemption_mode,
            "num_swapped_out": self.scheduler.num_swapped_out, "num_swapped_in": self.scheduler.num_swapped_in,
            "num_swap_fallbacks": self.scheduler.num_swap_fallbacks,
            "prefix_caching": kv.prefix_caching, "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits, "prefix_cache_hit_rate": kv.stats.hit_rate,
            "cached_blocks": kv.num_cached_blocks, "prefix_cache_evictions": kv.num_evictions,
            "kv_eviction": self.config.kv_eviction, "kv_budget": self.config.kv_budget,
            "evicted_tokens": self.evictor.stats.evicted_tokens, "eviction_freed_blocks": self.evictor.stats.freed_blocks,
            "eviction_compactions": self.evictor.stats.compactions,
            "kv_pressure_policy": self.config.kv_pressure_policy, **self._pressure_info(),
            "pinned_blocks": len(kv.pool.pinned),
            "prefill_tokens_computed": self.stats.prefill_tokens_computed,
            "speculative_config": vars(self.spec) if self.spec else None,
            "spec_decode_num_drafts": self.stats.spec_drafts,
            "spec_decode_num_draft_tokens": self.stats.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": self.stats.spec_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.stats.spec_accepted_per_position),
            "spec_decode_propose_seconds": self.stats.spec_propose_seconds,
            "draft_model": self.drafter.info() if self.drafter else None,
            "offload": self.offload.info() if self.offload else None,
            "kv_events": self.event_publisher.info() if self.event_publisher else None,
        }

    def _pressure_info(self) -> dict:
        """The pressure ladder's counts (zero without it)."""
        ladder = self.scheduler.pressure
        stats = ladder.stats if ladder is not None else PressureStats()
        return {f"pressure_{k}": v for k, v in dataclasses.asdict(stats).items()}

    def close(self) -> None:
        """Write what the offload tiers still have queued and publish the last KV events; the engine must not be
        stepped afterwards. Idempotent. Stops the tensor-parallel workers."""
        if self.tp is not None:
            self.tp.close()
        if self.offload is not None:
            self.offload.close()
        if self.event_publisher is not None:
            self.event_publisher.close()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many. Refused (RuntimeError) while requests run,
        as their blocks are in use (vLLM refuses too)."""
        if self.requests:
            raise RuntimeError(f"cannot reset the prefix cache while {len(self.requests)} requests are unfinished; "
                               "wait for them or abort them first")
        return self.kv.reset_prefix_cache()

    def check_no_leaks(self) -> None:
        """Raise if any block is held while no request is unfinished (used by tests and benchmarks).

        With no request left, every block is free or cached: idle in the free list (hash) or held
        once by the radix tree, with nothing locked.
        """
        if self.requests:
            return
        if self.drafter is not None:
            self.drafter.check_no_leaks()
        kv, pool = self.kv, self.kv.pool
        tree = (kv.radix.num_blocks if kv.radix else 0) + len(pool.pinned)  # pinned blocks are held for good
        held = sum(pool.ref_counts)
        if kv.block_tables or held != tree or kv.num_free_blocks + len(pool.pinned) != pool.num_usable:
            raise AssertionError(f"{held - tree} block references still held with no request running "
                                 f"({len(kv.block_tables)} block tables, {tree} blocks in the radix tree or pinned)")
