"""The output layer and the loss in chunks of target tokens (``train.loss_chunk_tokens``).

The output layer's logits are (target tokens x vocabulary): at 25,000 target tokens and a 37,000-token
vocabulary, 3.4 GiB in fp32, and the loss keeps log-probabilities of that size for its backward. No
layer checkpoint reaches them: on an H200 they were most of what stayed of a step's peak with every
layer checkpointed (docs/distributed.md). Here each chunk's logits are made, scored and dropped in
the forward and made again in the backward (``torch.utils.checkpoint``, non-reentrant): what the
step keeps is the decoder's output (tokens x d_model), and one chunk's logits, log-probabilities
and gradient are alive at a time. The cost is the output layer's product once more in the backward.

The model knows nothing of it: ``Transformer.forward(src, tgt_in, head)`` hands the decoder's output
and the output weight to ``head`` (a ``ChunkedLoss``) instead of making the logits. The values are
those of the whole-batch loss up to the order of summation: rows are scored independently, the
chunks' sums are added, and the output weight's gradient is a sum over chunks. Without gradients
(validation) the chunks are taken one at a time and not recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from tpe_train.model.kernels import linear
from tpe_train.model.loss import label_smoothed_loss

#: a chunk's scoring: (h, weight, target, pad_id, epsilon) -> (loss, nll) sums
Score = Callable[[Tensor, Tensor, Tensor, int, float], tuple[Tensor, Tensor]]


@dataclass(frozen=True, eq=False)
class ChunkedLoss:
    """``head(h, weight)``: the sums of ``label_smoothed_loss`` (loss, nll without gradient, target
    tokens) of the logits ``h @ weight.T``, ``tokens`` rows of them at a time. ``target``: (B, L) with
    ``pad_id`` at padding; ``grad_scale``: the factor of the loss in the backward that follows;
    ``score``: another way to score a chunk (the vocabulary-parallel loss under tensor parallelism,
    which the model does not know of); not compared by ``==``: it differs between ranks by design."""

    target: Tensor
    pad_id: int
    epsilon: float
    tokens: int  # 0: all rows in one chunk
    grad_scale: float | Tensor = 1.0
    score: Score | None = None  # (h, weight, target, pad_id, epsilon) -> (loss, nll) sums of a chunk
    recompute: bool = True  # each chunk's logits made again in the backward instead of kept

    def __eq__(self, other: object) -> bool:
        """The same targets scored the same way (DeepSpeed's AutoTP compares a forward's arguments
        across the ranks of a tensor-parallel group, the other rank's tensors on its own device)."""
        if not isinstance(other, ChunkedLoss):
            return NotImplemented
        same = (self.pad_id, self.epsilon, self.tokens) == (other.pad_id, other.epsilon, other.tokens)
        scales = [torch.as_tensor(s, dtype=torch.float64) for s in (self.grad_scale, other.grad_scale)]
        return (
            same
            and torch.equal(scales[0].cpu(), scales[1].cpu())
            and torch.equal(self.target, other.target.to(self.target.device))
        )

    __hash__ = None  # type: ignore[assignment]  # equal by value, and it holds a tensor

    def __call__(self, h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = h.reshape(-1, h.shape[-1])
        target = self.target.reshape(-1)
        recompute = torch.is_grad_enabled() and self.recompute
        size = self.tokens or max(rows.shape[0], 1)
        loss = nll = None
        for start in range(0, max(rows.shape[0], 1), size):
            part = slice(start, start + size)
            if recompute:  # no randomness in a chunk: no RNG state to keep
                terms = checkpoint(
                    self._chunk,
                    rows[part],
                    weight,
                    target[part],
                    use_reentrant=False,
                    preserve_rng_state=False,
                )
            else:
                terms = self._chunk(rows[part], weight, target[part])
            loss = terms[0] if loss is None else loss + terms[0]
            nll = terms[1] if nll is None else nll + terms[1]
        assert loss is not None and nll is not None
        return loss, nll.detach(), (target != self.pad_id).sum()

    def _chunk(self, h: Tensor, weight: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        if self.score is not None:
            return self.score(h, weight, target, self.pad_id, self.epsilon)
        loss, nll, _ = label_smoothed_loss(
            linear(h, weight), target, self.pad_id, self.epsilon, self.grad_scale
        )
        return loss, nll
