"""Position diagnostics during training: measured on a fixed validation batch every
``train.diagnostics_every`` steps (and at the last step), written to TensorBoard.

Scalars ``diag/<enc|dec>/layer<l>/head<h>/mean_distance`` (encoder and decoder self-attention), and for
a learned position table the image ``diag/<enc|dec>/position_similarity`` (cosine similarity of its rows,
-1 blue, 0 white, 1 red). The measurement runs in evaluation mode without gradients and draws no random
numbers, so the training that follows is the same with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.tensorboard import SummaryWriter

from tpe_train.config import Config, ConfigError
from tpe_train.data.prepare import Prepared
from tpe_train.data.splits import pairs_of
from tpe_train.evaluation.position_report import (
    DIAGNOSTIC_PAIRS,
    SHORT,
    diagnose,
    diagnostic_batch,
    merge,
    similarity_image,
)
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.scalars import write_scalars
from tpe_train.train.step import as_transformer


@dataclass
class TrainingDiagnostics:
    """The fixed batch (the first validation pairs that fit data.max_len) and where its figures go."""

    src: Tensor
    tgt_in: Tensor
    length: int  # positions compared for an encoding without a limit of its own
    heads: list[int]  # global indices of this rank's heads

    @classmethod
    def of_run(cls, cfg: Config, data: Prepared, ctx: ParallelContext) -> TrainingDiagnostics | None:
        """The run's diagnostics, or None when ``train.diagnostics_every`` is 0."""
        if not cfg.train.diagnostics_every:
            return None
        pairs = pairs_of(data.splits.valid, 16 * DIAGNOSTIC_PAIRS)
        try:
            src, tgt_in = diagnostic_batch(data.tokenizer, pairs, cfg.data.max_len)
        except ValueError as err:  # before the first step; reported by tpe-train without a traceback
            raise ConfigError(f"{err}; or train without them: train.diagnostics_every=0") from None
        return cls(src, tgt_in, cfg.data.max_len, ctx.heads(cfg.model.n_heads))

    def write(
        self,
        engine: Engine,
        writer: SummaryWriter | None,
        ctx: ParallelContext,
        step: int,
        amp_dtype: torch.dtype | None,
        images: bool = True,
    ) -> None:
        """Measure the model (every rank: tensor-parallel ranks compute their heads together) and write
        the figures of all heads at ``step`` (rank 0 has the writer); ``images``: also the learned
        tables' similarity images."""
        with engine.gathered() as module:
            model = as_transformer(module)
            diag = diagnose(
                model, self.src, self.tgt_in, self.length, heads=self.heads, learned_only=True, cast=amp_dtype
            )
        diag.distances = merge(ctx.gather(diag.distances))
        if writer is None:
            return
        write_scalars(writer, diag.scalars(), step)
        for side, sim in diag.similarity.items() if images else ():
            image = similarity_image(sim)
            writer.add_image(f"diag/{SHORT[side]}/position_similarity", image, step, dataformats="HWC")
