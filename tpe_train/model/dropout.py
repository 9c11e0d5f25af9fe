"""Dropout whose mask costs a fraction of ``F.dropout``'s on the CPU.

On the CPU ``F.dropout`` draws its mask with ``bernoulli_``: one generator call and one conversion
per element, the largest single cost outside the GEMMs of a bf16 step. Here the mask is cut from full
64-bit draws of the same generator (``random_(-2**63, None)``): four 16-bit integers per draw, each
kept when it is at least a threshold. The keep probability is then a multiple of 2^-16 (p = 0.1 drops
6554 / 65536 = 0.100006 of the elements), and the kept ones are scaled by the inverse of that exact
probability, so the layer's expectation is the identity as with ``F.dropout``.

In reduced precision the mask is a tensor of x's dtype (0 or 1), not a bool mask (PyTorch multiplies
bf16 by bool in a slow mixed-dtype loop); the products are the same bits. In fp32 the mask holds 0 or
the scale itself, so ``x * mask`` is one product in the forward and one in the backward, with the same
bits; the mask then takes 4 bytes an element. The comparison writes that tensor itself
(``torch.ge(..., out=)``). The timings: docs/cpu-kernels.md#dropout.

The generator is torch's default CPU generator, filled serially: a seed gives the same masks at any
thread count, and its state travels with the checkpoints. GPUs (a fused kernel already),
``torch.compile`` (which fuses ``F.dropout`` with its neighbours) and a p that rounds to 0 or 1 take
``F.dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_LEVELS = 1 << 16  # values of one 16-bit slice of a draw


def keep_mask(shape: torch.Size, dropped: int, dtype: torch.dtype = torch.bool) -> Tensor:
    """Mask of ``shape``, each element False (0) with probability ``dropped`` / 2^16, else True (1),
    written in ``dtype`` by the comparison itself (see above)."""
    n = shape.numel()
    draws = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    out = torch.empty(n, dtype=dtype)
    return torch.ge(draws.view(torch.int16)[:n], dropped - _LEVELS // 2, out=out).view(shape)


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout(x, p, training)``, with the mask of ``keep_mask`` on the CPU."""
    if not training or p == 0.0:
        return x
    dropped = round(p * _LEVELS)
    if x.device.type != "cpu" or not 0 < dropped < _LEVELS or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    scale = _LEVELS / (_LEVELS - dropped)
    if x.dtype == torch.float32:  # the mask written as 0 or the scale: one product each way (see above)
        return x * keep_mask(x.shape, dropped, torch.float32).mul_(scale)
    # a bool operand takes PyTorch's slow mixed-dtype loop in reduced precision (see above)
    return x * keep_mask(x.shape, dropped, x.dtype) * scale  # autograd saves the mask for the gradient
