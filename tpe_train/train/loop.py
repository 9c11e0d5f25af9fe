"""The training loop, top to bottom: ``tpe-train [--preset P] [key=value ...]``.

config + launch layout -> data (corpus, joint BPE, token batches of this rank) -> model (position tables
sharded for tensor parallelism) -> AdamW + inverse-sqrt schedule -> engine (one process, DDP or
DeepSpeed) -> resume from the latest complete checkpoint -> loop (forward, label-smoothed CE, backward,
clip, step, log, position diagnostics, validate, checkpoint; a preemption signal saves and exits) ->
export -> evaluate.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from tpe_train.ckpt.export import build_model, export_mean, load_export, parameter_count
from tpe_train.ckpt.rundir import RunDir
from tpe_train.ckpt.state import Checkpointer, Progress
from tpe_train.ckpt.store import CheckpointError, check_compatible, latest_complete, resume_choice
from tpe_train.config import Config
from tpe_train.data.corpus import Prepared, TrainBatches, prepare
from tpe_train.evaluation.evaluate import EvalFiles, config_sets, evaluate, format_table
from tpe_train.parallel.checkpointing import apply_activation_checkpointing
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import ProcessLayout, deepspeed_config, resolve_layout
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.memory import memory_report
from tpe_train.parallel.plan import apply_tensor_parallel
from tpe_train.run import atomic
from tpe_train.run import lock as run_lock
from tpe_train.run.exits import EXIT_PREEMPTED
from tpe_train.train import batch_size, selection
from tpe_train.train.cadence import Cadence
from tpe_train.train.diagnostics import TrainingDiagnostics
from tpe_train.train.scalars import log_line, write_scalars
from tpe_train.train.step import (
    TokenTally,
    autocast_dtype,
    inverse_sqrt,
    precision_warning,
    seed_everything,
    train_step,
    validate,
)
from tpe_train.train.throughput import Throughput, configure_cpu


class Preempted(Exception):
    """Raised after the checkpoint of a preempted run is complete."""


class Signals:
    """SIGTERM / SIGUSR1 only raise a flag; the loop saves at the end of the current step. A second
    signal while saving raises the flag again and changes nothing."""

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum


def prepare_data(cfg: Config, ctx: ParallelContext) -> Prepared:
    """The token store, built by rank 0 while the others wait, then read by all (memory-mapped)."""
    if ctx.distributed and not ctx.is_main:
        dist.barrier()
    data = prepare(cfg.data, run_tokenizer=RunDir(cfg.run_dir()).tokenizer if ctx.is_main else None)
    if ctx.distributed and ctx.is_main:
        dist.barrier()
    return data


def build_engine(cfg: Config, data: Prepared, ctx: ParallelContext, layout: ProcessLayout) -> Engine:
    """Model (same initial weights on every rank), position shards, optimizer, schedule, engine."""
    model = build_model(cfg, data.tokenizer)
    apply_tensor_parallel(model, ctx)
    model.to(ctx.device).train()
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.checkpoint_every)
    if cfg.train.compile:
        model.compile_layers()
    if ctx.dp_size > 1:
        torch.manual_seed(cfg.train.seed + 7919 * ctx.dp_rank)  # dropout: one stream per data-parallel rank
    ds_config = deepspeed_config(cfg, layout) if layout.deepspeed is not None else None
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.train.lr,
        betas=cfg.train.adam_betas,
        eps=cfg.train.adam_eps,
        weight_decay=cfg.train.weight_decay,
        fused=True,  # one kernel for all parameters, or for DeepSpeed's flat partitions (bench_engine.py)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(cfg.train.warmup_steps))
    return Engine(model, optimizer, scheduler, ctx, **engine_options(cfg, ds_config))


def engine_options(cfg: Config, deepspeed: dict[str, Any] | None) -> dict[str, Any]:
    """``Engine``'s keyword arguments that follow from the config: accumulation, clipping, the DeepSpeed
    config, and without DeepSpeed torch's fp16 loss scaling (from the scale DeepSpeed would start at)."""
    fp16 = cfg.train.fp16 and deepspeed is None
    return {
        "accumulate": cfg.train.accumulate,
        "clip_norm": cfg.train.clip_norm,
        "deepspeed": deepspeed,
        "loss_scale": 2.0**cfg.train.loss_scale_power if fp16 else None,
        "scale_window": cfg.train.loss_scale_window,
    }


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


