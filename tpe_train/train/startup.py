"""Everything a run is set up with before step 1, built once: ``start`` returns the ``Run``.

Seeds and process settings -> the checkpoint to resume from (checked against the config before any
work) -> data -> the batch of this launch (``asked``: the config as given, kept in the run directory;
``cfg``: micro-batch and accumulation resolved) -> engine -> the data stream and the checkpointer
(resumed) -> the start-up report and the run directory's records.
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from tpe_train.ckpt.export import parameter_count
from tpe_train.ckpt.rundir import RunDir
from tpe_train.ckpt.state import Checkpointer, Progress
from tpe_train.ckpt.store import CheckpointError, check_compatible, resume_choice
from tpe_train.config import Config
from tpe_train.data.prepare import Prepared, prepare
from tpe_train.data.train_batches import TrainBatches
from tpe_train.parallel.batch import BatchPlan
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import ProcessLayout, deepspeed_config
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.memory import MemoryReport, memory_report
from tpe_train.run import atomic, logs
from tpe_train.train import batch_size
from tpe_train.train.build import build_engine, build_train_model
from tpe_train.train.cpu_setup import configure_cpu, set_threads
from tpe_train.train.precision import autocast_dtype, precision_warning
from tpe_train.train.seeding import seed_dropout, seed_everything
from tpe_train.train.step import TokenTally

log = logging.getLogger(__name__)


class Signals:
    """SIGTERM / SIGUSR1 only raise a flag; the loop saves at the end of the current step. A second
    signal while saving raises the flag again and changes nothing."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum


@dataclass
class Run:
    """One run on this process, as set up before step 1."""

    asked: Config  # the config as given: what the run directory keeps
    cfg: Config  # the same with the micro-batch and accumulation of this launch resolved
    layout: ProcessLayout
    ctx: ParallelContext
    run_dir: RunDir
    data: Prepared
    batch: BatchPlan
    engine: Engine
    batches: TrainBatches  # this rank's stream of training batches
    checkpointer: Checkpointer
    progress: Progress  # step, tokens and best validation so far (restored on resume)
    tally: TokenTally  # the steps' token counts, kept on the device between reads
    amp_dtype: torch.dtype | None  # the forward passes' autocast dtype (None: none)
    signals: Signals
    writer: SummaryWriter | None  # rank 0's TensorBoard writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@contextmanager
def log_file(cfg: Config, ctx: ParallelContext) -> Iterator[None]:
    """Rank 0 also logs to ``train.log`` in the run directory while the run lasts."""
    handler = logs.add_file(RunDir(cfg.run_dir()).log, rank=ctx.rank) if ctx.is_main else None
    try:
        yield
    finally:
        if handler is not None:
            logs.remove_file(handler)


def start(asked: Config, layout: ProcessLayout, ctx: ParallelContext) -> Run:
    """Set up the run (every rank) and report it (rank 0)."""
    seed_everything(asked.train.seed)
    set_threads(asked.train.threads)  # at most the node's cores per process
    configure_cpu(asked.train.cpu_gemm, ctx.device)  # training GEMM kernels, allocator
    resume_from = resume_point(asked, ctx)
    if resume_from is not None:
        check_compatible(resume_from, asked)  # another model stops here, before any work
    signals = Signals()
    data = prepare_data(asked, ctx)
    cfg, batch = batch_size.plan(asked, data, ctx, start_recorded=asked.train.resume != "never")
    seed_everything(cfg.train.seed)  # as if nothing ran before: a probe draws from the generators
    model = build_train_model(cfg, data.tokenizer.get_vocab_size(), ctx)
    seed_dropout(cfg.train.seed, ctx)
    ds_config = deepspeed_config(cfg, layout) if layout.deepspeed is not None else None
    engine = build_engine(model, cfg, ctx, ds_config)
    batches = TrainBatches(data, cfg.data, cfg.train.seed, ctx.dp_rank, ctx.dp_size)
    run_dir = RunDir(cfg.run_dir())
    zero = layout.zero_stage
    checkpointer = Checkpointer(run_dir.checkpoints, asked, engine, data.tokenizer, batches, zero)
    progress = checkpointer.restore(resume_from) if resume_from is not None else Progress()
    amp_dtype = autocast_dtype(cfg, engine.uses_deepspeed)  # DeepSpeed holds bf16/fp16 weights itself
    reports = ctx.gather(memory_report(engine.module, engine.optimizer, ctx.rank, layout))
    writer = SummaryWriter(str(run_dir.tensorboard)) if ctx.is_main else None
    run = Run(asked, cfg, layout, ctx, run_dir, data, batch, engine, batches, checkpointer, progress,
              TokenTally(progress.tokens), amp_dtype, signals, writer)  # fmt: skip
    if writer is not None:
        writer.add_text("batch", "\n\n".join(filter(None, (batch.line(), batch.warning()))), progress.step)
    if ctx.is_main:
        record(run, reports)
        report(run, reports, resume_from)
    return run


