"""The output layer and the loss split by vocabulary over a tensor-parallel group.

Under tensor parallelism the layers' products are split, but the output layer (the tied embedding,
V x D) was not: every rank of a group computed all V logits of every target token, the largest
product of the step and its largest activation, t times over. Here each rank computes the logits of
its own V/t words, and the loss is taken over the group (Megatron's vocabulary-parallel
cross-entropy): the row maximum and the sums of exp(logit - max), of the target logit and of all
logits are reduced over the group, so each rank holds the same loss, nll and gradient factors, and the
gradient of its logits is its block of softmax - eps/V - (1-eps) onehot.

The embedding stays whole on every rank (the input lookup reads any row): the output layer uses the
rank's block of rows, so the weight's gradient from the output layer is that block only, and the
group sums the weight's gradient (as for Shaw's shared tables). The input lookup's gradient, the same
on every rank, is divided by t before that sum so that it counts once (``scale_lookup_gradient``).
The decoder's output h is whole on every rank; each rank's logits give only part of h's gradient, so
h passes through an identity whose backward sums the gradient over the group.

Validation, decoding and exports compute all V logits from the whole embedding as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tpe_train.parallel.collectives import OnGradient, sum_over
from tpe_train.parallel.context import ParallelContext


class _VocabParallelCE(torch.autograd.Function):
    """Label-smoothed cross-entropy sums (loss, nll) of logits split by vocabulary over ``group``:
    ``logits`` (N, V/t) are this rank's words ``start .. start + V/t``; the result is the same on
    every rank. The backward is closed-form, as in ``model/loss.py``."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        start: int,
        vocab: int,
        epsilon: float,
        pad_id: int,
        group: Any,
    ) -> tuple[Tensor, Tensor]:
        x = logits.float()
        top = x.detach().amax(dim=-1)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        e = (x - top[:, None]).exp_()
        local = target - start
        here = (local >= 0) & (local < x.shape[-1])
        index = local.clamp(0, x.shape[-1] - 1)[:, None]
        sums = torch.stack([e.sum(-1), x.gather(-1, index).squeeze(-1) * here, x.sum(-1)])
        dist.all_reduce(sums, group=group)  # sum of exp, target logit, sum of logits: (3, N)
        total, x_target, x_sum = sums.unbind()
        lse = top + total.log()
        nll = lse - x_target
        nonpad = target != pad_id
        loss = torch.where(nonpad, (1.0 - epsilon) * nll + epsilon * (lse - x_sum / vocab), 0.0).sum()
        grad = e.div_(total[:, None]).sub_(epsilon / vocab)  # softmax - eps / V, in e's buffer
        grad.scatter_add_(-1, index, (here * -(1.0 - epsilon)).to(grad.dtype)[:, None])
        grad.mul_(nonpad[:, None])
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        return loss, torch.where(nonpad, nll, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(ctx.dtype), None, None, None, None, None, None


class VocabParallelScore:
    """``score(h, weight, target, pad_id, epsilon)``: the (loss, nll) sums of the logits ``h @
    weight.T`` over the whole vocabulary, each rank of ``ctx``'s tensor-parallel group computing the
    logits of its block of ``weight``'s rows (``weight`` is whole on every rank)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.group, self.rank, self.size = ctx.tp_group, ctx.tp_rank, ctx.tp_size

    def __getstate__(self) -> dict[str, Any]:
        """Without the process group, which cannot be pickled: DeepSpeed's AutoTP pickles a forward's
        arguments to compare them across the group (``ChunkedLoss.__eq__`` does not compare this)."""
        return {"group": None, "rank": self.rank, "size": self.size}

    def __call__(
        self, h: Tensor, weight: Tensor, target: Tensor, pad_id: int, epsilon: float
    ) -> tuple[Tensor, Tensor]:
        vocab = weight.shape[0]
        rows = -(-vocab // self.size)  # the last rank's block may be shorter
        start = min(self.rank * rows, vocab)
        block = weight[start : start + rows]
        logits = F.linear(OnGradient.apply(h, sum_over(self.group)), block)  # h's gradient: all blocks'
        loss, nll = _VocabParallelCE.apply(logits, target, start, vocab, epsilon, pad_id, self.group)
        return loss, nll


def scale_lookup_gradient(embedding: nn.Module, ctx: ParallelContext) -> None:
    """Divide the gradient of ``embedding``'s lookups by the tensor-parallel size, and sum the
    weight's gradient over the group: every rank's lookup gradient is the same and then counts once,
    and each rank's output-layer block counts for its rows."""
    weight = getattr(embedding, "weight")  # noqa: B009 - an embedding's table
    factor = 1.0 / ctx.tp_size

    def scaled(module: nn.Module, inputs: Any, out: Tensor) -> Tensor:
        return OnGradient.apply(out, lambda grad: grad * factor)

    embedding.register_forward_hook(scaled)
    weight.register_hook(sum_over(ctx.tp_group))
