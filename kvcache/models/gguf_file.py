"""Read a GGUF checkpoint's tensors into Hugging Face-named fp32 tensors."""
from __future__ import annotations

import re

import gguf
import numpy as np
import torch

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each Llama q/k head; undo it
    # so the rotate-half RoPE of the Hugging Face layout applies.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_tensors(path: str, arch: str, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Dequantize every tensor (F32, F16, BF16, Q8_0, Q4_0, Q4_1, K-quants: whatever `gguf` supports) to fp32."""
    reader = gguf.GGUFReader(path)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m:
            name = f"model.layers.{m.group(1)}.{_LAYER_NAMES.get(m.group(2), m.group(2))}"
        else:
            name = _GLOBAL_NAMES.get(t.name, t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            w = _unpermute(w, num_heads if "q_proj" in name else num_kv_heads)
        out[name] = torch.from_numpy(w if w.flags.writeable and w.flags.c_contiguous else np.array(w))
    return out
