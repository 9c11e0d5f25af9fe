"""Token-based batches from length-sorted buckets, deterministic from (seed, epoch), resumable.

A batch holds at most ``max_tokens`` padded source + target tokens. Batches are cut from the
length-sorted order (so padding stays small), then shuffled; with several data-parallel ranks each
global step hands every rank a different batch, and every rank takes the same number of steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from datasets import Dataset

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the tokenizer's special tokens (tpe_train.data.tokenizer)


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


def _divisible(batches: list[np.ndarray], parts: int) -> list[np.ndarray]:
    """Split the largest batches in two until their number is a multiple of ``parts``."""
    batches = list(batches)
    while len(batches) % parts:
        largest = max(range(len(batches)), key=lambda i: len(batches[i]))
        if len(batches[largest]) < 2:
            raise ValueError(
                f"the corpus has only {sum(len(b) for b in batches)} pairs, fewer than the {parts} "
                "data-parallel ranks need; use fewer ranks or a larger corpus"
            )
        half = len(batches[largest]) // 2
        big = batches.pop(largest)
        batches[largest:largest] = [big[:half], big[half:]]
    return batches


@dataclass
class BatchState:
    """Where an iterator stands: the epoch and the number of global steps taken in it."""

    epoch: int = 0
    step_in_epoch: int = 0


class BatchIterator:
    """Endless epochs of token batches for one data-parallel rank.

    Every epoch cuts the same batches and shuffles them with ``(seed, epoch)``; global step ``s``
    hands rank ``r`` batch ``s * dp_size + r``. The batch count is made a multiple of ``dp_size``
    (by halving the largest batches), so every pair is seen exactly once per epoch and every rank
    takes the same number of steps. Ranks of one tensor-parallel group pass the same ``dp_rank``
    and so receive identical batches.
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
        self.batches = _divisible(token_batches(src_len, tgt_len, max_tokens, seed), dp_size)
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


@dataclass
class Batch:
    """Padded tensors of one batch: src (B, Ls), tgt_in = BOS + target, tgt_out = target + EOS."""

    ids: torch.Tensor
    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    @property
    def target_tokens(self) -> int:
        return int((self.tgt_out != PAD_ID).sum())


def pad(seqs: list[list[int]], prefix: int | None = None) -> torch.Tensor:
    """Right-pad id lists into a (B, L) long tensor, optionally prefixing a token."""
    extra = 1 if prefix is not None else 0
    out = torch.full((len(seqs), max(len(s) for s in seqs) + extra), PAD_ID, dtype=torch.long)
    for i, s in enumerate(seqs):
        if prefix is not None:
            out[i, 0] = prefix
        out[i, extra : extra + len(s)] = torch.tensor(s, dtype=torch.long)
    return out


def collate(ds: Dataset, indices: np.ndarray) -> Batch:
    rows = ds[indices.tolist()]
    tgt = rows["tgt_ids"]
    tgt_in = pad([t[:-1] for t in tgt], prefix=BOS_ID)
    return Batch(
        ids=torch.tensor(rows["id"]),
        src=pad(rows["src_ids"]),
        tgt_in=tgt_in,
        tgt_out=pad(tgt),
    )


def length_arrays(ds: Dataset) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ds["src_len"]), np.asarray(ds["tgt_len"])
