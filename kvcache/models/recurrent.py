"""What every recurrent mixer (Mamba-2's, Gated DeltaNet's) does with its state slots, once: a causal depthwise
convolution over some of its projected channels (the conv state: the last K - 1 of them), then a recurrence over
the conv's output (the recurrent state), both per sequence in the slots the step's StateBatch names.

- A chunk that scans (a prompt's, or any chunk that starts a sequence) runs the convolution after its slot's conv
  state (zeros where it starts at position 0) and the chunked form of the recurrence from its recurrent state,
  piece by piece between the snapshot boundaries it is asked for (exact: the state carries over), writing each
  snapshot and leaving its slot as of its last token.
- Decode rows run one step of each, batched.

A subclass says how: `project` (its input projections: the conv's channels, the per-row values the recurrence
reads, the output gate), `chunk` and `step` (the recurrence's two forms), `finish` (norm, gate, output projection).
"""
from __future__ import annotations

import torch
from torch import nn

from kvcache.attention.metadata import ForwardBatch
from kvcache.models.ssm import conv_chunk, conv_step
from kvcache.store.state_store import StateSpan


class RecurrentMixer(nn.Module):
    """Base of the mixers; `layer` is its index among the model's recurrent layers (its tensors in the state store),
    `conv_weight` [C, 1, K] and `conv_bias` [C] or None its convolution's."""

    layer: int
    conv_weight: nn.Parameter
    conv_bias: nn.Parameter | None

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the conv's input channels [T, C], per-row values of the recurrence [T, E] float32, the gate [T, ...])."""
        raise NotImplementedError

    def chunk(self, conv_out: torch.Tensor, per_row: torch.Tensor, state: torch.Tensor | None, start: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens from position `start`: (outputs [n, ...] float32, the state after them) from
        `state` (None: zeros)."""
        raise NotImplementedError

    def step(self, conv_out: torch.Tensor, per_row: torch.Tensor, states: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of B sequences: (outputs [B, ...] float32, their new states [B, ...])."""
        raise NotImplementedError

    def finish(self, y: torch.Tensor, gate: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The mixer's output [T, hidden] from the recurrence's outputs [T, ...] and the gate."""
        raise NotImplementedError

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        xbc, per_row, gate = self.project(h)
        states = batch.states
        conv, rec = states.store.tensors[self.layer]["conv"], states.store.tensors[self.layer]["ssm"]
        weight = self.conv_weight.squeeze(1)
        y = torch.empty(h.shape[0], *self.out_shape, dtype=torch.float32, device=h.device)
        for span in states.spans:
            y[span.first:span.first + span.rows] = self._scan(span, xbc, per_row, conv, rec, weight)
        if states.decode_rows.numel():
            r, s = states.decode_rows, states.decode_slots
            out, conv_new = conv_step(xbc.index_select(0, r), conv.index_select(0, s), weight, self.conv_bias)
            conv.index_copy_(0, s, conv_new)
            yd, rec_new = self.step(out.float(), per_row.index_select(0, r), rec.index_select(0, s).float())
            rec.index_copy_(0, s, rec_new.to(rec.dtype))
            y.index_copy_(0, r, yd)
            for i, dst in states.decode_saves:  # a snapshot after this step's token
                conv[dst], rec[dst] = conv_new[i], rec_new[i]
        return self.finish(y, gate, h)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of one row's recurrence output."""
        raise NotImplementedError

    def _scan(self, span: StateSpan, xbc: torch.Tensor, per_row: torch.Tensor, conv: torch.Tensor,
              rec: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One sequence's chunk (see the module docstring): its outputs."""
        n, rows = span.rows, slice(span.first, span.first + span.rows)
        conv_in = conv.new_zeros(conv.shape[1:]) if span.fresh else conv[span.slot]
        out, window = conv_chunk(xbc[rows], conv_in, weight, self.conv_bias)
        out, values, K1 = out.float(), per_row[rows], conv.shape[2]
        state = None if span.fresh else rec[span.slot].float()
        ys, done = [], 0
        for end, dst in [*span.saves, (span.start + n, span.slot)]:
            o = end - span.start
            if o > done:
                y, state = self.chunk(out[done:o], values[done:o], state, span.start + done)
                ys.append(y)
                done = o
            conv[dst], rec[dst] = window[:, o:o + K1], state.to(rec.dtype)
        return torch.cat(ys)