def resume_point(cfg: Config, ctx: ParallelContext) -> Path | None:
    """The checkpoint to resume from (``train.resume``): rank 0 chooses, every rank gets its choice."""
    if cfg.train.resume == "never":
        return None
    found: tuple[Path | None, str] = (None, "")
    if ctx.is_main:  # alone: auto may set a corrupt checkpoint aside
        try:
            found = (resume_choice(cfg.train.resume, cfg.run_dir()), "")
        except CheckpointError as err:
            found = (None, str(err))
    path, error = ctx.gather(found)[0]
    if error:
        raise CheckpointError(error)
    return path


def prepare_data(cfg: Config, ctx: ParallelContext) -> Prepared:
    """The token store, built by rank 0 while the others wait, then read by all (memory-mapped)."""
    if ctx.distributed and not ctx.is_main:
        dist.barrier()
    data = prepare(cfg.data, run_tokenizer=RunDir(cfg.run_dir()).tokenizer if ctx.is_main else None)
    if ctx.distributed and ctx.is_main:
        dist.barrier()
    return data


def record(run: Run, reports: list[MemoryReport]) -> None:
    """The run directory's records of this start: the config as asked (before step 1), the batch, the
    DeepSpeed config, the memory report."""
    atomic.write_text(run.run_dir.config, run.asked.to_yaml())
    batch_size.record(run.run_dir, run.batch, auto=run.asked.data.max_tokens == 0)
    if run.engine.uses_deepspeed:
        run.run_dir.deepspeed_config.write_text(json.dumps(deepspeed_config(run.cfg, run.layout), indent=2))
    run.run_dir.memory.write_text(json.dumps([r.as_dict() for r in reports], indent=2))


def report(run: Run, reports: list[MemoryReport], resume_from: Path | None) -> None:
    """The start-up lines: cleaning, model and data, layout, precision, batch, resume, memory."""
    cfg, data = run.cfg, run.data
    for line in data.splits.report:
        log.info(f"cleaning {line}")
    log.info(
        f"{cfg.preset} | position {cfg.model.position.kind} | "
        f"{parameter_count(run.engine.module) / 1e6:.2f}M parameters on this rank | "
        f"{'streamed' if cfg.data.streaming else len(data.train)} training pairs "
        f"({data.dropped_too_long} longer than data.max_len dropped) | vocab "
        f"{data.tokenizer.get_vocab_size()} | token store {data.store} "
        f"({'built' if data.built else 'reused'}) | run dir {run.run_dir.path}"
    )
    log.info(f"{run.ctx.describe()} | ZeRO {run.layout.zero_stage} | {run.layout.source}")
    warning = precision_warning(cfg, run.ctx.device)
    if warning is not None:
        log.warning(warning)
    batch = run.batch
    for line in filter(None, (batch_size.auto_note(run.asked, batch), batch.line(), batch.warning())):
        log.info(line)
    if resume_from is not None:
        log.info(f"resumed from {resume_from} at step {run.progress.step}")
    for r in reports:
        log.info(f"memory {r.line()}")
