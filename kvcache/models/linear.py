"""The engine's float32 linear layer (Dense) and the packings it runs from: the C++ kernels' panels and code panels
(cpu_kernels.py), oneDNN's blocked layout, or MKL on the dense weight; the quantized layers are quant_linear.py's."""
from __future__ import annotations

import os

import torch
from torch import nn

from kvcache.models import cpu_kernels
from kvcache.models.quant_linear import INT4_UNIT, Int4Dense, Int8Dense, exact_codes


def check_int4_sizes(sizes: dict[str, int]) -> None:
    """int4's kernel packs INT4_UNIT (64) inputs at a time: every linear layer's input size (named in `sizes`, from
    the config) must be a multiple."""
    bad = [f"{k} {v}" for k, v in sizes.items() if v % INT4_UNIT]
    if bad:
        raise ValueError(f"quantization int4 needs layer input sizes that are multiples of {INT4_UNIT}; this model "
                         f"has {', '.join(bad)}: use --quantization int8 or none")


# Whether Dense.pack also keeps a float32 layer whose weights are a GGUF grid's (Q4_0/Q4_1, Q8_0) as codes that
# decode to those very floats (cpu_kernels' code panels), for steps of up to code_rows() rows (8 with the AVX-512
# and AVX2 kernels; none with the scalar ones): the same outputs from 0.75-1.25 bytes a weight instead of 4,
# decoded in registers (what single-stream decode reads: docs/kernels.md). Larger steps keep the float32 panels,
# faster there (see CODE_ROWS in csrc/linear/panels.cpp).
EXACT_CODES = os.environ.get("KVCACHE_EXACT_CODES", "1") != "0"


def packable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether weights of `dtype` on `device` can be packed (Dense.pack): float32 on a CPU, with the project's C++
    kernels or oneDNN."""
    return device.type == "cpu" and dtype == torch.float32 and (
        cpu_kernels.load() is not None or torch.backends.mkldnn.is_available())


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """A contiguous [out, in] float32 weight in oneDNN's blocked layout (mkldnn::_reorder_linear_weight)."""
    return torch.ops.mkldnn._reorder_linear_weight(w)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b through oneDNN's linear on a weight from pack_weight."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n_out: int, bias: torch.Tensor | None = None,
                 codes: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x W^T + b through the C++ kernel (cpu_kernels' panel_linear) on W [n_out, in] packed by its pack_panels, or
    for a step of up to code_rows() rows on W's codes where it has them (code_panel_linear: the same floats)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], n_out, dtype=x.dtype)
    if codes is not None and rows.shape[0] <= cpu_kernels.code_rows():
        cpu_kernels.load().code_panel_linear(out, rows, *codes)
    else:
        cpu_kernels.load().panel_linear(out, rows, panels)
    if bias is not None:
        out.add_(bias)
    return out.view(*x.shape[:-1], n_out)


class Dense(nn.Module):
    """y = x W + b with W stored [in, out]: on CPU (MKL) this layout runs the skinny GEMMs of decode steps faster
    than nn.Linear's [out, in].

    In float32 on the CPU, `pack()` (once the weights are loaded) repacks W and drops the dense copy, unless it is
    also looked up (a tied embedding). Where the C++ kernels build, W goes into panels of 32 output channels for
    their panel_linear (cpu_kernels.py), faster than oneDNN's linear on its own packed weights at decode's row counts
    and the same at prefill's (`kvcache bench linear`); each row's result is then independent of the batch. Without
    them, or where only their plain C++ variant runs (no AVX2: 60-80x slower than oneDNN), oneDNN's blocked layout (faster than MKL's GEMM). `KVCACHE_PACKED_WEIGHTS=onednn` picks oneDNN's, `0`
    keeps MKL on the dense W. What each measured: docs/kernels.md."""

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = n_in, n_out
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.packed: torch.Tensor | None = None  # W^T in panels (pack_panels) or in oneDNN's layout (pack)
        self.codes: tuple[torch.Tensor, ...] | None = None  # or as code panels (pack_code_panels): codes, scale, min

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            if self.packed.is_mkldnn:
                return packed_linear(x, self.packed, self.bias)
            return panel_linear(x, self.packed, self.out_features, self.bias, self.codes)
        return torch.matmul(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def pack(self, keep_dense: bool = False) -> bool:
        """Repack W (float32 CPU weights only; where neither the C++ kernels nor oneDNN are there, or
        KVCACHE_PACKED_WEIGHTS=0, keep it as it is); the dense W is dropped unless `keep_dense`. Whether it packed."""
        w, how = self.weight, os.environ.get("KVCACHE_PACKED_WEIGHTS", "1")
        if how not in ("0", "1", "onednn"):
            raise ValueError(f"KVCACHE_PACKED_WEIGHTS={how!r}: use 1 (panels for the C++ kernels, else oneDNN), "
                             "onednn or 0 (dense)")
        if self.packed is not None or self.codes is not None or w is None or not packable(w.dtype, w.device) or \
                how == "0":
            return False
        kernels = cpu_kernels.load() if how == "1" else None
        if kernels is not None and kernels.isa == "scalar" and torch.backends.mkldnn.is_available():
            kernels = None  # the plain C++ panels run at a few GFLOP/s, oneDNN at the machine's (docs/kernels.md)
        if kernels is None and not torch.backends.mkldnn.is_available():
            return False
        exact = exact_codes(w.detach().t()) if kernels is not None and EXACT_CODES and cpu_kernels.code_rows() else None
        if exact is not None:
            self.codes = cpu_kernels.pack_code_panels(*exact)
        # loading peaks at the weights plus one matrix (tests/models/test_loading.py): the panels are read from W's
        # transposed view with no copy; for oneDNN a contiguous [out, in] copy is made (it would copy the view
        # itself), so that W can go before the repacking
        w_t = w.detach().t() if kernels is not None else w.detach().t().contiguous()
        del w
        if not keep_dense:
            self.weight = None
        self.packed = cpu_kernels.pack_panels(w_t, kernels) if kernels is not None else pack_weight(w_t)
        return True

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight (a tied head keeps its dense one too, a parameter, and holds both)."""
        codes = sum(t.numel() * t.element_size() for t in self.codes) if self.codes is not None else 0
        return codes + (self.packed.numel() * 4 if self.packed is not None else 0)

    def load_rows(self, start: int, rows: torch.Tensor) -> None:
        """Copy Hugging Face weight rows [n, in] (output channels start .. start + n) into their columns."""
        self.weight[:, start:start + rows.shape[0]].copy_(rows.t())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` of the Hugging Face layout, [len(ids), in] (a tied embedding's lookups)."""
        return self.weight.index_select(1, ids).t()


def kernel_tensors(m: nn.Module) -> list[torch.Tensor]:
    """A linear layer as cpu_kernels' fused calls take it (see linear_into there)."""
    if isinstance(m, Int4Dense):
        ts = [m.qweight, m.scale, m.minimum]
    elif isinstance(m, Int8Dense):
        ts = [m.weight, m.scale]
    else:
        ts = [m.packed if m.packed is not None else m.weight] + (list(m.codes) if m.codes is not None else [])
    return [t.detach() for t in ts] + ([m.bias.detach()] if m.bias is not None else [])
