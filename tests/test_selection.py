"""Model selection by validation (eval.select=best) and early stopping (train.patience): the best
checkpoint survives pruning and becomes the final model, the run stops after `patience` validations
without improvement, and a resumed run selects and stops exactly where an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_checkpoints import exported, steps_of, train, weights

from tpe_train.ckpt.state import Best
from tpe_train.config import load_config
from tpe_train.parallel.context import ParallelContext
from tpe_train.train.selection import observe

# A high constant learning rate: the validation loss falls for a few steps, then wanders above its best.
NOISY = [
    "train.lr=0.01",
    "train.warmup_steps=0",
    "train.valid_every=2",
    "train.save_every=4",
    "train.max_steps=40",
]
SELECT = ["eval.select=best", "eval.select_by=loss", "train.patience=3", "train.keep_last=1"]


def valid_nll(run: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("valid/nll")]


def trainer_state(run: Path, step: int) -> dict:
    return json.loads((run / f"checkpoints/step-{step:08d}/trainer.json").read_text())


@pytest.mark.integration
def test_the_best_checkpoint_is_kept_and_selected_and_patience_stops_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, *NOISY, *SELECT, "eval.at_end=true")
    curve = valid_nll(run)
    # what the run should have done, from the validation losses it logged (stored as float32)
    best_step, best_value, stale, stop = 0, float("inf"), 0, None
    for step, value in curve:
        if value < best_value:
            best_step, best_value, stale = step, value, 0
        else:
            stale += 1
        if stale == 3:
            stop = step
            break
    assert stop is not None and stop < 40, curve  # the settings must make it stop early
    assert curve[-1][0] == stop and f"early stop at step {stop}" in proc.stdout
    # keep_last=1 keeps only the newest, and the best validation's checkpoint besides
    assert steps_of(run) == [best_step, stop]
    state = trainer_state(run, stop)["best"]
    assert state["step"] == best_step and state["stale"] == 3
    assert abs(state["value"] - best_value) < 1e-5
    chosen, saved = exported(run / "best"), weights(run / f"checkpoints/step-{best_step:08d}")
    assert all(torch.equal(chosen[k], saved[k]) for k in saved)
    last = exported(run / "checkpoint")  # the last step's weights are exported too, as always
    assert not torch.equal(
        last["encoder.layers.0.ffn.fc_in.weight"], saved["encoder.layers.0.ffn.fc_in.weight"]
    )
    figures = json.loads((run / "eval.json").read_text())
    assert figures["selected"]["select"] == "best" and figures["selected"]["step"] == best_step

    # Stopped at a validation one after the best, then resumed: the count of validations without
    # improvement must come back, or the resumed run would stop later.
    halves = tmp_path / "halves"
    train(halves, *NOISY, *SELECT, f"train.max_steps={best_step + 2}")
    assert trainer_state(halves, best_step + 2)["best"]["stale"] == 1
    resumed = train(halves, *NOISY, *SELECT)
    assert "resumed from" in resumed.stdout and f"early stop at step {stop}" in resumed.stdout
    assert steps_of(halves) == [best_step, stop]
    assert trainer_state(halves, stop)["best"] == trainer_state(run, stop)["best"]
    again = train(halves, *NOISY, *SELECT)  # a stopped run stays stopped
    assert "early stop" not in again.stdout and steps_of(halves) == [best_step, stop]


def test_bleu_selects_the_highest_and_loss_the_lowest() -> None:
    ctx = ParallelContext.fake()
    for by, values, expected in (("bleu", [10.0, 30.0, 20.0], 2), ("loss", [3.0, 2.0, 2.5], 2)):
        cfg = load_config("demo", [f"eval.select_by={by}", "eval.select=best", "train.patience=1"])
        best = Best()
        saves, stops = zip(
            *(
                observe(best, {"valid/bleu": v, "valid/nll": v}, cfg, step, ctx)
                for step, v in enumerate(values, 1)
            ),
            strict=True,
        )
        assert best.step == expected and saves == (True, True, False) and stops == (False, False, True)
    best = Best()
    observe(best, {"valid/nll": float("nan")}, cfg, 1, ctx)  # a diverged validation is never the best
    assert best.step == 0 and best.stale == 1
