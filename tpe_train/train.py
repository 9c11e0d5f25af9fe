"""The training loop, top to bottom: ``tpe-train [--preset P] [key=value ...]``.

config -> data (corpus, joint BPE, token batches) -> model -> Adam + inverse-sqrt schedule ->
loop (forward, label-smoothed CE, backward, clip, step, log, validate) -> checkpoint -> evaluate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
from typing import Any

import numpy as np
import torch
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


def batch_loss(model: Transformer, batch: Batch, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(summed smoothed loss, summed nll, target tokens) of one batch."""
    with autocast(cfg.train.bf16):
        logits = model(batch.src, batch.tgt_in)
    loss, nll, ntok = label_smoothed_loss(logits, batch.tgt_out, PAD_ID, cfg.train.label_smoothing)
    return loss, nll, int(ntok)


def accumulate_gradients(model: Transformer, micro: list[Batch], cfg: Config) -> tuple[float, float, int]:
    """Backward over ``train.accumulate`` batches, normalised by all their target tokens, so that
    accumulating k batches gives the gradient of one k-times larger batch. Returns the summed
    loss, summed nll and token count."""
    ntok = sum(b.target_tokens for b in micro)
    loss_sum, nll_sum = 0.0, 0.0
    for batch in micro:
        loss, nll, _ = batch_loss(model, batch, cfg)
        (loss / ntok).backward()
        loss_sum, nll_sum = loss_sum + float(loss.detach()), nll_sum + float(nll)
    return loss_sum, nll_sum, ntok


@torch.no_grad()
def validate(model: Transformer, data: Any, cfg: Config) -> dict[str, float]:
    """Validation loss (nll per token) and greedy BLEU on the first ``valid_bleu_size`` pairs."""
    model.eval()
    src_len, tgt_len = length_arrays(data.valid)
    nll_sum, ntok_sum = 0.0, 0
    for idx in BatchIterator(src_len, tgt_len, cfg.data.max_tokens, seed=0).batches:
        _, nll, ntok = batch_loss(model, collate(data.valid, idx), cfg)
        nll_sum, ntok_sum = nll_sum + float(nll), ntok_sum + ntok
    out = {
        "valid/nll": nll_sum / ntok_sum,
        "valid/ppl": math.exp(min(nll_sum / ntok_sum, 50.0)),
    }
    n = cfg.train.valid_bleu_size
    if n:
        pairs = pairs_of(data.splits.valid, n)
        hyps = translate(model, data.tokenizer, [s for s, _ in pairs], cfg.eval, beam=1)
        refs = [t for _, t in pairs]
        out["valid/bleu"] = bleu_score([h or "" for h in hyps], refs, data.splits.pretokenized)[0]
    model.train()
    return out


def run(cfg: Config) -> dict[str, Any]:
    """Train (and evaluate) one run; returns the final figures."""
    seed_everything(cfg.train.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = cfg.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())  # resolved config, before step 1

    data = prepare(cfg.data, run_tokenizer=run_dir / "tokenizer.json")
    model = build_model(cfg, data.tokenizer)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.train.lr,
        betas=cfg.train.adam_betas,
        eps=cfg.train.adam_eps,
        weight_decay=cfg.train.weight_decay,
        fused=True,  # one kernel over all parameters instead of a dozen ops per tensor
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(cfg.train.warmup_steps))
    batches = batch_stream(data, cfg.data, cfg.train.seed)
    writer = SummaryWriter(str(run_dir / "tb"))
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

    bar = tqdm(total=cfg.train.max_steps, disable=not cfg.train.progress, dynamic_ncols=True)
    window_tokens, window_start = 0, time.perf_counter()
    for step in range(1, cfg.train.max_steps + 1):
        micro = [next(batches) for _ in range(cfg.train.accumulate)]
        optimizer.zero_grad(set_to_none=True)
        loss_sum, nll_sum, ntok = accumulate_gradients(model, micro, cfg)
        max_norm = cfg.train.clip_norm or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        optimizer.step()
        scheduler.step()
        window_tokens += ntok

        if step % cfg.train.log_every == 0 or step == cfg.train.max_steps:
            elapsed = time.perf_counter() - window_start
            scalars = {
                "train/loss": loss_sum / ntok,
                "train/nll": nll_sum / ntok,
                "train/lr": scheduler.get_last_lr()[0],
                "train/grad_norm": grad_norm,
                "train/tokens_per_s": window_tokens / max(elapsed, 1e-9),
            }
            for name, value in scalars.items():
                writer.add_scalar(name, value, step)
            bar.set_postfix(loss=f"{scalars['train/loss']:.3f}", lr=f"{scalars['train/lr']:.2e}")
            window_tokens, window_start = 0, time.perf_counter()
        if step % cfg.train.valid_every == 0 or step == cfg.train.max_steps:
            for name, value in validate(model, data, cfg).items():
                writer.add_scalar(name, value, step)
        bar.update(1)
    bar.close()

    checkpoint = save_export(run_dir / "checkpoint", model, cfg, data.tokenizer, cfg.train.max_steps)
    metrics: dict[str, Any] = {"checkpoint": str(checkpoint)}
    if cfg.eval.at_end:
        metrics.update(evaluate(model, data.tokenizer, data.splits, cfg.eval))
        for name in ("bleu", "chrf", "exact_match", "probe_accuracy"):
            if metrics[name] is not None:
                writer.add_scalar(f"test/{name}", metrics[name], cfg.train.max_steps)
        (run_dir / "eval.json").write_text(json.dumps(metrics, indent=2))
        print(format_table(metrics))
    writer.close()
    print(f"checkpoint: {checkpoint}")
    return metrics


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
    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as err:
        print(f"tpe-train: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    try:
        run(cfg)
    except CorpusError as err:  # bad data is reported before any training step
        print(f"tpe-train: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
