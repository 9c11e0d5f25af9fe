"""Pieces of the training loop: gradient accumulation and the learning-rate schedule."""

from __future__ import annotations

import torch
from support.models import tiny_model

from tpe_train.config import load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.cadence import Cadence
from tpe_train.train.step import inverse_sqrt, train_step


def batch(rows: list[list[int]]) -> Batch:
    tgt = [[*r[::-1], EOS_ID] for r in rows]
    return Batch(
        ids=torch.arange(len(rows)),
        src=pad([[*r, EOS_ID] for r in rows]),
        tgt_in=pad([t[:-1] for t in tgt], prefix=BOS_ID),
        tgt_out=pad(tgt),
    )


def one_step(micro: list[Batch], accumulate: int) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Parameters after one SGD step (linear in the gradient, so gradients are compared exactly)."""
    cfg = load_config("demo", [f"train.accumulate={accumulate}", "train.clip_norm=0"])
    torch.manual_seed(0)
    model = tiny_model("t5")  # eval mode: no dropout, so the two computations are comparable
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctx = ParallelContext.fake()
    engine = Engine(model, opt, sched, ctx, accumulate=accumulate, clip_norm=0.0, deepspeed=None)
    stats = train_step(engine, micro, cfg, ctx, cast=None).read(ctx)
    return stats, [p.detach().clone() for p in model.parameters()]


def test_accumulating_two_batches_equals_one_double_batch() -> None:
    rows_a = [[5, 6, 7], [8, 9, 10, 11, 12]]
    rows_b = [[13, 14], [15, 16, 17, 18], [19, 20, 21]]
    acc, params_acc = one_step([batch(rows_a), batch(rows_b)], accumulate=2)
    one, params_one = one_step([batch(rows_a + rows_b)], accumulate=1)
    assert acc["tokens"] == one["tokens"] == (3 + 1) + (5 + 1) + (2 + 1) + (4 + 1) + (3 + 1)  # + EOS
    assert abs(acc["loss"] - one["loss"]) < 1e-5
    assert abs(acc["grad_norm"] - one["grad_norm"]) < 1e-5 * one["grad_norm"]
    for a, b in zip(params_acc, params_one, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_inverse_sqrt_schedule() -> None:
    f = inverse_sqrt(100)
    assert f(1) == 0.01 and f(50) == 0.5 and f(100) == 1.0
    assert abs(f(400) - 0.5) < 1e-12  # sqrt(100 / 400)


def test_the_loop_logs_validates_and_saves_on_its_cadence_and_always_at_the_last_step() -> None:
    cfg = load_config(
        "demo", ["train.max_steps=10", "train.log_every=3", "train.valid_every=4", "train.save_every=5"]
    )
    cadence = Cadence.of(cfg.train)
    steps = range(1, 11)
    assert [s for s in steps if cadence.should_log(s)] == [3, 6, 9, 10]
    assert [s for s in steps if cadence.should_validate(s)] == [4, 8, 10]
    assert [s for s in steps if cadence.should_save(s)] == [5, 10]
    assert cadence.should_save(2, stopping=True) and cadence.should_save(2, new_best=True)
    never = Cadence.of(load_config("demo", ["train.max_steps=10", "train.save_every=0"]).train)
    assert [s for s in steps if never.should_save(s)] == [10]  # save_every=0: only at the end
