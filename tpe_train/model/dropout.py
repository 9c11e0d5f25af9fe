"""Dropout whose mask costs a fraction of ``F.dropout``'s on the CPU.

On the CPU ``F.dropout`` draws its mask with ``bernoulli_``: one generator call and one conversion
per element. In the bf16 training step of the Multi30k model that was the largest single cost outside
the GEMMs (113 ms of a 770 ms step, profiled on 2 threads). Here the mask is cut from full 64-bit draws
of the same generator (``random_(-2**63, None)``): four 16-bit integers per draw, each kept when it is
at least a threshold. The keep probability is then a multiple of 2^-16 (p = 0.1 drops 6554 / 65536 =
0.100006 of the elements), and the kept ones are scaled by the inverse of that exact probability, so
the layer's expectation is the identity as with ``F.dropout``.

In reduced precision the mask is applied as a tensor of x's dtype (0 or 1), not as the bool mask:
PyTorch multiplies a bf16 tensor by a bool one in a slow mixed-dtype loop (1.2 ms against 0.3 ms for
bf16 x bf16 on a (128, 37, 256) activation, one thread), in the forward and again in the backward.
The products are the same bits (x times 1 or 0), and a bf16 training step of the benchmark's shape
took 2.5% less time (median of 12 interleaved steps, one thread, Intel Xeon with AMX).
In fp32 the mask is written as 0 or the scale itself (the fp32 0/1 mask times the scale, in place):
``x * mask`` is then one product in the forward and one in the backward instead of two each, with
the same bits (the scale, a Python float, is rounded to fp32 as ``x * keep * scale`` rounds it, and
1 times it is exact). Forward + backward of a (128, 37, 256) activation, 2 threads, Zen 4 EPYC:
2.8-4.0 against 5.0-8.1 ms with the bool mask (medians of 31, two runs; 0.7-1.0 ms of each is the
test's own copy and backward). The mask then takes 4 bytes an element instead of 1, as much as the
activation it drops.
The comparison writes that tensor itself (``torch.ge(..., out=)``): comparing into a bool tensor and
converting it took 1.0 ms against 0.17 ms on a (128, 37, 256) activation (2 threads, Intel Xeon with
AMX, the other core busy), the same values.

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
