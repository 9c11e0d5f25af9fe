"""Token-based batches from length-sorted buckets, deterministic from (seed, epoch), resumable.

A batch holds at most ``max_tokens`` padded source + target tokens. Batches are cut from the
length-sorted order (so padding stays small), then shuffled; with several data-parallel ranks each
global step hands every rank a different batch, and every rank takes the same number of steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


def token_batches(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    """Indices grouped into batches whose padded size (max src + max tgt) * n <= max_tokens.

    Sorted by (source, target) length with a seeded random tie-break; a pair longer than
    ``max_tokens`` on its own gets a batch of one.
    """
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(src_len)), tgt_len, src_len))
    batches: list[np.ndarray] = []
    start, max_s, max_t = 0, 0, 0
    for i, idx in enumerate(order):
        s, t = int(src_len[idx]), int(tgt_len[idx])
        ms, mt = max(max_s, s), max(max_t, t)
        if i > start and (ms + mt) * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, ms, mt = i, s, t
        max_s, max_t = ms, mt
    if start < len(order):
        batches.append(order[start:])
    return batches


@dataclass
class BatchState:
    """Where an iterator stands: the epoch and the number of global steps taken in it."""

    epoch: int = 0
    step_in_epoch: int = 0


class BatchIterator:
    """Endless epochs of token batches for one data-parallel rank.

    Every epoch cuts the same batches and shuffles them with ``seed + epoch``; global step ``s``
    hands rank ``r`` batch ``s * dp_size + r``, and an epoch ends when fewer than ``dp_size`` batches
    remain (those are dropped, so every rank takes the same number of steps).
    """

    def __init__(
        self,
        src_len: np.ndarray,
        tgt_len: np.ndarray,
        max_tokens: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        state: BatchState | None = None,
    ) -> None:
        self.batches = token_batches(src_len, tgt_len, max_tokens, seed)
        if len(self.batches) < dp_size:
            raise ValueError(
                f"the corpus makes only {len(self.batches)} batches, fewer than the {dp_size} "
                "data-parallel ranks; lower data.max_tokens or use fewer ranks"
            )
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.state = state or BatchState()

    @property
    def steps_per_epoch(self) -> int:
        return len(self.batches) // self.dp_size

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.batches))

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            order = self._order(self.state.epoch)
            while self.state.step_in_epoch < self.steps_per_epoch:
                k = self.state.step_in_epoch * self.dp_size + self.dp_rank
                self.state.step_in_epoch += 1
                yield self.batches[order[k]]
            self.state = BatchState(self.state.epoch + 1, 0)
