"""The trainer's model, optimizer, schedule and engine, built from a config."""

from __future__ import annotations

from typing import Any

import torch

from tpe_train.ckpt.export import build_model
from tpe_train.config import Config
from tpe_train.data.corpus import Prepared
from tpe_train.parallel.checkpointing import apply_activation_checkpointing
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import Layout, deepspeed_config
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.plan import apply_tensor_parallel
from tpe_train.train.step import inverse_sqrt


def build_engine(cfg: Config, data: Prepared, ctx: ParallelContext, layout: Layout) -> Engine:
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
