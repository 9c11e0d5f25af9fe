"""The trainer's model, optimizer, schedule and engine, built from a config: one copy for the trainer,
the benchmarks and the test harnesses, so that what they time or compare is what a run trains."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tpe_train.config import Config, TrainConfig
from tpe_train.data.batching import model_args
from tpe_train.model.build import build_model
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.checkpointing import apply_activation_checkpointing
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.plan import apply_tensor_parallel
from tpe_train.train.schedule import inverse_sqrt


def build_train_model(cfg: Config, vocab_size: int, ctx: ParallelContext) -> Transformer:
    """The model of a run (the same initial weights on every rank: torch's generator as seeded), its
    position tables sharded for tensor parallelism, on the rank's device, in training mode, with the
    activation checkpointing and compilation the config asks for."""
    model = build_model(model_args(cfg.model, vocab_size))
    apply_tensor_parallel(model, ctx)
    model.to(ctx.device).train()
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.checkpoint_every)
    if cfg.train.compile:
        model.compile_layers()
    return model


def build_optimizer(model: nn.Module, train: TrainConfig, fused: bool = True) -> torch.optim.AdamW:
    """AdamW with the ``train`` section's lr, betas, eps and weight decay; ``fused``: one kernel for all
    parameters, or for DeepSpeed's flat partitions (benchmarks/bench_engine.py)."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=train.lr,
        betas=train.adam_betas,
        eps=train.adam_eps,
        weight_decay=train.weight_decay,
        fused=fused,
    )


def build_schedule(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The inverse-square-root schedule with ``train.warmup_steps`` of linear warmup."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(train.warmup_steps))


def build_engine(
    model: nn.Module,
    cfg: Config,
    ctx: ParallelContext,
    deepspeed: dict[str, Any] | None,
    optimizer: torch.optim.Optimizer | None = None,
    schedule: Any = None,
) -> Engine:
    """The engine of ``model`` (one process, DDP or DeepSpeed with the ``deepspeed`` config): the
    trainer's optimizer and schedule unless given, the config's accumulation, clipping and loss scaling."""
    optimizer = optimizer if optimizer is not None else build_optimizer(model, cfg.train)
    schedule = schedule if schedule is not None else build_schedule(optimizer, cfg.train)
    return Engine(model, optimizer, schedule, ctx, **engine_options(cfg, deepspeed))


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
        "find_unused": cfg.parallel.find_unused,
    }
