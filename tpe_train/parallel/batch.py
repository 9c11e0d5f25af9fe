"""The global batch, stated once in target tokens (``train.batch_tokens``), resolved for a launch.

A preset states the science: the target tokens of one optimizer step over all ranks. The hardware
decides the rest: the micro-batch (``data.max_tokens`` padded source + target tokens of one rank's
batch) and the accumulation. Batches are cut by padded tokens, so the target tokens of one
micro-batch vary; the resolution uses their mean over an epoch, which is exact for a token store:
the training pairs' target tokens (EOS included) divided by the number of micro-batches that
``data.max_tokens`` cuts them into (``micro_tokens``). Then

    accumulate = ceil(batch_tokens / (dp_size x mean target tokens per micro-batch))

the smallest accumulation whose global batch reaches the request. One step takes ``accumulate x
dp_size`` micro-batches from one global stream, the same order for every number of ranks
(``tpe_train.data.batching.BatchIterator``), so two launches with the same product train the same
batches step by step; the product moves only when the micro-batches needed are not a multiple of
the data-parallel size (then it is rounded up, and the step is at most dp_size - 1 micro-batches
larger).

Also here: ``largest_fitting``, the search behind ``data.max_tokens=auto`` (multiples of 64), given a
``fits(max_tokens)`` predicate that the trainer builds from a probe on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tpe_train.data.batching import token_batches

#: Target tokens of a micro-batch as a share of its padded source + target tokens, when no token store
#: is at hand to count them (``tpe-launch --dry-run`` before the data is prepared): half of the padded
#: tokens are the target side, less about a tenth of padding.
TARGET_SHARE = 0.45
#: Warn when the global batch reached differs from the request by more than this share.
TOLERANCE = 0.10
#: ``data.max_tokens=auto`` tries multiples of this.
GRAIN = 64


def micro_tokens(src_len: np.ndarray, tgt_len: np.ndarray, max_tokens: int, seed: int) -> float:
    """The mean target tokens of a micro-batch over an epoch: the epoch's target tokens / its batches."""
    n = len(token_batches(src_len, tgt_len, max_tokens, seed))
    return float(tgt_len.sum()) / max(1, n)


def estimated_micro_tokens(max_tokens: int) -> float:
    """The mean target tokens of a micro-batch without a corpus to count them in (``TARGET_SHARE``)."""
    return TARGET_SHARE * max_tokens


@dataclass(frozen=True)
class BatchPlan:
    """One launch's batch: the request, the micro-batch, the accumulation and what a step holds."""

    batch_tokens: int  # requested global target tokens per step (0: none, accumulate given by hand)
    max_tokens: int  # micro-batch: padded source + target tokens of one rank's batch
    micro_tokens: float  # mean target tokens of one micro-batch
    dp_size: int
    accumulate: int
    source: str  # where micro_tokens comes from (counted in a token store, or estimated)

    @property
    def micro_per_step(self) -> int:
        """Micro-batches of one optimizer step over all ranks."""
        return self.accumulate * self.dp_size

    @property
    def global_tokens(self) -> float:
        """Mean target tokens of one optimizer step over all ranks."""
        return self.micro_per_step * self.micro_tokens

    @property
    def deviation(self) -> float:
        """(reached - requested) / requested; 0 without a request."""
        return self.global_tokens / self.batch_tokens - 1.0 if self.batch_tokens else 0.0

    def line(self) -> str:
        """The resolution in one line, as the trainer and ``tpe-launch --dry-run`` print it."""
        asked = f"{self.batch_tokens:,} asked" if self.batch_tokens else "train.accumulate by hand"
        return (
            f"batch: {self.global_tokens:,.0f} target tokens per step ({asked}) = {self.dp_size} "
            f"data-parallel x {self.accumulate} accumulated x micro-batch of {self.max_tokens:,} "
            f"padded tokens (~{self.micro_tokens:,.0f} target tokens, {self.source})"
        )

    def warning(self) -> str | None:
        """A warning when the reachable global batch is more than ``TOLERANCE`` off the request."""
        if not self.batch_tokens or abs(self.deviation) <= TOLERANCE:
            return None
        return (
            f"warning: the global batch reached, {self.global_tokens:,.0f} target tokens, is "
            f"{self.deviation:+.0%} off train.batch_tokens={self.batch_tokens:,}: a step is a whole number "
            f"of micro-batches (~{self.micro_tokens:,.0f} target tokens) on each of {self.dp_size} "
            "data-parallel ranks; lower data.max_tokens (or use fewer ranks) to come closer"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "global_tokens": self.global_tokens, "micro_per_step": self.micro_per_step}


def resolve(
    batch_tokens: int, max_tokens: int, micro: float, dp_size: int, accumulate: int = 1, source: str = ""
) -> BatchPlan:
    """The accumulation for ``batch_tokens`` (0: keep ``accumulate``), given the mean target tokens
    ``micro`` of one micro-batch and the data-parallel size."""
    if dp_size < 1 or micro <= 0:
        raise ValueError(f"cannot resolve a batch over {dp_size} ranks of {micro} target tokens each")
    if batch_tokens:
        # a relative slack of 1e-9: a request that is an exact multiple stays one (no float round-up)
        accumulate = max(1, math.ceil(batch_tokens / (dp_size * micro) * (1 - 1e-9)))
    return BatchPlan(batch_tokens, max_tokens, micro, dp_size, accumulate, source)


def largest_fitting(fits: Callable[[int], bool], start: int = 4096, limit: int = 1 << 20) -> int:
    """The largest multiple of ``GRAIN`` up to ``limit`` for which ``fits`` holds (``fits`` must be
    monotone: true up to a size, false above). Doubles from ``start`` (halves when it fails) to bracket
    the edge, then bisects between the last size that fitted and the first that did not.
    Raises ``ValueError`` when not even ``GRAIN`` tokens fit."""
    size = max(GRAIN, start // GRAIN * GRAIN)
    if fits(size):
        good, bad = size, None
        while bad is None and good < limit:
            trial = min(limit, good * 2)
            if fits(trial):
                good = trial
            else:
                bad = trial
        if bad is None:
            return good
    else:
        bad, good = size, 0
        while good == 0 and bad > GRAIN:
            trial = max(GRAIN, bad // 2 // GRAIN * GRAIN)
            if fits(trial):
                good = trial
            else:
                bad = trial
        if good == 0:
            raise ValueError(f"not even a micro-batch of {GRAIN} padded tokens fits")
    while bad - good > GRAIN:
        mid = (good + bad) // 2 // GRAIN * GRAIN
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
