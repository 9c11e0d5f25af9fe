"""One builder (``tpe_train.train.build``): every benchmark's step takes the trainer's optimizer class and
its settings (lr, betas, eps, weight decay, fused) and the trainer's learning-rate schedule."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

from tpe_train.config import Config, load_config
from tpe_train.parallel.context import ParallelContext
from tpe_train.train.build import build_engine, build_optimizer, build_schedule, build_train_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_checkpoint  # noqa: E402
import bench_engine  # noqa: E402
import harness  # noqa: E402

#: Settings no default has, so that a builder with its own numbers shows.
SETTINGS = [
    "model.d_model=16", "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1",
    "model.decoder_layers=1", "data.vocab_size=50", "train.lr=3e-3", "train.adam_betas=[0.8,0.95]",
    "train.adam_eps=1e-7", "train.weight_decay=0.01", "train.warmup_steps=7",
]  # fmt: skip
SETTING_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "fused", "amsgrad", "maximize")


def config() -> Config:
    return load_config("demo", SETTINGS)


def settings(opt: torch.optim.Optimizer, schedule: Any) -> dict[str, Any]:
    """What an optimizer step does: the class, each group's settings, and the schedule's factors."""
    groups = [{k: g.get(k) for k in SETTING_KEYS} for g in opt.param_groups]
    factors = [[f(step) for step in (0, 1, 3, 7, 8, 50)] for f in schedule.lr_lambdas]
    return {"class": type(opt), "groups": groups, "schedule": type(schedule), "factors": factors}


def trainers() -> dict[str, Any]:
    cfg = config()
    engine = build_engine(
        build_train_model(cfg, 50, ParallelContext.fake()), cfg, ParallelContext.fake(), None
    )
    return settings(engine.optimizer, engine.scheduler)


def test_the_trainers_optimizer_has_the_configs_settings() -> None:
    cfg, trainer = config(), trainers()
    assert trainer["class"] is torch.optim.AdamW
    assert trainer["groups"][0]["betas"] == (0.8, 0.95) and trainer["groups"][0]["eps"] == 1e-7
    assert trainer["groups"][0]["weight_decay"] == 0.01 and trainer["groups"][0]["fused"] is True
    assert trainer["groups"][0]["initial_lr"] == cfg.train.lr
    assert trainer["factors"][0] == [1 / 7, 1 / 7, 3 / 7, 1.0, (7 / 8) ** 0.5, (7 / 50) ** 0.5]
    model = build_train_model(cfg, 50, ParallelContext.fake())
    opt = build_optimizer(model, cfg.train)
    assert settings(opt, build_schedule(opt, cfg.train)) == trainer


def test_every_benchmark_step_takes_the_trainers_optimizer_and_schedule() -> None:
    cfg, trainer = config(), trainers()
    model = harness.build(cfg)
    row = harness.TrainRow(
        "row", model, [], torch.device("cpu"), cfg.train
    )  # bench_train, bench_attention ...
    assert settings(row.opt, row.optimization.schedule) == trainer
    shared = harness.trainer_optimizer(model, cfg.train)  # bench_attention's rows of one model
    assert settings(shared.opt, shared.schedule) == trainer
    plain = bench_engine.engine(cfg, ParallelContext.fake(), None)  # bench_engine's plain row
    assert settings(plain.optimizer, plain.scheduler) == trainer
    engine, _ = bench_checkpoint.engine_of(cfg, ParallelContext.fake(), None)
    assert settings(engine.optimizer, engine.scheduler) == trainer


def test_no_benchmark_builds_an_optimizer_of_its_own() -> None:
    """Optimizers and schedules come from ``tpe_train.train.build`` (through ``harness.trainer_optimizer``
    or the engine builder), never from ``torch.optim`` in a benchmark script."""
    own = re.compile(r"torch\.optim\.(?!Optimizer\b|lr_scheduler\.LRScheduler\b)\w+")
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        found = own.findall(path.read_text())
        assert not found, (
            f"{path.name} builds {found}; use harness.trainer_optimizer or tpe_train.train.build"
        )


def test_a_step_of_a_benchmark_row_moves_at_the_schedules_lr() -> None:
    """The row steps its schedule: after one step the lr is the second factor's."""
    cfg = config()
    model = harness.build(cfg)
    batches = harness.Uniform(size=2, count=1, lo=3, hi=5).batches(
        cfg.data.vocab_size, 0, torch.device("cpu")
    )
    row = harness.TrainRow("row", model, batches, torch.device("cpu"), cfg.train)
    row.step()
    row.step()
    assert math.isclose(row.opt.param_groups[0]["lr"], cfg.train.lr * 2 / 7, rel_tol=1e-12)
