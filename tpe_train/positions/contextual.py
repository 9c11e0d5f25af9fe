"""CoPE (Golovneva et al. 2024, contextual position encoding): positions counted by the content.

The gate g_it = sigmoid(q_i . k_t / sqrt(hd)) says whether key t counts; the position of key j seen from
query i is p_ij = sum of g_it over the keys t from j to i, a fraction in general. The logit term is
q_i . e[p_ij] / sqrt(hd), interpolated between the rows e[floor p_ij] and e[ceil p_ij] of a learned table e
(``cope_positions`` rows; larger counts take the last), computed as q_i . e[p] for every integer p once
and then gathered, as in the paper's code. The table starts at zero, as there. The authors' code adds
q_i . e[p_ij] to q_i . k_j and divides the sum by sqrt(hd) (its default; its ``--cope-nodiv`` adds the
term after the division): attention here divides q . k itself, so the term comes divided
(``cope_divide``, default true; false: the ``--cope-nodiv`` form).

Masked keys (padding, and in the decoder the future) count nothing. The paper's form is causal (t from j
up to i). Two-sided form for the encoder: t runs between j and i in either direction, the count of the
keys between the two tokens, both included, so a key after the query is counted forward as one before
it is counted backward; one table serves both directions, as in the causal form the distance has one
sign. Self-attention only: the count runs from the query's own position, which a key sequence of
another sentence does not contain (``model.position.cross=cope`` is refused).

It needs the keys: it defines ``key_bias``, which attention calls instead of ``attn_bias``. One table per
layer, shared by the heads; under tensor parallelism every rank holds it, its gradient summed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding


@POSITIONS.register("cope")
class ContextualPosition(PositionEncoding):
    """CoPE: logits += q_i . e[p_ij] / sqrt(hd), with
    p_ij = sum_{t between j and i} sigmoid(q_i . k_t / sqrt(hd))."""

    per_layer = True

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.table = nn.Parameter(torch.zeros(args.head_dim, args.cope_positions))  # e, one column a count

    def counts(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, keep: Tensor | None) -> Tensor:
        """p_ij: (B, H, Lq, Lk) in q's dtype (float32 or wider)."""
        wide = torch.promote_types(q.dtype, torch.float32)
        gates = torch.sigmoid(torch.matmul(q, k.transpose(-1, -2)).to(wide) * q.shape[-1] ** -0.5)
        visible = torch.ones_like(gates, dtype=torch.bool)
        if keep is not None:
            visible = visible & keep
        if self.args.causal:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        gates = gates * visible
        # keys are consecutive positions from k_pos[0]: the query's own key is at q_pos - k_pos[0]
        total = torch.cumsum(gates, dim=-1)  # (B, H, Lq, Lk): sum of the gates of keys 0..t
        keys = torch.arange(k_pos.shape[0], device=k_pos.device)
        own = (q_pos - k_pos[0]).clamp(0, k_pos.shape[0] - 1)
        low = torch.minimum(keys[None, :], own[:, None]).expand_as(gates)  # (B, H, Lq, Lk) index
        high = torch.maximum(keys[None, :], own[:, None]).expand_as(gates)
        return total.gather(-1, high) - total.gather(-1, low) + gates.gather(-1, low)

    def key_bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, keep: Tensor | None) -> Tensor:
        p = self.counts(q, k, q_pos, k_pos, keep).clamp(max=self.args.cope_positions - 1)
        per_count = torch.matmul(q.to(p.dtype), self.table.to(p.dtype))  # (B, H, Lq, npos)
        floor, ceil = p.floor(), p.ceil()
        w = p - floor
        low = per_count.gather(-1, floor.long())
        high = per_count.gather(-1, ceil.long())
        term = high * w + low * (1 - w)
        if self.args.cope_divide:
            term = term * q.shape[-1] ** -0.5
        return term.to(q.dtype)
