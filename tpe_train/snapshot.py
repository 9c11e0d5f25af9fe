"""Saving and resuming a run: what the loop calls, on every rank.

``save`` writes one checkpoint (``ckpt_store`` describes the directory and the protocol), ``restore``
puts a checkpoint back into the current engine and data stream, whatever layout wrote it. The RNG
states of every rank are restored when the layout is the same; on another layout each rank's stream
is derived from (seed, step, data-parallel rank) instead, and the run says so.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tpe_train.ckpt_store import (
    MODEL,
    OPTIMIZER,
    TRAINER,
    CheckpointError,
    check_compatible,
    prune,
    publish,
    rank_file,
    step_dir,
    verify,
    write_json,
    write_manifest,
)
from tpe_train.config import Config
from tpe_train.data.corpus import TrainBatches
from tpe_train.data.tokenizer import vocab_hash
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.parallel.portable import adam_steps, gather_state, load_state
from tpe_train.selection import Best, from_trainer


@dataclass
class Progress:
    """The trainer's own counters."""

    step: int = 0
    tokens: float = 0.0  # target tokens trained on, over all ranks
    best: Best = field(default_factory=Best)  # model selection and early stopping (``selection``)


def layout_of(ctx: ParallelContext, zero_stage: int | None) -> dict[str, Any]:
    return {
        "world_size": ctx.world_size,
        "tp_size": ctx.tp_size,
        "dp_size": ctx.dp_size,
        "zero_stage": zero_stage,
    }


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch generator states as plain JSON data (no pickles)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save(
    root: Path,
    progress: Progress,
    engine: Engine,
    cfg: Config,
    tok: Tokenizer,
    batches: TrainBatches,
    zero_stage: int | None,
) -> Path:
    """Write checkpoint ``step-<progress.step>`` under ``root`` (collective: every rank calls it)."""
    ctx, step = engine.ctx, progress.step
    tmp, final = root / f".tmp-step-{step:08d}", step_dir(root, step)
    error: str | None = None

    def attempt(fn: Any) -> None:
        nonlocal error
        if error is None:
            try:
                fn()
            except (OSError, SafetensorError) as err:  # a full disk, a lost mount, no permission
                error = f"{type(err).__name__}: {err}"

    def fresh_tmp() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    if ctx.is_main:
        attempt(fresh_tmp)
    _agree(ctx, error, tmp)
    if engine.uses_deepspeed:  # every rank's own shards, for DeepSpeed's tools
        attempt(lambda: engine.accelerator.save_state(str(tmp / "deepspeed")))
    weights, moments = gather_state(engine)  # collective
    rank_state = {"rng": rng_state(), "data": batches.state_dict() if batches.per_rank else None}
    attempt(lambda: write_json(tmp / rank_file(ctx.rank), rank_state))
    if ctx.is_main:
        trainer = {
            **asdict(progress),
            "data": None if batches.per_rank else batches.state_dict(),
            "scheduler": _jsonable(engine.lr_scheduler.state_dict()),
            "adam_steps": adam_steps(engine),
            "loss_scaler": _loss_scaler(engine),
            "layout": layout_of(ctx, zero_stage),
            "vocab_hash": vocab_hash(tok),
        }
        attempt(lambda: save_file(weights, str(tmp / MODEL), metadata={"step": str(step)}))
        attempt(lambda: save_file(moments, str(tmp / OPTIMIZER), metadata={"step": str(step)}))
        attempt(lambda: write_json(tmp / TRAINER, trainer))
        attempt(lambda: (tmp / "config.yaml").write_text(cfg.to_yaml()))
        attempt(lambda: tok.save(str(tmp / "tokenizer.json")))
    _agree(ctx, error, tmp)  # every rank has written its part
    if os.environ.get("TPE_FAULT_SAVE_DELAY"):  # fault injection for the crash tests: a slow save
        time.sleep(float(os.environ["TPE_FAULT_SAVE_DELAY"]))
    if ctx.is_main:
        attempt(lambda: write_manifest(tmp, step, layout_of(ctx, zero_stage)))
        attempt(lambda: publish(tmp, final))
        if error is None:
            best = (progress.best.step,) if cfg.eval.select == "best" else ()
            prune(root, cfg.train.keep_last, cfg.train.keep_every, best)
    _agree(ctx, error, tmp)
    return final


