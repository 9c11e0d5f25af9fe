"""Dropout whose mask costs a fraction of ``F.dropout``'s on the CPU.

On the CPU ``F.dropout`` draws its mask with ``bernoulli_``: one generator call and one conversion
per element. In the bf16 training step of the Multi30k model that was the largest single cost outside
the GEMMs (113 ms of a 770 ms step, profiled on 2 threads). Here the mask is cut from full 64-bit draws
of the same generator (``random_(-2**63, None)``): four 16-bit integers per draw, each kept when it is
at least a threshold. The keep probability is then a multiple of 2^-16 (p = 0.1 drops 6554 / 65536 =
0.100006 of the elements), and the kept ones are scaled by the inverse of that exact probability, so
the layer's expectation is the identity as with ``F.dropout``.

The generator is torch's default CPU generator, filled serially: a seed gives the same masks at any
thread count, and its state travels with the checkpoints as before. GPUs (a fused kernel already),
``torch.compile`` (which fuses ``F.dropout`` with its neighbours) and a p that rounds to 0 or 1 take
``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_LEVELS = 1 << 16  # values of one 16-bit slice of a draw


def keep_mask(shape: torch.Size, dropped: int) -> Tensor:
    """Bool mask of ``shape``, each element False with probability ``dropped`` / 2^16."""
    n = shape.numel()
    draws = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    return (draws.view(torch.int16)[:n] >= dropped - _LEVELS // 2).view(shape)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)``, with the mask of ``keep_mask`` on the CPU."""
    if not training or p == 0.0:
        return x
    dropped = round(p * _LEVELS)
    if x.device.type != "cpu" or not 0 < dropped < _LEVELS or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    keep = keep_mask(x.shape, dropped)
    return x * keep * (_LEVELS / (_LEVELS - dropped))  # autograd saves the bool mask for the gradient
