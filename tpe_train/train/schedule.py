"""The learning-rate schedule: linear warmup, then the inverse square root of the step."""

from __future__ import annotations

import math
from collections.abc import Callable


def inverse_sqrt(warmup: int) -> Callable[[int], float]:
    """Multiplier of the peak lr: linear warmup, then sqrt(warmup / step) (Vaswani et al. 2017)."""

    def factor(step: int) -> float:
        step = max(step, 1)
        if warmup and step < warmup:
            return step / warmup
        return math.sqrt(max(warmup, 1) / step)

    return factor
