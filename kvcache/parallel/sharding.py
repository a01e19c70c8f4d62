"""Megatron-style sharding of the Llama family for tensor parallelism (`--tensor-parallel-size N`).

Each of the N ranks holds a slice of every layer: q/k/v and gate/up column-parallel (its query heads, its KV heads,
its share of the intermediate size), o_proj and down row-parallel (the matching input columns; one all-reduce of
their partial outputs each), the embedding and the LM head vocabulary-parallel (a lookup masked to the rank's rows
and all-reduced; logits all-gathered). KV heads are split across ranks, or replicated (one per rank) when N exceeds
them, as `kvcache plan --tensor-parallel-size` assumes: each rank's paged store holds its heads' K/V only, so a
rank's KV bytes per token are the planner's per-GPU figure. The processes are group.py's.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist

from kvcache.compress.policy import HeadShare
from kvcache.models.loader import LoadedModel, build_model
from kvcache.models.weights import WeightSource
from kvcache.parallel.errors import checked
from kvcache.parallel.host import usable_cores
from kvcache.plan.kv_bytes import heads_per_gpu

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def check_tensor_parallel(cfg, size: int, device: torch.device) -> None:
    """ValueError, with the numbers, for a tensor-parallel size this model or machine cannot take (before loading)."""
    if size == 1:
        return
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size {size}: tensor parallelism runs the {', '.join(ARCHITECTURES)} "
                         f"architectures, not {cfg.model_type}")
    heads_per_gpu(cfg.num_key_value_heads, size)  # the planner's refusal, word for word
    for name in ("num_attention_heads", "intermediate_size"):
        n = getattr(cfg, name)
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} must divide {name} ({n:,})")
    if device.type == "cuda":
        have = torch.cuda.device_count()
        if size > have:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; torch sees {have}")
    else:
        have = usable_cores()
        if size > have:
            raise ValueError(f"tensor_parallel_size {size} needs a CPU core per rank; this process may use {have}")


@dataclasses.dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds of a model with these global sizes."""

    rank: int
    size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def q_rows(self) -> range:
        n = self.heads // self.size * self.head_dim
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def kv_rows(self) -> range:
        """This rank's KV heads' rows: its share, or the one head its queries use when KV heads are replicated."""
        local = heads_per_gpu(self.kv_heads, self.size)
        first = self.rank * local if self.kv_heads >= self.size else self.rank * self.kv_heads // self.size
        return range(first * self.head_dim, (first + local) * self.head_dim)

    @property
    def ffn_rows(self) -> range:
        n = self.intermediate // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab // self.size)

    @property
    def vocab_rows(self) -> range:
        """This rank's vocabulary rows (the last rank's may be short: its shard is padded with zero rows)."""
        n = self.vocab_per_rank
        return range(min(self.vocab, self.rank * n), min(self.vocab, (self.rank + 1) * n))


def shard_of(cfg, rank: int, size: int) -> Shard:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Shard(rank, size, cfg.num_attention_heads, cfg.num_key_value_heads, hd, cfg.intermediate_size,
                 cfg.vocab_size)


def sharded_config(cfg, shard: Shard):
    """The config of one rank's model: its heads, KV heads, intermediate size and vocabulary rows."""
    local = copy.deepcopy(cfg)
    local.num_attention_heads = shard.heads // shard.size
    local.num_key_value_heads = heads_per_gpu(shard.kv_heads, shard.size)
    local.intermediate_size = shard.intermediate // shard.size
    local.head_dim = shard.head_dim
    local.vocab_size = shard.vocab_per_rank
    return local


