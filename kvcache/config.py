"""Engine configuration: one validated dataclass; CLI flags map onto it one to one (vLLM names)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvcache.compress.spec import EvictionSpec, parse_budget
from kvcache.plan.capacity import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from kvcache.plan.kv_bytes import KV_DTYPES, default_block_size, kv_dtype
from kvcache.plan.sizes import memory_share, parse_bytes

PRESSURE_POLICIES = ("preempt", "ladder")
PRESSURE_EVICT_RULES = ("knorm", "streaming")
MAX_PRESSURE_EVICT = 0.9  # the ladder never evicts more of a request's tokens than this

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")  # where --kv-events-endpoint may bind (ZeroMQ)

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


# Weight formats of --quantization (models/quant_linear.py); the quantized ones run on the CPU.
WEIGHT_QUANTIZATIONS = {
    "none": "as loaded, in the compute dtype",
    "int8": "weight-only, one scale per output channel",
    "int4": "4-bit groups of 32 with a scale and minimum (GGUF Q4_1), int8 activations, LM head int8",
}

def _offload_bytes(name: str, value) -> int:
    try:
        if memory_share(value) is not None:
            raise ValueError("a share is not accepted here")
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{name} must be a positive size such as 8GiB or 512MiB; got {value!r} ({e})") from None


@dataclass
class EngineConfig:
    """Everything an engine is started with. Sizes in tokens unless named otherwise."""

    model: str | None = None  # HF directory or GGUF file; None = the demo model
    block_size: int | None = None  # tokens per KV block; None = 16 (64 for int4/int2: one KIVI key group)
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # sequences in one step at most
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # tokens per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens; None = the model's context length
    # KV cache bytes ('2GiB'), or a share ('25%') of the device's memory on CUDA, of available RAM on CPU;
    # None = sized from what the device has left after the weights (see engine/sizing.py)
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory for weights + KV cache
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # share computed full blocks between requests with equal prefixes
    prefix_caching_algo: str = "hash"  # hash: vLLM's hash-chained blocks; radix: SGLang's radix tree
    # Models with linear-attention / SSM layers, with prefix caching: their state is snapshotted every
    # mamba_block_size tokens (vLLM's name; None: 4 blocks), in num_state_snapshots slots (None: max_num_seqs)
    mamba_block_size: int | None = None
    num_state_snapshots: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs, or lpm: longest cached prefix first
    dtype: str = "auto"  # compute and weight dtype: auto = float32 on CPU, bfloat16 on CUDA (aliases fp32, bf16, fp16, half)
    kv_cache_dtype: str = "auto"  # KV storage: auto (= compute dtype), float32, float16, bfloat16, fp8_e4m3,
    # fp8_e5m2, int8, int4, int2 (aliases fp32, fp16, bf16, fp8)
    device: str = "auto"
    attention_backend: str = "auto"  # auto, triton (CUDA), torch (portable), cpu (the C++ decode kernel)
    quantization: str = "none"  # weights: one of WEIGHT_QUANTIZATIONS
    seed: int = 0
    kv_eviction: str = "none"  # token eviction: none, streaming, h2o, snapkv, tova, pyramidkv, random
    kv_budget: int | float | str | None = None  # KV tokens a request keeps (512) or a ratio of its prompt (0.25)
    # Offload tiers below the pool (offload/): prefix blocks kept in host memory and/or a directory
    kv_offload_memory: int | str | None = None  # bytes of host memory ('8GiB'); None = no cpu tier
    kv_offload_dir: str | None = None  # a directory, shareable between processes; None = no disk tier
    kv_offload_disk_size: int | str | None = None  # bytes on disk; default 10GiB when a directory is given
    kv_remote: str | None = None  # redis://host:port/db: a Redis/Valkey tier shared between processes and machines
    kv_remote_timeout: float = 0.5  # seconds, every call to kv_remote
    # What a preempted sequence loses: recompute (its blocks are freed, its tokens prefilled again on resume) or
    # swap (its blocks' contents go to the cpu tier, else the disk tier, and come back on resume; recompute when
    # the tier has no room)
    preemption_mode: str = "recompute"
    # When a step's blocks do not fit (engine/pressure.py): preempt (the last admitted sequence, as vLLM), or ladder:
    # swap it out where preemption_mode is swap, else evict tokens of the longest running sequence (its attention
    # sinks and recent window kept; at most kv_pressure_max_evict of its tokens in all), then preempt
    kv_pressure_policy: str = "preempt"
    kv_pressure_max_evict: float = 0.5
    kv_pressure_evict: str = "knorm"  # which tokens the ladder evicts: knorm (largest key norms) or streaming
    # A prefix kept in the prefix cache for good (a system prompt), prefilled at start-up: its text as a prompt
    # starts (the tokenizer's special tokens added); its full blocks are never evicted. At most kv_pin_max_fraction
    # of the pool may be pinned.
    kv_pin_prefix: str | None = None
    kv_pin_max_fraction: float = 0.25
    # KV events for routers (vLLM's format over ZeroMQ, engine/kv_events.py): tcp://*:5557 binds, tcp://host:port
    # connects to a subscriber that binds; None = none published
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    # vLLM's replay_endpoint: a ROUTER bound here answers a subscriber's request for the batches it missed, from the
    # last kv_events_buffer_steps batches (tcp://*:5558, ipc://path); None = no replay
    kv_events_replay_endpoint: str | None = None
    kv_events_buffer_steps: int = 10_000
    # Speculative decoding, vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2} (a dict or its JSON text); None = none (engine/spec_decode.py)
    speculative_config: dict | str | None = None
    # Models mixing full and sliding-window layers keep one block table per layer group (vLLM's hybrid KV cache
    # manager, memory/layer_groups.py); True keeps one table of every layer, every block (vLLM's flag of this name)
    disable_hybrid_kv_cache_manager: bool = False
    # CUDA: decode steps replay CUDA graphs captured at start-up (engine/cuda_graphs.py); True runs every step eager
    # (vLLM's flag)
    enforce_eager: bool = False
    # Ranks a model is split over (Megatron-style, torch.distributed: gloo on CPU, NCCL on GPUs); the engine starts
    # the other ranks' processes itself (parallel/group.py)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        """Normalize the fields (aliases, byte sizes) and refuse, with the field and its value, what cannot run."""
        self._check_kv_format()
        self._check_compute()
        self._check_tiers()
        self._check_replay()
        self._check_speculation_and_ranks()

    def _check_kv_format(self) -> None:
        """kv_cache_dtype (its aliases resolved), block_size (its default for the format) and the scheduler's sizes."""
        if self.kv_cache_dtype != "auto":
            try:
                self.kv_cache_dtype = kv_dtype(self.kv_cache_dtype).name
            except ValueError:
                raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; supported: auto, "
                                 f"{', '.join(KV_DTYPES)} (aliases fp32, fp16, bf16, fp8)") from None
        group = self.kv_group
        if self.block_size is None:
            self.block_size = default_block_size(self.kv_cache_dtype if group else "float32")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.mamba_block_size is None:
            self.mamba_block_size = 4 * self.block_size
        for name in ("mamba_block_size", "num_state_snapshots"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.mamba_block_size % self.block_size:
            raise ValueError(f"mamba_block_size ({self.mamba_block_size} tokens between state snapshots) must be a "
                             f"multiple of block_size ({self.block_size}): a snapshot ends a block")
        if group and self.block_size % group:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} quantizes keys in groups of {group} tokens, each "
                             f"inside one block: block_size must be a multiple of {group}, got {self.block_size}")

    @property
    def kv_group(self) -> int:
        """Tokens a KIVI format (int4/int2) quantizes keys over (0: another format)."""
        return KV_DTYPES[self.kv_cache_dtype].group if self.kv_cache_dtype != "auto" else 0

    def _check_compute(self) -> None:
        """The model's length, memory, dtype, device, weights' format, prefix caching and scheduling fields."""
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.kv_cache_memory is not None and memory_share(self.kv_cache_memory) is None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)  # a share stays a string until the device is known
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in ("auto", *COMPUTE_DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(COMPUTE_DTYPES)} (aliases "
                             f"{', '.join(DTYPE_ALIASES)}); got {self.dtype!r}")
        if self.prefix_caching_algo not in ("hash", "radix"):
            raise ValueError(f"prefix_caching_algo must be hash or radix; got {self.prefix_caching_algo!r}")
        if self.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be fcfs or lpm; got {self.scheduling_policy!r}")
        self.kv_budget = parse_budget(self.kv_budget)
        EvictionSpec(self.kv_eviction, self.kv_budget)  # raises on a bad policy or budget
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {self.device!r}")
        if self.quantization not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(WEIGHT_QUANTIZATIONS)} ("
                             f"{'; '.join(f'{k}: {v}' for k, v in WEIGHT_QUANTIZATIONS.items())}); got "
                             f"{self.quantization!r}")

    def _check_tiers(self) -> None:
        """The offload tiers (host memory, disk, Redis), swap preemption and the KV events' endpoint."""
        if self.kv_offload_memory is not None:
            self.kv_offload_memory = _offload_bytes("kv_offload_memory", self.kv_offload_memory)
        if self.kv_offload_disk_size is not None and self.kv_offload_dir is None:
            raise ValueError("kv_offload_disk_size needs kv_offload_dir: the directory the disk tier writes to")
        if self.kv_offload_dir is not None:
            self.kv_offload_disk_size = _offload_bytes("kv_offload_disk_size", self.kv_offload_disk_size or "10GiB")
        if self.kv_remote is not None and not str(self.kv_remote).startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote must be a redis://, rediss:// or unix:// URL; got {self.kv_remote!r}")
        if not (isinstance(self.kv_remote_timeout, (int, float)) and 0 < self.kv_remote_timeout <= 60):
            raise ValueError(f"kv_remote_timeout must be in (0, 60] seconds; got {self.kv_remote_timeout!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap; got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_offload_memory is None and self.kv_offload_dir is None:
            raise ValueError("preemption_mode swap keeps a preempted sequence's KV in an offload tier: give "
                             "--kv-offload-memory SIZE (host memory) or --kv-offload-dir PATH (disk)")
        self._check_pressure()
        if self.kv_events_endpoint is not None and not str(self.kv_events_endpoint).startswith(ENDPOINT_SCHEMES):
            raise ValueError(f"kv_events_endpoint must be a ZeroMQ endpoint (tcp://*:5557, tcp://host:port, ipc://path);"
                             f" got {self.kv_events_endpoint!r}")

    def _check_pressure(self) -> None:
        """The memory-pressure ladder's fields (engine/pressure.py)."""
        if self.kv_pressure_policy not in PRESSURE_POLICIES:
            raise ValueError(f"kv_pressure_policy must be one of {', '.join(PRESSURE_POLICIES)}; got "
                             f"{self.kv_pressure_policy!r}")
        self._check_share("kv_pressure_max_evict", "the share of a request's tokens the ladder may evict")
        self._check_share("kv_pin_max_fraction", "the share of the KV pool pinned prefixes may take")
        if self.kv_pin_prefix is not None:
            if not isinstance(self.kv_pin_prefix, str) or not self.kv_pin_prefix:
                raise ValueError(f"kv_pin_prefix must be a non-empty text; got {self.kv_pin_prefix!r}")
            if not self.enable_prefix_caching or self.prefix_caching_algo != "hash":
                raise ValueError("kv_pin_prefix keeps a prefix in the prefix cache: it needs prefix caching on, with "
                                 "--prefix-caching-algo hash")
        if self.kv_pressure_evict not in PRESSURE_EVICT_RULES:
            raise ValueError(f"kv_pressure_evict must be one of {', '.join(PRESSURE_EVICT_RULES)}; got "
                             f"{self.kv_pressure_evict!r}")

    def _check_share(self, name: str, what: str) -> None:
        """Field `name` (`what` it is) must be a number in (0, MAX_PRESSURE_EVICT]."""
        v = getattr(self, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_PRESSURE_EVICT:
            raise ValueError(f"{name} ({what}) must be in (0, {MAX_PRESSURE_EVICT}]; got {v!r}")

    def _check_speculation_and_ranks(self) -> None:
        """speculative_config (parsed into `speculative`), tensor_parallel_size and attention_backend, and what
        cannot be combined with them."""
        group = self.kv_group
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative is not None:
            if self.kv_pressure_policy == "ladder":
                raise ValueError("speculative_config cannot be combined with kv_pressure_policy ladder: a verification "
                                 "step's rejected tokens would sit in a compacted cache")
            if self.kv_eviction != "none":
                raise ValueError(f"speculative_config cannot be combined with kv_eviction {self.kv_eviction}: its "
                                 "scores would count the queries of rejected tokens")
            if group:
                raise ValueError(f"speculative_config cannot be combined with kv_cache_dtype {self.kv_cache_dtype} "
                                 "(KIVI): a rejected token's key would stay in the fp16 residual (use int8 or fp8)")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1:
            refused = {"the KV offload tiers": self.offload_tiers,
                       "preemption_mode swap": self.preemption_mode == "swap",
                       "kv_pressure_policy ladder": self.kv_pressure_policy == "ladder",
                       "a draft model": self.speculative is not None and self.speculative.method == "draft_model"}
            on = [k for k, v in refused.items() if v]
            if on:
                raise ValueError(f"tensor_parallel_size {tp} cannot be combined with {' and '.join(on)} yet: they read "
                                 "or move KV through rank 0's store alone")
        if self.attention_backend not in ("auto", "triton", "torch", "cpu"):
            raise ValueError(f"attention_backend must be one of auto, triton, torch, cpu; got {self.attention_backend!r}")

    def _check_replay(self) -> None:
        replay, steps = self.kv_events_replay_endpoint, self.kv_events_buffer_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"kv_events_buffer_steps must be a positive integer (batches kept for replay); got "
                             f"{steps!r}")
        if replay is None:
            return
        if self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint replays KV events: give --kv-events-endpoint too")
        if not str(replay).startswith(ENDPOINT_SCHEMES):
            raise ValueError(f"kv_events_replay_endpoint must be a ZeroMQ endpoint to bind (tcp://*:5558, "
                             f"ipc://path); got {replay!r}")
        if replay == self.kv_events_endpoint:
            raise ValueError(f"kv_events_replay_endpoint must differ from kv_events_endpoint; both are {replay!r}")

    @property
    def offload_tiers(self) -> bool:
        """Whether any KV offload tier (CPU memory, disk, remote) is configured."""
        return bool(self.kv_offload_memory or self.kv_offload_dir or self.kv_remote)

    @property
    def eviction(self) -> EvictionSpec:
        """The eviction every request gets unless it asks for its own."""
        return EvictionSpec(self.kv_eviction, self.kv_budget)


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None  # no proposals while more sequences than this are running
    model: str | None = None  # draft_model: the draft checkpoint (a directory or GGUF with the target's tokenizer)
    quantization: str | None = None  # draft_model: its linear layers (None: as the target's --quantization)

    @staticmethod
    def parse(value) -> SpeculativeConfig | None:
        """From vLLM's `speculative_config` (a dict, or its JSON text); None for None. ValueError, naming the field
        and the numbers, for what is not supported or inconsistent. Absent lookup sizes follow vLLM: both 5, or
        the one given for both."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object; {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(known)}")
        method = value.get("method", "draft_model" if value.get("model") is not None else "ngram")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}; got {method!r}")
        k = _spec_integer("num_speculative_tokens", value.get("num_speculative_tokens"), MAX_SPECULATIVE_TOKENS)
        off = value.get("disable_by_batch_size")
        off = None if off is None else _spec_integer("disable_by_batch_size", off)
        if method == "draft_model":
            return SpeculativeConfig._draft(value, k, off)
        for name in ("model", "quantization"):
            if value.get(name) is not None:
                raise ValueError(f"speculative_config {name} is a draft_model field; method ngram has no model")
        hi, lo = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        hi, lo = (5, 5) if hi is None and lo is None else (hi if hi is not None else lo, lo if lo is not None else hi)
        hi, lo = _spec_integer("prompt_lookup_max", hi), _spec_integer("prompt_lookup_min", lo)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min {lo} is above prompt_lookup_max {hi}")
        return SpeculativeConfig(method, k, hi, lo, off)

    @staticmethod
    def _draft(value: dict, k: int, off: int | None) -> SpeculativeConfig:
        model, quant = value.get("model"), value.get("quantization")
        if not isinstance(model, str) or not model:
            raise ValueError(f"speculative_config method draft_model needs model (the draft checkpoint's path); "
                             f"got {model!r}")
        lookup = sorted(n for n in ("prompt_lookup_max", "prompt_lookup_min") if value.get(n) is not None)
        if lookup:
            raise ValueError(f"speculative_config {', '.join(lookup)} are ngram fields; method draft_model has none")
        if quant is not None and quant not in WEIGHT_QUANTIZATIONS:
            raise ValueError(f"speculative_config quantization must be one of {', '.join(WEIGHT_QUANTIZATIONS)}; "
                             f"got {quant!r}")
        return SpeculativeConfig("draft_model", k, 0, 0, off, model, quant)


def _spec_integer(name: str, v, most: int | None = None) -> int:
    """`v` if it is an int in 1..most (a positive int where no `most`); ValueError naming the field otherwise."""
    if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= (most or v):
        return v
    want = f"an integer in 1..{most}" if most else "a positive integer"
    raise ValueError(f"speculative_config {name} must be {want}; got {v!r}")
