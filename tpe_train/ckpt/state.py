"""Saving and resuming a run: what the loop calls, on every rank.

``Checkpointer.save`` writes one checkpoint, ``Checkpointer.restore`` puts one back into the engine and
the data stream, whatever layout wrote it. Each rank writes only what it holds (``ckpt.holdings``) as
regions of the single-device tensors (``ckpt.shards``) and reads back only the regions its own layout
needs; ``ckpt.store`` describes the directory and the publishing protocol. The RNG states of every
rank are restored when the layout is the same; on another layout each rank's stream is derived from
(seed, step, data-parallel rank) instead.

With ``train.async_save`` the rank's pieces are copied to host memory (the only pause of training)
and a background thread writes them; the thread agrees with the other ranks' threads over a
process group of its own (gloo), so that it never interleaves with the training's collectives, and
rank 0's thread publishes the checkpoint once every rank has written. The next save, the end of
training and a preemption wait for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from tpe_train.ckpt.holdings import MOMENTS, adam_steps, after_load, before_load, holdings
from tpe_train.ckpt.rundir import CONFIG, TOKENIZER
from tpe_train.ckpt.shards import (
    INDEX,
    Piece,
    Plan,
    ShardError,
    check_files,
    dump_index,
    merge_index,
    read_index,
    save_pieces,
)
from tpe_train.ckpt.store import (
    TRAINER,
    CheckpointError,
    check_compatible,
    prune,
    publish,
    rank_file,
    step_dir,
    verify,
    write_manifest,
)
from tpe_train.config import Config
from tpe_train.data.tokenizer import vocab_hash
from tpe_train.data.train_batches import TrainBatches
from tpe_train.parallel.context import ParallelContext
from tpe_train.parallel.engine import Engine
from tpe_train.run import members, readers

log = logging.getLogger(__name__)


@dataclass
class Best:
    """The best validation so far and the validations since it: trainer state, so that a resumed run
    selects and stops early exactly where an uninterrupted one does (the policy: ``train.selection``)."""

    step: int = 0  # step of the best validation (0: none yet)
    value: float | None = None  # its eval.select_by figure
    stale: int = 0  # validations since it without improvement (early stopping counts these)


def best_of(trainer: dict[str, Any]) -> Best:
    """The state saved in a checkpoint's ``trainer.json`` (none in checkpoints older than this)."""
    return Best(**trainer["best"]) if trainer.get("best") else Best()


@dataclass
class Progress:
    """The trainer's own counters."""

    step: int = 0
    tokens: float = 0.0  # target tokens trained on, over all ranks
    best: Best = field(default_factory=Best)  # model selection and early stopping (``train.selection``)


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


def seed_rank_streams(seed: int, dp_rank: int, step: int = 0) -> None:
    """torch's generator for data-parallel rank ``dp_rank`` from ``step`` on: one reproducible stream per
    rank (dropout), at the start of a run (step 0) and on resuming in another layout."""
    torch.manual_seed(seed + 1_000_003 * step + 7919 * dp_rank)


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def is_moment(name: str) -> bool:
    """Whether a checkpoint tensor is one of Adam's moments (``exp_avg/<parameter>``)."""
    return name.split("/", 1)[0] in MOMENTS


def write_text(path: Path, text: str) -> dict[str, Any]:
    """Write a small file durably; its size and hash for the manifest."""
    data = text.encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@dataclass
class _Job:
    """One checkpoint's writing on this rank: its pieces and its small files."""

    step: int
    tmp: Path
    final: Path
    pieces: list[Piece]
    texts: dict[str, str]
    keep: tuple[int, ...]  # steps pruning must keep (the best validation's under eval.select=best)


