"""The batch of this run, resolved before step 1: micro-batch (``data.max_tokens``, or ``auto``: probed
on the GPU), accumulation (from ``train.batch_tokens`` and the data-parallel size), recorded in
``<run_dir>/batch.json``. The arithmetic is ``tpe_train.parallel.batch``; this module measures.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from tpe_train.ckpt.rundir import RunDir
from tpe_train.config import Config, ConfigError
from tpe_train.data.batching import collate, length_arrays, model_args
from tpe_train.data.prepare import Prepared
from tpe_train.model.build import build_model
from tpe_train.parallel.batch import BatchPlan, estimated_micro_tokens, largest_fitting, micro_tokens, resolve
from tpe_train.parallel.checkpointing import apply_activation_checkpointing
from tpe_train.parallel.context import ParallelContext
from tpe_train.run import atomic
from tpe_train.train.build import build_optimizer
from tpe_train.train.precision import autocast_dtype
from tpe_train.train.step import batch_terms


def recorded_max_tokens(run_dir: RunDir) -> int | None:
    """The micro-batch an earlier start of this run probed (``data.max_tokens=auto``), if any."""
    if not run_dir.batch.is_file():
        return None
    value = json.loads(run_dir.batch.read_text()).get("probed_max_tokens")
    return int(value) if value else None


def probe_max_tokens(cfg: Config, data: Prepared, ctx: ParallelContext) -> int:
    """``data.max_tokens=auto``: the largest multiple of 64 padded tokens whose forward, backward and
    AdamW step, on a batch of the longest training pairs, peaks below ``train.memory_fraction`` of the
    GPU (``torch.cuda.max_memory_allocated``). A single-device fp32 model with bf16 autocast, activation
    checkpointing and the loss's chunks as configured: ZeRO and tensor parallelism only lower the real
    peak. The smallest over ranks."""
    if ctx.device.type != "cuda":
        raise ConfigError(
            f"data.max_tokens=auto probes a GPU's memory, but this process runs on {ctx.device.type}; set "
            "data.max_tokens to a number of padded tokens (e.g. 4096) on a CPU"
        )
    model = build_model(model_args(cfg.model, data.tokenizer.get_vocab_size()), ctx.device).train()
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.checkpoint_every)
    optimizer = build_optimizer(model, cfg.train)  # the trainer's: its state is part of the peak
    budget = cfg.train.memory_fraction * torch.cuda.get_device_properties(ctx.device).total_memory
    src_len, tgt_len = length_arrays(data.train)
    order = np.argsort(-(src_len + tgt_len), kind="stable")  # the longest pairs first
    width = int(src_len[order[0]] + tgt_len[order[0]])
    cast = autocast_dtype(cfg, deepspeed=False)

    def fits(max_tokens: int) -> bool:
        rows = order[: max(1, min(len(order), max_tokens // width))]
        batch = collate(data.train, rows).to(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        try:
            batch_terms(model, batch, cfg, cast)[0].backward()  # the step's loss: chunked as the run's
            optimizer.step()
            torch.cuda.synchronize(ctx.device)
            peak = torch.cuda.max_memory_allocated(ctx.device)
        except torch.OutOfMemoryError:
            peak = None
        optimizer.zero_grad(set_to_none=True)
        return peak is not None and peak <= budget

    found = largest_fitting(fits, limit=max(64, width * len(order)))
    return min(ctx.gather(found))  # the probe's model and optimizer are freed on return


def plan(cfg: Config, data: Prepared, ctx: ParallelContext, start_recorded: bool) -> tuple[Config, BatchPlan]:
    """The batch of this launch and the config the engine and the step read: ``data.max_tokens`` a
    number (``auto``: recorded by an earlier start when ``start_recorded``, else probed), and
    ``train.accumulate`` derived from ``train.batch_tokens`` (the config the run directory keeps
    still says what was asked)."""
    max_tokens = cfg.data.max_tokens
    if max_tokens == 0:
        run_dir = RunDir(cfg.run_dir())
        recorded = recorded_max_tokens(run_dir) if start_recorded else None
        max_tokens = recorded or probe_max_tokens(cfg, data, ctx)
    if cfg.data.streaming:
        micro, source = estimated_micro_tokens(max_tokens), "estimated: a streamed corpus is not counted"
    else:
        src_len, tgt_len = length_arrays(data.train)
        micro, source = micro_tokens(src_len, tgt_len, max_tokens, cfg.train.seed), "the mean over an epoch"
    batch = resolve(cfg.train.batch_tokens, max_tokens, micro, ctx.dp_size, cfg.train.accumulate, source)
    resolved = cfg.model_copy(
        update={
            "data": cfg.data.model_copy(update={"max_tokens": max_tokens}),
            "train": cfg.train.model_copy(update={"accumulate": batch.accumulate}),
        }
    )
    return resolved, batch


def record(run_dir: RunDir, batch: BatchPlan, auto: bool) -> None:
    """``<run_dir>/batch.json``: the resolution of this start, and with ``auto`` (data.max_tokens=auto)
    the probed micro-batch that a resume reuses."""
    probed = batch.max_tokens if auto else None
    atomic.write_json(run_dir.batch, {**batch.as_dict(), "probed_max_tokens": probed}, indent=2)


def auto_note(asked: Config, batch: BatchPlan) -> str | None:
    """The start-up line of ``data.max_tokens=auto`` (None when a number was given)."""
    if asked.data.max_tokens:
        return None
    return (
        f"data.max_tokens=auto: {batch.max_tokens:,} padded tokens fit train.memory_fraction="
        f"{asked.train.memory_fraction} of the GPU (in batch.json; a resume reuses it)"
    )
