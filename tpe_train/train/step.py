"""One training step and one validation pass, shared by the loop and the distributed tests.

The gradient of a step is that of the summed loss over all its target tokens on all data-parallel
ranks divided by their count, so any layout computes the gradient of one process with the same
global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpe_train.config import Config
from tpe_train.data.batching import PAD_ID, Batch, BatchIterator, collate, length_arrays
from tpe_train.data.lengths import fits
from tpe_train.data.splits import pairs_of
from tpe_train.evaluation import metrics
from tpe_train.evaluation.decoding import DecodeOptions, decode_sentences
from tpe_train.model.chunked_loss import ChunkedLoss, Score
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.vocab import VocabParallelScore
from tpe_train.train.precision import autocast


def batch_terms(
    model: Any,
    batch: Batch,
    cfg: Config,
    amp_dtype: torch.dtype | None,
    grad_scale: float | torch.Tensor = 1.0,
    score: Score | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed smoothed loss, summed nll, target tokens) of one batch as tensors on the batch's
    device, nothing read back to the host; ``amp_dtype``: the autocast dtype (None: none); ``grad_scale``:
    the factor of the loss in the backward that follows; ``score``: how the output layer and loss
    are taken (the vocabulary-parallel loss under tensor parallelism; default: all logits on this
    rank)."""
    smoothing, chunk = cfg.train.label_smoothing, cfg.train.loss_chunk_tokens
    with autocast(amp_dtype, batch.src.device):
        if chunk or score is not None:  # chunk by chunk, recomputed in the backward (chunk > 0)
            head = ChunkedLoss(
                batch.tgt_out, PAD_ID, smoothing, chunk, grad_scale, score, recompute=chunk > 0
            )
            loss, nll, ntok = model(batch.src, batch.tgt_in, head)
            return loss, nll, ntok
        logits = model(batch.src, batch.tgt_in)
    loss, nll, ntok = label_smoothed_loss(logits, batch.tgt_out, PAD_ID, smoothing, grad_scale)
    return loss, nll, ntok


