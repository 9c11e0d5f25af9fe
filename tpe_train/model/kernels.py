"""Inference-only kernels chosen by device: a linear layer whose weight is packed once for oneDNN.

On x86 CPUs PyTorch sends fp32 ``F.linear`` to MKL's sgemm, which on AMD processors runs far below
the machine's peak; oneDNN (bundled with PyTorch, the path PyTorch's compiler takes for frozen CPU
weights) computes the same product 1.3-1.6x faster here when the weight is reordered into its blocked
layout first (measured on this 2-core EPYC, one thread: 256x256 @ 256x8000 at 61-67 against 36-45
GFLOP/s). Packing costs one pass over the weight, so it pays where one weight serves many calls with
unchanged values: the output projection of every step of a decoding. Training keeps ``F.linear``
(its weights change every step and it needs autograd). Elsewhere (GPU, other dtypes, a PyTorch built
without oneDNN) the plain product is used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Linear = Callable[[Tensor], Tensor]


def packed_linear(weight: Tensor, bias: Tensor | None = None, rows: int = 256) -> Linear:
    """``x -> F.linear(x, weight, bias)`` with ``weight`` packed once for oneDNN (CPU fp32, no grad);
    ``rows``: the expected rows of ``x`` (a layout hint; any number of rows works)."""
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if not _onednn_usable(weight):
        return lambda x: F.linear(x, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def linear(x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or x.requires_grad:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return linear


def _onednn_usable(weight: Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0  # a ZeRO-3 placeholder outside a gathered context has no values
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
