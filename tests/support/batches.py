"""Batches of the reversal task (target = the source reversed) for tests that train a few steps."""

from __future__ import annotations

import torch

from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad


def reversal_batches(
    n: int, generator: torch.Generator, *, rows: int, vocab: int, lengths: tuple[int, int]
) -> list[Batch]:
    """``n`` batches of ``rows`` random sentences over ids 4..``vocab``-1, lengths drawn in
    [``lengths[0]``, ``lengths[1]``); the target is the source reversed, both end in EOS."""
    out = []
    for _ in range(n):
        lo, hi = lengths
        src = [
            torch.randint(
                4, vocab, (int(torch.randint(lo, hi, (1,), generator=generator)),), generator=generator
            ).tolist()
            for _ in range(rows)
        ]
        tgt = [[*s[::-1], EOS_ID] for s in src]
        out.append(
            Batch(
                ids=torch.arange(rows),
                src=pad([[*s, EOS_ID] for s in src]),
                tgt_in=pad([t[:-1] for t in tgt], prefix=BOS_ID),
                tgt_out=pad(tgt),
            )
        )
    return out
