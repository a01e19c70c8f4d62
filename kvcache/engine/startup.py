"""LLMEngine's start-up, in its order: every setting checked against the checkpoint before anything loads, then
the weights, the KV budget and pool, and the step's machinery (EngineStartup, a base of LLMEngine).

Among what start-up sets on the engine and the step reads: config, device, dtype, tokenizer, max_model_len,
shape, kv_dtype, layer_groups, backend, model, drafter, tp, budget, capacity, kv (the block manager), store,
offload, scheduler, runner, graphs, evictor, spec, eos_token_ids, stop, stats and the (empty) request table.
"""
from __future__ import annotations

import collections
import itertools
import logging
import numbers

from kvcache import native
from kvcache.attention.backend import resolve_backend, with_backend_write
from kvcache.compress.spec import EvictionSpec
from kvcache.config import EngineConfig
from kvcache.engine.cuda_graphs import DecodeGraphPlan
from kvcache.engine.draft import DraftProposer, read_draft
from kvcache.engine.eviction import Evictor
from kvcache.engine.kv_events import ZmqEventPublisher
from kvcache.engine.model_runner import ModelRunner
from kvcache.engine.outputs import Request
from kvcache.engine.scheduler import Scheduler
from kvcache.engine.pressure import PressureLadder
from kvcache.engine.sampling_params import SamplingParams
from kvcache.engine.sizing import (check_recurrent, kv_capacity, layer_groups_for, peak_blocks, release_window, resolve_device_dtype,
                                   slow_half_precision, why_every_block_is_kept)
from kvcache.engine.stats import EngineStats
from kvcache.engine.stop_checker import StopChecker
from kvcache.engine.tp_worker import serve_as_launched_worker
from kvcache.memory.kv_cache_manager import KVCacheManager
from kvcache.memory.kv_events import KVEventLog
from kvcache.memory.layer_groups import GroupedKVCacheManager
from kvcache.memory.state_slots import StateSlots
from kvcache.memory.state_snapshots import StateSnapshots
from kvcache.messages import describe
from kvcache.native import host_memory
from kvcache.models.loader import LoadedModel, build_model, model_windows, read_checkpoint
from kvcache.offload.offloader import make_offloader, offload_tiers
from kvcache.parallel.group import MirroredStore, TensorParallel
from kvcache.parallel.sharding import build_shard, check_tensor_parallel, head_share
from kvcache.plan.kv_bytes import KV_DTYPES, check_kv_format, kv_formula, pool_tokens
from kvcache.plan.report import human
from kvcache.plan.shape import shape_from_config
from kvcache.store.quantized_store import check_latent_format, make_store
from kvcache.store.state_store import StateStore, state_formula

log = logging.getLogger("kvcache")


