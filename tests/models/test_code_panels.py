"""Code panels (cpu_kernels' code_panel_linear, linear.py's Dense.pack with EXACT_CODES): float32 weights that are a
GGUF grid's (Q4_1, Q4_0, Q8_0) kept as codes that decode to them bit for bit. exact_codes finds the grid or says
there is none; the kernel gives panel_linear's very floats at every row count and shape, one row's in-register path
included, in every instruction-set variant the CPU runs; and a model on such weights generates the same tokens and
log probabilities with and without them, the native decode loop and the fused MLP included."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvcache.models.linear as linear
from kvcache import LLM, SamplingParams
from kvcache.models import cpu_kernels
from kvcache.models.quant_linear import exact_codes, quantize_groups, quantize_q8


def _on_grid(w: torch.Tensor, bits: int) -> torch.Tensor:
    """w's nearest weights on a GGUF grid (Q4_1 for 4 bits, Q8_0 for 8), as a dequantized checkpoint holds them."""
    codes, d, m = (quantize_groups if bits == 4 else quantize_q8)(w)
    return d.float().repeat_interleave(32, 1) * codes.float() + m.float().repeat_interleave(32, 1)


@pytest.fixture
def kernels(isa_kernels):
    return isa_kernels


@pytest.mark.parametrize("bits", [4, 8])
def test_exact_codes_find_the_grid_and_give_its_weights_back(bits):
    g = torch.Generator().manual_seed(bits)
    w = _on_grid(torch.randn(70, 96, generator=g), bits)
    w[3, 32:64] = 0.25 if bits == 4 else 0.0  # a constant group (scale 0; Q8_0 has no minimum, so 0 there)
    found = exact_codes(w, rows=16)  # several row blocks
    assert found is not None and found[3] == bits
    codes, d, m, _ = found
    assert codes.shape == w.shape and d.shape == m.shape == (70, 3) and d.dtype == torch.float32
    assert bits == 8 or codes.max().item() <= 15
    back = d.repeat_interleave(32, 1) * codes.float() + m.repeat_interleave(32, 1)
    assert torch.equal(back.view(torch.int32), w.view(torch.int32))


