"""Find and load a checkpoint: a Hugging Face directory (safetensors) or a GGUF file, with its tokenizer."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from kvcache.models import gguf_meta
from kvcache.models.deepseek import DeepseekModel
from kvcache.models.deepseek import check_config as check_deepseek_config
from kvcache.models.gemma import Gemma2Model, Gemma3Model
from kvcache.models.gemma import check_config as check_gemma_config
from kvcache.models.hybrid import HybridModel
from kvcache.models.hybrid import check_config as check_hybrid_config
from kvcache.models.llama import LlamaModel
from kvcache.models.qwen3_next import Qwen3NextModel
from kvcache.models.qwen3_next import check_config as check_qwen3_next_config
from kvcache.models.weights import GGUFSource, SafetensorsSource, WeightSource
from kvcache.plan.model_source import demo_model_path

__all__ = ["LoadedModel", "ModelLoadError", "build_model", "demo_model_path", "model_windows", "read_checkpoint",
           "read_config"]


# model_type -> the decoder that runs it
MODEL_CLASSES: dict[str, type[LlamaModel]] = {**{a: LlamaModel for a in LlamaModel.ARCHITECTURES},
                                              **{a: Gemma2Model for a in Gemma2Model.ARCHITECTURES},
                                              **{a: Gemma3Model for a in Gemma3Model.ARCHITECTURES},
                                              **{a: DeepseekModel for a in DeepseekModel.ARCHITECTURES},
                                              **{a: HybridModel for a in HybridModel.ARCHITECTURES},
                                              **{a: Qwen3NextModel for a in Qwen3NextModel.ARCHITECTURES}}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


class ModelLoadError(ValueError):
    """The model path does not name a loadable checkpoint."""


@dataclass
class LoadedModel:
    """A checkpoint opened for loading: its tensors are read only when a model is built from it (any number of
    times: each build reads them again, converted to that model's dtype and device)."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    weights: WeightSource
    source: str


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, n) for n in names]
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    return [os.path.join(directory, f) for f in files]


def _resolve(path: str | None) -> str:
    path = demo_model_path() if path is None else os.path.expanduser(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"model path {path!r} does not exist (and models are not downloaded: give a "
                             "local Hugging Face directory or GGUF file)")
    if os.path.isfile(path) and not _is_gguf(path):
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic) nor a model directory")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    return path


def read_config(path: str | None) -> PretrainedConfig:
    """The model's configuration (Hugging Face config.json or GGUF metadata); None means the demo model."""
    path = _resolve(path)
    try:
        if os.path.isfile(path):
            directory, name = os.path.split(os.path.abspath(path))
            config = gguf_meta.cached(path, "config", lambda: AutoConfig.from_pretrained(directory, gguf_file=name),
                                      lambda c, d: c.save_pretrained(d), AutoConfig.from_pretrained)
            config.name_or_path = directory
        else:
            config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read the model configuration of {path}: {e}") from e
    _check_arch(config, path)
    return config


def read_checkpoint(path: str | None) -> LoadedModel:
    """Config, tokenizer and (lazily read) tensors of `path`; None means the demo model."""
    path = _resolve(path)
    config = read_config(path)
    if os.path.isfile(path):
        if config.model_type not in LlamaModel.ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF checkpoints of {config.model_type} are not supported (kvcache reads "
                                 f"GGUF tensors of {', '.join(LlamaModel.ARCHITECTURES)}); load its safetensors "
                                 "directory instead")
        directory, name = os.path.split(os.path.abspath(path))
        try:
            tokenizer = gguf_meta.cached(path, "tokenizer",
                                         lambda: AutoTokenizer.from_pretrained(directory, gguf_file=name),
                                         lambda t, d: t.save_pretrained(d), AutoTokenizer.from_pretrained)
            tokenizer.name_or_path = directory
        except Exception as e:
            raise ModelLoadError(f"cannot build the tokenizer from the GGUF metadata of {path}: {e}") from e
        weights = GGUFSource(path, config.model_type, config.num_attention_heads, config.num_key_value_heads)
        return LoadedModel(config, tokenizer, weights, path)
    weights = SafetensorsSource(_safetensors_files(path))
    return LoadedModel(config, AutoTokenizer.from_pretrained(path), weights, path)


def _check_arch(config: PretrainedConfig, path: str) -> None:
    """The architecture is one of ours, and its layer kinds and Gemma's fields are consistent (before any tensor
    is read)."""
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: architecture {config.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        model_windows(config)
        if MODEL_CLASSES[config.model_type] is HybridModel:
            check_hybrid_config(config)
        if MODEL_CLASSES[config.model_type] is Qwen3NextModel:
            check_qwen3_next_config(config)
        if MODEL_CLASSES[config.model_type] in (Gemma2Model, Gemma3Model):
            check_gemma_config(config)
        if MODEL_CLASSES[config.model_type] is DeepseekModel:
            check_deepseek_config(config)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def model_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention, or a layer that keeps no KV), as its decoder reads them;
    ValueError naming the field where the config's layer kinds do not add up."""
    return MODEL_CLASSES[config.model_type].windows_of(config)


def build_model(loaded: LoadedModel, max_positions: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, quantization: str = "none") -> LlamaModel:
    """The model in `dtype` on `device` (its linear layers' weights int8 with `quantization="int8"`), its weights
    copied in from the checkpoint chunk by chunk: the memory it takes on the way is its own size plus one chunk
    (weights.CHUNK_BYTES)."""
    with torch.device("meta"):  # no random init: every weight is overwritten
        model = MODEL_CLASSES[loaded.config.model_type](loaded.config, max_positions, quantization)
    model = model.to(dtype).keep_scale_dtypes().to_empty(device=device).requires_grad_(False)  # no autograd
    model.load_weights(loaded.weights)
    model.init_rope(device)
    return model.eval()