def _agree(ctx: ParallelContext, error: str | None, tmp: Path) -> None:
    """Stop every rank if any rank failed to write, leaving earlier checkpoints as they were."""
    failed = ctx.any(error is not None)
    if not failed:
        return
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(
        f"saving the checkpoint {tmp.name.removeprefix('.tmp-')} under {tmp.parent} failed"
        f"{' (' + error + ')' if error else ' on another rank'}; the earlier checkpoints are intact. Free "
        "space (or point train.run_dir elsewhere) and run the same command again: it resumes from the last "
        "complete checkpoint"
    )


def restore(path: Path, engine: Engine, cfg: Config, tok: Tokenizer, batches: TrainBatches) -> Progress:
    """Load checkpoint ``path`` into this rank; returns the trainer's counters."""
    ctx = engine.ctx
    check_compatible(path, cfg, vocab_hash(tok))
    verify(path, [TRAINER, MODEL, OPTIMIZER])
    trainer = json.loads((path / TRAINER).read_text())
    saved = trainer["layout"]
    same_layout = saved == layout_of(ctx, saved.get("zero_stage")) and saved["zero_stage"] == _stage(engine)
    load_state(engine, load_file(str(path / MODEL)), load_file(str(path / OPTIMIZER)), trainer["adam_steps"])
    scheduler = engine.lr_scheduler
    scheduler.load_state_dict({**scheduler.state_dict(), **trainer["scheduler"]})
    engine.set_lr(scheduler.get_last_lr())
    _set_loss_scaler(engine, trainer.get("loss_scaler"))
    progress = Progress(
        step=int(trainer["step"]), tokens=float(trainer["tokens"]), best=from_trainer(trainer)
    )
    mine = path / rank_file(ctx.rank)
    if batches.per_rank:
        if saved["dp_size"] != ctx.dp_size:
            raise CheckpointError(
                f"{path} holds the positions of {saved['dp_size']} streamed data-parallel ranks, this run "
                f"has {ctx.dp_size}; a streamed corpus (data.streaming) resumes on as many ranks only"
            )
        verify(path, [mine.name])
        batches.load_state_dict(json.loads(mine.read_text())["data"])
    else:
        batches.load_state_dict(trainer["data"])
    if same_layout:
        verify(path, [mine.name])
        set_rng_state(json.loads(mine.read_text())["rng"])
    else:  # another layout: fresh, reproducible streams per data-parallel rank
        torch.manual_seed(cfg.train.seed + 1_000_003 * progress.step + 7919 * ctx.dp_rank)
    return progress


def _stage(engine: Engine) -> int | None:
    return engine.model.zero_optimization_stage() if engine.uses_deepspeed else None


def _jsonable(state: dict[str, Any]) -> dict[str, Any]:
    """A torch scheduler's state without its lambdas (our schedule is rebuilt from the config)."""
    return {k: v for k, v in state.items() if k != "lr_lambdas"}


def _loss_scaler(engine: Engine) -> dict[str, Any] | None:
    scaler = getattr(getattr(engine.model, "optimizer", None), "loss_scaler", None)
    if scaler is None:
        return None
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {k: float(getattr(scaler, k)) for k in keys if hasattr(scaler, k)}


def _set_loss_scaler(engine: Engine, state: dict[str, Any] | None) -> None:
    scaler = getattr(getattr(engine.model, "optimizer", None), "loss_scaler", None)
    if scaler is None or not state:
        return
    for key, value in state.items():
        old = getattr(scaler, key)
        setattr(scaler, key, type(old)(value) if not torch.is_tensor(old) else torch.tensor(value))
