"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) in PyTorch: one sequence's chunk in the
chunked form, or one token of a batch of sequences, on a state [value heads, key dim, value dim] held outside.

Per token, the state S decays by exp(g), then takes the delta rule's correction: S += k (beta (v - S^T k))^T; the
output is S^T q. q and k are L2-normalised and q is scaled by key_dim^-0.5 first. The chunked form (blocks of
`chunk` tokens: a UT transform solves each block's corrections at once, the state carries between blocks) computes
the same, up to float rounding. transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule are
the oracle the tests hold this to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [.., Hk, dk] float32, each key head serving heads / Hk consecutive value heads, L2-normalised, q
    scaled by dk^-0.5."""
    r = heads // q.shape[-2]
    q, k = q.float().repeat_interleave(r, dim=-2), k.float().repeat_interleave(r, dim=-2)
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


def delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int,
                initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's n tokens: (outputs [n, Hv, dv], the final state [Hv, dk, dv]). q, k [n, Hk, dk]; v [n, Hv, dv];
    g (log decay, <= 0) and beta [n, Hv]; `initial` [Hv, dk, dv] (None: zeros)."""
    n, H, dv = v.shape
    q, k = _prepare(q, k, H)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v.float()))  # [H, n, d]
    g, beta = g.float().t(), beta.float().t()  # [H, n]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    c = (n + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(H, c, chunk, -1) for t in (q, k, k_beta, v_beta))
    g = g.reshape(H, c, chunk).cumsum(-1)  # log of the decay from the block's start
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(above, float("-inf")).exp()  # [H, c, l, s]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    scores = (q @ k.transpose(-1, -2)) * decay
    # the UT transform: every block's corrections at once (unit lower-triangular solves)
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    state = initial.float().clone() if initial is not None else q.new_zeros(H, k.shape[-1], dv)
    q, k = q * g.exp()[..., None], k * (g[..., -1:] - g).exp()[..., None]
    out = torch.empty_like(values)
    for i in range(c):
        v_new = values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + scores[:, i] @ v_new
        state = state * g[:, i, -1].exp()[:, None, None] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(H, -1, dv)[:, :n].transpose(0, 1), state


def delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: (outputs [B, Hv, dv], the new states [B, Hv, dk, dv]) from `state`; q, k
    [B, Hk, dk]; v [B, Hv, dv]; g, beta [B, Hv]."""
    q, k = _prepare(q, k, v.shape[1])
    state = state * g.float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)  # S^T k: [B, H, dv]
    delta = (v.float() - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state
