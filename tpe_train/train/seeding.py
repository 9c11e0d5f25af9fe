"""Seeding: every generator from ``train.seed`` at start-up, and the dropout stream of each data-parallel
rank (``ckpt.state.seed_rank_streams``, which a resume on another layout uses too)."""

from __future__ import annotations

import random

import numpy as np
import torch

from tpe_train.ckpt.state import seed_rank_streams
from tpe_train.parallel.context import ParallelContext


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_dropout(seed: int, ctx: ParallelContext) -> None:
    """After the model is built (the same weights on every rank): one dropout stream per data-parallel
    rank (nothing to do with one)."""
    if ctx.dp_size > 1:
        seed_rank_streams(seed, ctx.dp_rank)
