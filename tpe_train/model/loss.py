"""Label-smoothed cross-entropy with a hand-written backward.

loss_i = (1 - eps) * nll_i + eps * mean_v(-log p_iv), summed over non-pad tokens: the same value as
``F.cross_entropy(label_smoothing=eps, reduction="sum")``. The gradient has a closed form, softmax(x) -
eps / V - (1 - eps) * onehot(target), computed in place in one (N, V) buffer instead of autograd's
several (N, V) tensors through log_softmax, gather and mean.

- bf16 logits on the CPU are taken in chunks of rows small enough to stay in cache, widened there, and
  the loss and the gradient (in the logits' dtype) computed in the forward pass; the backward at most
  scales it. fp32 logits, and GPU logits of any dtype, take the one-buffer path.
- The chunks' gradient is already scaled by ``grad_scale``, the factor the caller multiplies the loss
  by before its backward (the trainer's 1 / target tokens, divided by ``train.accumulate`` as every
  engine divides it): the backward hands it on as it is when the incoming gradient is that factor.
  Any other incoming gradient (no hint, a loss scaler) is applied by one more pass: the hint changes
  the speed, never the gradient beyond rounding.
- The one-buffer path takes log-probabilities from ``log_softmax``'s fused kernel and, on the CPU, the
  softmax as ``exp2(log p * log2(e))``: an error of at most |log p| * 6e-8 relative in p, below 3e-8
  absolute.
- A chunk computes one exponential per logit: e = exp(x - max) gives the row's log-sum-exp (max + log
  sum e), nll = lse - x_target, the smoothing term lse - mean(x) and the gradient e / sum e - eps / V
  - (1 - eps) onehot, e scaled in place. Everything per row (log-sum-exp, weights, sums, the target
  logits) is an (N,) vector outside the loop.

Each of these measured faster on the CPU; the figures, and what was tried and not kept:
docs/cpu-kernels.md#the-loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

LOG2E = math.log2(math.e)


def _exp_(x: Tensor) -> Tensor:
    """``exp`` in place: as ``exp2(x * log2(e))`` on the CPU (see above), ``exp`` elsewhere."""
    return x.mul_(LOG2E).exp2_() if x.device.type == "cpu" else x.exp_()


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
        grad = _exp_(lprobs)  # in the saved buffer (it is not needed again)
        grad.sub_(eps / grad.shape[-1])
        grad.scatter_add_(-1, target[:, None], grad.new_full((grad.shape[0], 1), -(1.0 - eps)))
        grad.mul_((nonpad.to(grad.dtype) * grad_loss)[:, None])
        return grad.to(ctx.dtype), None, None, None


class _ChunkedSmoothedCE(torch.autograd.Function):
    ROWS = 32  # 32 x 8,000 fp32 = 1 MB per chunk

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        epsilon: float,
        pad_id: int,
        grad_scale: float | Tensor = 1.0,
    ) -> tuple[Tensor, Tensor]:
        rows, vocab = logits.shape
        scale = torch.as_tensor(grad_scale, dtype=torch.float32, device=logits.device)  # fp32, as the loss
        weight = (target != pad_id).float()
        w = (weight * scale)[:, None]  # the gradient's row factor: (softmax - eps/V - (1-eps) onehot) * w
        w_smooth, w_target = w * (epsilon / vocab), w * -(1.0 - epsilon)
        x_target = logits.gather(-1, target[:, None]).squeeze(-1).float()  # logits are exact in fp32
        grad = torch.empty_like(logits)
        lse, mean = weight.new_empty(rows), weight.new_empty(rows)
        for start in range(0, rows, _ChunkedSmoothedCE.ROWS):
            r = slice(start, start + _ChunkedSmoothedCE.ROWS)
            x = logits[r].to(torch.float32, copy=True)  # a copy even of fp32 logits: x is overwritten
            top = x.amax(dim=-1, keepdim=True)
            torch.mean(x, dim=-1, out=mean[r])
            e = _exp_(x.sub_(top))  # exp(x - max), in x's buffer: the chunk's only exponential
            total = e.sum(dim=-1, keepdim=True)
            lse[r] = (top + total.log()).squeeze(-1)  # log-sum-exp: -log p_v = lse - x_v
            e.mul_(w[r] / total).scatter_add_(-1, target[r, None], w_target[r])
            torch.sub(e, w_smooth[r], out=grad[r])  # written in the logits' dtype by the last pass
        nll = lse - x_target
        loss = (((1.0 - epsilon) * nll + epsilon * (lse - mean)) * weight).sum(dtype=torch.float64)
        nll_sum = (nll * weight).sum(dtype=torch.float64)
        ctx.save_for_backward(grad)
        ctx.scale = scale
        return loss.float(), nll_sum.float()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        if not torch.equal(grad_loss.float(), ctx.scale):  # not the factor foreseen: one pass
            grad.mul_((grad_loss.float() / ctx.scale).to(grad.dtype))
        return grad, None, None, None, None


def loss_kernel(dtype: torch.dtype, device_type: str) -> type[torch.autograd.Function]:
    """Cache-sized chunks for lower-precision logits on the CPU; one buffer otherwise (see above)."""
    return _ChunkedSmoothedCE if device_type == "cpu" and dtype != torch.float32 else _SmoothedCE


def label_smoothed_loss(
    logits: Tensor, target: Tensor, pad_id: int, epsilon: float, grad_scale: float | Tensor = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Sums over non-pad tokens: (label-smoothed loss, nll (no gradient), token count).

    logits: (..., V); target: (...) with ``pad_id`` at padding. ``grad_scale``: the factor the loss
    will be multiplied by before its backward, if known, as a float or a 0-d tensor (a hint for the CPU's
    bf16 kernel, see above).
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    kernel = loss_kernel(flat_logits.dtype, flat_logits.device.type)
    hint = (grad_scale,) if kernel is _ChunkedSmoothedCE else ()
    loss, nll = kernel.apply(flat_logits, flat_target, epsilon, pad_id, *hint)
    return loss, nll.detach(), (flat_target != pad_id).sum()
