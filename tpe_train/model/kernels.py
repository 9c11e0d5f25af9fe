"""Inference kernels chosen by device: linear layers whose weights are packed for oneDNN.

On x86 CPUs PyTorch sends fp32 ``F.linear`` to MKL's sgemm, which on AMD processors runs well below
the machine's peak; oneDNN (bundled with PyTorch; the path PyTorch's compiler takes for frozen CPU
weights) computes the same products faster once a weight is reordered into its blocked layout
(measured on this 2-core EPYC, one thread, median speed-up: 1.2x at 256x256 @ 256x256, 1.5x at
256x1024 @ 1024x256, 1.3-1.6x for the 8,000-word output projection). Packing costs one pass over the
weight, so it pays where a weight serves many products with unchanged values: inference, above all the
steps of a decoding. Packing happens only inside ``packed_inference()`` (greedy and beam search
enter it): there the weights cannot change, and the packed copies are dropped when it ends. Anywhere
else, and for autograd, autocast, other dtypes and devices, or a PyTorch without oneDNN, plain
``F.linear`` is used.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ONEDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
)


class _Scope(threading.local):
    depth = 0
    packed: dict[int, tuple[Tensor, Tensor]]  # id(weight) -> (weight, packed weight)
    fused: dict[tuple[int, ...], tuple[list[Linear], Tensor, Tensor | None]]  # stacked weights

    def __init__(self) -> None:
        self.packed = {}
        self.fused = {}


_SCOPE = _Scope()


@contextlib.contextmanager
def packed_inference() -> Iterator[None]:
    """Within this block the weights do not change: linear layers may pack their weights once."""
    _SCOPE.depth += 1
    try:
        with torch.no_grad():
            yield
    finally:
        _SCOPE.depth -= 1
        if _SCOPE.depth == 0:
            _SCOPE.packed.clear()
            _SCOPE.fused.clear()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; inside ``packed_inference`` on a CPU in fp32, through oneDNN with
    the weight packed on first use."""
    if not _packable(x, weight):
        return F.linear(x, weight, bias)
    entry = _SCOPE.packed.get(id(weight))
    if entry is None or entry[0] is not weight:
        entry = (weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256))
        _SCOPE.packed[id(weight)] = entry
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")


def linears(x: Tensor, layers: Sequence[nn.Module]) -> list[Tensor]:
    """``[layer(x) for layer in layers]``; inside ``packed_inference``, when they are all ``Linear``,
    one product with their weights stacked and packed once (self-attention's q, k, v: one GEMM of
    width 3 d instead of three of width d), its outputs returned as column views."""
    plain = [layer for layer in layers if isinstance(layer, Linear)]
    if len(plain) != len(layers) or not _packable(x, plain[0].weight):
        return [layer(x) for layer in layers]
    key = tuple(id(layer.weight) for layer in plain)
    entry = _SCOPE.fused.get(key)
    if entry is None:
        weight = torch.cat([layer.weight.detach() for layer in plain])
        biases = [layer.bias for layer in plain]
        present = [b.detach() for b in biases if b is not None]
        if len(present) not in (0, len(biases)):  # some with a bias, some without: one at a time
            return [layer(x) for layer in layers]
        bias = torch.cat(present) if present else None
        entry = (plain, weight, bias)
        _SCOPE.fused[key] = entry
    out = linear(x, entry[1], entry[2])
    return list(out.split([layer.weight.shape[0] for layer in plain], dim=-1))


def _packable(x: Tensor, weight: Tensor) -> bool:
    return (
        _SCOPE.depth > 0
        and _ONEDNN
        and not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0  # a ZeRO-3 placeholder outside a gathered context has no values
        and not torch.is_autocast_enabled("cpu")
    )


class Linear(nn.Linear):
    """``nn.Linear`` that takes ``linear`` (oneDNN with a packed weight inside ``packed_inference``)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