class Checkpointer:
    """Saves the run's checkpoints under ``root`` and restores one: one per rank, every call collective."""

    def __init__(
        self,
        root: Path,
        cfg: Config,
        engine: Engine,
        tok: Tokenizer,
        batches: TrainBatches,
        zero_stage: int | None,
    ) -> None:
        self.root, self.cfg, self.engine, self.tok, self.batches = root, cfg, engine, tok, batches
        self.ctx, self.layout = engine.ctx, layout_of(engine.ctx, zero_stage)
        # The writer's agreement runs on its own group: a background write never interleaves with the
        # training's collectives (and gloo serves it beside nccl on GPUs).
        self.group = dist.new_group(backend="gloo") if self.ctx.distributed else None
        self._thread: threading.Thread | None = None
        self._failure: str | None = None

    def save(self, progress: Progress, wait: bool = False) -> Path:
        """Write checkpoint ``step-<progress.step>`` (in the background with ``train.async_save``, unless
        ``wait``); returns its path. Raises ``CheckpointError`` if this or the previous save failed."""
        self.wait()
        step = progress.step
        tmp, final = self.root / f".tmp-step-{step:08d}", step_dir(self.root, step)

        def fresh_tmp() -> None:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

        self._agree(_attempt(fresh_tmp) if self.ctx.is_main else None, tmp)
        if self.cfg.train.deepspeed_shards and self.engine.uses_deepspeed:  # for DeepSpeed's tools
            self._agree(_attempt(lambda: self.engine.accelerator.save_state(str(tmp / "deepspeed"))), tmp)
        pieces = [h.piece() for h in holdings(self.engine, moments=adam_steps(self.engine) > 0)]
        keep = (progress.best.step,) if self.cfg.eval.select == "best" else ()
        job = _Job(step, tmp, final, pieces, self._texts(progress), keep)
        if not self.cfg.train.async_save:
            self._write(job)
            self.wait()
            return final
        job.pieces = [Piece(p.region, _to_host(p.data)) for p in pieces]  # training may now go on
        self._thread = threading.Thread(target=self._write, args=(job,), name=f"save-{step}", daemon=True)
        self._thread.start()
        if wait:
            self.wait()
        return final

    def wait(self) -> None:
        """Wait for a background save; raise ``CheckpointError`` (on every rank) if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise CheckpointError(failure)

    def _texts(self, progress: Progress) -> dict[str, str]:
        """This rank's small files, taken now (RNG and data position of this very step)."""
        batches, engine = self.batches, self.engine
        rank_state = {"rng": rng_state(), "data": batches.state_dict() if batches.per_rank else None}
        texts = {rank_file(self.ctx.rank): json.dumps(rank_state, indent=1)}
        if self.ctx.is_main:
            trainer = {
                **asdict(progress),
                "data": None if batches.per_rank else batches.state_dict(),
                "scheduler": _jsonable(engine.lr_scheduler.state_dict()),
                "adam_steps": adam_steps(engine),
                "loss_scaler": engine.loss_scale_state(),
                "layout": self.layout,
                "vocab_hash": vocab_hash(self.tok),
            }
            texts[TRAINER] = json.dumps(trainer, indent=1)
            texts[CONFIG] = self.cfg.to_yaml()
            texts[TOKENIZER] = self.tok.to_str(pretty=True)
        return texts

    def _write(self, job: _Job) -> None:
        """Every rank writes its files; rank 0 writes the index and the manifest and publishes. Two
        collectives on the writer's group, whatever the model's size."""
        ctx, error = self.ctx, None
        index: dict[str, Any] = {}
        files: dict[str, Any] = {}
        try:
            for stem, moments in (("model", False), ("optimizer", True)):
                mine = [p for p in job.pieces if is_moment(p.region.name) == moments]
                part, written = save_pieces(job.tmp, f"{stem}-{ctx.rank:05d}", mine)
                index.update(part)
                files.update(written)
            for name, text in job.texts.items():
                files[name] = write_text(job.tmp / name, text)
            _fault_delay(job.step)
        except Exception as err:  # a full disk, a lost mount; whatever it is, the other ranks must hear of it
            error = f"{type(err).__name__}: {err}"
        reports = self._gather((error, index, files))
        if ctx.is_main:
            error = next((r[0] for r in reports if r[0]), None)
            if error is None:
                try:
                    listed = {name: info for r in reports for name, info in r[2].items()}
                    merged = merge_index(r[1] for r in reports)
                    listed[INDEX] = write_text(job.tmp / INDEX, dump_index(merged))
                    write_manifest(job.tmp, job.step, self.layout, listed)
                    publish(job.tmp, job.final)
                    with readers.alone(self.root) as free:
                        if free:
                            prune(self.root, self.cfg.train.keep_last, self.cfg.train.keep_every, job.keep)
                        else:
                            log.info("pruning waits for the next save: a reader holds %s", self.root)
                except Exception as err:  # as above: the other ranks wait for the verdict
                    error = f"{type(err).__name__}: {err}"
            if error is not None:
                shutil.rmtree(job.tmp, ignore_errors=True)
        error = self._broadcast(error)
        if error is not None:
            self._failure = _failed(job.tmp, error)

    def _gather(self, report: Any) -> list[Any]:
        if self.group is None:
            return [report]
        out: list[Any] | None = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(report, out, dst=0, group=self.group)
        return out or []

    def _broadcast(self, error: str | None) -> str | None:
        if self.group is None:
            return error
        box = [error]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _agree(self, error: str | None, tmp: Path) -> None:
        """Stop every rank if any rank failed, leaving earlier checkpoints as they were."""
        errors = [e for e in self.ctx.gather(error) if e]
        if errors:
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(_failed(tmp, errors[0]))

    def restore(self, path: Path) -> Progress:
        """Load checkpoint ``path`` into this rank: only the regions this rank's layout holds. Every file
        read is checked against the manifest first; a failure on any rank stops every rank."""
        ctx, engine, cfg = self.ctx, self.engine, self.cfg
        check_compatible(path, cfg, vocab_hash(self.tok))
        verify(path, [TRAINER])
        trainer = read_trainer(path)
        index = read_index(path, files=False)  # each rank checks the files it reads (below)
        saved, steps = trainer["layout"], int(trainer["adam_steps"])
        same_layout = saved == self.layout
        mine = path / rank_file(ctx.rank)
        per_rank = self.batches.per_rank
        if per_rank and saved["dp_size"] != ctx.dp_size:
            raise CheckpointError(
                f"{path} holds the positions of {saved['dp_size']} streamed data-parallel ranks, this run "
                f"has {ctx.dp_size}; a streamed corpus (data.streaming) resumes on as many ranks only"
            )
        stored = set(index["tensors"])
        before_load(engine, steps, stored)
        wanted = holdings(engine, moments=steps > 0, load=True)
        for h in wanted:
            if is_moment(h.region.name) and h.region.name not in stored:
                h.data.zero_()  # a parameter that never got a gradient: no moments saved (ckpt.holdings)
        error = None
        try:
            plan = Plan(path, index, [(h.region, h.data) for h in wanted if h.region.name in stored])
            verify(path, [*plan.files, *([mine.name] if same_layout or per_rank else [])])
            check_files(path, index, plan.files)
        except (ShardError, CheckpointError) as err:
            error = str(err)
        errors = [e for e in ctx.gather(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        plan.run()
        after_load(engine, wanted, steps)
        scheduler = engine.lr_scheduler
        scheduler.load_state_dict({**scheduler.state_dict(), **trainer["scheduler"]})
        engine.set_lr(scheduler.get_last_lr())
        engine.load_loss_scale_state(trainer.get("loss_scaler"))
        progress = Progress(int(trainer["step"]), float(trainer["tokens"]), best=best_of(trainer))
        rank_state = (
            members.read_json(path, mine.name, {"rng": dict}, error=CheckpointError)
            if same_layout or per_rank
            else {}
        )
        self.batches.load_state_dict(rank_state["data"] if per_rank else trainer["data"])
        if same_layout:
            set_rng_state(rank_state["rng"])
        else:  # another layout: fresh, reproducible streams per data-parallel rank
            seed_rank_streams(cfg.train.seed, ctx.dp_rank, progress.step)
        return progress


def read_trainer(path: Path) -> dict[str, Any]:
    """A checkpoint's ``trainer.json``, with the types its readers rely on."""
    fields: dict[str, Any] = {"step": int, "tokens": (int, float), "adam_steps": int, "layout": dict}
    trainer = members.read_json(path, TRAINER, {**fields, "scheduler": dict}, error=CheckpointError)
    where = f"{path / TRAINER}: layout.dp_size"
    members.check_type(trainer["layout"].get("dp_size"), int, where, CheckpointError)
    return trainer


def _attempt(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except OSError as err:  # a full disk, a lost mount, no permission
        return f"{type(err).__name__}: {err}"
    return None


def _fault_delay(step: int) -> None:
    """Fault injection for the crash tests: ``TPE_FAULT_SAVE_DELAY=S`` holds every save S seconds
    after its files are written, ``S@N`` only the save of step N."""
    seconds, _, at = os.environ.get("TPE_FAULT_SAVE_DELAY", "").partition("@")
    if seconds and (not at or int(at) == step):
        time.sleep(float(seconds))


def _failed(tmp: Path, error: str) -> str:
    return (
        f"saving the checkpoint {tmp.name.removeprefix('.tmp-')} under {tmp.parent} failed ({error}); the "
        "earlier checkpoints are intact. Free space (or point train.run_dir elsewhere) and run the same "
        "command again: it resumes from the last complete checkpoint"
    )


def _to_host(data: torch.Tensor) -> torch.Tensor:
    """A copy in host memory (pinned when it comes from a GPU, so that the copy is a fast DMA)."""
    out = torch.empty(data.shape, dtype=data.dtype, pin_memory=data.is_cuda)
    out.copy_(data)
    return out


def _jsonable(state: dict[str, Any]) -> dict[str, Any]:
    """A torch scheduler's state without its lambdas (our schedule is rebuilt from the config)."""
    return {k: v for k, v in state.items() if k != "lr_lambdas"}
