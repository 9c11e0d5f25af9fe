"""The training loop, top to bottom: ``tpe-train [--preset P] [key=value ...]``.

config + launch layout -> start-up (``startup``: data, the batch of this launch, model, optimizer,
schedule and engine (``build``), resume from the latest complete checkpoint) -> the steps (forward,
label-smoothed CE, backward, clip, step; then log, position diagnostics, validate, checkpoint, each
when its ``periodic`` part says so; a preemption signal saves and exits) -> export and evaluation
(``finish``).
"""

from __future__ import annotations

from typing import Any

from tpe_train.config import Config
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import ProcessLayout, resolve_layout
from tpe_train.run import lock as run_lock
from tpe_train.train import startup
from tpe_train.train.finish import export_and_evaluate
from tpe_train.train.gradless import GradlessWatch
from tpe_train.train.periodic import PositionLog, SampleLog, Saver, StepLog, Validator
from tpe_train.train.startup import Run
from tpe_train.train.step import train_step


class Preempted(Exception):
    """Raised after the checkpoint of a preempted run is complete."""


def run(cfg: Config) -> dict[str, Any]:
    """Train (and evaluate) one run on this process's share of the launch; returns the final figures."""
    layout = resolve_layout(cfg)  # an impossible layout stops here, before any work
    ctx = ParallelContext.from_env(layout.tp_size, deepspeed=layout.deepspeed is not None)
    with run_lock.own(cfg.run_dir(), ctx.is_main, ctx.any):  # one run per directory; all ranks stop if not
        return train(cfg, layout, ctx)


def train(asked: Config, layout: ProcessLayout, ctx: ParallelContext) -> dict[str, Any]:
    """The run itself, once this process's rank 0 owns the run directory."""
    with startup.log_file(asked, ctx):
        run = startup.start(asked, layout, ctx)
        try:
            saver = train_steps(run)
            return export_and_evaluate(run, saver.final())
        finally:
            run.close()


def train_steps(run: Run) -> Saver:
    """The steps from the one after ``run.progress.step`` to ``train.max_steps`` (or early stopping)."""
    cfg, progress = run.cfg, run.progress
    log, positions, validator, saver = StepLog(run), PositionLog(run), Validator(run), Saver(run)
    samples = SampleLog(run)
    gradless = GradlessWatch(run.engine.module, run.ctx)  # names what gets no gradient, at the first step
    first = progress.step + 1
    try:
        for step in range(first, cfg.train.max_steps + 1):
            if validator.stop:
                break
            micro = [next(run.batches) for _ in range(cfg.train.accumulate)]
            pending = train_step(run.engine, micro, cfg, run.ctx, run.amp_dtype)  # read at log steps only
            progress.step = step
            if step == first:  # what got no gradient: warned about, and plain DDP told
                run.engine.settle(gradless.report(step))
            samples.write(step, micro)
            log.step(step, micro, pending)
            positions.maybe_write(step)  # attention distances, tables
            new_best = validator.maybe_validate(step)
            preempted = run.ctx.any(run.signals.received is not None)
            saver.maybe_save(step, stopping=preempted or validator.stop, new_best=new_best, wait=preempted)
            if preempted:
                saver.preempted(step)
                raise Preempted
            log.bar.update(1)
    finally:
        log.close()
        samples.close()
    return saver
