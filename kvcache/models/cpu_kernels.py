"""The model's C++ kernels for the CPU (csrc/linear/, csrc/layer/, csrc/sampling.cpp), built at install for each
instruction-set variant (kvcache.native loads the one this CPU runs); where they cannot run, the model keeps
PyTorch's ops.

- `pack_panels`, `panel_linear`: the float32 linear layers' product, on weights packed in panels of 32 output
  channels (llama.py's Dense.pack; on 2 MiB pages where the OS gives them, native.huge_page_zeros); it streams the
  weights from memory faster than oneDNN's linear at decode's row counts on the machines measured (`kvcache bench
  linear`; docs/kernels.md), and each row's result does not depend on the rows beside it.
- `code_panel_linear`: panel_linear on a GGUF grid's codes (Q4_0/Q4_1 4-bit, Q8_0 8-bit, a float32 scale and minimum
  per 32 inputs) that decode to the float32 weights bit for bit: a step of up to code_rows() rows (8 with AVX-512 or
  AVX2, 0 in the plain build) reads 0.75-1.25 bytes a weight instead of 4 and decodes them in registers (llama.py's
  Dense keeps both forms for such layers; EXACT_CODES).
- `int8_linear`: weight-only int8 matrix product (quant_linear.py).
- `int4_linear`: 4-bit weights (groups of 32 with a scale and a minimum, GGUF's Q4_1) times activations quantized to
  int8 per group of 32 on the fly (GGUF's Q8_1), multiplied with AVX512-VNNI's u8 x s8 dot product, as llama.cpp does
  (on AVX2, vpmaddubsw and vpmaddwd compute the same integer sums: the results are bit-identical).
- `add_rms_norm`: the residual sum and RMSNorm of a layer's input in one pass over each row (float32).
- `silu_mul`: SiLU(gate) x up of the MLP in one pass, with the floats ATen's silu and mul_ give (Sleef's exp, as ATen's).
- `gate_up_silu`: the float32 gate/up product with SiLU x up in its epilogue (pairs of gate and up panels), the floats
  of panel_linear then silu_mul without the [T, 2I] tensor between them.
- `rope_`: rotate-half RoPE of a step's query and key heads in place, in the q/k/v product's own buffer (float32).

- `argmax_finite`: the sampler's greedy ids and each row's finiteness in one pass over the logits.
- `attn_in` and `mlp`: a decoder layer's work around attention in two calls (RMSNorm, the q/k/v
  product and RoPE; the output projection, RMSNorm, gate/up, SiLU x up and down), for float32, int8 and int4 layers.
- `decode_layers`: a decode step's layers in one call (attn_in, the attention module's paged_decode, mlp in turn), for
  LlamaModel's decode-only steps: ~40 Python calls a layer less.

Each kernel has an AVX-512 version, an AVX2 + FMA one (8 floats a register, 16 registers) and a plain C++ one
(csrc/isa.h); where a version exists for a wider instruction set only, the narrower variants run the plain one.

A decode step of a small model is a few hundred tiny ops, and on one core their Python dispatch costs as much as
reading the weights; each of these replaces several of them (figures: docs/kernels.md, docs/cpu-speed-history.md).
"""
from __future__ import annotations

from kvcache import native
from kvcache.native.host_memory import huge_page_zeros


def code_rows() -> int:
    """Steps of at most this many rows take a layer's code panels (code_panel_linear) where it has them (8 with
    the AVX-512 and AVX2 variants, 0 with the scalar one); 0 without the kernels."""
    k = load()
    return 0 if k is None else k.code_rows()


def has_int4() -> bool:
    """Whether the kernels include int4_linear (every variant built here does; False without the kernels)."""
    k = load()
    return k is not None and k.has_int4()


# The C++ kernels of the variant this process runs, or None where they cannot (kvcache.native says why, once)
load = native.kernels


def pack_code_panels(codes, scale, minimum, bits: int) -> tuple:
    """Codes [N, K] (uint8; 4 or 8 bits), scales and minima [N, K / 32] (float32) as code_panel_linear's panels:
    codes [P, K, 16] (4 bits: byte j holds output j's code in its low half, j + 16's in its high) or [P, K, 32],
    scale and minimum [P, K / 32, 32], the last panel's missing outputs 0 (weight 0, as pack_panels pads)."""
    import torch
    n, k = codes.shape
    pad = -n % 32
    per = lambda t: torch.nn.functional.pad(t, (0, 0, 0, pad)).view(-1, 32, t.shape[1]).transpose(1, 2)  # noqa: E731
    c = per(codes)
    if bits == 4:
        c = c[..., :16] | (c[..., 16:] << 4)
    out = huge_page_zeros(tuple(c.shape), torch.uint8, touch=False)
    out.copy_(c)
    return out, per(scale).contiguous(), per(minimum).contiguous()


def pack_panels(w, kernels=None):
    """w [N, K] float32 in panels [ceil(N / 32), K, 32] for panel_linear (the last panel's missing outputs zero), on
    memory the OS may back with huge pages: decode streams every weight from memory each step. `kernels`: a
    module built from this source (default: load())."""
    import torch
    out = huge_page_zeros((-(-w.shape[0] // 32), w.shape[1], 32), torch.float32, touch=False)  # all written
    (kernels or load()).pack_panels(w, out)
    return out
