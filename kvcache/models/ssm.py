"""Mamba-2's arithmetic in PyTorch (state space duality, SSD), one sequence's chunk or a batch of decode rows at a
time, on states held outside the model (store/state_store.py).

- A prefill chunk runs the causal depthwise convolution over its inputs after the (K - 1) inputs before it (the
  conv state), then the chunked scan from the SSM state it starts from; it leaves both states as of its last token.
- A decode row runs one step of each: the conv window slides by one, the state decays by exp(dt A) and takes
  dt B x.

A prompt split into chunks anywhere gives the same outputs, up to float rounding, as in one piece: the chunked scan
is exact (no approximation), only its order of additions depends on the chunking. transformers' Mamba2Mixer (its
torch path) is the oracle the tests hold this to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = x[j+1] + ... + x[i] for j <= i, -inf above the diagonal (computed
    by masked cumulative sums, which stay exact where differences of cumsums would cancel)."""
    T = x.shape[-1]
    x = x[..., None].expand(*x.shape, T)
    below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~below, 0).cumsum(dim=-2)
    on_or_below = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
    return x.masked_fill(~on_or_below, float("-inf"))


def conv_chunk(inputs: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(causal depthwise conv) of `inputs` [n, C] after the K - 1 inputs in `state` [C, K - 1], [n, C];
    the window [C, K - 1 + n], `state` then the inputs: the state after the chunk's first o tokens is
    window[:, o:o + K - 1], the new state window[:, n:]). `weight` [C, K]."""
    window = torch.cat([state, inputs.t().to(state.dtype)], dim=1)
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out[0]).t(), window


def conv_step(inputs: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B rows: (silu(conv) [B, C], the new states [B, C, K - 1]) of `inputs` [B, C] after `states`."""
    window = torch.cat([states, inputs.unsqueeze(-1).to(states.dtype)], dim=2)  # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out), window[:, :, 1:]


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
              chunk: int, initial: torch.Tensor | None, offset: int = 0,
              boundaries: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of one sequence's `n` tokens: (y [n, H, P], the final state [H, P, N]), or with `boundaries`,
    (y, the states at the scan's block boundaries [c + 1, H, P, N]: the first `initial`, the last the final state).

    x [n, H, P]; dt [n, H] (softplus'd and clamped); A [H] (negative); B, C [n, G, N] (G groups of H / G heads);
    D [H]; `initial` [H, P, N] (None: zeros). Tokens go in blocks of `chunk`: within a block the output is a masked
    (decayed) attention-like product, between blocks the state carries over. The first token is `offset` tokens
    into its block (the sequence's position modulo `chunk`): blocks then sit on the sequence's multiples of `chunk`,
    so boundary j is position (start - offset) + j x chunk.
    """
    n, H, P = x.shape
    y_skip = x * D[:, None]
    x = x * dt[..., None]
    a = A * dt  # [n, H]
    B = B.repeat_interleave(H // B.shape[1], dim=1)
    C = C.repeat_interleave(H // C.shape[1], dim=1)
    pad = (chunk - (offset + n) % chunk) % chunk
    if pad or offset:  # zero input and no decay before the start and past the end: states pass through unchanged
        x, a, B, C = (F.pad(t, (0, 0) * (t.dim() - 1) + (offset, pad)) for t in (x, a, B, C))
    c = x.shape[0] // chunk
    x, B, C = (t.reshape(c, chunk, H, -1) for t in (x, B, C))
    a = a.reshape(c, chunk, H).permute(2, 0, 1)  # [H, c, l]
    a_cum = a.cumsum(-1)
    # within each block: y[l] = sum over s <= l of C[l].B[s] exp(a[s+1] + ... + a[l]) x[s]
    decay = torch.exp(segsum(a))  # [H, c, l, s]
    scores = torch.einsum("clhn,cshn->clsh", C, B) * decay.permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, x)
    # each block's own contribution to the state at its end, then the states carried from block to block
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [H, c, l]
    block_states = torch.einsum("clhn,clhp->chpn", B * to_end.permute(1, 2, 0)[..., None], x)
    start = initial[None].to(block_states.dtype) if initial is not None else torch.zeros_like(block_states[:1])
    block_states = torch.cat([start, block_states])  # [c + 1, H, P, N]
    carry = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # [H, c + 1, c + 1]
    states = torch.einsum("hij,jhpn->ihpn", carry, block_states)
    # what each block's starting state adds to its outputs
    y = y + torch.einsum("clhn,chpn->clhp", C, states[:-1]) * torch.exp(a_cum).permute(1, 2, 0)[..., None]
    y = y.reshape(-1, H, P)[offset:offset + n] + y_skip
    return y, (states if boundaries else states[-1])


def ssm_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B rows: (y [B, H, P], the new states [B, H, P, N]) from `state` [B, H, P, N]; x [B, H, P],
    dt [B, H] (softplus'd), B and C [B, G, N]."""
    H = x.shape[1]
    B = B.repeat_interleave(H // B.shape[1], dim=1)  # [B, H, N]
    C = C.repeat_interleave(H // C.shape[1], dim=1)
    new = state * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new, C) + x * D[:, None]
    return y, new


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """RMSNorm, per group of channels, of y * silu(z), times `weight`; in float32, cast back to y's dtype before the
    weight multiplies (transformers' MambaRMSNormGated)."""
    h = y.float() * F.silu(z.float())
    g = h.view(*h.shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return weight * g.view_as(h).to(y.dtype)
