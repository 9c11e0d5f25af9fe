"""Additive biases that are a function of the distance |i - j| with per-head constants or parameters:
KERPLE (Chi et al. 2022, logarithmic and power kernels) and Sandwich (Chi et al. 2023).

Both are two-sided as written (functions of |i - j|): the encoder takes them as they are, and in the
decoder the causal mask leaves the keys j <= i of the papers' causal forms. One module serves every
layer of a stack (``shared_bias``), as in the papers' implementations, which add the same kernel in
every layer; rows are per global head, so a tensor-parallel rank keeps only its own heads.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding, ScoreMod, head_index

#: the smallest value of a kernel parameter (the reference implementation clamps them at 0.01)
KERPLE_EPS = 0.01
#: how far above KERPLE_EPS a draw below it starts: the reference clamps such a draw to 0.01 exactly, a
#: value that EPS + softplus(raw) reaches only as raw -> -inf (softplus^-1(1e-4) is about -9.2)
KERPLE_INIT_MARGIN = 1e-4


def inverse_softplus(x: Tensor) -> Tensor:
    """The raw value whose softplus is ``x`` (> 0)."""
    return x + torch.log(-torch.expm1(-x))


def read_scale(settings: dict[str, str]) -> float:
    """The ``distance_scale`` setting (default 1); ValueError for one not positive."""
    scale = PositionEncoding.setting(settings, "distance_scale", float, 1.0)
    if not scale > 0:
        raise ValueError(f"distance_scale={scale}: give a positive factor")
    return scale


def distance(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """(Lq, Lk) float32 |j - i|."""
    return (k_pos[None, :] - q_pos[:, None]).abs().to(torch.float32)


class _Kernel(PositionEncoding):
    """A per-head bias -k_h(|i - j|) from two positive per-head parameters (r1, r2), stored raw.

    r = EPS + softplus(raw) keeps each parameter above the reference's clamp without the reference's
    in-place projection of the parameter after each step (which the optimizer's fp32 master copy
    under ZeRO would not see); the initial values follow the reference's uniform draws, a draw below
    the clamp starting at EPS + ``KERPLE_INIT_MARGIN`` (the reference: at EPS)."""

    shared_bias = True
    tp_split = "heads"

    #: the upper bounds of the initial uniform draws of (r1, r2)
    init: tuple[float, float] = (1.0, 1.0)

    settings: ClassVar[dict[str, str]] = {
        "distance_scale": "divide every distance by this factor at test time (above 1: longer inputs see "
        "the trained range of distances)",
    }

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.distance_scale = 1.0
        h = args.n_heads
        draws = [(torch.rand(h) * top).clamp(min=KERPLE_EPS + KERPLE_INIT_MARGIN) for top in self.init]
        self.r1 = nn.Parameter(self.raw(draws[0], 0))
        self.r2 = nn.Parameter(self.raw(draws[1], 1))

    def adapt(self, **settings: str) -> None:
        """``distance_scale=s``: the kernel at |i - j| / s (1: the trained bias, bitwise)."""
        super().adapt(**settings)
        self.distance_scale = read_scale(settings)

    def raw(self, value: Tensor, which: int) -> Tensor:
        """The stored value of parameter ``which`` (0: r1, 1: r2) that gives ``value``."""
        return inverse_softplus(value - KERPLE_EPS)

    def value(self, raw: Tensor, which: int) -> Tensor:
        """The kernel parameter from its stored value."""
        return KERPLE_EPS + F.softplus(raw)

    def params(self) -> tuple[Tensor, Tensor]:
        """(r1, r2) of the heads this module serves, (h,) in float32 (fp64 parameters: fp64)."""
        wide = torch.promote_types(self.r1.dtype, torch.float32)
        return self.value(self.r1.to(wide), 0), self.value(self.r2.to(wide), 1)

    def kernel(self, r1: Tensor, r2: Tensor, d: Tensor) -> Tensor:
        """The bias at distances ``d`` (float32, broadcast against r1 and r2)."""
        raise NotImplementedError

    def keep_heads(self, heads: list[int]) -> None:
        columns = head_index([self.heads.index(h) for h in heads], self.r1.device)
        with torch.no_grad():
            self.r1 = nn.Parameter(self.r1[columns].clone())
            self.r2 = nn.Parameter(self.r2[columns].clone())
        super().keep_heads(heads)

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        r1, r2 = self.params()
        d = distance(q_pos, k_pos).to(r1.dtype)  # (Lq, Lk)
        if self.distance_scale != 1.0:
            d = d / self.distance_scale
        return self.kernel(r1[:, None, None], r2[:, None, None], d).unsqueeze(0).to(q.dtype)

    def score_mod(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> ScoreMod | None:
        r1, r2 = self.params()  # (h,) of the global heads self.heads
        scale = 1.0 / self.distance_scale

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = (k_pos[kv_idx] - q_pos[q_idx]).abs().to(r1.dtype)
            if scale != 1.0:
                d = d * scale
            return score + self.kernel(r1[h], r2[h], d).to(score.dtype)

        return mod

    def extra_repr(self) -> str:
        return f"heads={len(self.heads)}, kernel={type(self).__name__}"


@POSITIONS.register("kerple_log")
class KerpleLog(_Kernel):
    """KERPLE's logarithmic kernel: -r1 * log(1 + r2 * |i - j|), r1, r2 > 0 per head; initial
    r1 ~ U(0, 2), r2 ~ U(0, 1) as in the reference implementation."""

    init = (2.0, 1.0)

    def kernel(self, r1: Tensor, r2: Tensor, d: Tensor) -> Tensor:
        return -r1 * torch.log1p(r2 * d)


@POSITIONS.register("kerple_power")
class KerplePower(_Kernel):
    """KERPLE's power kernel: -r1 * |i - j|^r2, r1 > 0.01 and 0.01 < r2 < 2 per head; initial
    r1 ~ U(0, 1), r2 ~ U(0, 2) as in the reference implementation. r2 = EPS + (2 - EPS) * sigmoid(raw)
    keeps the exponent within the reference's clamp [0.01, 2] (the kernel is conditionally positive
    definite for exponents in (0, 2])."""

    init = (1.0, 2.0)

    def raw(self, value: Tensor, which: int) -> Tensor:
        if which == 0:
            return super().raw(value, which)
        top = 2 - KERPLE_INIT_MARGIN
        return torch.logit((value.clamp(max=top) - KERPLE_EPS) / (2 - KERPLE_EPS))

    def value(self, raw: Tensor, which: int) -> Tensor:
        if which == 0:
            return super().value(raw, which)
        return KERPLE_EPS + (2 - KERPLE_EPS) * torch.sigmoid(raw)

    def kernel(self, r1: Tensor, r2: Tensor, d: Tensor) -> Tensor:
        return -r1 * torch.pow(d, r2)


def sandwich_scales(n_heads: int, heads: list[int]) -> Tensor:
    """Sandwich's per-head divisor, as ALiBi's slopes spread the heads: head h (1-based) gets its bias
    divided by 8h/H, i.e. multiplied by H / (8h); float32 (len(heads),)."""
    return torch.tensor([n_heads / (8.0 * (h + 1)) for h in heads], dtype=torch.float32)


def sandwich_kernel(d: Tensor, dim: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """sum_{k=1..d'/2} cos(d / 10000^(2k/d')) - d'/2: the inner product of the sinusoidal embeddings of
    two positions d apart, shifted to 0 at d = 0 (a float64 sum, returned in ``dtype``)."""
    k = torch.arange(1, dim // 2 + 1, dtype=torch.float64, device=d.device)
    inv_freq = torch.pow(10000.0, -2.0 * k / dim)  # (d'/2,)
    angles = d.to(torch.float64)[..., None] * inv_freq
    return (torch.cos(angles).sum(-1) - dim / 2).to(dtype)


@POSITIONS.register("sandwich")
class SandwichPosition(PositionEncoding):
    """Sandwich: bias_h(i, j) = (sum_{k=1..d'/2} cos((i - j) / 10000^(2k/d')) - d'/2) * H / (8h).

    Parameter-free. The sum is even in i - j, so the encoder takes it as it is. d' is
    ``model.position.sandwich_dim``."""

    shared_bias = True
    tp_split = "heads"
    scales: Tensor
    settings = _Kernel.settings

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.distance_scale = 1.0
        if args.sandwich_dim % 2:
            raise ValueError(f"sandwich needs an even sandwich_dim, got {args.sandwich_dim}")
        self.register_buffer("scales", sandwich_scales(args.n_heads, self.heads), persistent=False)

    def adapt(self, **settings: str) -> None:
        """``distance_scale=s``: the bias at (i - j) / s (1: the trained bias, bitwise)."""
        super().adapt(**settings)
        self.distance_scale = read_scale(settings)

    def keep_heads(self, heads: list[int]) -> None:
        super().keep_heads(heads)
        self.scales = sandwich_scales(self.args.n_heads, heads).to(self.scales.device)

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        d = k_pos[None, :] - q_pos[:, None]  # (Lq, Lk)
        if self.distance_scale != 1.0:
            d = d / self.distance_scale
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64: an exact reference
        term = sandwich_kernel(d, self.args.sandwich_dim, wide)
        scales = self.scales.to(device=q.device, dtype=term.dtype)
        return (scales[:, None, None] * term).unsqueeze(0).to(q.dtype)  # (1, h, Lq, Lk)
