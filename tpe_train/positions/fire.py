"""FIRE (Li et al. 2024, functional interpolation for relative positions): a learned bias
f(psi(|i - j|) / psi(max(L, i))) with psi(x) = log(c x + 1), f a small MLP with one output per head.

The paper's form is causal (keys j <= i, query position i). Two-sided form for the encoder: the input
psi(|i - j|) / psi(max(L, i, j)), the normaliser by the later of the two positions, which is the
query's for keys at or before it (the paper's form) and keeps every input within [0, 1] for keys after
it too (normalised by the query's position alone, a key n positions after an early query would feed
the MLP inputs up to psi(n) / psi(L), above 1 once n > L: values it never saw in training, which the
paper's bounded input is there to avoid); and two output layers of the MLP, one for keys at or
before the query and one for keys after it. With a single
output over |i - j| the encoder's bias would be symmetric and FIRE would no longer contain the
bidirectional T5 bias (separate buckets for each sign), one of the biases the paper shows it contains;
the hidden layer, c and L stay shared by the two sides. The decoder has the left layer only.

One module serves every layer of a stack, as T5's table does (``shared_bias``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding, head_index

#: the paper's initial c of psi(x) = log(c x + 1)
FIRE_INIT_C = 0.1
#: added to psi(max(L, i)), as in the paper's reference code
FIRE_EPS = 1e-6


@POSITIONS.register("fire")
class FirePosition(PositionEncoding):
    """FIRE: b_h(i, j) = f_h(psi(|i - j|) / psi(max(L, i, j))) (max(L, i) for keys j <= i); learned c,
    learned multiplier m of the threshold L = |m| * L0 (L0 = ``model.position.fire_threshold``), and the
    MLP f: 1 -> width (ReLU) -> heads (two-sided in the encoder: one output layer per side)."""

    shared_bias = True
    tp_split = "heads"

    settings: ClassVar[dict[str, str]] = {
        "threshold": "L at test time (positions) in place of the learned |m| L0: the query position up to "
        "which distances are normalised by psi(L) rather than by psi(i)",
    }

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.hidden = nn.Linear(1, args.fire_width)
        self.left = nn.Linear(args.fire_width, args.n_heads)  # keys at or before the query
        self.right = None if args.causal else nn.Linear(args.fire_width, args.n_heads)  # keys after it
        # shape (1,), not 0-d: DeepSpeed broadcasts parameters as bytes, which a 0-d tensor cannot view
        self.c = nn.Parameter(torch.tensor([FIRE_INIT_C]))
        self.multiplier = nn.Parameter(torch.tensor([1.0]))
        self.threshold: float | None = None  # test time (``adapt``): L itself

    def adapt(self, **settings: str) -> None:
        """``threshold=L``: normalise by psi(max(L, i)) with this L instead of the learned one (FIRE's
        test-time lever: a larger L keeps longer queries on the normaliser of the trained ones)."""
        super().adapt(**settings)
        if "threshold" not in settings:
            self.threshold = None
            return
        value = self.setting(settings, "threshold", float, 0.0)
        if not value > 0:
            raise ValueError(f"fire.threshold={value}: give a positive threshold")
        self.threshold = value

    def head_dims(self) -> dict[str, int]:
        """The output layers hold one row per head; the hidden layer, c and L serve every head."""
        sides = [side for side in ("left", "right") if getattr(self, side) is not None]
        return {f"{side}.{p}": 0 for side in sides for p in ("weight", "bias")}

    def keep_heads(self, heads: list[int]) -> None:
        rows = head_index([self.heads.index(h) for h in heads], self.left.weight.device)
        for side in ("left", "right"):
            layer = getattr(self, side)
            if layer is None:
                continue
            with torch.no_grad():
                layer.weight = nn.Parameter(layer.weight[rows].clone())
                layer.bias = nn.Parameter(layer.bias[rows].clone())
            layer.out_features = len(heads)
        super().keep_heads(heads)

    def normalised(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """psi(|i - j|) / psi(max(L, i, j)): (Lq, Lk) in float32 (fp64 parameters: fp64), i the query
        position and j the key's (max(L, i) for every key at or before the query: the paper's form)."""
        wide = torch.promote_types(self.c.dtype, torch.float32)  # fp32, or fp64 for an fp64 reference
        c = self.c.to(wide).abs()
        threshold = (self.multiplier.to(wide) * self.args.fire_threshold).abs()
        if self.threshold is not None:
            threshold = torch.full_like(threshold, self.threshold)
        rel = (k_pos[None, :] - q_pos[:, None]).abs().to(wide)
        later = torch.maximum(q_pos[:, None], k_pos[None, :]).to(wide)  # (Lq, Lk)
        norm = torch.log1p(c * torch.maximum(later, threshold)) + FIRE_EPS
        return torch.log1p(c * rel) / norm

    @staticmethod
    def linear(layer: nn.Linear, x: Tensor) -> Tensor:
        """``layer`` in the dtype of ``x`` (float32 under autocast too: the bias is computed in fp32)."""
        return nn.functional.linear(x, layer.weight.to(x.dtype), layer.bias.to(x.dtype))

    def attn_bias(self, q: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        x = self.normalised(q_pos, k_pos)[..., None]  # (Lq, Lk, 1)
        hidden = torch.relu(self.linear(self.hidden, x))
        out = self.linear(self.left, hidden)  # (Lq, Lk, h)
        if self.right is not None:
            after = self.linear(self.right, hidden)
            out = torch.where((k_pos[None, :] > q_pos[:, None])[..., None], after, out)
        return out.permute(2, 0, 1).unsqueeze(0).to(q.dtype)  # (1, h, Lq, Lk)
