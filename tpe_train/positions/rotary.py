"""Rotary position embeddings (Su et al. 2021): queries and keys rotated by their absolute position,
so that q_i . k_j depends only on i - j."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding


def check_head_dim(head_dim: int) -> None:
    """Refuse an odd head dimension (RoPE rotates pairs of features): where the config is loaded, and
    where the encoding is built without one."""
    if head_dim % 2:
        raise ValueError(
            f"rope needs an even head dimension, but d_model/n_heads = {head_dim}; "
            "change model.d_model or model.n_heads"
        )


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

    settings: ClassVar[dict[str, str]] = {
        "scaling": "none | pi (positions / factor) | ntk (base * factor^(hd/(hd-2))) | yarn",
        "factor": "the context extension factor s (default 1: unchanged)",
        "original": "YaRN: the trained context length L (wavelength ramp alpha=1, beta=32)",
    }
    #: YaRN's ramp bounds (Peng et al. 2023, section 3.2, for LLaMA): rotations per original context
    yarn_alpha = 1.0
    yarn_beta = 32.0

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        check_head_dim(args.head_dim)
        self.scaling, self.factor, self.original = "none", 1.0, 0

    def adapt(self, **settings: str) -> None:
        """Position interpolation (Chen et al. 2023), NTK-aware base scaling (bloc97 2023) or YaRN
        (Peng et al. 2023, with its attention temperature) by ``factor``; factor 1 is the identity."""
        super().adapt(**settings)
        scaling = settings.get("scaling", "none")
        if scaling not in ("none", "pi", "ntk", "yarn"):
            raise ValueError(f"rope.scaling={scaling!r}: choose none, pi, ntk or yarn")
        factor = self.setting(settings, "factor", float, 1.0)
        if factor < 1.0:
            raise ValueError(f"rope.factor={factor}: give a factor of at least 1")
        original = self.setting(settings, "original", int, 0)
        if scaling == "yarn" and original < 1:
            raise ValueError("rope.scaling=yarn needs rope.original=<trained context length>")
        self.scaling, self.factor, self.original = scaling, factor, original

    def inv_freq(self, device: torch.device) -> Tensor:
        """theta_i = base^(-2i/hd), i < hd/2, after the test-time scaling: (hd/2,) float64."""
        hd, s = self.args.head_dim, self.factor
        two_i = torch.arange(0, hd, 2, dtype=torch.float64, device=device)
        base = self.args.rope_base
        if self.scaling == "ntk" and s != 1.0:
            base = base * s ** (hd / (hd - 2))
        theta = 1.0 / torch.pow(base, two_i / hd)
        if self.scaling == "pi" and s != 1.0:
            theta = theta / s
        if self.scaling == "yarn" and s != 1.0:
            ratio = self.original * theta / (2 * math.pi)  # r = L / wavelength
            gamma = ((ratio - self.yarn_alpha) / (self.yarn_beta - self.yarn_alpha)).clamp(0.0, 1.0)
            theta = (1 - gamma) * theta / s + gamma * theta
        return theta

    @property
    def mscale(self) -> float:
        """YaRN's sqrt(1/t) = 0.1 ln s + 1, applied to q and k alike (logits times its square)."""
        return 0.1 * math.log(self.factor) + 1.0 if self.scaling == "yarn" else 1.0

    def cos_sin(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin of every position's angles in the half-split layout: two (L, hd) float32."""
        inv_freq = self.inv_freq(pos.device)  # (hd/2,)
        freqs = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # (L, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, hd)
        if self.mscale != 1.0:
            return (emb.cos() * self.mscale).float(), (emb.sin() * self.mscale).float()
        return emb.cos().float(), emb.sin().float()

    def tables(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, and the signed sin with its halves swapped, as (L, 1, hd) in ``dtype``.

        The half-split rotation is x * cos + swap(x) * s with s = (-sin, +sin) on the (first, second)
        half. swap is its own inverse, so swap(x) * s = swap(x * swap(s)), and swap(s) = (+sin, -sin)
        is what is returned: the swap then acts on a fresh dense product, as one ``roll``. A swap of
        the strided projection view itself took two slices and a ``cat`` (and in the backward two
        ``slice_backward``, each a zero-filled copy): 18 aten ops a rotation, 12 now."""
        cos, sin = self.cos_sin(pos)
        half = sin.shape[-1] // 2
        swapped_signed = torch.cat((sin[:, half:], -sin[:, :half]), dim=-1)
        return cos.to(dtype)[:, None, :], swapped_signed.to(dtype)[:, None, :]

    def _rotated(self, x: Tensor, pos: Tensor) -> Tensor:
        cos, sin = self.memo("tables", (pos,), x.dtype, lambda: self.tables(pos, x.dtype))
        t = x.transpose(1, 2)  # (B, L, H, hd): the projection's layout (a view, no copy)
        return (t * cos + (t * sin).roll(t.shape[-1] // 2, dims=-1)).transpose(1, 2)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        q = self._rotated(q, q_pos)
        if k.shape[-2]:  # cross-attention with a cached memory passes no keys
            k = self._rotated(k, k_pos)
        return q, k
