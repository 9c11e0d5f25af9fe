"""Label-smoothed cross-entropy with a hand-written backward.

loss_i = (1 - eps) * nll_i + eps * mean_v(-log p_iv), summed over non-pad tokens: the same value as
``F.cross_entropy(label_smoothing=eps, reduction="sum")``. Autograd through log_softmax, gather and
mean writes and reads several (N, V) tensors; the gradient has a closed form, softmax(x) - eps / V - (1 -
eps) * onehot(target), computed here in place in one (N, V) buffer. On a vocabulary of 8,000 this
saves about a tenth of a training step on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _SmoothedCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, target: Tensor, epsilon: float, pad_id: int
    ) -> tuple[Tensor, Tensor]:
        lprobs = torch.log_softmax(logits.float(), dim=-1)  # (N, V); log_softmax's fused kernel
        nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)
        smooth = -lprobs.mean(dim=-1)
        nonpad = target != pad_id
        loss = torch.where(nonpad, (1.0 - epsilon) * nll + epsilon * smooth, 0.0).sum()
        ctx.save_for_backward(lprobs, target, nonpad)
        ctx.epsilon, ctx.dtype = epsilon, logits.dtype
        return loss, torch.where(nonpad, nll, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        lprobs, target, nonpad = ctx.saved_tensors
        eps = ctx.epsilon
        grad = lprobs.exp_()  # softmax, in the saved buffer (it is not needed again)
        grad.sub_(eps / grad.shape[-1])
        grad.scatter_add_(-1, target[:, None], grad.new_full((grad.shape[0], 1), -(1.0 - eps)))
        grad.mul_((nonpad.to(grad.dtype) * grad_loss)[:, None])
        return grad.to(ctx.dtype), None, None, None


def label_smoothed_loss(
    logits: Tensor, target: Tensor, pad_id: int, epsilon: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Sums over non-pad tokens: (label-smoothed loss, nll (no gradient), token count).

    logits: (..., V); target: (...) with ``pad_id`` at padding.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    loss, nll = _SmoothedCE.apply(flat_logits, flat_target, epsilon, pad_id)
    return loss, nll.detach(), (flat_target != pad_id).sum()