def run(cfg: Config) -> dict[str, Any]:
    """Train (and evaluate) one run on this process's share of the launch; returns the final figures."""
    layout = resolve_layout(cfg)  # an impossible layout stops here, before any work
    ctx = ParallelContext.from_env(layout.tp_size, deepspeed=layout.deepspeed is not None)
    with run_lock.own(cfg.run_dir(), ctx.is_main, ctx.any):  # one run per directory; all ranks stop if not
        return train(cfg, layout, ctx)


def train(cfg: Config, layout: ProcessLayout, ctx: ParallelContext) -> dict[str, Any]:
    """The run itself, once this process's rank 0 owns the run directory."""
    seed_everything(cfg.train.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    configure_cpu(cfg.train.cpu_gemm, ctx.device)  # training GEMM kernels, allocator
    run_dir = RunDir(cfg.run_dir())
    start = resume_point(cfg, ctx)
    if start is not None:
        check_compatible(start, cfg)  # another model stops here, before any work
    signals = Signals()
    data = prepare_data(cfg, ctx)
    asked = cfg  # what the run directory keeps; cfg: micro-batch and accumulation resolved for this launch
    cfg, batch = batch_size.plan(asked, data, ctx, start_recorded=asked.train.resume != "never")
    seed_everything(cfg.train.seed)  # as if nothing ran before: a probe draws from the generators
    engine = build_engine(cfg, data, ctx, layout)
    batches = TrainBatches(data, cfg.data, cfg.train.seed, ctx.dp_rank, ctx.dp_size)
    progress = Progress()
    checkpointer = Checkpointer(
        run_dir.checkpoints, asked, engine, data.tokenizer, batches, layout.zero_stage
    )
    if start is not None:
        progress = checkpointer.restore(start)
    cast = autocast_dtype(cfg, engine.uses_deepspeed)  # DeepSpeed holds bf16/fp16 weights itself
    reports = ctx.gather(memory_report(engine.module, engine.optimizer, ctx.rank, layout))
    samples = _sample_log(cfg, ctx)
    writer = SummaryWriter(str(run_dir.tensorboard)) if ctx.is_main else None
    if writer is not None:
        writer.add_text("batch", "\n\n".join(filter(None, (batch.line(), batch.warning()))), progress.step)
    if ctx.is_main:
        atomic.write_text(run_dir.config, asked.to_yaml())  # resolved config, before step 1
        batch_size.record(run_dir, batch, auto=asked.data.max_tokens == 0)
        if engine.uses_deepspeed:
            run_dir.deepspeed_config.write_text(json.dumps(deepspeed_config(cfg, layout), indent=2))
        for line in data.splits.report:
            print(f"tpe-train: cleaning {line}")
        print(
            f"tpe-train: {cfg.preset} | position {cfg.model.position.kind} | "
            f"{parameter_count(engine.module) / 1e6:.2f}M parameters on this rank | "
            f"{'streamed' if cfg.data.streaming else len(data.train)} training pairs "
            f"({data.dropped_too_long} longer than data.max_len dropped) | vocab "
            f"{data.tokenizer.get_vocab_size()} | token store {data.store} "
            f"({'built' if data.built else 'reused'}) | run dir {run_dir.path}"
        )
        print(f"tpe-train: {ctx.describe()} | ZeRO {layout.zero_stage} | {layout.source}")
        warning = precision_warning(cfg, ctx.device)
        if warning is not None:
            print(f"tpe-train: warning: {warning}", flush=True)
        for line in filter(None, (batch_size.auto_note(asked, batch), batch.line(), batch.warning())):
            print(f"tpe-train: {line}")
        if start is not None:
            print(f"tpe-train: resumed from {start} at step {progress.step}")
        for r in reports:
            print(f"tpe-train: memory {r.line()}")
        run_dir.memory.write_text(json.dumps([r.as_dict() for r in reports], indent=2))

    show = cfg.train.progress and ctx.is_main and sys.stderr.isatty()
    lines = ctx.is_main and not show  # a log (Slurm, nohup, a pipe) gets a line per log_every instead
    bar = tqdm(total=cfg.train.max_steps, initial=progress.step, disable=not show, dynamic_ncols=True)
    cadence = Cadence.of(cfg.train)
    meter = Throughput.of_run(cfg, data.tokenizer.get_vocab_size(), ctx)  # tokens/s, MFU
    diagnostics = TrainingDiagnostics.of_run(cfg, data, ctx)  # a fixed validation batch; None: off
    stop = selection.exhausted(progress.best, cfg.train.patience)  # a resumed run that stopped early
    tally = TokenTally(progress.tokens)  # the steps' token counts, kept on the device between reads
    for step in range(progress.step + 1, cfg.train.max_steps + 1):
        if stop:
            break
        micro = [next(batches) for _ in range(cfg.train.accumulate)]
        pending = train_step(engine, micro, cfg, ctx, cast)  # on the device; read at log steps only
        progress.step = step
        tally.add(pending.tokens)
        meter.step(micro)
        if samples is not None:
            samples.write(json.dumps({"step": step, "ids": [int(i) for b in micro for i in b.ids]}) + "\n")
            samples.flush()
        if cadence.should_log(step):
            stats = pending.read(ctx)
            logged, progress.tokens = progress.tokens, tally.total()
            scalars = {
                "train/loss": stats["loss"],
                "train/nll": stats["nll"],
                "train/lr": engine.lr(),
                "train/grad_norm": stats["grad_norm"],
                "train/target_tokens": stats["tokens"],  # of the step, all ranks: train.batch_tokens reached
                **meter.read(progress.tokens - logged),
            }
            scaler = engine.loss_scale_state() if cfg.train.fp16 else None  # ZeRO keeps a static 1 too
            if scaler is not None:
                scalars["train/loss_scale"] = scaler["cur_scale"]  # halved at each overflow
            write_scalars(writer, scalars, step)
            bar.set_postfix(loss=f"{scalars['train/loss']:.3f}", lr=f"{scalars['train/lr']:.2e}")
            if lines:
                print(log_line(step, cfg.train.max_steps, scalars), flush=True)
        if diagnostics is not None and cadence.should_diagnose(step):
            images = cadence.should_draw_tables(step)
            diagnostics.write(engine, writer, ctx, step, cast, images)  # attention distances, tables
        save_best = False  # eval.select=best: the best validation's checkpoint is saved at once
        if cadence.should_validate(step):
            figures = validate(engine, data, cfg, ctx, cast)
            write_scalars(writer, figures, step)
            if ctx.is_main:
                tqdm.write(log_line(step, cfg.train.max_steps, figures))
            save_best, stop = selection.observe(progress.best, figures, cfg, step, ctx)
        preempted = ctx.any(signals.received is not None)
        if cadence.should_save(step, stopping=preempted or stop, new_best=save_best):
            progress.tokens = tally.total()
            path = checkpointer.save(progress, wait=preempted)  # in the background with train.async_save
            if ctx.is_main:
                tqdm.write(f"tpe-train: checkpoint {path}")
        if preempted:
            if ctx.is_main:
                run_dir.preempted.write_text(json.dumps({"step": step, "checkpoint": str(path)}))
                print(f"tpe-train: preempted at step {step}; checkpoint {path}; exiting {EXIT_PREEMPTED}")
            raise Preempted
        bar.update(1)
    bar.close()
    progress.tokens = tally.total()
    checkpointer.wait()
    latest = latest_complete(run_dir.checkpoints)[0]
    if latest is None or latest.step != progress.step:  # e.g. resumed from elsewhere with no step left
        last = checkpointer.save(progress, wait=True)
    else:
        last = latest.path
    metrics: dict[str, Any] = {}
    if ctx.is_main:  # the export is consolidated from the last checkpoint's shards, one tensor at a time
        checkpoint = export_mean([last], run_dir.export)
        final = load_export(checkpoint)[0]
        metrics["checkpoint"] = str(checkpoint)
        final, metrics["selected"] = selection.final_model(cfg, run_dir, final, progress.best)
        if cfg.eval.at_end:
            final.to(ctx.device)  # decoding on the rank's GPU where it has one
            sets = config_sets(cfg.data, data.splits)
            result = evaluate(final, data.tokenizer, sets, cfg.eval, lang=cfg.data.tgt_lang)
            metrics.update(result.figures())
            for name in ("bleu", "chrf", "exact_match", "probe_accuracy"):
                if metrics[name] is not None:
                    write_scalars(writer, {f"test/{name}": metrics[name]}, progress.step)
            EvalFiles(run_dir.path).write(result, metrics)  # eval.json and the hypotheses scored
            print(format_table(metrics))
        assert writer is not None
        writer.close()
        print(f"checkpoint: {checkpoint}")
    return metrics


def _sample_log(cfg: Config, ctx: ParallelContext) -> Any:
    """Per data-parallel rank, the ids of every batch trained on (appended; a resumed run continues)."""
    if not cfg.train.log_samples or ctx.tp_rank != 0:
        return None
    path = RunDir(cfg.run_dir()).samples(ctx.dp_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a")  # kept open for the whole run
