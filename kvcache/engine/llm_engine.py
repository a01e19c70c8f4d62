"""LLMEngine: requests in, one scheduled step at a time, outputs out.

A failure is contained to the requests it can be blamed on. An error in one sequence's sampling, eviction,
prefix caching or stop check fails that request alone (finish_reason "error", its blocks freed); the others
carry on in the same step. An error no request can be blamed on (the batch's forward, the scheduler) fails
the requests of that batch; after MAX_CONSECUTIVE_FAILURES such steps in a row the engine raises
EngineDeadError and must be rebuilt.
"""
from __future__ import annotations

import collections
import itertools
import logging
import numbers
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvcache import native
from kvcache.attention.backend import resolve_backend, with_backend_write
from kvcache.attention.metadata import SeqChunk
from kvcache.compress.spec import EvictionSpec
from kvcache.config import EngineConfig
from kvcache.distributed.tensor_parallel import (MirroredStore, RankDiedError, TensorParallel, build_shard,
                                                 check_tensor_parallel, head_share, serve_as_launched_worker)
from kvcache.engine import scoring
from kvcache.engine.cuda_graphs import DecodeGraphPlan
from kvcache.engine.draft import DraftProposer, read_draft
from kvcache.engine.eviction import Evictor
from kvcache.engine.kv_events import ZmqEventPublisher
from kvcache.engine.model_runner import ModelRunner
from kvcache.engine.outputs import CompletionOutput, Request, RequestMetrics, RequestOutput, request_output
from kvcache.engine.sampler import (SamplingRow, logprob_dicts, probabilities, rejection_sample, sample,
                                    skip_draws)
from kvcache.engine.sampling_params import SamplingParams
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.sequence import Sequence
from kvcache.engine.sizing import (kv_capacity, layer_groups_for, peak_blocks, release_window, resolve_device_dtype,
                                   slow_half_precision, why_every_block_is_kept)
from kvcache.engine.spec_decode import ngram_propose
from kvcache.engine.stop_checker import StopChecker
from kvcache.memory.block_pool import OutOfBlocksError
from kvcache.memory.kv_cache_manager import KVCacheManager, blocks_for
from kvcache.memory.layer_groups import GroupedKVCacheManager
from kvcache.memory.kv_events import KVEventLog
from kvcache.messages import describe
from kvcache.models.loader import LoadedModel, build_model, read_checkpoint
from kvcache.models.llama import layer_windows
from kvcache.offload.offloader import make_offloader, offload_tiers
from kvcache.plan.kv_bytes import KV_DTYPES, check_kv_format, kv_formula, residual_bytes_per_seq
from kvcache.plan.shape import shape_from_config
from kvcache.store.quantized_store import check_latent_format, make_store

log = logging.getLogger("kvcache")
MAX_CACHE_SALT_CHARS = 256
MAX_CONSECUTIVE_FAILURES = 3  # steps in a row that fail with no request to blame before the engine gives up

__all__ = ["CompletionOutput", "EngineDeadError", "LLMEngine", "RequestOutput"]


class EngineDeadError(RuntimeError):
    """The engine failed MAX_CONSECUTIVE_FAILURES steps in a row with no request to blame; it cannot go on."""