class ShardedSource(WeightSource):
    """One rank's slice of a checkpoint, under the same Hugging Face names: column-parallel weights' rows,
    row-parallel weights' columns (their biases whole on rank 0 and zero elsewhere, so that the all-reduce adds them
    once), vocabulary rows of the embedding and LM head (zero rows past the vocabulary), the rest replicated."""

    def __init__(self, source: WeightSource, shard: Shard) -> None:
        self.source, self.shard = source, shard

    def names(self) -> list[str]:
        return self.source.names()

    def _rule(self, name: str) -> tuple[str, range | None]:
        """(kind, range): rows / cols / vocab / bias0 / whole."""
        s = self.shard
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return "rows", s.q_rows
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return "rows", s.kv_rows
        if name.endswith(("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")):
            return "rows", s.ffn_rows
        if name.endswith("o_proj.weight"):
            return "cols", s.q_rows
        if name.endswith("down_proj.weight"):
            return "cols", s.ffn_rows
        if name.endswith(("o_proj.bias", "down_proj.bias")):
            return "bias0", None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return "vocab", s.vocab_rows
        return "whole", None

    def shape(self, name: str) -> tuple[int, ...]:
        full = self.source.shape(name)
        kind, r = self._rule(name)
        if kind == "rows":
            return (len(r), *full[1:])
        if kind == "cols":
            return (full[0], len(r))
        if kind == "vocab":
            return (self.shard.vocab_per_rank, *full[1:])
        return full

    def row_bytes(self, name: str) -> int:
        return self.source.row_bytes(name)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        kind, r = self._rule(name)
        n = self.shape(name)[0] if self.shape(name) else 0
        stop = n if stop is None else stop
        if kind == "rows":
            if len(self.source.shape(name)) < 2:
                return self.source.read(name)[r.start + start:r.start + stop]
            return self.source.read(name, r.start + start, r.start + stop)
        if kind == "cols":
            return self.source.read(name, start, stop)[:, r.start:r.stop].contiguous()
        if kind == "bias0":
            b = self.source.read(name)
            return b if self.shard.rank == 0 else torch.zeros_like(b)
        if kind == "vocab":
            lo, hi = r.start + start, min(r.stop, r.start + stop)
            have = self.source.read(name, lo, hi) if hi > lo else None
            want = stop - start
            if have is not None and have.shape[0] == want:
                return have
            pad = torch.zeros(want - (0 if have is None else have.shape[0]), *self.source.shape(name)[1:],
                              dtype=torch.float32 if have is None else have.dtype)
            return pad if have is None else torch.cat([have, pad])
        return self.source.read(name, start, stop)

    def chunks(self, name: str) -> Iterator[tuple[int, torch.Tensor]]:
        kind, _ = self._rule(name)
        if kind == "whole":
            yield from self.source.chunks(name)  # a GGUF source un-permutes q/k whole: those are "rows", read whole
        elif kind == "rows" and name.endswith(("q_proj.weight", "k_proj.weight")):
            yield 0, self.read(name)
        else:
            yield from super().chunks(name)


class Collectives:
    """The model's side of tensor parallelism: the all-reduces after row-parallel layers and the embedding, the
    all-gather of the vocabulary-parallel logits."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        checked(dist.all_reduce, x)
        return x

    def embed(self, weight_rows, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the vocabulary-parallel embedding: each rank looks up the ids in its range, the rest zero."""
        r = self.shard.vocab_rows
        local = ids - r.start
        mine = (local >= 0) & (local < len(r))
        x = weight_rows(local.clamp(0, max(0, len(r) - 1)))
        return self.all_reduce((x * mine[:, None].to(x.dtype)).contiguous())

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[T, vocab_per_rank] on each rank -> [T, vocab] (the padding past the vocabulary cut)."""
        parts = [torch.empty_like(local) for _ in range(self.shard.size)]
        checked(dist.all_gather, parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, :self.shard.vocab]


def head_share(shard: Shard):
    """The HeadShare (compress/policy.py) of rank `shard.rank`: which KV heads it holds, how many of each one's
    query heads, and the all-reduce that sums a score across ranks."""
    kv = shard.kv_rows
    local = len(kv) // shard.head_dim
    q_local = shard.heads // shard.size // local
    return HeadShare(shard.kv_heads, shard.heads, kv.start // shard.head_dim, q_local,
                     lambda x: checked(dist.all_reduce, x) or x)


def parallelize(model, shard: Shard) -> None:
    """Make a model built from a ShardedSource run its rank's part: collectives after the row-parallel layers and
    around the vocabulary, and no fused C++ layer calls (they run o_proj and the MLP in one call, with no point to
    reduce between)."""
    comm = Collectives(shard)
    model.tp = comm
    model.decode_stack = None  # the native decode loop (llama.py) is the fused calls too
    for layer in model.layers:
        layer.tp = comm
        layer.fused = None


def build_shard(loaded, rank: int, size: int, max_model_len: int, device, dtype, quantization: str):
    """Rank `rank`'s model: built from its slice of the checkpoint, its collectives attached."""
    shard = shard_of(loaded.config, rank, size)
    local = LoadedModel(sharded_config(loaded.config, shard), loaded.tokenizer,
                        ShardedSource(loaded.weights, shard), loaded.source)
    model = build_model(local, max_model_len, device, dtype, quantization)
    parallelize(model, shard)
    model.shard_config, model.config = model.config, loaded.config  # the engine reads the whole model's sizes
    return model
