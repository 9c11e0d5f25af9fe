"""Training checkpoints that survive crashes, preemption and a change of layout.

One checkpoint is a directory ``<run_dir>/checkpoints/step-<8 digits>/``:

- ``model.safetensors``, ``optimizer.safetensors``: the full fp32 weights and Adam moments of the
  single-device model (``parallel.portable``): what resuming, averaging and exporting read, in any
  layout, without unpickling anything;
- ``deepspeed/``: every rank's own DeepSpeed shards, written through accelerate's ``save_state`` (for
  DeepSpeed's tools: ``zero_to_fp32``, universal conversion); never read by tpe-train;
- ``trainer.json``: step, tokens seen, data position, scheduler, Adam's step count, loss scaler,
  the layout that wrote it; ``rank-<5 digits>.json``: each rank's RNG states (and stream position);
- ``config.yaml``, ``tokenizer.json``;
- ``manifest.json``, written last: every file with its size and SHA-256. No manifest, no checkpoint.

Protocol: all ranks write under ``.tmp-step-…``; when every rank reports success rank 0 writes the
manifest, renames the directory into place and only then moves ``latest`` (a one-line file, replaced
atomically). A crash at any moment leaves either the previous state or the new complete checkpoint;
leftovers (``.tmp-*``, directories without a valid manifest) are reported, skipped and removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tpe_train.config import Config

LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
FORMAT = "tpe-train-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint cannot be written or used; the message names the file and the fix."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, step: int, layout: dict[str, Any]) -> None:
    """List every file with size and hash; written last, it is what makes the checkpoint complete."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = str(path.relative_to(directory))
        files[rel] = {"size": path.stat().st_size, "sha256": sha256(path)}
    write_json(directory / MANIFEST, {"format": FORMAT, "step": step, "layout": layout, "files": files})


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished checkpoint into place, then move ``latest`` to it."""
    if final.exists():  # a stale copy of the same step (an earlier attempt): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(final.parent)
    pointer = final.parent / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    with open(pointer) as f:
        os.fsync(f.fileno())
    os.replace(pointer, final.parent / LATEST)
    fsync_dir(final.parent)


@dataclass(frozen=True)
class Entry:
    """One checkpoint directory as ``tpe-ckpt list`` and resume see it."""

    path: Path
    step: int
    complete: bool
    reason: str  # why incomplete ("" when complete)
    size: int
    layout: dict[str, Any]


def inspect(path: Path) -> Entry:
    """Complete means: a manifest of this format, and every listed file present with its size (the
    hashes are checked when the checkpoint is loaded)."""
    m = _STEP_DIR.match(path.name)
    step = int(m.group(1)) if m else -1
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return Entry(path, step, False, "no manifest (the save did not finish)", size, {})
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        assert manifest.get("format") == FORMAT
    except (ValueError, KeyError, AssertionError):
        return Entry(path, step, False, "unreadable manifest", size, {})
    for rel, info in files.items():
        p = path / rel
        if not p.is_file() or p.stat().st_size != info["size"]:
            return Entry(path, step, False, f"{rel} missing or truncated", size, manifest.get("layout", {}))
    return Entry(path, int(manifest["step"]), True, "", size, manifest.get("layout", {}))


def entries(root: Path) -> list[Entry]:
    """Every checkpoint directory (and unfinished ``.tmp-*`` one) under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        inspect(p)
        for p in root.iterdir()
        if p.is_dir() and (_STEP_DIR.match(p.name) or p.name.startswith(".tmp-"))
    ]
    return sorted(found, key=lambda e: (e.step, e.path.name))


def latest_complete(root: Path) -> tuple[Entry | None, list[Entry]]:
    """The newest complete checkpoint (``latest`` if it is complete) and the incomplete ones skipped."""
    all_entries = entries(root)
    skipped = [e for e in all_entries if not e.complete]
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named.is_dir():
            entry = inspect(named)
            newer = [e for e in all_entries if e.complete and e.step > entry.step]
            if entry.complete and not newer:
                return entry, skipped
    complete = [e for e in all_entries if e.complete]
    return (complete[-1] if complete else None), skipped


def verify(path: Path, names: list[str]) -> None:
    """Check the SHA-256 of the files tpe-train is about to read against the manifest."""
    manifest = json.loads((path / MANIFEST).read_text())
    for name in names:
        info = manifest["files"].get(name)
        if info is None:
            raise CheckpointError(
                f"{path / name} is not listed in {path / MANIFEST}; the checkpoint is incomplete"
            )
        if sha256(path / name) != info["sha256"]:
            raise CheckpointError(
                f"{path / name} does not match the hash in {path / MANIFEST}: the file was modified or "
                "corrupted after it was written; resume from another checkpoint (tpe-ckpt list) or restore it"
            )


def check_compatible(path: Path, cfg: Config, vocab: str | None = None) -> None:
    """Refuse a checkpoint of another model config or tokenizer (``vocab``: the tokenizer's hash, when
    known), naming what differs."""
    saved = yaml.safe_load((path / "config.yaml").read_text())
    ours = cfg.model_dump(mode="json")["model"]
    differences = _diff(saved.get("model", {}), ours, "model")
    if differences:
        raise CheckpointError(
            f"{path} was written by another model ({'; '.join(differences[:6])}); resume it with its own "
            "model settings, or start a new run directory (train.run_dir) or train.resume=never"
        )
    trainer = json.loads((path / TRAINER).read_text())
    if vocab is not None and trainer.get("vocab_hash") != vocab:
        raise CheckpointError(
            f"{path} was trained with another tokenizer (vocabulary hash {trainer.get('vocab_hash')} against "
            f"{vocab}); resume with the data settings the run was started with, or start a new run directory"
        )


def _diff(saved: Any, ours: Any, prefix: str) -> list[str]:
    if isinstance(saved, dict) and isinstance(ours, dict):
        out = []
        for key in sorted(set(saved) | set(ours)):
            out += _diff(saved.get(key), ours.get(key), f"{prefix}.{key}")
        return out
    return [] if saved == ours else [f"{prefix} is {saved!r} there, {ours!r} here"]


def prune(root: Path, keep_last: int, keep_every: int, keep_steps: tuple[int, ...] = ()) -> list[Path]:
    """Remove all but the last ``keep_last`` complete checkpoints, keeping any whose step is a
    multiple of ``keep_every`` (> 0) or in ``keep_steps`` (the best validation's), and remove unfinished
    leftovers. Returns what was removed."""
    all_entries = entries(root)
    complete = [e for e in all_entries if e.complete]
    keep = {e.path for e in complete[-keep_last:]} if keep_last > 0 else set()
    keep |= {
        e.path for e in complete if (keep_every > 0 and e.step % keep_every == 0) or e.step in keep_steps
    }
    removed = [e.path for e in all_entries if e.path not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