@dataclass
class EngineStats:
    """Counters since start-up (tokens, requests, preemptions)."""

    prompt_tokens: int = 0  # prompt tokens submitted
    prefill_tokens_computed: int = 0  # tokens run through the model in prefill chunks (recompute included)
    generation_tokens: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    steps: int = 0
    spec_drafts: int = 0  # steps in which a sequence verified a proposal (speculative decoding)
    spec_draft_tokens: int = 0  # tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [i]: proposals whose token i was accepted
    spec_propose_seconds: float = 0.0  # spent proposing (n-gram lookups, draft forwards), found or not
    peak_used_blocks: int = 0

    def count_draft(self, proposed: int, accepted: int) -> None:
        """One verified proposal of `proposed` tokens whose first `accepted` were accepted."""
        self.spec_drafts += 1
        self.spec_draft_tokens += proposed
        self.spec_accepted_tokens += accepted
        per = self.spec_accepted_per_position
        per.extend([0] * (proposed - len(per)))
        for i in range(accepted):
            per[i] += 1


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    `add_request` validates and queues; every `step()` runs one batch (decodes and
    prefill chunks together) and returns the outputs of requests that finished, and
    of streaming requests that received tokens.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.tp = None
        try:
            self._build(config, loaded)
        except BaseException:
            if self.tp is not None:  # the workers stop with the engine that failed to start
                self.tp.close()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        """Start-up in its order: what can be refused is checked before anything loads; then the weights; then the
        KV budget, pool and scheduler; then the step's machinery (runner, graphs, evictor) and request state."""
        loaded, draft, tiers, why = self._check(config, loaded)
        self._load(config, loaded, draft)
        self._allocate(config, loaded, tiers)
        self._log_layout(config)
        self._prepare_steps(config, loaded.config)
        self._log_start(config, why)
        if self.device.type == "cpu":  # a step's activations reuse freed heap instead of fresh pages
            native.keep_freed_host_memory()

    def _check(self, config: EngineConfig, loaded: LoadedModel | None):
        """Device, dtype, lengths, shapes and every setting checked against the checkpoint, before anything is
        loaded (the tokenizer and config are read); (loaded, draft, offload tiers, why this backend)."""
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        if slow := slow_half_precision(self.device, self.dtype):
            log.warning(slow)
        loaded = loaded or read_checkpoint(config.model)
        self.tokenizer = loaded.tokenizer
        hf = loaded.config
        model_len = getattr(hf, "max_position_embeddings", None) or 2048
        self.max_model_len = config.max_model_len or model_len
        if self.max_model_len > model_len:
            raise ValueError(f"max_model_len {self.max_model_len:,} exceeds the model's context length {model_len:,}")
        self.shape = shape_from_config(hf.to_dict(), name=loaded.source)
        spec = config.speculative
        draft = read_draft(spec.model, loaded, self.max_model_len) if spec and spec.method == "draft_model" else None
        self.kv_dtype = config.kv_cache_dtype
        if self.kv_dtype == "auto":
            self.kv_dtype = str(self.dtype).removeprefix("torch.")
        tp_size = config.tensor_parallel_size
        check_tensor_parallel(hf, tp_size, self.device)  # before anything is loaded
        if tp_size > 1 and self.device.type == "cuda" and config.kv_cache_memory is None:
            raise ValueError(f"tensor_parallel_size {tp_size} on CUDA needs --kv-cache-memory (bytes per GPU): the "
                             "profiled sizing runs one rank's forward alone")
        check_kv_format(self.shape, self.kv_dtype, config.block_size, tp_size)  # before anything is loaded
        self._mla = "mla" in self.shape.layer_kinds
        if self._mla:
            check_latent_format(self.kv_dtype)  # before anything is loaded
        windows = layer_windows(hf)
        self._sliding = any(w is not None for w in windows)
        self.release_window = release_window(self.shape, config)
        if config.speculative is not None and self.release_window:
            raise ValueError("speculative_config cannot be combined with a sliding window whose blocks are given back "
                             "(a rejected token would move the window past blocks still needed); use "
                             "--prefix-caching-algo radix to keep every block")
        self.layer_groups = layer_groups_for(self.shape, config, self.kv_dtype)  # [] : one table of every layer
        if any(windows[i] != g.window for g in self.layer_groups for i in g.layers):
            raise RuntimeError(f"the planner's layer groups {self.layer_groups} do not match the model's windows {windows}")
        self._kivi_group = KV_DTYPES[self.kv_dtype].group if KV_DTYPES[self.kv_dtype].scales == "kivi" else 0
        if config.eviction.enabled:
            self._check_eviction(config.eviction)
        self.backend, why = resolve_backend(config.attention_backend, self.device, self.dtype, self.kv_dtype,
                                            config.block_size)
        if config.quantization != "none" and self.device.type != "cpu":
            raise ValueError(f"quantization {config.quantization} runs on the CPU only (its kernel is a CPU one); "
                             "use --quantization none on CUDA")
        tiers = offload_tiers(config)  # before the model loads: an unwritable directory is refused first
        self.kv_events = KVEventLog(config.block_size) if config.kv_events_endpoint else None
        self.event_publisher = ZmqEventPublisher(self.kv_events, config.kv_events_endpoint, config.kv_events_topic) \
            if self.kv_events else None  # before the model loads too: an endpoint in use is refused first
        return loaded, draft, tiers, why

    def _load(self, config: EngineConfig, loaded: LoadedModel, draft) -> None:
        """The model's weights (this rank's slices under tensor parallelism, the workers loading theirs meanwhile)
        and the draft model's."""
        tp_size, spec = config.tensor_parallel_size, config.speculative
        if tp_size > 1:  # the workers load their slices while this rank loads its own (__init__ closes them on failure)
            serve_as_launched_worker(loaded.source, tp_size, self.max_model_len, self.device, self.dtype,
                                     config.quantization)  # torchrun's ranks > 0 work here, then exit
            self.tp = TensorParallel(loaded.source, tp_size, self.max_model_len, self.device, self.dtype,
                                     config.quantization)
            self.model = build_shard(loaded, 0, tp_size, self.max_model_len, self.device, self.dtype,
                                     config.quantization)
        else:
            self.model = build_model(loaded, self.max_model_len, self.device, self.dtype, config.quantization)
        self.drafter = None if draft is None else DraftProposer(
            draft, self.max_model_len, self.device, self.dtype, self.kv_dtype,
            spec.quantization or config.quantization, self.backend, config.max_num_batched_tokens)

    def _allocate(self, config: EngineConfig, loaded: LoadedModel, tiers) -> None:
        """The KV budget (after the CUDA graphs' memory), the block manager, the store, the offload tiers and the
        scheduler."""
        group_of = {i: g for g, group in enumerate(self.layer_groups) for i in group.layers}
        self._layer_group = [group_of[i] for i in range(self.shape.num_layers)] if self.layer_groups else None
        self.graphs = DecodeGraphPlan(config, self.device, self.backend, self.model, self.max_model_len,
                                      max(1, len(self.layer_groups)), self._layer_group)
        self.budget, self.capacity = kv_capacity(config, self.device, self.model, self.shape, self.kv_dtype,
                                                 self.max_model_len, self.backend,
                                                 self.drafter.bytes_per_token if self.drafter else 0,
                                                 self.graphs.estimator(lambda: self._make_store(2)))
        # One more physical block than the budget buys: block 0, the null block that pads tables.
        caching = config.prefix_caching_algo if config.enable_prefix_caching else None
        if self.layer_groups:
            self.kv = GroupedKVCacheManager(self.capacity.num_blocks + 1, config.block_size,
                                            [g.window for g in self.layer_groups], caching)
        else:
            self.kv = KVCacheManager(self.capacity.num_blocks + 1, config.block_size, caching,
                                     seq_blocks=self.capacity.seq_blocks, events=self.kv_events)
        self.store = self._make_store(self.capacity.num_blocks + 1, self.capacity.bytes_per_token)
        local_store = self._local_store = self.store  # this rank's: self.store reaches every rank under TP
        if self.tp is not None:  # every rank's store has as many blocks; forks' copies and scrubs reach them all
            self.store = MirroredStore(local_store, self.tp)
        self.offload = make_offloader(tiers, self.store, loaded.source, self.kv_events, compute=str(self.dtype), kv=self.kv_dtype,
                                      block_size=config.block_size, quantization=config.quantization)
        self.scheduler = Scheduler(config, self.kv, self.offload)

    def _log_layout(self, config: EngineConfig) -> None:
        """Logs how the pool's tables are laid out where layers differ (groups, windows)."""
        if self.layer_groups:
            kinds = collections.Counter("full" if g.window is None else f"sliding {g.window:,}"
                                        for g in self.layer_groups)
            log.info("per-layer-group block tables (%s groups of %d layers; a block holds one group's layers): %s",
                     " + ".join(f"{n} {k}" for k, n in kinds.items()), self.capacity.layers_per_block,
                     "sliding groups give back blocks older than their window as sequences advance" if self._sliding
                     else "each layer's table gives back the blocks its eviction budget leaves dead (PyramidKV)")
        elif self._sliding:
            log.info("sliding window: %s", f"blocks older than {self.release_window:,} tokens are given back as "
                     "sequences advance" if self.release_window else
                     why_every_block_is_kept(self.shape, config, self.kv_dtype))

    def _prepare_steps(self, config: EngineConfig, hf) -> None:
        """The runner and its CUDA graphs, the evictor, the draft's cache, and empty request state."""
        local_store = self._local_store
        self.spec = config.speculative
        self.runner = ModelRunner(self.model, local_store, self.kv, self.device, self.backend, self._layer_group)
        self.runner.graphs = self.graphs.capture(local_store, self.capacity.num_blocks + 1)
        if self.tp is not None:
            self.runner.tp = self.tp
            self.runner.all_threads = self.runner.small_step_threads = self.tp.threads  # set in each forward
        if self.drafter is not None:
            self.drafter.make_cache(self.capacity.num_blocks + 1, config.block_size)
        self.evictor = Evictor(self.store, self.kv, self.shape.num_layers, self.model.kv_layout[0],
                               self.model.layers[0].scale, self.device, self._layer_group,
                               head_share(self.model.tp.shard) if self.tp else None, self.tp)
        self.eos_token_ids = self._eos_ids(hf)
        self._sampler_eos = next(iter(self.eos_token_ids), None)  # the EOS min_tokens forbids
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._failed: set[str] = set()  # requests failed in this step (they are among its outputs)
        self._consecutive_failures = 0  # steps in a row that failed with no request to blame
        self.stop = StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len)

    def _log_start(self, config: EngineConfig, why: str) -> None:
        """Logs the weights, the backend and the KV budget, and the pool it bought."""
        c = self.capacity
        log.info("weights: %.2f GiB of %s on %s; attention backend %s (%s); KV budget %s",
                 self.model.weight_bytes / 2**30, str(self.dtype).removeprefix("torch.") + (
                     f" with {config.quantization} linear layers" if config.quantization != "none" else ""), self.device, self.backend,
                 why, self.budget)
        log.info("KV cache (%s): %s blocks x %d tokens = %s tokens, %.2f GiB (%s)%s; maximum concurrency for %s "
                 "tokens per request: %.2fx", self.kv_dtype, f"{c.num_blocks:,}", c.block_size, f"{c.num_tokens:,}",
                 c.total_bytes / 2**30, self._kv_formula(),
                 f"; plus {c.seq_blocks} blocks per request for its fp16 key residual" if c.seq_blocks else "",
                 f"{c.max_model_len:,}", c.max_concurrency)

    def _kv_formula(self) -> str:
        """The bytes-per-token formula of this process's store: each rank's heads under tensor parallelism."""
        tp = self.config.tensor_parallel_size
        return kv_formula(self.shape, self.kv_dtype, tp) + (f" per rank ({tp} ranks)" if tp > 1 else "")

    def _make_store(self, num_blocks: int, bytes_per_token: int | None = None):
        """The KV store of this engine's layout with `num_blocks` blocks (the null block included); with
        `bytes_per_token`, checked against the planner's figure."""
        kv_heads, head_dim, latent = self.model.kv_layout
        slots = None
        if self.layer_groups:
            slot_of = {i: group.layers.index(i) for group in self.layer_groups for i in group.layers}
            slots = [slot_of[i] for i in range(self.shape.num_layers)]
        layers = len(self.layer_groups[0].layers) if self.layer_groups else self.shape.num_layers
        kw = dict(num_layers=layers, num_blocks=num_blocks, block_size=self.config.block_size, num_kv_heads=kv_heads,
                  head_dim=head_dim, kv_cache_dtype=self.kv_dtype, compute_dtype=self.dtype,
                  expected_bytes_per_token=bytes_per_token, latent=latent, layer_slots=slots)
        if self.tp is not None and bytes_per_token is not None:  # the pool's store: the workers build theirs alike
            self.tp.send_store(kw, self.backend, self._layer_group,
                               [g.window for g in self.layer_groups] if self.layer_groups else None)
        return with_backend_write(make_store(device=self.device, **kw), self.backend)

    def peak_blocks(self, tokens: int) -> int:
        """The most blocks a sequence of `tokens` tokens holds at once: all of them, or where out-of-window blocks
        are given back and prefills are chunked, a window behind the largest chunk (window - 1 tokens before it,
        one block more for the alignment), however long it grows."""
        windows = [g.window for g in self.layer_groups] or [self.release_window]
        return peak_blocks(tokens, windows, self.config)

    def _check_eviction(self, spec: EvictionSpec) -> None:
        """ValueError if this engine cannot evict tokens under `spec`."""
        if isinstance(spec.budget, numbers.Integral) and spec.budget > self.max_model_len:
            raise ValueError(f"kv_budget {describe(spec.budget)} tokens is above max_model_len "
                             f"{self.max_model_len:,}: no request holds more tokens than that")
        if self._sliding:
            raise ValueError(f"kv_eviction {spec.policy} is not supported on models with sliding-window layers: "
                             "their masks count positions, and eviction changes which slot holds which position")
        if self._mla:
            raise ValueError(f"kv_eviction {spec.policy} is not supported on MLA models: its scores are per KV head, "
                             "and an MLA latent is shared by every head (the heads' attention is not what it ranks)")
        if self._kivi_group:
            raise ValueError(f"kv_eviction {spec.policy} cannot be combined with kv_cache_dtype {self.kv_dtype}: it "
                             f"quantizes keys in {self._kivi_group}-token groups, so tokens cannot be dropped one "
                             "by one (use int8 or fp8)")

    def _eos_ids(self, hf) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(hf, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(src)
        return ids

    # ---- requests -------------------------------------------------------------------------

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
            raise ValueError("the prompt is empty")
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
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # tokenizers raise TypeError/exceptions of their own on bad text
            raise ValueError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}") from None

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

    def _sample_and_append(self, sampled: list[Sequence], logits: torch.Tensor) -> set[str]:
        seqs, rows, forks = self._sampling_rows(sampled)
        if not seqs:
            return set()
        # Logits rows: 1 + len(draft) per sampled sequence, in order; a fork samples from its parent's (a prompt's)
        first = list(itertools.accumulate([1 + len(s.draft) for s in sampled], initial=0))
        row_seqs, row_ids, outputs = [], [], []
        drawn = {}  # a sampled draft-model proposal's rows go to the rejection rule, not the plain draw
        for seq, i in zip(seqs, rows):
            if seq.draft and seq.draft_probs is not None:
                drawn[seq.seq_id] = self._rejection_sample(seq, logits[first[i]:first[i] + 1 + len(seq.draft)])
                continue
            for j in range(1 + len(seq.draft)):  # a speculating sequence: row j verifies draft[j] (draft[:j] before it)
                row_seqs.append(seq)
                row_ids.append(first[i] + j)
                outputs.append(seq.output_token_ids + seq.draft[:j] if seq.draft else None)
        batch_logits = logits if row_ids == list(range(logits.shape[0])) else \
            logits.index_select(0, torch.tensor(row_ids, dtype=torch.long).to(logits.device, non_blocking=True))
        # a seeded speculating sequence's generator, before its rows draw (rewound to what its accepted rows drew)
        rewind = {seq.seq_id: seq.generator.get_state() for seq in seqs if seq.draft and seq.generator is not None
                  and not seq.params.greedy and seq.seq_id not in drawn}
        results = self._sample(row_seqs, batch_logits, outputs) if row_seqs else []
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
        k, out = len(seq.draft), seq.output_token_ids
        rows = [SamplingRow(seq.params, None, seq.prompt_token_ids, out + seq.draft[:j]) for j in range(k + 1)]
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

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, outputs: list[list[int] | None] | None = None
                ) -> list[tuple[int, dict | None]]:
        """(token, logprobs) per row: row i is seqs[i]'s, with outputs[i] (when given and not None) as its output
        so far (a speculating sequence's row after proposed tokens). A row the sampler refuses, or that raises when
        sampled alone after the whole batch raised, fails its request; its pair is then (-1, None)."""
        outputs = outputs or [None] * len(seqs)
        rows = [SamplingRow(s.params, s.generator, s.prompt_token_ids, s.output_token_ids if o is None else o)
                for s, o in zip(seqs, outputs)]
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

    def score(self, token_ids: list[int], start: int = 0, chunk_size: int | None = None,
              eviction: EvictionSpec | None = None) -> torch.Tensor:
        """Teacher-forced logits, row i the next-token distribution after `token_ids[:start + i + 1]` (fp32): see
        engine/scoring.py. Only while no request is unfinished."""
        return scoring.score(self, token_ids, start, chunk_size, eviction)

    # ---- introspection ------------------------------------------------------------------------

    def kv_cache_info(self) -> dict:
        """KV cache figures (bytes, blocks, tokens) as sized at start-up, plus current usage and prefix caching.

        Cached blocks that no request holds count as free: an allocation takes them (evicting them).
        """
        c, kv = self.capacity, self.kv
        free = kv.num_free_blocks
        return {
            "device": str(self.device), "compute_dtype": str(self.dtype).removeprefix("torch."),
            "attention_backend": self.backend, "cuda_graphs": self.graphs.info(),
            "quantization": self.config.quantization,
            "weight_bytes": self.model.weight_bytes, "kv_cache_budget": str(self.budget),
            "block_size": c.block_size, "num_blocks": c.num_blocks, "num_tokens": c.num_tokens,
            "bytes_per_token": c.bytes_per_token, "total_bytes": c.total_bytes, "dtype": self.kv_dtype,
            "seq_blocks": c.seq_blocks, "residual_bytes_per_seq": residual_bytes_per_seq(self.shape, self.kv_dtype),
            "max_model_len": c.max_model_len, "max_concurrency": c.max_concurrency,
            "formula": self._kv_formula(),
            "layer_groups": [{"window": g.window, "layers": list(g.layers)} for g in self.layer_groups],
            "layers_per_block": c.layers_per_block or self.shape.num_layers,
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
        tree = kv.radix.num_blocks if kv.radix else 0
        held = sum(pool.ref_counts)
        if kv.block_tables or held != tree or kv.num_free_blocks != pool.num_usable:
            raise AssertionError(f"{held - tree} block references still held with no request running "
                                 f"({len(kv.block_tables)} block tables, {tree} blocks in the radix tree)")
