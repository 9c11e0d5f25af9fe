"""What the loop does every so many steps, each part answering its own timing (``Cadence``): the log
line and TensorBoard scalars (``StepLog``), position diagnostics (``PositionLog``), validation and early
stopping (``Validator``), checkpoints (``Saver``), the ids of every batch (``SampleLog``)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import IO

from tqdm import tqdm

from tpe_train.ckpt.store import latest_complete
from tpe_train.data.batching import Batch
from tpe_train.run.exits import EXIT_PREEMPTED
from tpe_train.train import selection
from tpe_train.train.cadence import Cadence
from tpe_train.train.position_logging import TrainingDiagnostics
from tpe_train.train.scalars import log_line, write_scalars
from tpe_train.train.startup import Run
from tpe_train.train.step import StepResult, validate
from tpe_train.train.throughput import Throughput

log = logging.getLogger(__name__)


class StepLog:
    """The training figures: counted every step, read back and written at the log steps (TensorBoard,
    the progress bar on a terminal, else a line per ``train.log_every``)."""

    def __init__(self, run: Run) -> None:
        cfg, ctx = run.cfg, run.ctx
        self.run, self.cadence = run, Cadence.of(cfg.train)
        show = cfg.train.progress and ctx.is_main and sys.stderr.isatty()
        # a log (Slurm, nohup, a pipe) shows a line per log_every; a terminal the bar (the file the lines)
        self.level = logging.DEBUG if show else logging.INFO
        total, initial = cfg.train.max_steps, run.progress.step
        self.bar = tqdm(total=total, initial=initial, disable=not show, dynamic_ncols=True)
        self.meter = Throughput.of_run(cfg, run.data.tokenizer.get_vocab_size(), ctx)  # tokens/s, MFU

    def step(self, step: int, micro: list[Batch], pending: StepResult) -> None:
        """Count one step; at a log step read its figures (every rank: the reduction is a collective)."""
        run = self.run
        run.tally.add(pending.tokens)
        self.meter.step(micro)
        if not self.cadence.should_log(step):
            return
        stats = pending.read(run.ctx)
        logged, run.progress.tokens = run.progress.tokens, run.tally.total()
        scalars = {
            "train/loss": stats["loss"],
            "train/nll": stats["nll"],
            "train/lr": run.engine.lr(),
            "train/grad_norm": stats["grad_norm"],
            "train/target_tokens": stats["tokens"],  # of the step, all ranks: train.batch_tokens reached
            **self.meter.read(run.progress.tokens - logged),
        }
        scaler = run.engine.loss_scale_state() if run.cfg.train.fp16 else None  # ZeRO keeps a static 1 too
        if scaler is not None:
            scalars["train/loss_scale"] = scaler["cur_scale"]  # halved at each overflow
        write_scalars(run.writer, scalars, step)
        self.bar.set_postfix(loss=f"{scalars['train/loss']:.3f}", lr=f"{scalars['train/lr']:.2e}")
        log.log(self.level, log_line(step, run.cfg.train.max_steps, scalars))

    def close(self) -> None:
        self.bar.close()


class PositionLog:
    """Position diagnostics on a fixed validation batch at ``train.diagnostics_every`` (0: never)."""

    def __init__(self, run: Run) -> None:
        self.run, self.cadence = run, Cadence.of(run.cfg.train)
        self.diagnostics = TrainingDiagnostics.of_run(run.cfg, run.data, run.ctx)  # None: off

    def maybe_write(self, step: int) -> None:
        if self.diagnostics is None or not self.cadence.should_diagnose(step):
            return
        run, images = self.run, self.cadence.should_draw_tables(step)
        self.diagnostics.write(run.engine, run.writer, run.ctx, step, run.amp_dtype, images)


class Validator:
    """Validation at ``train.valid_every`` and the last step; the best so far and early stopping."""

    def __init__(self, run: Run) -> None:
        self.run, self.cadence = run, Cadence.of(run.cfg.train)
        # a resumed run may have stopped early already
        self.stop = selection.exhausted(run.progress.best, run.cfg.train.patience)

    def maybe_validate(self, step: int) -> bool:
        """Whether this step's validation is a new best to save at once (``eval.select=best``); sets
        ``stop`` when early stopping ends the run."""
        if not self.cadence.should_validate(step):
            return False
        run = self.run
        figures = validate(run.engine, run.data, run.cfg, run.ctx, run.amp_dtype)
        write_scalars(run.writer, figures, step)
        log.info(log_line(step, run.cfg.train.max_steps, figures))
        new_best, self.stop = selection.observe(run.progress.best, figures, run.cfg, step, run.ctx)
        return new_best


class Saver:
    """Checkpoints: at ``train.save_every``, the last step, a new best, and when the run must stop."""

    def __init__(self, run: Run) -> None:
        self.run, self.cadence = run, Cadence.of(run.cfg.train)
        self.last: Path | None = None  # the latest checkpoint this run saved

    def maybe_save(self, step: int, *, stopping: bool, new_best: bool, wait: bool = False) -> None:
        """``stopping``: preempted or stopped early; ``wait``: the files complete on return (else in the
        background with ``train.async_save``)."""
        if not self.cadence.should_save(step, stopping=stopping, new_best=new_best):
            return
        run = self.run
        run.progress.tokens = run.tally.total()
        self.last = run.checkpointer.save(run.progress, wait=wait)
        log.info("checkpoint %s", self.last)

    def preempted(self, step: int) -> None:
        """Record a preemption (the checkpoint of ``step`` complete) for the launcher."""
        run = self.run
        if run.ctx.is_main:
            run.run_dir.preempted.write_text(json.dumps({"step": step, "checkpoint": str(self.last)}))
            log.info("preempted at step %d; checkpoint %s; exiting %d", step, self.last, EXIT_PREEMPTED)

    def final(self) -> Path:
        """The last step's complete checkpoint: waited for, or saved now (e.g. a run resumed from
        elsewhere with no step left)."""
        run = self.run
        run.progress.tokens = run.tally.total()
        run.checkpointer.wait()
        latest = latest_complete(run.run_dir.checkpoints)[0]
        if latest is None or latest.step != run.progress.step:
            return run.checkpointer.save(run.progress, wait=True)
        return latest.path


class SampleLog:
    """Per data-parallel rank, the ids of every batch trained on (``train.log_samples``; appended: a
    resumed run continues the file)."""

    def __init__(self, run: Run) -> None:
        self.file: IO[str] | None = None
        if run.cfg.train.log_samples and run.ctx.tp_rank == 0:
            path = run.run_dir.samples(run.ctx.dp_rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")  # noqa: SIM115 -- open for the whole run, closed by ``close``

    def write(self, step: int, micro: list[Batch]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "ids": [int(i) for b in micro for i in b.ids]}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
