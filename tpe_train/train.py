"""The training loop, top to bottom: ``tpe-train [--preset P] [key=value ...]``.

config -> data (corpus, joint BPE, token batches) -> model -> Adam + inverse-sqrt schedule ->
loop (forward, label-smoothed CE, backward, clip, step, log, validate) -> checkpoint -> evaluate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from tpe_train.checkpoint import build_model, parameter_count, save_export
from tpe_train.config import Config, ConfigError, load_config
from tpe_train.data.batching import PAD_ID, Batch, BatchIterator, collate, length_arrays
from tpe_train.data.corpus import batch_stream, pairs_of, prepare
from tpe_train.data.sources import CorpusError
from tpe_train.evaluate import bleu_score, evaluate, format_table, translate
from tpe_train.model.loss import label_smoothed_loss
from tpe_train.model.transformer import Transformer
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.deepspeed import deepspeed_config, resolve_layout
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.memory import memory_report
from tpe_train.parallel.plan import shard_positions


def inverse_sqrt(warmup: int) -> Any:
    """Multiplier of the peak lr: linear warmup, then sqrt(warmup / step) (Vaswani et al. 2017)."""

    def factor(step: int) -> float:
        step = max(step, 1)
        if warmup and step < warmup:
            return step / warmup
        return math.sqrt(max(warmup, 1) / step)

    return factor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def batch_loss(model: Any, batch: Batch, cfg: Config, cast: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(summed smoothed loss, summed nll, target tokens) of one batch; ``cast``: bf16 autocast."""
    with autocast(cast):
        logits = model(batch.src, batch.tgt_in)
    loss, nll, ntok = label_smoothed_loss(logits, batch.tgt_out, PAD_ID, cfg.train.label_smoothing)
    return loss, nll, int(ntok)


def train_step(
    engine: Engine, micro: list[Batch], cfg: Config, ctx: ParallelContext, cast: bool
) -> dict[str, float]:
    """One optimizer step over ``train.accumulate`` batches on every data-parallel rank.

    The gradient is that of the summed loss over all target tokens of the step on all ranks, divided
    by their count, so that 2 ranks x k batches give exactly the gradient of one process holding the
    same 2k batches. The token count is summed over ranks first; each backward then multiplies by
    ``accumulate * dp_size``, which undoes the averaging that accelerate/DeepSpeed apply over
    accumulation steps and data-parallel ranks."""
    ntok = ctx.dp_sum([float(sum(b.target_tokens for b in micro))])[0]
    scale = cfg.train.accumulate * ctx.dp_size / ntok
    loss_sum, nll_sum = 0.0, 0.0
    for batch in micro:
        loss, nll, _ = batch_loss(engine.forward, batch, cfg, cast)
        engine.backward(loss * scale)
        loss_sum, nll_sum = loss_sum + float(loss.detach()), nll_sum + float(nll)
    grad_norm = engine.step()
    loss_sum, nll_sum = ctx.dp_sum([loss_sum, nll_sum])
    return {"loss": loss_sum / ntok, "nll": nll_sum / ntok, "grad_norm": grad_norm, "tokens": ntok}


@torch.no_grad()
def validate(engine: Engine, data: Any, cfg: Config, ctx: ParallelContext, cast: bool) -> dict[str, float]:
    """Validation loss (nll per token, batches split over data-parallel ranks) and greedy BLEU on the
    first ``valid_bleu_size`` pairs (every rank decodes them: tensor-parallel ranks must run together)."""
    with engine.gathered() as module:
        model = cast_model(module)
        model.eval()
        src_len, tgt_len = length_arrays(data.valid)
        batches = BatchIterator(src_len, tgt_len, cfg.data.max_tokens, seed=0).batches
        nll_sum, ntok_sum = 0.0, 0.0
        for idx in batches[ctx.dp_rank :: ctx.dp_size]:
            _, nll, ntok = batch_loss(model, collate(data.valid, idx), cfg, cast)
            nll_sum, ntok_sum = nll_sum + float(nll), ntok_sum + ntok
        nll_sum, ntok_sum = ctx.dp_sum([nll_sum, ntok_sum])
        out = {"valid/nll": nll_sum / ntok_sum, "valid/ppl": math.exp(min(nll_sum / ntok_sum, 50.0))}
        n = cfg.train.valid_bleu_size
        if n:
            pairs = pairs_of(data.splits.valid, n)
            hyps = translate(model, data.tokenizer, [s for s, _ in pairs], cfg.eval, beam=1)
            refs = [t for _, t in pairs]
            out["valid/bleu"] = bleu_score([h or "" for h in hyps], refs, data.splits.pretokenized)[0]
        model.train()
    return out


def cast_model(module: torch.nn.Module) -> Transformer:
    assert isinstance(module, Transformer)
    return module


def prepare_data(cfg: Config, ctx: ParallelContext) -> Any:
    """The token store, built by rank 0 while the others wait, then read by all (memory-mapped)."""
    if ctx.distributed and not ctx.is_main:
        dist.barrier()
    data = prepare(cfg.data, run_tokenizer=cfg.run_dir() / "tokenizer.json" if ctx.is_main else None)
    if ctx.distributed and ctx.is_main:
        dist.barrier()
    return data


