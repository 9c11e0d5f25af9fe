"""Relative encodings that act on the attention logits: Shaw et al. 2018, T5 buckets, ALiBi.

Each depends only on j - i, so shifting all positions by a constant changes nothing. Rows are built
for the global head indices a module serves, so a tensor-parallel rank builds only its own heads.
Each also gives its term to FlexAttention as a lookup inside ``score_mod`` (by head, query index and
key index), so the fused kernel never sees a dense (B, H, Lq, Lk) bias.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from tpe_train.positions.base import (
    POSITIONS,
    PositionArgs,
    PositionEncoding,
    ScoreMod,
    head_index,
    relative_distance,
)


@POSITIONS.register("shaw")
class ShawPosition(PositionEncoding):
    """Shaw et al. 2018: relative key (and optionally value) embeddings clipped at distance k.

    The key term q_i . a_{clip(j-i)} is computed as q @ R^T over the 2k+1 clipped distances, then
    gathered into (Lq, Lk): never an (L, L, d) tensor. Tables are per layer and shared by all heads.
    """

    per_layer = True

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        k, hd = args.shaw_clip, args.head_dim
        self.keys = nn.Parameter(torch.randn(2 * k + 1, hd) * hd**-0.5)
        self.values = nn.Parameter(torch.zeros(2 * k + 1, hd)) if args.shaw_values else None
        self.scale = hd**-0.5
        self.needs_weights = args.shaw_values

    def bucket(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """(Lq, Lk) index into the 2k+1 table rows: clip(j - i, -k, k) + k."""
        k = self.args.shaw_clip
        return relative_distance(q_pos, k_pos).clamp(-k, k) + k

    def relative_logits(self, q: Tensor) -> Tensor:
        """q . a_d / sqrt(hd) for each of the 2k+1 clipped distances d: (B, H, Lq, 2k+1)."""
        return torch.matmul(q, self.keys.to(q.dtype).t()) * self.scale

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        scores = self.relative_logits(q)  # (B, H, Lq, 2k+1)
        idx = self.bucket(q_pos, k_pos)  # (Lq, Lk)
        idx = idx.expand(*scores.shape[:-1], idx.shape[-1])  # (B, H, Lq, Lk)
        return torch.gather(scores, -1, idx)

    def score_mod(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> ScoreMod | None:
        """A lookup of q . a_d in the (B, H, Lq, 2k+1) relative logits, read through a flat view.

        Written for Inductor with dynamic shapes: the logits are captured as one flat buffer, the
        start of each (b, h, q) row comes from a captured (B, H, Lq) tensor, and the clip is a 0-d
        tensor, so the kernel indexes no multi-dimensional buffer with symbolic sizes and closes over
        no Python int: the direct forms failed to compile or gave wrong outputs at a second length
        (docs/attention.md, "Shaw through flex"). tests/test_gpu_path.py compiles this one on the CPU."""
        scores = self.relative_logits(q)  # (B, H, Lq, 2k+1)
        width = scores.shape[-1]
        rows = scores.shape[:-1]
        flat = scores.reshape(-1)
        start = torch.arange(rows.numel(), device=q.device).view(rows) * width
        clip = torch.full((), self.args.shaw_clip, dtype=q_pos.dtype, device=q.device)

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = torch.minimum(torch.maximum(k_pos[kv_idx] - q_pos[q_idx], -clip), clip) + clip
            return score + flat[start[b, h, q_idx] + d]

        return mod

    def value_term(self, weights: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        assert self.values is not None
        idx = self.bucket(q_pos, k_pos).expand_as(weights)  # (B, H, Lq, Lk)
        per_distance = weights.new_zeros(*weights.shape[:-1], self.values.shape[0])
        per_distance.scatter_add_(-1, idx, weights)  # (B, H, Lq, 2k+1): weight on each distance
        return torch.matmul(per_distance, self.values.to(weights.dtype))  # (B, H, Lq, hd)


def t5_bucket(
    relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int, extra: int = 0
) -> Tensor:
    """T5's bucket of each relative position (key minus query): exact for small distances,
    logarithmic up to ``max_distance``; bidirectional splits the buckets between the two signs.

    ``extra`` (test time) adds that many log buckets per sign past ``max_distance`` at the same spacing
    (buckets per unit of log distance): distances below ``max_distance`` keep their bucket exactly."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * (num_buckets + extra)
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # the future gets bucket 0 (it is masked anyway)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets + extra - 1)
    return bucket + torch.where(is_small, distance, large)


