"""Pieces of the training loop: gradient accumulation and the learning-rate schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.models import tiny_model

from tpe_train.ckpt.holdings import MOMENTS, adam_steps, before_load, holdings
from tpe_train.config import load_config
from tpe_train.data.batching import BOS_ID, EOS_ID, Batch, pad
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.train.cadence import Cadence
from tpe_train.train.gradless import GradlessWatch
from tpe_train.train.schedule import inverse_sqrt
from tpe_train.train.step import train_step


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
    stats = train_step(engine, micro, cfg, ctx, amp_dtype=None).read(ctx)
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


TINY_RUN = [
    "model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1",
    "model.decoder_layers=1", "data.vocab_size=80", "data.synthetic.train_size=100",
    "data.synthetic.valid_size=8", "data.synthetic.test_size=4", "data.synthetic.probe_size=2",
    "data.synthetic.long_size=2", "data.max_tokens=256", "train.max_steps=4", "train.log_every=2",
    "train.valid_every=100", "train.valid_bleu_size=0", "train.progress=false", "train.threads=1",
    "train.peak_gflops=1", "eval.at_end=false",
]  # fmt: skip


def test_quiet_keeps_the_terminal_to_warnings_and_the_run_directory_keeps_the_whole_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tpe-train --quiet``: no progress lines on the terminal, every one of them in ``train.log``;
    without it, the same lines on stdout, each as ``tpe-train: ...``."""
    from tpe_train.run import logs
    from tpe_train.train.cli import main

    monkeypatch.setenv("TPE_DATA_CACHE", str(tmp_path / "data"))
    monkeypatch.delenv("RANK", raising=False)
    try:
        assert main(["--quiet", *TINY_RUN, f"train.run_dir={tmp_path / 'quiet'}"]) == 0
        quiet = capsys.readouterr().out
        assert main([*TINY_RUN, f"train.run_dir={tmp_path / 'loud'}"]) == 0
        loud = capsys.readouterr().out
    finally:
        logs.configure("tpe-train")
    assert "step 2/4 | loss" not in quiet and "memory rank 0" not in quiet
    assert "checkpoint: " in quiet  # the command's result: the export's path
    logged = (tmp_path / "quiet" / "train.log").read_text()
    assert "rank 0 INFO tpe_train.train.periodic: step 2/4 | loss" in logged and "memory rank 0" in logged
    lines = [line for line in loud.splitlines() if line.startswith("tpe-train: step ") and "| loss" in line]
    assert [line.split(" | ")[0] for line in lines] == ["tpe-train: step 2/4", "tpe-train: step 4/4"]
    assert "tpe-train: checkpoint " in loud


def test_a_parameter_without_gradient_is_named_once_and_held_without_moments(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One process: the warning names only the parameter the loss does not use, at the first step
    only; the checkpoint's holdings have its weight and no moments (torch's Adam has no state for it)."""
    cfg = load_config("demo", ["train.clip_norm=0"])
    model = tiny_model("t5")
    model.register_parameter("idle", torch.nn.Parameter(torch.zeros(3)))  # no forward reads it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctx = ParallelContext.fake()
    engine = Engine(model, opt, sched, ctx, accumulate=1, clip_norm=0.0, deepspeed=None)
    watch = GradlessWatch(model, ctx)
    found = []
    for step in (1, 2):
        train_step(engine, [batch([[5, 6, 7], [8, 9]])], cfg, ctx, amp_dtype=None)
        found.append(watch.report(step))
    assert found == [["idle"], []]
    warnings = [r.getMessage() for r in caplog.records if "no gradient" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "no gradient at step 1 for the trainable parameter(s) idle:"
    )
    names = {h.region.name for h in holdings(engine, moments=True)}
    assert "idle" in names and "exp_avg/idle" not in names and "exp_avg_sq/idle" not in names
    assert "exp_avg/embed.weight" in names and torch.equal(model.idle, torch.zeros(3))


def test_adam_steps_is_the_most_of_any_parameter_when_one_gets_no_gradient_after_a_load() -> None:
    """A checkpoint written under DeepSpeed has (zero) moments for a parameter that gets no gradient:
    loaded into torch's Adam, its state keeps the loaded step count while the others count on."""
    cfg = load_config("demo", ["train.clip_norm=0"])
    model = tiny_model("t5")
    model.register_parameter("idle", torch.nn.Parameter(torch.zeros(3)))  # the model's first parameter
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ctx = ParallelContext.fake()
    engine = Engine(model, opt, sched, ctx, accumulate=1, clip_norm=0.0, deepspeed=None)
    before_load(engine, 5, {f"{m}/{n}" for n, _ in model.named_parameters() for m in MOMENTS})
    assert next(iter(opt.state)) is model.idle
    train_step(engine, [batch([[5, 6, 7], [8, 9]])], cfg, ctx, amp_dtype=None)
    assert int(opt.state[model.idle]["step"]) == 5 and adam_steps(engine) == 6
