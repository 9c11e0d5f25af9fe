"""Stopped writers: a checkpoint save, an export, a token-store build and a study update are stopped at
each of their writes, syncs and renames in turn (``support.stops``: counted once, then the k-th made to
fail; for the checkpoint also a child process killed with SIGKILL at a few of them). After every stop the
newest complete output from before is byte-equal to what it was (or the new one is complete), and the
next run of the same writer succeeds: a checkpoint is resumed from and training goes on."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset, Features, Sequence, Value
from support.stops import Stopped, Stops, instrumented
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from tpe_train.ckpt.export import write_export
from tpe_train.ckpt.state import Checkpointer
from tpe_train.ckpt.store import CheckpointError, latest_complete, verify_all
from tpe_train.config import load_config
from tpe_train.data.store import write_store
from tpe_train.data.store_open import load_store
from tpe_train.run.atomic import is_temp
from tpe_train.study.grid import MANIFEST, Study
from tpe_train.train import loop, startup

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "data.synthetic.train_size=200", "data.synthetic.test_size=10", "data.synthetic.valid_size=10",
    "data.synthetic.long_size=4", "data.synthetic.probe_size=4", "data.vocab_size=100", "eval.at_end=false",
    "train.valid_bleu_size=0", "train.valid_every=100", "train.progress=false", "train.threads=1",
    "train.diagnostics_every=0", "train.save_every=1", "train.keep_last=2", "model.d_model=16",
    "model.n_heads=2", "model.ffn_dim=32", "model.encoder_layers=1", "model.decoder_layers=1",
]  # fmt: skip


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (temporaries excepted) and the hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not any(is_temp(Path(part)) for part in p.relative_to(folder).parts)
    }


def newest(root: Path) -> Path:
    entry, _ = latest_complete(root)
    assert entry is not None, f"no complete checkpoint in {root}"
    return entry.path


def stop_points(write: Callable[[], Any]) -> int:
    """How many stop points ``write`` passes when nothing stops it."""
    return len(stop_names(write))


def stop_names(write: Callable[[], Any]) -> list[str]:
    """The stop points ``write`` passes when nothing stops it, in order."""
    with instrumented(Stops()) as stops:
        write()
    assert stops.count > 0
    return stops.points


def stopped(write: Callable[[], Any], k: int, expected: type[BaseException] = Stopped) -> None:
    """Run ``write`` failing at its k-th stop point; it must report the failure."""
    with pytest.raises(expected), instrumented(Stops(stop_at=k)):
        write()


def deleting(point: str) -> bool:
    """A stop point inside a deletion that ignores its errors (pruning an old checkpoint)."""
    return point.startswith(("os.unlink", "os.rmdir"))


# -- the checkpoint: a real tiny run, its Checkpointer then saving further steps in this process --


@dataclasses.dataclass
class Trained:
    cfg: list[str]
    run_dir: Path
    pristine: Path  # the run directory as training left it (two checkpoints), for the child processes
    checkpointer: Checkpointer
    progress: startup.Progress
    save_points: list[str]  # the stop points of one save


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    base = tmp_path_factory.mktemp("fault")
    run_dir = base / "run"
    cfg = [*TINY, "train.max_steps=2", f"train.run_dir={run_dir}"]
    runs: list[startup.Run] = []
    real_start = startup.start

    def keep(*args: Any) -> startup.Run:
        runs.append(real_start(*args))
        return runs[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(startup, "start", keep)
        loop.run(load_config("demo", cfg))
    pristine = base / "pristine"
    shutil.copytree(run_dir, pristine)
    run = runs[0]
    progress = dataclasses.replace(run.progress, step=3)
    points = stop_names(lambda: run.checkpointer.save(progress, wait=True))
    yield Trained(cfg, run_dir, pristine, run.checkpointer, run.progress, points)


def saver(trained: Trained, step: int) -> Callable[[], Path]:
    return lambda: trained.checkpointer.save(dataclasses.replace(trained.progress, step=step), wait=True)


@pytest.mark.slow  # a short training, two saves per stop point and a resume
def test_a_checkpoint_save_stopped_at_any_write_keeps_the_newest_and_resumes(trained: Trained) -> None:
    root = trained.run_dir / "checkpoints"
    n = len(trained.save_points)
    for k in range(1, n + 1):
        before = newest(root)
        kept = tree(before)
        step = 10 + k
        save = saver(trained, step)
        if deleting(trained.save_points[k - 1]):  # the save is done; its pruning stops halfway
            with instrumented(Stops(stop_at=k)) as stops:
                save()
            assert stops.count >= k
        else:
            stopped(save, k, CheckpointError)
        now = newest(root)
        assert now == before or now.name == f"step-{step:08d}", f"stop point {k}: {now}"
        verify_all(before)
        assert tree(before) == kept, f"stop point {k} changed {before}"
        if now != before:  # stopped after the rename: the new checkpoint is whole
            verify_all(now)
        assert save() == root / f"step-{step:08d}"
        assert newest(root) == root / f"step-{step:08d}"
        verify_all(newest(root))
        left = sorted(p.name for p in root.iterdir() if p.is_dir())
        assert len(left) == 2 and not any(name.startswith(".") for name in left), f"stop point {k}: {left}"
    log.info("checkpoint save: %d stop points", n)
    last = 10 + n
    loop.run(load_config("demo", [*trained.cfg, "train.resume=auto", f"train.max_steps={last + 1}"]))
    assert newest(root) == root / f"step-{last + 1:08d}"  # resumed from the last one and trained on
    verify_all(newest(root))


CHILD = """
import sys
from support.stops import Stops, instrumented
from tpe_train.ckpt.state import Checkpointer
from tpe_train.train.cli import main