def run(cfg: Config) -> dict[str, Any]:
    """Train (and evaluate) one run on this process's share of the launch; returns the final figures."""
    layout = resolve_layout(cfg)  # an impossible layout stops here, before any work
    ctx = ParallelContext.from_env(layout.tp_size, deepspeed=layout.deepspeed is not None)
    seed_everything(cfg.train.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = cfg.run_dir()
    ds_config = deepspeed_config(cfg, layout) if layout.deepspeed is not None else None
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())  # resolved config, before step 1
        if ds_config is not None:
            (run_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))

    data = prepare_data(cfg, ctx)
    model = build_model(cfg, data.tokenizer)  # the same initial weights on every rank (same seed)
    shard_positions(model, ctx)
    model.train()
    if ctx.dp_size > 1:
        torch.manual_seed(cfg.train.seed + 7919 * ctx.dp_rank)  # dropout: one stream per data-parallel rank
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.train.lr,
        betas=cfg.train.adam_betas,
        eps=cfg.train.adam_eps,
        weight_decay=cfg.train.weight_decay,
        # one kernel over all parameters instead of a dozen ops per tensor; DeepSpeed's flat fp32
        # partitions take the plain path
        fused=ds_config is None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(cfg.train.warmup_steps))
    engine = Engine(
        model,
        optimizer,
        scheduler,
        ctx,
        accumulate=cfg.train.accumulate,
        clip_norm=cfg.train.clip_norm,
        deepspeed=ds_config,
    )
    cast = cfg.train.bf16 and ds_config is None  # DeepSpeed holds bf16 weights itself
    reports = ctx.gather(memory_report(engine.module, engine.optimizer, ctx.rank, layout))
    batches = batch_stream(data, cfg.data, cfg.train.seed, ctx.dp_rank, ctx.dp_size)
    writer = SummaryWriter(str(run_dir / "tb")) if ctx.is_main else None
    if ctx.is_main:
        for line in data.splits.report:
            print(f"tpe-train: cleaning {line}")
        print(
            f"tpe-train: {cfg.preset} | position {cfg.model.position.kind} | "
            f"{parameter_count(model) / 1e6:.2f}M parameters | "
            f"{'streamed' if cfg.data.streaming else len(data.train)} training pairs "
            f"({data.dropped_too_long} longer than data.max_len dropped) | vocab "
            f"{data.tokenizer.get_vocab_size()} | token store {data.store} "
            f"({'built' if data.built else 'reused'}) | run dir {run_dir}"
        )
        print(f"tpe-train: {ctx.describe()} | ZeRO {layout.zero_stage} | {layout.source}")
        for r in reports:
            print(f"tpe-train: memory {r.line()}")
        (run_dir / "memory.json").write_text(json.dumps([r.as_dict() for r in reports], indent=2))

    bar = tqdm(
        total=cfg.train.max_steps, disable=not (cfg.train.progress and ctx.is_main), dynamic_ncols=True
    )
    window_tokens, window_start = 0.0, time.perf_counter()
    for step in range(1, cfg.train.max_steps + 1):
        stats = train_step(engine, [next(batches) for _ in range(cfg.train.accumulate)], cfg, ctx, cast)
        window_tokens += stats["tokens"]
        if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            elapsed = time.perf_counter() - window_start
            scalars = {
                "train/loss": stats["loss"],
                "train/nll": stats["nll"],
                "train/lr": engine.lr(),
                "train/grad_norm": stats["grad_norm"],
                "train/tokens_per_s": window_tokens / max(elapsed, 1e-9),
            }
            _log(writer, scalars, step)
            bar.set_postfix(loss=f"{scalars['train/loss']:.3f}", lr=f"{scalars['train/lr']:.2e}")
            window_tokens, window_start = 0.0, time.perf_counter()
        if step % cfg.train.valid_every == 0 or step == cfg.train.max_steps:
            _log(writer, validate(engine, data, cfg, ctx, cast), step)
        bar.update(1)
    bar.close()

    weights = engine.consolidated()  # every rank takes part; rank 0 writes and evaluates
    metrics: dict[str, Any] = {}
    if ctx.is_main:
        final = build_model(cfg, data.tokenizer)
        final.load_state_dict(weights)
        checkpoint = save_export(run_dir / "checkpoint", final, cfg, data.tokenizer, cfg.train.max_steps)
        metrics["checkpoint"] = str(checkpoint)
        if cfg.eval.at_end:
            metrics.update(evaluate(final, data.tokenizer, data.splits, cfg.eval))
            for name in ("bleu", "chrf", "exact_match", "probe_accuracy"):
                if metrics[name] is not None:
                    _log(writer, {f"test/{name}": metrics[name]}, cfg.train.max_steps)
            (run_dir / "eval.json").write_text(json.dumps(metrics, indent=2))
            print(format_table(metrics))
        assert writer is not None
        writer.close()
        print(f"checkpoint: {checkpoint}")
    return metrics


def _log(writer: SummaryWriter | None, scalars: dict[str, float], step: int) -> None:
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tpe-train",
        description="Train an encoder-decoder Transformer. Without arguments: the demo preset.",
        epilog="Example: tpe-train --preset demo model.position.kind=rope train.max_steps=200",
    )
    parser.add_argument("--preset", default="demo", help="preset name in configs/presets or a YAML path")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.position.kind=rope")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-train`` and ``python -m tpe_train.train``."""
    args = parse_args(argv)
    main_rank = os.environ.get("RANK", "0") == "0"  # every rank finds the error; one reports it
    try:
        cfg = load_config(args.preset, args.overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        run(cfg)
    except (ConfigError, CorpusError) as err:  # bad config, layout or data: before any training step
        if main_rank:
            print(f"tpe-train: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