@POSITIONS.register("t5")
class T5Position(PositionEncoding):
    """T5 relative bias: one scalar per (bucket, head), shared across the layers of a stack;
    bidirectional in the encoder, causal in the decoder."""

    shared_bias = True
    tp_split = "heads"

    settings: ClassVar[dict[str, str]] = {
        "max_distance": "a larger T5 max_distance: log buckets added past the trained one, same spacing",
        "fill": "the added buckets' biases: linear (extrapolated from the last two trained) or last",
    }
    extension: Tensor | None

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.table = nn.Embedding(args.t5_buckets, args.n_heads)  # column h: head self.heads[h]
        nn.init.normal_(self.table.weight, std=0.1)
        self.extra = 0  # log buckets per sign added at test time (``adapt``)
        self.register_buffer("extension", None, persistent=False)

    def adapt(self, **settings: str) -> None:
        """``max_distance=M``: distances below the trained max_distance keep their bucket and bias;
        buckets continue at the trained log spacing up to M (one more per sign past it: the catch-all),
        with biases extrapolated linearly in the bucket index from the last two trained buckets of each
        sign (``fill=linear``) or copied from the last (``fill=last``: outputs unchanged)."""
        super().adapt(**settings)
        a = self.args
        limit = self.setting(settings, "max_distance", int, a.t5_max_distance)
        fill = settings.get("fill", "linear")
        if fill not in ("linear", "last"):
            raise ValueError(f"t5.fill={fill!r}: choose linear or last")
        if limit < a.t5_max_distance:
            raise ValueError(f"t5.max_distance={limit}: give at least the trained {a.t5_max_distance}")
        half = a.t5_buckets if a.causal else a.t5_buckets // 2
        exact = half // 2
        per_log = (half - exact) / math.log(a.t5_max_distance / exact)
        self.extra = math.ceil(per_log * math.log(limit / exact) - 1e-9) - (half - exact)
        if not self.extra:
            self.extension = None
            return
        with torch.no_grad():
            w = self.table.weight.detach()
            step = w[half - 1] - w[half - 2] if fill == "linear" else torch.zeros_like(w[0])
            k = torch.arange(1, self.extra + 1, dtype=w.dtype, device=w.device)[:, None]
            parts = [w[half - 1] + k * step]  # (extra, h) after the first sign's buckets
            if not a.causal:
                parts.append(w[-1] + k * (w[-1] - w[-2] if fill == "linear" else torch.zeros_like(w[0])))
            self.extension = torch.cat(parts)

    def weights(self) -> Tensor:
        """The (buckets, h) biases, with the test-time buckets (``adapt``) after each sign's."""
        w = self.table.weight
        if self.extension is None:
            return w
        ext = self.extension.to(w.dtype)
        if self.args.causal:
            return torch.cat((w, ext))
        half = w.shape[0] // 2
        return torch.cat((w[:half], ext[: self.extra], w[half:], ext[self.extra :]))

    def keep_heads(self, heads: list[int]) -> None:
        columns = [self.heads.index(h) for h in heads]
        with torch.no_grad():
            kept = self.table.weight[:, head_index(columns, self.table.weight.device)].clone()
        self.table.weight = nn.Parameter(kept)
        super().keep_heads(heads)

    def bucket(self, relative: Tensor) -> Tensor:
        """The bucket of each relative position (key minus query), any shape."""
        a = self.args
        return t5_bucket(relative, not a.causal, a.t5_buckets, a.t5_max_distance, self.extra)

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        buckets = self.bucket(relative_distance(q_pos, k_pos))  # (Lq, Lk)
        return self.weights()[buckets].permute(2, 0, 1).unsqueeze(0).to(q.dtype)  # (1, h, Lq, Lk)

    def score_mod(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> ScoreMod | None:
        table = self.weights()  # (buckets, h): column h is global head self.heads[h]

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + table[self.bucket(k_pos[kv_idx] - q_pos[q_idx]), h].to(score.dtype)

        return mod


def alibi_slopes(n_heads: int) -> list[float]:
    """Press et al. 2022: a geometric sequence starting at 2^(-8/n); for n not a power of two, the
    slopes of the closest smaller power of two followed by every other slope of the next one."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]


@POSITIONS.register("alibi")
class AlibiPosition(PositionEncoding):
    """ALiBi: a linear penalty -slope_h * |i - j|; symmetric in the encoder, and in the decoder the
    causal mask leaves only j <= i, where it is the original -slope_h * (i - j)."""

    shared_bias = True
    tp_split = "heads"
    slopes: Tensor

    settings: ClassVar[dict[str, str]] = {
        "slope_scale": "multiply every head's slope (below 1: a gentler penalty at long range)"
    }

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.slope_scale = 1.0
        self.register_buffer("slopes", self._slopes(self.heads), persistent=False)

    def adapt(self, **settings: str) -> None:
        """``slope_scale=c``: slopes c * m_h (1: the trained slopes, bitwise)."""
        super().adapt(**settings)
        scale = self.setting(settings, "slope_scale", float, 1.0)
        if not scale > 0:
            raise ValueError(f"alibi.slope_scale={scale}: give a positive scale")
        self.slope_scale = scale
        self.slopes = self._slopes(self.heads).to(self.slopes.device)

    def _slopes(self, heads: list[int]) -> Tensor:
        """Slopes of the global heads ``heads`` only (a TP rank never builds the others)."""
        every = alibi_slopes(self.args.n_heads)
        if self.slope_scale != 1.0:
            every = [m * self.slope_scale for m in every]
        return torch.tensor([every[h] for h in heads], dtype=torch.float32)

    def keep_heads(self, heads: list[int]) -> None:
        super().keep_heads(heads)
        self.slopes = self._slopes(heads).to(self.slopes.device)

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        slopes = self.slopes.to(q.device)  # (h,)
        distance = relative_distance(q_pos, k_pos).abs().to(torch.float32)  # (Lq, Lk)
        return (-slopes[:, None, None] * distance).unsqueeze(0).to(q.dtype)  # (1, h, Lq, Lk)

    def score_mod(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> ScoreMod | None:
        slopes = self.slopes.to(q.device)  # (h,) of the global heads self.heads

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            distance = (k_pos[kv_idx] - q_pos[q_idx]).abs().to(torch.float32)
            return score + (-slopes[h] * distance).to(score.dtype)

        return mod
