"""Multi-head attention through ``F.scaled_dot_product_attention``, calling the three position hooks.

The local head count is inferred with ``view(B, L, -1, head_dim)`` so that tensor parallelism can
shard the projections from outside without this file knowing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpe_train.positions import PositionEncoding

KVCache = dict[str, Tensor]


class Attention(nn.Module):
    """Self- or cross-attention with separate q, k, v and out projections."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def _split(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.head_dim).transpose(1, 2)  # (B, H, L, hd)

    def forward(
        self,
        x: Tensor,
        pos: PositionEncoding,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        memory: Tensor | None = None,
        keep: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
    ) -> Tensor:
        """x: (B, Lq, D); memory: (B, Lk, D) for cross-attention (None: self-attention).

        ``keep``: bool (B, 1, 1, Lk), False at padded keys. ``cache``: this layer's KV cache, filled
        in place (self-attention appends; cross-attention projects the memory once).
        """
        q = self._split(self.q(x))
        if memory is None:
            k, v = self._split(self.k(x)), self._split(self.v(x))
            q, k = pos.rotate(q, k, q_pos, q_pos)
            if cache is not None:
                if "k" in cache:
                    k = torch.cat((cache["k"], k), dim=2)
                    v = torch.cat((cache["v"], v), dim=2)
                cache["k"], cache["v"] = k, v
        elif cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]
            q, _ = pos.rotate(q, k[:, :, :0], q_pos, k_pos[:0])
        else:
            k, v = self._split(self.k(memory)), self._split(self.v(memory))
            q, k = pos.rotate(q, k, q_pos, k_pos)
            if cache is not None:
                cache["k"], cache["v"] = k, v

        causal = causal and q.shape[2] > 1
        p = self.dropout if self.training else 0.0
        bias = pos.attn_bias(q, q_pos, k_pos) if pos.has_bias else None
        if pos.needs_weights:
            mask = _mask(bias, keep, causal, q_pos, k_pos)
            out = self._explicit(q, k, v, pos, q_pos, k_pos, mask, p)
        elif bias is None and keep is None and causal and q.shape[2] == k.shape[2]:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        elif bias is None and not causal:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p)
        else:
            mask = _mask(bias, keep, causal, q_pos, k_pos)
            assert mask is not None
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), dropout_p=p)
        b, _, length, _ = out.shape
        return self.out(out.transpose(1, 2).reshape(b, length, -1))

    def _explicit(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        pos: PositionEncoding,
        q_pos: Tensor,
        k_pos: Tensor,
        mask: Tensor | None,
        p: float,
    ) -> Tensor:
        """Attention with explicit weights, for encodings that add a weight-dependent value term."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim**-0.5  # (B, H, Lq, Lk)
        if mask is not None:
            scores = scores + mask
        weights = F.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p, self.training)
        return torch.matmul(weights, v) + pos.value_term(weights, q_pos, k_pos)


def _mask(
    bias: Tensor | None, keep: Tensor | None, causal: bool, q_pos: Tensor, k_pos: Tensor
) -> Tensor | None:
    """Fold bias, key padding and causality into one additive float mask (B|1, H|1, Lq, Lk)."""
    if bias is None and keep is None and not causal:
        return None
    if bias is None:
        mask = torch.zeros(1, 1, q_pos.numel(), k_pos.numel(), device=q_pos.device)
    else:
        mask = bias
    if causal:
        future = k_pos[None, :] > q_pos[:, None]  # (Lq, Lk)
        mask = mask.masked_fill(future, float("-inf"))
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    return mask
