"""Pieces of the training loop: gradient accumulation and the learning-rate schedule."""

from __future__ import annotations

import torch
from conftest import tiny_model

from tpe_train.config import load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
from tpe_train.train import accumulate_gradients, inverse_sqrt


def batch(rows: list[list[int]]) -> Batch:
    tgt = [[*r[::-1], EOS_ID] for r in rows]
    return Batch(
        ids=torch.arange(len(rows)),
        src=pad([[*r, EOS_ID] for r in rows]),
        tgt_in=pad([t[:-1] for t in tgt], prefix=BOS_ID),
        tgt_out=pad(tgt),
    )


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_accumulating_two_batches_equals_one_double_batch() -> None:
    cfg = load_config("demo", ["train.label_smoothing=0.1"])
    rows_a = [[5, 6, 7], [8, 9, 10, 11, 12]]
    rows_b = [[13, 14], [15, 16, 17, 18], [19, 20, 21]]
    model = tiny_model("t5")  # eval mode: no dropout, so the two computations are comparable
    loss_acc, _, ntok_acc = accumulate_gradients(model, [batch(rows_a), batch(rows_b)], cfg)
    accumulated = grads(model)
    model.zero_grad()
    loss_one, _, ntok_one = accumulate_gradients(model, [batch(rows_a + rows_b)], cfg)
    assert ntok_acc == ntok_one == (3 + 1) + (5 + 1) + (2 + 1) + (4 + 1) + (3 + 1)  # targets + EOS
    assert abs(loss_acc - loss_one) < 1e-4
    for a, b in zip(accumulated, grads(model), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_inverse_sqrt_schedule() -> None:
    f = inverse_sqrt(100)
    assert f(1) == 0.01 and f(50) == 0.5 and f(100) == 1.0
    assert abs(f(400) - 0.5) < 1e-12  # sqrt(100 / 400)