stops = Stops(stop_at=int(sys.argv[1]), kill=True)
real_save = Checkpointer.save

def save(self, *args, **kw):
    with instrumented(stops):
        return real_save(self, *args, **kw)

Checkpointer.save = save
sys.exit(main(["--quiet", *sys.argv[2:]]))
"""


def child(k: int, run_dir: Path, cfg: list[str], max_steps: int) -> subprocess.CompletedProcess:
    over = [*(c for c in cfg if not c.startswith("train.run_dir=")), f"train.run_dir={run_dir}"]
    cmd = [sys.executable, "-c", CHILD, str(k), *over, "train.resume=auto", f"train.max_steps={max_steps}"]
    env_path = f"{ROOT / 'tests'}:{ROOT}"
    env = {**os.environ, "PYTHONPATH": env_path}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.integration  # tpe-train in a child process
def test_a_checkpoint_save_killed_at_any_write_keeps_the_newest_and_resumes(
    trained: Trained, tmp_path: Path
) -> None:
    n = len(trained.save_points)
    kept = tree(trained.pristine / "checkpoints" / "step-00000002")
    points = trained.save_points
    publish = next(i for i, p in enumerate(points, 1) if p.startswith("os.rename") and ".tmp-step-" in p)
    pruning = next(i for i, p in enumerate(points, 1) if deleting(p)) + 1  # the old checkpoint half gone
    spread = sorted({1, n // 3, publish, pruning, n})
    for k in spread:
        run_dir = tmp_path / f"killed-{k}"
        shutil.copytree(trained.pristine, run_dir)
        proc = child(k, run_dir, trained.cfg, max_steps=3)
        assert proc.returncode == -signal.SIGKILL, f"stop point {k}: {proc.returncode} {proc.stderr[-2000:]}"
        root = run_dir / "checkpoints"
        before = root / "step-00000002"
        verify_all(before)
        assert tree(before) == kept, f"kill at stop point {k} changed {before}"
        assert newest(root) in (before, root / "step-00000003")
        if newest(root) != before:
            verify_all(newest(root))
    again = tmp_path / f"killed-{n // 3}"  # killed midway: the next run cleans up and goes on
    proc = child(0, again, trained.cfg, max_steps=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    root = again / "checkpoints"
    assert newest(root) == root / "step-00000004"
    verify_all(newest(root))
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []
    log.info("checkpoint save killed at stop points %s of %d", spread, n)


# -- an export, a token store, a study's manifest: written in this process, stopped at every point --


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))


def test_an_export_stopped_at_any_write_keeps_the_old_one_or_is_the_new_one_whole(tmp_path: Path) -> None:
    cfg, tok = load_config("demo", []), tiny_tokenizer()
    shapes = {"w": (2, 3), "b": (3,)}

    def export(out: Path, step: int) -> Callable[[], Any]:
        tensors = {"w": torch.full((2, 3), float(step)), "b": torch.arange(3.0) + step}
        return lambda: write_export(out, iter(tensors.items()), shapes, cfg, tok, step)

    out = tmp_path / "exports" / "model"
    export(out, 0)()
    export(tmp_path / "count" / "model", 0)()
    n = stop_points(export(tmp_path / "count" / "model", 1))  # replacing one, as below
    for k in range(1, n + 1):
        before = tree(out)
        export(tmp_path / f"ref-{k}" / "model", k)()
        new = tree(tmp_path / f"ref-{k}" / "model")
        stopped(export(out, k), k)
        assert tree(out) in (before, new), f"stop point {k} left a mixed export"
        assert [p.name for p in out.parent.iterdir()] == ["model"], f"stop point {k} left temporaries"
        export(out, k)()
        assert tree(out) == new
    log.info("export: %d stop points", n)


def test_a_token_store_stopped_at_any_write_is_absent_or_whole_and_builds_next(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    ids = Sequence(Value("uint16"))
    columns = {"id": Value("int64"), "src_ids": ids, "tgt_ids": ids, "src_len": Value("int32")}
    features = Features({**columns, "tgt_len": Value("int32")})  # a store's columns (load_store checks them)

    def pairs(src: list[list[int]], tgt: list[list[int]]) -> Dataset:
        lengths = {"src_len": [len(s) for s in src], "tgt_len": [len(t) for t in tgt]}
        rows = {"id": list(range(len(src))), "src_ids": src, "tgt_ids": tgt, **lengths}
        return Dataset.from_dict(rows, features=features)

    train, valid = pairs([[1, 2], [2]], [[2], [1, 1]]), pairs([[1]], [[2]])

    def build(path: Path) -> Callable[[], Any]:
        return lambda: write_store(path, tok, train, valid, {"dropped_too_long": 0, "report": []})

    other = tmp_path / "stores" / "kept"
    build(other)()
    kept = tree(other)
    n = stop_points(build(tmp_path / "count" / "store"))
    for k in range(1, n + 1):
        path = tmp_path / "stores" / f"store-{k}"
        stopped(build(path), k)
        assert not path.exists() or load_store(path) is not None, f"stop point {k} left a half store"
        assert tree(other) == kept
        assert sorted(p.name for p in path.parent.iterdir() if is_temp(p)) == [], f"stop point {k}"
        build(path)()
        loaded = load_store(path)
        assert loaded is not None and loaded[1]["src_ids"] == [[1, 2], [2]]
    log.info("token store: %d stop points", n)


def test_a_study_update_stopped_at_any_write_keeps_study_json_old_or_new(tmp_path: Path) -> None:
    root = tmp_path / "study"
    Study(root, "demo", settings=["rope"], seeds=[1]).save()

    def update(seed: int) -> Callable[[], Any]:
        return lambda: Study.load(root).merge(Study(root, "demo", settings=["rope"], seeds=[seed])).save()

    n = stop_points(update(2))
    for k in range(1, n + 1):
        before = (root / MANIFEST).read_bytes()
        stopped(update(k + 2), k)
        after = (root / MANIFEST).read_bytes()
        assert after == before or k + 2 in Study.load(root).seeds, f"stop point {k}"
        assert [p.name for p in root.iterdir() if is_temp(p)] == [], f"stop point {k} left temporaries"
        update(k + 2)()
        assert k + 2 in Study.load(root).seeds
    log.info("study update: %d stop points", n)
