"""Rotary position embeddings (Su et al. 2021): queries and keys rotated by their absolute position,
so that q_i . k_j depends only on i - j."""

from __future__ import annotations

import torch
from torch import Tensor

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@POSITIONS.register("rope")
class RotaryPosition(PositionEncoding):
    """RoPE in the half-split layout (GPT-NeoX): pairs (x_i, x_{i + hd/2}) rotate together."""

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        hd = args.head_dim
        if hd % 2:
            raise ValueError(f"rope needs an even head dimension, got d_model/n_heads = {hd}")
        self.inv_freq = 1.0 / (args.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def _cos_sin(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._cos.shape[0] < length or self._cos.device != device:
            size = max(length, 2 * self._cos.shape[0], 256)
            pos = torch.arange(size, dtype=torch.float64)
            freqs = pos[:, None] * self.inv_freq[None, :]  # (size, hd/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (size, hd)
            self._cos = emb.cos().float().to(device)
            self._sin = emb.sin().float().to(device)
        return self._cos, self._sin

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        last = max(int(q_pos[-1]), int(k_pos[-1])) if k.shape[-2] else int(q_pos[-1])
        cos, sin = self._cos_sin(last + 1, q.device)
        cq, sq = cos[q_pos].to(q.dtype), sin[q_pos].to(q.dtype)  # (Lq, hd)
        q = q * cq + _rotate_half(q) * sq
        if k.shape[-2]:
            ck, sk = cos[k_pos].to(k.dtype), sin[k_pos].to(k.dtype)
            k = k * ck + _rotate_half(k) * sk
        return q, k
