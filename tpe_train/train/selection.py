"""Which weights a run ends with: selection by validation and early stopping.

``eval.select`` picks the final model: ``last`` (the last step's weights), ``best`` (the checkpoint of
the best validation by ``eval.select_by``) or ``average_last`` (the mean of the last
``eval.average_last`` checkpoints). ``train.patience`` stops training after that many validations in a
row without improvement of the same figure. What this needs to remember -- the best validation's step
and value, and the validations since -- is trainer state (``ckpt.state.Best``): it is written into every
checkpoint's ``trainer.json`` and restored on resume, so a resumed run selects and stops exactly where
an uninterrupted one does. The best checkpoint is saved when its validation happens and is exempt from
``train.keep_last`` pruning.
"""

from __future__ import annotations

import logging
from typing import Any

from tpe_train.ckpt.export import average_last, export_mean, load_export
from tpe_train.ckpt.rundir import RunDir
from tpe_train.ckpt.state import Best
from tpe_train.ckpt.store import inspect, step_dir
from tpe_train.config import Config
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.context import ParallelContext

log = logging.getLogger(__name__)

#: eval.select_by -> (validation figure, whether higher is better)
FIGURES = {"bleu": ("valid/bleu", True), "loss": ("valid/nll", False)}


def observe(
    best: Best, figures: dict[str, float], cfg: Config, step: int, ctx: ParallelContext
) -> tuple[bool, bool]:
    """Record one validation in ``best``. Returns (save now: a new best under eval.select=best, stop:
    train.patience validations without improvement), the same on every rank."""
    name, higher = FIGURES[cfg.eval.select_by]
    value = figures[name]
    better = best.value is None or (value > best.value if higher else value < best.value)
    if value == value and better:  # a NaN is never better
        best.step, best.value, best.stale = step, value, 0
    else:
        best.stale += 1
    stop = ctx.any(exhausted(best, cfg.train.patience))
    if stop:
        log.info(
            f"early stop at step {step}: {best.stale} validations without a better {name} than "
            f"{best.value} (step {best.step}); train.patience={cfg.train.patience}"
        )
    return ctx.any(best.step == step and cfg.eval.select == "best"), stop


def exhausted(best: Best, patience: int) -> bool:
    """Whether early stopping ends the run (``patience`` 0: never)."""
    return patience > 0 and best.stale >= patience


def final_model(
    cfg: Config, run_dir: RunDir, last: Transformer, best: Best
) -> tuple[Transformer, dict[str, Any]]:
    """The model ``eval.select`` names (``last``: the last step's, already built) and what was chosen,
    for ``eval.json``."""
    if cfg.eval.select == "average_last":
        model, info = average_last(cfg, run_dir)
        return model, {"select": "average_last", **info}
    if cfg.eval.select == "best":
        path = step_dir(run_dir.checkpoints, best.step)
        if best.step and path.is_dir() and inspect(path).complete:
            export = export_mean([path], run_dir.best)
            log.info(f"final model = {path.name}, best {cfg.eval.select_by} {best.value} -> {export}")
            info = {"select": "best", "by": cfg.eval.select_by, "step": best.step, "value": best.value}
            return load_export(export)[0], {**info, "export": str(export)}
        log.warning(
            f"eval.select=best, but the checkpoint of the best validation (step {best.step}) is "
            f"not in {run_dir.checkpoints} (a run resumed from another directory?); the final model is "
            "the last step's"
        )
    return last, {"select": "last"}