def test_exact_codes_say_none_off_the_grid():
    g = torch.Generator().manual_seed(0)
    assert exact_codes(torch.randn(40, 64, generator=g)) is None  # a float checkpoint's weights
    w = _on_grid(torch.randn(100, 64, generator=g), 4)
    assert exact_codes(w[:, :48].contiguous()) is None  # 48 inputs: no whole groups
    assert exact_codes(w[:, 16:48].contiguous()) is None  # a range cut through the groups
    assert exact_codes(w, rows=16) is not None
    bent = w.clone()
    bent[99, 5] = torch.nextafter(bent[99, 5], torch.tensor(1.0))  # one weight one ulp off, in the last row block
    assert exact_codes(bent, rows=16) is None
    assert exact_codes(w.double()) is None


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k", [(70, 96), (32, 160), (5, 64), (64, 576)])  # partial panels; chunks of 128 and tails
def test_code_panel_linear_gives_panel_linears_floats(kernels, bits, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k + bits)
    w = _on_grid(torch.randn(n, k, generator=g), bits)
    codes = cpu_kernels.pack_code_panels(*exact_codes(w))
    assert codes[0].shape == (-(-n // 32), k, 16 if bits == 4 else 32)
    panels = cpu_kernels.pack_panels(w, kernels)
    for rows in (1, 2, 7, 8, 9, 33, 300):  # one row (decoded in registers), tiles and passes of a decoded panel
        x = torch.randn(rows, k, generator=g)
        want, got = torch.empty(rows, n), torch.empty(rows, n)
        kernels.panel_linear(want, x, panels)
        kernels.code_panel_linear(got, x, *codes)
        assert torch.equal(got, want), (rows, n, k)


def test_code_panel_linear_refuses_what_it_cannot_read(kernels):
    w = _on_grid(torch.randn(40, 64), 4)
    codes, scale, minimum = cpu_kernels.pack_code_panels(*exact_codes(w))
    x, out = torch.randn(3, 64), torch.empty(3, 40)
    for args in ((out, torch.randn(3, 96), codes, scale, minimum),
                 (out, x, codes[..., :8].contiguous(), scale, minimum),
                 (out, x, codes, scale[:, :1].contiguous(), minimum),
                 (out, x, codes, scale, minimum.double())):
        with pytest.raises(RuntimeError, match="code_panel_linear: x"):
            kernels.code_panel_linear(*args)
    with pytest.raises(RuntimeError, match="code_panel_linear: out"):
        kernels.code_panel_linear(torch.empty(3, 65), x, codes, scale, minimum)


def test_code_panel_linear_gives_the_same_floats_on_every_instruction_set(kernels):
    from kvcache import native
    other = native.kernels("scalar")
    g = torch.Generator().manual_seed(11)
    for bits in (4, 8):
        w = _on_grid(torch.randn(70, 160, generator=g), bits)
        codes = cpu_kernels.pack_code_panels(*exact_codes(w))
        for m in (1, 6, 13):
            x = torch.randn(m, 160, generator=g)
            a, b = torch.empty(m, 70), torch.empty(m, 70)
            kernels.code_panel_linear(a, x, *codes)
            other.code_panel_linear(b, x, *codes)
            assert torch.equal(a, b), (kernels.isa, bits, m)


@pytest.fixture(scope="module")
def grid_llama(tiny_model_dirs, tmp_path_factory) -> str:
    """The tiny llama with its linear layers on Q4_1's grid and its LM head on Q8_0's (as the demo GGUF's)."""
    import shutil
    d = tmp_path_factory.mktemp("grid_llama")
    shutil.copytree(tiny_model_dirs["llama"], d, dirs_exist_ok=True)
    w = load_file(os.path.join(d, "model.safetensors"))
    for name, t in w.items():
        if t.dim() == 2 and "embed" not in name:
            w[name] = _on_grid(t.float(), 8 if "lm_head" in name else 4).to(t.dtype)
    save_file(w, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return str(d)


def test_a_model_on_grid_weights_decodes_the_same_with_its_codes(grid_llama, monkeypatch, cpu_isa):
    """Single-stream decode (one row: the codes, in the native decode loop and in the layers' own fused calls) and
    a batch (the float32 panels): the same tokens and log probabilities to the bit as the model without codes, in
    each variant this CPU runs that keeps them (code_rows() > 0: the vector variants)."""
    if cpu_kernels.code_rows() == 0:
        pytest.skip(f"the {cpu_isa} variant keeps no codes (code_rows() is 0): its float32 panels serve every step")
    def make(codes: bool):
        monkeypatch.setattr(linear, "EXACT_CODES", codes)
        return LLM(grid_llama, kv_cache_memory="4MiB", max_model_len=256)
    with_codes, without = make(True), make(False)
    model = with_codes.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, linear.Dense)]
    assert all(m.codes is not None for m in linears)
    assert not any(m.codes is not None for m in without.engine.runner.model.modules() if isinstance(m, linear.Dense))
    assert model.decode_stack is not None
    # a step reads the codes (the rooflines' bytes); memory holds them beside the panels
    plain = without.engine.runner.model
    codes = sum(t.numel() * t.element_size() for m in linears for t in m.codes)
    assert model.weight_read_bytes == plain.weight_read_bytes - sum(m.packed.numel() * 4 for m in linears) + codes
    assert model.weight_bytes == plain.weight_bytes + codes
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [list(range(3 + i, 30 + 5 * i)) for i in range(3)]

    def run(llm, native: bool):
        monkeypatch.setattr(llm.engine.runner.model, "decode_stack", llm.engine.runner.model.decode_stack
                            if native else None)
        single = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
        batch = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(o.token_ids, o.logprobs) for o in single + batch]
    for native in (True, False):
        assert run(with_codes, native) == run(without, native)
