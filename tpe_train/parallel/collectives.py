"""Autograd pieces over a tensor-parallel group, shared by the plan (``plan.py``) and the
vocabulary-parallel output layer (``vocab.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class ReduceFromGroup(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity (every rank already holds the full gradient
    of the replicated output, and each rank's input only fed its own share)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class OnGradient(torch.autograd.Function):
    """Forward: identity. Backward: ``change(grad)`` (a sum over the group, a scaling)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, change: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.change = change
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.change(grad), None


def sum_over(group: Any) -> Callable[[Tensor], Tensor]:
    """A gradient hook: the gradient summed over ``group``."""

    def hook(grad: Tensor) -> Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad

    return hook
