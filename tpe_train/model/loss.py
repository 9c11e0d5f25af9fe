"""Label-smoothed cross-entropy with a hand-written backward.

loss_i = (1 - eps) * nll_i + eps * mean_v(-log p_iv), summed over non-pad tokens: the same value as
``F.cross_entropy(label_smoothing=eps, reduction="sum")``. Autograd through log_softmax, gather and
mean writes and reads several (N, V) tensors; the gradient has a closed form, softmax(x) - eps / V - (1 -
eps) * onehot(target), computed here in place in one (N, V) buffer. On a vocabulary of 8,000 this
saves about a tenth of a training step on the CPU.

Logits in lower precision (bf16 autocast) are not widened to one fp32 (N, V) copy: rows are taken
in chunks small enough to stay in cache, widened, and the loss and the gradient (already in the
logits' dtype) computed there in the forward pass; the backward at most scales it. On 4,736 x 8,000
bf16 logits this took 240 ms for forward + backward against 410 ms for the widened path (one thread);
fp32 logits keep the one-buffer path, which was as fast. The chunks are a CPU measure: on a GPU each
chunk is a dozen small kernel launches, and a training step of the benchmark's shape in bf16 took 4x
as long as in fp32 on an H200. GPU logits of any dtype take the one-buffer path.

The chunks' gradient is already scaled by ``grad_scale``, the factor the caller multiplies the loss
by before its backward (the trainer's 1 / target tokens, divided by ``train.accumulate`` as every
engine divides it): the backward then hands it on as it is when the incoming gradient is that
factor, instead of one more pass over the (N, V) bf16 gradient (33 of 940 ms of a bf16 step, one
thread, Intel Xeon with AMX; 6% of the step measured A/B). Any other incoming gradient (no hint, a
loss scaler) is applied by that pass, as before: the hint changes the speed, never the gradient
beyond rounding.

The one-buffer path takes log-probabilities from ``log_softmax``'s fused kernel and the softmax from
them as ``exp2(log p * log2(e))`` on the CPU: PyTorch's CPU ``exp`` was 2.5-4x slower than ``mul`` +
``exp2`` on a 32 x 8,000 fp32 chunk (158 against 59 us, one thread, AVX-512 AMD EPYC; on the Intel Xeon
with AMX ``exp`` was the faster, 38 against 68 us on 2 threads, but a whole bf16 step measured no
difference). The product rounds the exponent relatively by 2^-24, an error of at most |log p| * 6e-8
relative in p: below 3e-8 absolute.

The chunks compute one exponential per logit, not two: e = exp(x - max) gives the row's
log-sum-exp (max + log sum e), from which nll = lse - x_target and the smoothing term lse - mean(x),
and the gradient e / sum e - eps / V - (1 - eps) onehot is e scaled in place. ``log_softmax`` followed
by the softmax of its output (the chunks' first form) exponentiated every logit twice and wrote one
more chunk: a bf16 step of the benchmark's shape took 450 against 472 ms (2 threads, Intel Xeon with
AMX, median of 16 interleaved steps), the losses of 14 steps within 2e-5 relative of the old form's.
Measured on that machine only: on the AMD EPYC, where ``logsumexp`` (max, subtract, exp, sum and log
as separate ops) was 4x slower than ``log_softmax``, this form has not been timed.

A chunk does only what needs its (rows, V) block: max, mean, exp in the widened copy's own buffer,
sum, the gradient's scaling and target term, and the last pass writes the gradient in the logits'
dtype (``torch.sub(..., out=)``, no separate copy). Everything per row (log-sum-exp, the weights, the
loss and nll sums, the target logits gathered once) is a (N,) vector outside the loop: 148 chunks of
the benchmark's 4,736 rows made about 1,400 scalar casts and 20 small ops each before. Forward +
backward of 4,736 x 8,000 random bf16 logits took 33 against 41 ms (2 threads, Intel Xeon with
AMX; the values are checked against fp64 by the tests, not against the old form). In whole bf16
steps the gain is at the machine's noise: 0.6-2.5% in four of five interleaved A/B runs (14-24 steps
each), 1.7% the other way in one.
Also measured there and not kept: the same math compiled by ``torch.compile`` (Inductor: one fused
kernel for the whole tensor, dynamic shapes) took 34 ms, no faster than these eager chunks, for 2-12
s of compilation in every process; 64-row chunks and ``exp`` in place of ``exp2`` each gained 2-4 ms
there, but 64 rows (2 MB in fp32) outgrow a core's L2 on many CPUs and ``exp`` was the slower on the
AMD EPYC (see above); neither was timed on the EPYC.
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