def batch_loss(
    model: Any, batch: Batch, cfg: Config, amp_dtype: torch.dtype | None, grad_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``batch_terms`` with the token count read back as an int (a host sync: evaluation only)."""
    loss, nll, ntok = batch_terms(model, batch, cfg, amp_dtype, grad_scale)
    return loss, nll, int(ntok)


def loss_sums(
    model: Any, batches: Iterable[Batch], cfg: Config, amp_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed nll, target tokens) of ``batches`` as float64 tensors on their device. Nothing is read
    back per batch: a GPU queues every batch of a validation pass instead of waiting for each one."""
    nll_sum = ntok_sum = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        _, nll, ntok = batch_terms(model, batch, cfg, amp_dtype)
        nll_sum, ntok_sum = nll_sum.to(nll.device) + nll, ntok_sum.to(ntok.device) + ntok
    return nll_sum, ntok_sum


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step leaves, on the device: nothing of it is read back until ``read``.

    ``sums``: (loss, nll) summed over this rank's micro-batches, float64; ``tokens``: the step's target
    tokens over all data-parallel ranks, float64; ``grad_norm``: before clipping, over all ranks (a
    tensor, or the float DeepSpeed hands back)."""

    sums: torch.Tensor
    tokens: torch.Tensor
    grad_norm: torch.Tensor | float

    def read(self, ctx: ParallelContext) -> dict[str, float]:
        """Loss and nll per target token over all data-parallel ranks, gradient norm and tokens, as
        floats: one reduction and one host read. Every data-parallel rank must call it at the same
        step (the reduction is a collective)."""
        loss_sum, nll_sum = ctx.dp_reduce(self.sums).unbind()
        norm = torch.as_tensor(self.grad_norm, dtype=torch.float64, device=self.tokens.device)
        loss, nll, tokens, grad_norm = torch.stack(
            [loss_sum / self.tokens, nll_sum / self.tokens, self.tokens, norm.reshape(())]
        ).tolist()
        return {"loss": loss, "nll": nll, "grad_norm": grad_norm, "tokens": tokens}


class TokenTally:
    """Target tokens trained so far: the steps' device counts are added on the device, and read back
    only when asked (a log line, a checkpoint), not once per step."""

    def __init__(self, done: float = 0.0) -> None:
        self.done, self._pending = done, None  # type: tuple[float, torch.Tensor | None]

    def add(self, tokens: torch.Tensor) -> None:
        self._pending = tokens if self._pending is None else self._pending + tokens

    def total(self) -> float:
        """All tokens so far (one host read if steps were added since the last call)."""
        if self._pending is not None:
            self.done, self._pending = self.done + float(self._pending), None
        return self.done


def train_step(
    engine: Engine, micro: list[Batch], cfg: Config, ctx: ParallelContext, amp_dtype: torch.dtype | None
) -> StepResult:
    """One optimizer step over ``train.accumulate`` batches on every data-parallel rank.

    The gradient is that of the summed loss over all target tokens of the step on all ranks, divided
    by their count, so that 2 ranks x k batches give exactly the gradient of one process holding the
    same 2k batches. The token count is summed over ranks first; each backward then multiplies by
    ``accumulate * dp_size``, which undoes the averaging that accelerate/DeepSpeed apply over
    accumulation steps and data-parallel ranks.

    Nothing is read back to the host (on a GPU the host queues the next step while this one runs):
    the token count is counted on the device from the batches and summed over the ranks there, the
    loss scale stays a device scalar, and the losses (summed in float64, in the order of the
    micro-batches) and the gradient norm stay on the device until ``StepResult.read``."""
    batches = [batch.to(ctx.device) for batch in micro]
    local = torch.stack([(b.tgt_out != PAD_ID).sum() for b in batches]).sum().to(torch.float64)
    ntok = ctx.dp_reduce(local)
    scale64 = cfg.train.accumulate * ctx.dp_size / ntok
    scale = scale64.float()  # what a Python float factor of the fp32 loss was rounded to
    # the loss's factor in the backward that follows: every engine divides by ``accumulate``
    backward_factor = (scale64 / cfg.train.accumulate).float()
    sums: torch.Tensor | None = None  # (loss, nll) summed in float64 on the device
    score = VocabParallelScore(ctx) if ctx.tp_size > 1 else None  # the output layer split by words
    for batch in batches:
        loss, nll, _ = batch_terms(engine.forward, batch, cfg, amp_dtype, backward_factor, score)
        engine.backward(loss * scale)
        both = torch.stack([loss.detach(), nll.detach()]).to(torch.float64)
        sums = both if sums is None else sums + both
    grad_norm = engine.step()
    assert sums is not None, "train_step needs at least one micro-batch"
    return StepResult(sums, ntok, grad_norm)


@torch.no_grad()
def validate(
    engine: Engine, data: Any, cfg: Config, ctx: ParallelContext, amp_dtype: torch.dtype | None
) -> dict[str, float]:
    """Validation loss (nll per token, batches split over data-parallel ranks) and greedy BLEU on the
    first ``valid_bleu_size`` pairs (every rank decodes them: tensor-parallel ranks must run together)."""
    with engine.gathered() as module:
        model = as_transformer(module)
        model.eval()
        src_len, tgt_len = length_arrays(data.valid)
        # Pairs longer than data.max_len are left out, as in training: a learned table may not reach them.
        kept = np.nonzero(fits(src_len, tgt_len, cfg.data.max_len))[0]
        batches = BatchIterator(src_len[kept], tgt_len[kept], cfg.data.max_tokens, seed=0).batches
        mine = (collate(data.valid, kept[idx]).to(ctx.device) for idx in batches[ctx.dp_rank :: ctx.dp_size])
        nll, ntok = loss_sums(model, mine, cfg, amp_dtype)
        nll_sum, ntok_sum = ctx.dp_sum([float(nll), float(ntok)])  # the pass's one host read
        out = {"valid/nll": nll_sum / ntok_sum, "valid/ppl": math.exp(min(nll_sum / ntok_sum, 50.0))}
        n = cfg.train.valid_bleu_size
        if n:
            pairs = pairs_of(data.splits.valid, n)
            greedy = DecodeOptions.of(cfg.eval, beam=1)
            hyps = decode_sentences(model, data.tokenizer, [s for s, _ in pairs], greedy)
            refs = [t for _, t in pairs]
            out["valid/bleu"] = metrics.bleu([h.text or "" for h in hyps], refs, data.splits.pretokenized)[0]
        model.train()
    return out


def as_transformer(module: torch.nn.Module) -> Transformer:
    """``module``, asserted to be a ``Transformer`` (what an engine's gathered module is)."""
    assert isinstance(module, Transformer), type(module)
    return module
