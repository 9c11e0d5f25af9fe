"""Encodings added to the token embeddings: none, sinusoidal (Vaswani et al. 2017), learned table."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from tpe_train.positions.base import POSITIONS, PositionArgs, PositionEncoding


@POSITIONS.register("none")
class NoPosition(PositionEncoding):
    """No position information: the encoder becomes permutation-equivariant."""


def sinusoid_table(positions: Tensor, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); (L, d) float32."""
    pos = positions.to(torch.float64)[:, None]  # (L, 1); float64 keeps large positions exact
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (L, d/2)
    table = torch.empty(positions.numel(), d_model, dtype=torch.float64, device=positions.device)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(torch.float32)


@POSITIONS.register("sinusoidal")
class SinusoidalPosition(PositionEncoding):
    """Fixed sinusoids added to the embeddings; computed from the positions on their device at each
    call ((L, d) sines, once per stack and forward pass), never stored and never sized on the host.
    In training, ``model.position.augment`` may move the positions of each sequence (real-valued for
    cape)."""

    augments: ClassVar[tuple[str, ...]] = ("shape", "cape", "randomized")

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        pos = self.train_positions(pos, x.shape[0])  # (L,), or (B, L) in training with augmentation
        table = sinusoid_table(pos.flatten(), self.args.d_model).view(*pos.shape, self.args.d_model)
        return x + table.to(x.dtype)


@POSITIONS.register("learned")
class LearnedPosition(PositionEncoding):
    """A learned absolute table of ``max_positions`` rows (BART, BERT). Tensor parallelism may
    replace ``table`` by a module that holds a slice of the rows and answers the same lookups.
    Longer inputs are refused by the model from their shape (``max_length``), before any lookup."""

    tp_split = "positions"
    #: integer positions only (a row per position): no cape
    augments: ClassVar[tuple[str, ...]] = ("shape", "randomized")
    settings: ClassVar[dict[str, str]] = {
        "extend": "refuse (default: positions past the table are an error) or interpolate",
        "factor": "interpolate: the table stretched to factor x its rows (row i: old position i / factor)",
    }
    extended: Tensor | None

    def __init__(self, args: PositionArgs) -> None:
        super().__init__(args)
        self.table = nn.Embedding(args.max_positions, args.d_model)
        nn.init.normal_(self.table.weight, std=args.d_model**-0.5)
        self.register_buffer("extended", None, persistent=False)

    def adapt(self, **settings: str) -> None:
        """``extend=interpolate factor=F``: a table of round(F * rows) rows, row i linearly interpolated
        at old position i / F (the last row past the end); ``extend=refuse`` or F = 1 keeps the table."""
        super().adapt(**settings)
        extend = settings.get("extend", "refuse")
        if extend not in ("refuse", "interpolate"):
            raise ValueError(f"learned.extend={extend!r}: choose refuse or interpolate")
        factor = self.setting(settings, "factor", float, 1.0)
        if factor < 1.0 or (extend == "refuse" and factor != 1.0):
            raise ValueError(f"learned.factor={factor}: give at least 1, with learned.extend=interpolate")
        if extend == "refuse" or factor == 1.0:
            self.extended = None
            return
        with torch.no_grad():
            w = self.table.weight.detach()
            rows = w.shape[0]
            x = torch.arange(round(rows * factor), dtype=torch.float64, device=w.device) / factor
            lo = x.floor().long().clamp(max=rows - 1)
            hi = (lo + 1).clamp(max=rows - 1)
            frac = (x - lo).clamp(max=1.0).to(w.dtype)[:, None]
            self.extended = (1 - frac) * w[lo] + frac * w[hi]

    @property
    def max_length(self) -> int | None:
        rows = self.args.max_positions if self.extended is None else self.extended.shape[0]
        return rows - self.shift  # a test-time shift uses the last rows for the first positions

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        pos = self.train_positions(pos, x.shape[0])  # (L,), or (B, L) in training with augmentation
        if self.extended is not None:
            return x + self.extended[pos].to(x.dtype)
        return x + self.table(pos).to(x.dtype)
