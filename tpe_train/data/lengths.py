"""The one length rule: a pair fits when both sides, in tokens with EOS, are at most ``max_len``.

Preparation, streaming and validation all drop pairs by this rule, so that a pair is trained and
validated on the same terms everywhere.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

Lengths = TypeVar("Lengths", int, np.ndarray)


def fits(src_len: Lengths, tgt_len: Lengths, max_len: int) -> Lengths:
    """Whether each pair fits ``max_len`` (a bool for two ints, a boolean array for two arrays)."""
    return (src_len <= max_len) & (tgt_len <= max_len)
