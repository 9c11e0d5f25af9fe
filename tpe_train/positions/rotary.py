"""Rotary position embeddings (Su et al. 2021): queries and keys rotated by their absolute position,
so that q_i . k_j depends only on i - j."""

from __future__ import annotations

import torch
from torch import Tensor

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding


@POSITIONS.register("rope")
class RotaryPosition(PositionEncoding):
    """RoPE in the half-split layout (GPT-NeoX): pairs (x_i, x_{i + hd/2}) rotate together by the angle
    pos * base^(-2i/hd), i < hd/2.

    The angles are computed from the positions on their device, in float64 (exact for any position a
    model meets), rounded to float32 and then to the compute dtype: once per stack and batch (``memo``:
    every layer reuses them), no table sized on the host, no host sync. The rotation works in the
    projection's own (B, L, H, hd) layout, so rotated q and k keep the memory order (and the strides'
    order) of the unrotated ones: attention's kernels see one layout whatever the encoding.
    """

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        if args.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got d_model/n_heads = {args.head_dim}")

    def cos_sin(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of every position's angles in the half-split layout: two (L, hd) float32."""
        hd = self.args.head_dim
        two_i = torch.arange(0, hd, 2, dtype=torch.float64, device=pos.device)
        inv_freq = 1.0 / torch.pow(self.args.rope_base, two_i / hd)  # (hd/2,)
        freqs = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # (L, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, hd)
        return emb.cos().float(), emb.sin().float()

    def tables(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and the signed sin (-sin on the first half, +sin on the second) as (L, 1, hd) in
        ``dtype``: x * cos + swap_halves(x) * signed_sin is the half-split rotation."""
        cos, sin = self.cos_sin(pos)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(dtype)[:, None, :], signed.to(dtype)[:, None, :]

    def _rotated(self, x: Tensor, pos: Tensor) -> Tensor:
        cos, sin = self.memo("tables", (pos,), x.dtype, lambda: self.tables(pos, x.dtype))
        t = x.transpose(1, 2)  # (B, L, H, hd): the projection's layout (a view, no copy)
        half = t.shape[-1] // 2
        swapped = torch.cat((t[..., half:], t[..., :half]), dim=-1)
        return (t * cos + swapped * sin).transpose(1, 2)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        q = self._rotated(q, q_pos)
        if k.shape[-2]:  # cross-attention with a cached memory passes no keys
            k = self._rotated(k, k_pos)
        return q, k
