"""`kvcache plan` output: one dict (the JSON) and its text rendering, each number with how it was computed."""
from __future__ import annotations

from kvcache.plan.capacity import DevicePlan
from kvcache.plan.kv_bytes import (heads_per_gpu, kv_bytes_per_token, kv_cache_bytes, kv_dtype, kv_formula,
                                   layer_groups, mha_equivalent_bytes_per_token, pool_tokens, residual_bytes_per_seq,
                                   state_bytes_per_seq)
from kvcache.plan.shape import ModelShape


def human(n: float) -> str:
    """Bytes in binary units: 85899345920 -> '80.00 GiB'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def build_report(shape: ModelShape, dtype: str, batch: int, seq_len: int, device: DevicePlan | None = None,
                 state_dtype: str = "bfloat16") -> dict:
    """Everything `kvcache plan` prints, as JSON-ready values (bytes are ints).

    Bytes per token and the B x L cache are for the whole model; the capacity part (with a
    `device`) is per GPU under its tensor and pipeline parallelism.
    """
    tp = device.tensor_parallel_size if device else 1
    cache = kv_cache_bytes(shape, dtype, batch, seq_len, state_dtype=state_dtype)
    groups = layer_groups(shape, dtype)
    report = {
        "model": shape.name, "attention": shape.attention_kind, "num_layers": shape.num_layers,
        "layers": {k: shape.count(k) for k in dict.fromkeys(shape.layer_kinds)},
        "num_attention_heads": shape.num_attention_heads, "num_kv_heads": shape.num_kv_heads,
        "kv_heads_per_gpu": heads_per_gpu(shape.num_kv_heads, tp), "head_dim": shape.head_dim,
        "sliding_window": shape.sliding_window, "kv_lora_rank": shape.kv_lora_rank or None,
        "qk_rope_head_dim": shape.qk_rope_head_dim or None, "max_position_embeddings": shape.max_position_embeddings,
        "num_parameters": shape.num_parameters, "notes": list(shape.notes),
        "kv_cache_dtype": kv_dtype(dtype).name, "kv_cache_dtype_layout": kv_dtype(dtype).describe(),
        "bytes_per_token_per_layer": {g.kind: g.bytes_per_token for g in groups},
        "bytes_per_token": kv_bytes_per_token(shape, dtype), "formula": kv_formula(shape, dtype),
        "mha_equivalent_bytes_per_token": mha_equivalent_bytes_per_token(shape, dtype),
        "residual_bytes_per_seq": residual_bytes_per_seq(shape, dtype),
        "state_bytes_per_seq": state_bytes_per_seq(shape, state_dtype),
        "batch": batch, "seq_len": seq_len, "total_bytes": cache.total_bytes, "attention_bytes": cache.attention_bytes,
        "residual_bytes": cache.residual_bytes, "state_bytes": cache.state_bytes, "paged_bytes": cache.paged_bytes,
        "total_formula": " + ".join(
            f"{g.count} {g.kind} x {g.bytes_per_token:,} B x {batch:,} x "
            + (f"min({seq_len:,}, {g.window:,})" if g.window else f"{seq_len:,}") for g in groups),
    }
    if device is not None:
        c = device.capacity
        report.update({
            "memory_per_gpu": device.memory_per_gpu, "num_gpus": device.num_gpus,
            "tensor_parallel_size": device.tensor_parallel_size, "pipeline_parallel_size": device.pipeline_parallel_size,
            "gpu_memory_utilization": device.gpu_memory_utilization, "weight_dtype": device.weight_dtype,
            "weight_bytes": device.weight_bytes, "activation_bytes": device.activation_bytes,
            "kv_budget": device.kv_budget, "kv_cache_bytes": device.kv_cache_bytes, "block_size": c.block_size,
            "block_bytes": c.block_size * c.bytes_per_token, "gpu_bytes_per_token": c.bytes_per_token,
            "num_blocks": c.num_blocks, "max_tokens": c.num_tokens, "max_concurrency": c.max_concurrency,
            "max_seq_len_for_batch": device.max_seq_len_for_batch, "seq_blocks": c.seq_blocks,
            "layers_per_block": c.layers_per_block,
            "attention_layers": device.stage.num_kv_layers, "blocks_per_request": c.blocks_per_request,
            "max_num_seqs": device.max_num_seqs, "gpu_formula": kv_formula(device.stage, dtype, tp),
        })
    return report


def format_report(r: dict) -> str:
    """The report as aligned text lines."""
    layers = ", ".join(f"{n} {k}" for k, n in r["layers"].items())
    if r["attention"] == "MLA":
        heads = f"latent {r['kv_lora_rank']} + rope {r['qk_rope_head_dim']} values per token and layer"
    else:
        heads = f"{r['num_attention_heads']} query heads, {r['num_kv_heads']} KV heads, head_dim {r['head_dim']}"
    lines = [
        ("model", r["model"]),
        ("attention", f"{r['attention']}, {r['num_layers']} layers ({layers}); {heads}"
         + (f"; window {r['sliding_window']:,} tokens" if r["sliding_window"] else "")),
        *[("", note) for note in r["notes"]],
        ("kv dtype", r["kv_cache_dtype_layout"]),
        ("per layer", ", ".join(f"{k}: {b:,} bytes/token" for k, b in r["bytes_per_token_per_layer"].items())),
        ("per token", f"{r['formula']} ({human(r['bytes_per_token'])})"),
        *([("MHA equiv", f"{r['mha_equivalent_bytes_per_token']:,} bytes/token with every head's K and V cached "
                         f"expanded: {r['mha_equivalent_bytes_per_token'] / r['bytes_per_token']:.1f}x the latent")]
          if r.get("mha_equivalent_bytes_per_token") else []),
        ("cache", f"{r['batch']:,} x {r['seq_len']:,} tokens = {r['total_bytes']:,} bytes ({human(r['total_bytes'])})"),
        ("", f"= {r['total_formula']}"),
    ]
    if r["residual_bytes"]:
        lines.append(("", f"+ fp16 residual keys: {r['batch']:,} x {r['residual_bytes_per_seq']:,} bytes"))
    if r["state_bytes"]:
        lines.append(("", f"+ linear-layer state: {r['batch']:,} x {r['state_bytes_per_seq']:,} bytes "
                          "(constant per request)"))
    if r["paged_bytes"] != r["total_bytes"]:
        lines.append(("paged", f"{r['paged_bytes']:,} bytes ({human(r['paged_bytes'])}) in kvcache's paged pool, which "
                               "keeps every layer's tokens: one block table serves every layer, so out-of-window "
                               "blocks are given back only where every layer slides with one window"))
    if "kv_budget" in r:
        lines += _capacity_lines(r)
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


def _capacity_lines(r: dict) -> list[tuple[str, str]]:
    lines = []
    if r["weight_bytes"] or r["activation_bytes"]:
        usable = int(r["memory_per_gpu"] * r["gpu_memory_utilization"])
        lines += [
            ("deployment", f"{r['num_gpus']} GPU(s) of {r['memory_per_gpu']:,} bytes ({human(r['memory_per_gpu'])}), "
                           f"tensor parallel {r['tensor_parallel_size']}, pipeline parallel {r['pipeline_parallel_size']}"),
            ("per GPU", f"{r['memory_per_gpu']:,} x {r['gpu_memory_utilization']} = {usable:,} usable"),
            ("", f"- {r['weight_bytes']:,} weights ({r['num_parameters']:,} params x {r['weight_dtype']} / {r['num_gpus']})"),
            ("", f"- {r['activation_bytes']:,} activation and runtime reserve (estimate; --activation-reserve sets it)"),
        ]
    if r["tensor_parallel_size"] > 1 or r["pipeline_parallel_size"] > 1:
        lines.append(("gpu token", f"{r['gpu_formula']} on each GPU"))
    lines += [
        ("kv budget", f"{r['kv_budget']:,} bytes per GPU ({human(r['kv_budget'])}); {r['kv_cache_bytes']:,} bytes in "
                      f"blocks on all GPUs ({human(r['kv_cache_bytes'])})"),
        ("blocks", pool_tokens(r["num_blocks"], r["block_size"], r["layers_per_block"], r["attention_layers"])
                   + f" ({r['block_bytes']:,} bytes per block per GPU)"
                   + (f"; a block holds {r['layers_per_block']} layers: one table per layer group, a request of "
                      f"{r['seq_len']:,} tokens takes {r['blocks_per_request']:,} blocks across them"
                      if r.get("layers_per_block") else "")
                   + (f"; each request also takes {r['seq_blocks']} block(s) for its per-sequence buffers"
                      if r["seq_blocks"] else "")),
        ("concurrency", f"{r['max_concurrency']:.2f} requests of {r['seq_len']:,} tokens at once"
                        + (f" (the scheduler runs at most --max-num-seqs {r['max_num_seqs']})"
                           if r["max_concurrency"] > r["max_num_seqs"] else "")),
        ("longest", f"{r['batch']:,} concurrent request(s) fit {r['max_seq_len_for_batch']:,} tokens each"
                    + (f" (beyond the model's {r['max_position_embeddings']:,}-token context)"
                       if r["max_position_embeddings"] and r["max_seq_len_for_batch"] > r["max_position_embeddings"] else "")),
    ]
    return lines