class EngineStartup:
    """LLMEngine's construction (LLMEngine.__init__ calls _build)."""

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        """Start-up in its order: what can be refused is checked before anything loads; then the weights; then the
        KV budget, pool and scheduler; then the step's machinery (runner, graphs, evictor) and request state."""
        loaded, draft, tiers, why = self._check(config, loaded)
        self._load(config, loaded, draft)
        self._allocate(config, loaded, tiers)
        self._log_layout(config)
        self._prepare_steps(config, loaded.config)
        self._log_start(config, why)
        self._pin_prefix(config)
        if self.device.type == "cpu":  # a step's activations reuse freed heap instead of fresh pages
            host_memory.keep_freed_host_memory()

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
        windows = model_windows(hf)
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
        self.recurrent = "linear" in self.shape.layer_kinds
        if self.recurrent:
            check_recurrent(config, self.shape, self.kv_dtype)
        if config.eviction.enabled:
            self._check_eviction(config.eviction)
        if config.kv_pressure_policy == "ladder":
            self._check_ladder()
        self.backend, why = resolve_backend(config.attention_backend, self.device, self.dtype, self.kv_dtype,
                                            config.block_size)
        if config.quantization != "none" and self.device.type != "cpu":
            raise ValueError(f"quantization {config.quantization} runs on the CPU only (its kernel is a CPU one); "
                             "use --quantization none on CUDA")
        self.cpu_isa = self._cpu_kernels(config) if self.device.type == "cpu" else None
        tiers = offload_tiers(config)  # before the model loads: an unwritable directory is refused first
        self.kv_events = KVEventLog(config.block_size) if config.kv_events_endpoint else None
        self.event_publisher = ZmqEventPublisher(
            self.kv_events, config.kv_events_endpoint, config.kv_events_topic,
            replay_endpoint=config.kv_events_replay_endpoint, buffer_steps=config.kv_events_buffer_steps) \
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
        self._allocate_states(config)
        if self.layer_groups:
            self.kv = GroupedKVCacheManager(self.capacity.num_blocks + 1, config.block_size,
                                            [g.window for g in self.layer_groups], caching)
        else:
            self.kv = KVCacheManager(self.capacity.num_blocks + 1, config.block_size, caching,
                                     seq_blocks=self.capacity.seq_blocks, events=self.kv_events,
                                     states=self.state_slots, snapshots=self.snapshots)
        self.store = self._make_store(self.capacity.num_blocks + 1, self.capacity.bytes_per_token)
        local_store = self._local_store = self.store  # this rank's: self.store reaches every rank under TP
        if self.tp is not None:  # every rank's store has as many blocks; forks' copies and scrubs reach them all
            self.store = MirroredStore(local_store, self.tp)
        self.offload = make_offloader(tiers, self.store, loaded.source, self.kv_events, compute=str(self.dtype), kv=self.kv_dtype,
                                      block_size=config.block_size, quantization=config.quantization)
        self.scheduler = Scheduler(config, self.kv, self.offload)

    def _allocate_states(self, config: EngineConfig) -> None:
        """A recurrent model's state pool: max_num_seqs running slots, then the snapshots' (prefix caching)."""
        self.state_slots = self.snapshots = self.state_store = None
        if not self.capacity.state_slots:
            return
        running = config.max_num_seqs
        self.state_slots = StateSlots(running)
        if self.capacity.state_slots > running:
            self.snapshots = StateSnapshots(list(range(running, self.capacity.state_slots)), config.mamba_block_size)
        self.state_store = StateStore(self.model.num_recurrent_layers, self.capacity.state_slots,
                                      self.model.state_shapes, self.dtype, self.device)

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
        self.runner = ModelRunner(self.model, local_store, self.kv, self.device, self.backend, self._layer_group,
                                  states=self.state_store)
        self.runner.graphs = self.graphs.capture(local_store, self.capacity.num_blocks + 1)
        if self.tp is not None:
            self.runner.tp = self.tp
            self.runner.all_threads = self.runner.small_step_threads = self.tp.threads  # set in each forward
        if self.drafter is not None:
            self.drafter.make_cache(self.capacity.num_blocks + 1, config.block_size)
        self.evictor = Evictor(self.store, self.kv, self.shape.num_layers, self.model.kv_layout[0],
                               self.model.attention_scale, self.device, self._layer_group,
                               head_share(self.model.tp.shard) if self.tp else None, self.tp)
        if config.kv_pressure_policy == "ladder":
            self.scheduler.pressure = PressureLadder(self.evictor, self.kv, config.kv_pressure_evict,
                                                     config.kv_pressure_max_evict)
        self.eos_token_ids = self._eos_ids(hf)
        self._sampler_eos = next(iter(self.eos_token_ids), None)  # the EOS min_tokens forbids
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._failed: set[str] = set()  # requests failed in this step (they are among its outputs)
        self._consecutive_failures = 0  # steps in a row that failed with no request to blame
        self.stop = StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len)

    def _cpu_kernels(self, config: EngineConfig) -> str | None:
        """The C++ kernels' variant this CPU engine runs (kvcache.native), or None where they cannot run (it said why
        once). Refused, with the reason, where the configuration needs them: quantized weights (their kernels are the
        int8/int4 matrix products), or a KVCACHE_CPU_ISA this CPU or build cannot run."""
        if config.quantization != "none":
            try:
                return native.require().isa
            except native.KernelsUnavailable as e:
                raise ValueError(f"--quantization {config.quantization} needs the C++ CPU kernels (its matrix "
                                 f"products), which cannot run here: {e}") from e
        k = native.kernels()  # ValueError for an impossible KVCACHE_CPU_ISA
        return None if k is None else k.isa

    def _log_start(self, config: EngineConfig, why: str) -> None:
        """Logs the weights, the backend and the KV budget, and the pool it bought."""
        c = self.capacity
        log.info("weights: %.2f GiB of %s on %s; attention backend %s (%s); KV budget %s",
                 self.model.weight_bytes / 2**30, str(self.dtype).removeprefix("torch.") + (
                     f" with {config.quantization} linear layers" if config.quantization != "none" else ""), self.device, self.backend,
                 why, self.budget)
        if self.device.type == "cpu":
            log.info("CPU kernels: %s", native.describe())
        log.info("KV cache (%s): %s, %s (%s)%s; maximum concurrency for %s tokens per request: %.2fx", self.kv_dtype,
                 pool_tokens(c.num_blocks, c.block_size, c.layers_per_block, self.shape.num_kv_layers),
                 human(c.total_bytes),
                 self._kv_formula(),
                 f"; plus {c.seq_blocks} blocks per request for its fp16 key residual" if c.seq_blocks else "",
                 f"{c.max_model_len:,}", c.max_concurrency)
        if self.state_store is not None:
            snapshots = self.snapshots.num_slots if self.snapshots is not None else 0
            log.info("state pool (%d linear-attention / SSM layers): %d slots x %s bytes/sequence = %s, beside the "
                     "blocks (%s): %d for running sequences, %s", self.model.num_recurrent_layers, c.state_slots,
                     f"{self.state_store.bytes_per_slot:,}", human(c.state_bytes),
                     state_formula(self.model.state_shapes, self.model.num_recurrent_layers, self.dtype),
                     c.state_slots - snapshots,
                     f"{snapshots} for snapshots every {config.mamba_block_size} tokens (a cached prefix starts from "
                     "the deepest one)" if snapshots else "none for snapshots: prefix caching is off")

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
        layers = len(self.layer_groups[0].layers) if self.layer_groups else self.shape.num_kv_layers
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

    def _pin_prefix(self, config: EngineConfig) -> None:
        """--kv-pin-prefix: prefill it (a request for one token), then pin its full blocks in the pool (never
        evicted); refused, with the numbers, when it fills no block or takes more than kv_pin_max_fraction of it."""
        text = config.kv_pin_prefix
        if text is None:
            return
        if self.recurrent:
            raise ValueError("kv_pin_prefix is not supported on models with recurrent layers: their state snapshots "
                             "are kept in slots of their own")
        ids, bs = self.tokenize(text), config.block_size
        usable, share = self.kv.pool.num_usable, config.kv_pin_max_fraction
        blocks = len(ids) // bs
        if blocks == 0:
            raise ValueError(f"kv_pin_prefix is {len(ids):,} tokens, less than one block of {bs}: nothing to pin")
        if blocks > share * usable:
            raise ValueError(f"kv_pin_prefix takes {blocks:,} blocks ({len(ids):,} tokens), above "
                             f"kv_pin_max_fraction {share:g} of the pool's {usable:,} blocks ({int(share * usable):,})")
        self.add_request("kv-pin-prefix", ids, SamplingParams(max_tokens=1, temperature=0.0))
        self.run_to_completion()
        probe = next(self._seq_ids)
        found = self.kv.find_prefix(probe, ids + [ids[-1]])
        self.kv.free(probe)
        self.kv.pool.pin(found)
        log.info("pinned prefix: %d tokens in %d blocks of %d, never evicted (%.1f%% of the pool)", len(found) * bs,
                 len(found), bs, 100 * len(found) / usable)

    def _check_ladder(self) -> None:
        """ValueError where the pressure ladder cannot evict tokens from this model's cache."""
        why = ("its sliding-window layers' masks count positions, and eviction changes which slot holds which position"
               if self._sliding else "an MLA latent is shared by every head" if self._mla else
               f"kv_cache_dtype {self.kv_dtype} quantizes keys in {self._kivi_group}-token groups" if self._kivi_group
               else "its recurrent layers' state holds every token and cannot drop one" if self.recurrent else None)
        if why:
            raise ValueError(f"kv_pressure_policy ladder evicts tokens under memory pressure, which this model "
                             f"cannot: {why} (use kv_pressure_policy preempt)")

    def _eos_ids(self, hf) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(hf, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(src)
        return ids
