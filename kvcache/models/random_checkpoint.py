"""Random-weight checkpoints of any architecture transformers has a config class for, saved as a Hugging Face
directory (safetensors, config.json and a word-level tokenizer over the vocabulary): what the tests check kvcache
against transformers on, and what benchmarks of a model's shape (a window, a layer pattern) run without a model hub.
"""
from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


def write_tokenizer(directory: str, vocab_size: int) -> None:
    """A word-level tokenizer over a vocabulary of `vocab_size` ids ("w3" is id 3), so text prompts work too. Not for
    qwen2 checkpoints: transformers 5 loads their tokenizer as Qwen2Tokenizer whatever tokenizer_config.json names,
    and its byte-level pipeline finds none of these words (give such a model token ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}w3{% endif %}")
    fast.save_pretrained(directory)


def save_random_checkpoint(directory: str, cfg: PretrainedConfig, seed: int = 0) -> str:
    """Save a model of `cfg` with random weights in `directory`. transformers initialises norms to 1 (Gemma's,
    which scale by 1 + w, to 0) and biases to 0 (DeepSeek-V3's expert score bias too): they are drawn around those
    values instead, so that they count; a Mamba mixer's time-step bias is drawn as mamba_ssm initialises it (Bamba's
    transformers init sets 1, which forgets a state within a few tokens), and its skip D small (the init's 1 would
    drown the state's share of the output, and with it any test of the state)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    unit = 0.0 if cfg.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):  # a Mamba mixer's time steps as trained ones: 0.001 to 0.1, long memory
                dt = torch.exp(torch.rand_like(p) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            elif name.endswith(".D"):  # a Mamba mixer's skip: small, so that its output is mostly its state's
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(unit + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias (a buffer, zero at init)
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(directory)
    write_tokenizer(directory, cfg.vocab_size)
    return directory
