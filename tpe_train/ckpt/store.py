"""Training checkpoints that survive crashes, preemption and a change of layout.

One checkpoint is a directory ``<run_dir>/checkpoints/step-<8 digits>/``:

- ``model-<rank>.safetensors``, ``optimizer-<rank>.safetensors``: the pieces of the single-device
  model's fp32 weights and Adam moments that each rank holds (its ZeRO partition, its tensor-parallel
  slice), and ``index.json``, which says for every piece which region of which tensor it is
  (``ckpt.shards``): what resuming in any layout, averaging and exporting read, without unpickling;
- ``trainer.json``: step, tokens seen, data position, scheduler, Adam's step count, loss scaler,
  the layout that wrote it; ``rank-<5 digits>.json``: each rank's RNG states (and stream position);
- ``config.yaml``, ``tokenizer.json``; with ``train.deepspeed_shards``, ``deepspeed/``: every rank's
  own DeepSpeed shards (for DeepSpeed's tools), never read by tpe-train;
- ``manifest.json``, written last: every file with its size and SHA-256. No manifest, no checkpoint.

Protocol: all ranks write under ``.tmp-step-…`` (hashing their files as they write them); when every
rank reports success rank 0 writes the index and the manifest, renames the directory into place and
only then moves ``latest`` (a one-line file, replaced atomically). A crash at any moment leaves either
the previous state or the new complete checkpoint; leftovers (``.tmp-*``, directories without a valid
manifest) are reported, skipped and removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tpe_train.ckpt.errors import CheckpointError, UnknownFormat
from tpe_train.ckpt.rundir import CONFIG, RunDir
from tpe_train.config import Config, legacy
from tpe_train.run import members, readers
from tpe_train.run.atomic import fsync_dir

LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"
FORMAT = "tpe-train-checkpoint/2"
FORMATS = (FORMAT, "tpe-train-checkpoint/1")  # /1: every tensor whole, in model/optimizer.safetensors
log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d{8})$")


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


def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(directory: Path, step: int, layout: dict[str, Any], known: dict[str, Any]) -> None:
    """List every file with size and hash (``known``: those hashed while written; any other file is
    hashed here); written last, it is what makes the checkpoint complete."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = str(path.relative_to(directory))
        files[rel] = known.get(rel) or {"size": path.stat().st_size, "sha256": sha256(path)}
    write_json(directory / MANIFEST, {"format": FORMAT, "step": step, "layout": layout, "files": files})


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished checkpoint into place, then move ``latest`` to it."""
    if final.exists():
        if inspect(final).complete:  # a stale copy of the same step (an earlier attempt): replace it
            shutil.rmtree(final)
        else:  # not the protocol's own (a copy coming in, a newer format): keep it, out of the way
            aside = final.with_name(f"{final.name}.unreadable")
            n = 1
            while aside.exists():
                n += 1
                aside = final.with_name(f"{final.name}.unreadable{n}")
            final.rename(aside)
            log.warning("moved %s, which this version cannot read, aside to %s", final, aside)
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
    size = members.tree_size(path)
    if path.name.startswith(".tmp-"):  # complete or not, never renamed into place (or being pruned)
        return Entry(path, step, False, "a temporary of a save or a pruning that stopped", size, {})
    if members.lstat_regular(path / MANIFEST) is None:
        return Entry(path, step, False, "no manifest (the save did not finish)", size, {})
    try:
        manifest = read_manifest(path)
    except UnknownFormat as err:
        why = f"a manifest of format {err.found!r}, which this version does not know (a newer tpe-train's?)"
        return Entry(path, step, False, why, size, {})
    except CheckpointError as err:
        return Entry(path, step, False, f"unreadable manifest: {str(err).split('; ')[0]}", size, {})
    for rel, info in manifest["files"].items():
        found = members.lstat_regular(path / rel)
        if found is None or found.st_size != info["size"]:
            why = "a symlink" if (path / rel).is_symlink() else "missing, truncated or not a plain file"
            return Entry(path, step, False, f"{rel} {why}", size, manifest["layout"])
    return Entry(path, manifest["step"], True, "", size, manifest["layout"])


def read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's manifest, checked: its format, types, and every file name a plain name of the
    checkpoint (``deepspeed/`` names: plain names under that folder) with a size and a hash."""
    where = path / MANIFEST
    manifest = members.read_json(
        path, MANIFEST, {"step": int, "files": dict, "layout": dict}, error=CheckpointError
    )
    if manifest.get("format") not in FORMATS:
        raise UnknownFormat(
            manifest.get("format"),
            f"{where} is of format {str(manifest.get('format'))[:40]!r}, which this tpe-train does not read "
            f"({', '.join(FORMATS)}); use the tpe-train version that wrote it",
        )
    for rel, info in manifest["files"].items():
        members.check_name(rel, where, nested=True, error=CheckpointError)
        if "/" in rel and not rel.startswith("deepspeed/"):
            members.check_name(rel, where, error=CheckpointError)  # only DeepSpeed's files are nested
        members.check_type(info, dict, f"{where}: files[{rel!r}]", CheckpointError)
        members.check_type(info.get("size"), int, f"{where}: files[{rel!r}].size", CheckpointError)
        members.check_type(info.get("sha256"), str, f"{where}: files[{rel!r}].sha256", CheckpointError)
    return manifest


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
    named = latest_named(root)
    if named is not None and named.is_dir() and not named.is_symlink():
        entry = inspect(named)
        newer = [e for e in all_entries if e.complete and e.step > entry.step]
        if entry.complete and not newer:
            return entry, skipped
    complete = [e for e in all_entries if e.complete]
    return (complete[-1] if complete else None), skipped


def latest_named(root: Path) -> Path | None:
    """The checkpoint that ``root/latest`` names (None without the file): a ``step-<8 digits>`` folder
    beside it, nothing else."""
    if not (root / LATEST).exists() and not (root / LATEST).is_symlink():
        return None
    name = members.read_text(root, LATEST, 4096, CheckpointError).strip()
    if not _STEP_DIR.match(name):
        raise CheckpointError(
            f"{root / LATEST} names {name[:80]!r}, not a checkpoint folder beside it (step-<8 digits>); "
            f"nothing was read through it. Delete {root / LATEST} (the newest complete checkpoint is then "
            "used) or write into it the name of one of the step-* folders listed by `tpe-ckpt list`"
        )
    return root / name


def verify(path: Path, names: list[str]) -> None:
    """Check the SHA-256 of the files tpe-train is about to read against the manifest."""
    manifest = read_manifest(path)
    for name in names:
        info = manifest["files"].get(name)
        if info is None:
            members.check_name(name, path / MANIFEST, error=CheckpointError)
            raise CheckpointError(
                f"{path / name} is not listed in {path / MANIFEST}; the checkpoint is incomplete"
            )
        found = members.lstat_regular(path / name)
        if found is not None and found.st_size != info["size"]:
            raise CheckpointError(
                f"{path / name} has {found.st_size} bytes, {info['size']} in {path / MANIFEST}: the file was "
                "truncated or replaced; resume from another checkpoint (tpe-ckpt list) or restore it"
            )
        if members.sha256(path, name, CheckpointError, nested=True) != info["sha256"]:
            raise CheckpointError(
                f"{path / name} does not match the hash in {path / MANIFEST}: the file was modified or "
                "corrupted after it was written; resume from another checkpoint (tpe-ckpt list) or restore it"
            )


def verify_all(path: Path) -> None:
    """Check every file of the manifest but DeepSpeed's own shards (``deepspeed/``, never read here)."""
    manifest = read_manifest(path)
    verify(path, [name for name in manifest["files"] if not name.startswith("deepspeed/")])


def resume_choice(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint ``train.resume`` names (one process chooses; it may rename, see ``auto``):

    - ``auto``: the newest complete checkpoint whose files match their manifest hashes; newer ones that
      do not are renamed ``step-<N>.corrupt`` (kept for inspection, out of resume's and pruning's way)
      with a warning naming each; when none verifies, the run stops and nothing is renamed;
    - ``latest``: the newest complete checkpoint; a file that fails its hash stops the run when it is read;
    - a path: that checkpoint (or the newest complete one of a ``checkpoints`` directory).
    """
    if resume not in ("auto", "latest"):
        path = Path(resume)
        entry = latest_complete(path)[0] if RunDir.of_checkpoints(path) else None
        if not (path / MANIFEST).is_file() and entry is None:
            raise CheckpointError(
                f"train.resume={path} is not a complete checkpoint (no manifest.json); pass a "
                "<run_dir>/checkpoints/step-* directory listed complete by `tpe-ckpt list`, or auto, latest "
                "or never"
            )
        return entry.path if entry is not None else path
    root = RunDir(run_dir).checkpoints
    entry, skipped = latest_complete(root)
    for bad in skipped:
        log.info("skipping incomplete checkpoint %s (%s)", bad.path, bad.reason)
    if resume == "latest" or entry is None:
        return entry.path if entry is not None else None
    older = [e for e in entries(root) if e.complete and e.step < entry.step]
    failed: list[tuple[Entry, str]] = []
    for candidate in [entry, *reversed(older)]:
        try:
            verify_all(candidate.path)
        except CheckpointError as err:
            failed.append((candidate, str(err).split("; ")[0]))  # what failed, not the strict advice
            continue
        with readers.alone(root) as free:
            for bad, why in failed:
                _move_aside(bad.path, why, candidate.path.name, free)
        return candidate.path
    raise CheckpointError(
        f"no checkpoint in {root} verifies against its manifest ({'; '.join(why for _, why in failed)}); "
        "restore one from a copy and run again, or start over in a new run directory"
    )


def _move_aside(path: Path, why: str, chosen: str, free: bool) -> None:
    """Rename a checkpoint that fails its hashes ``step-<N>.corrupt`` (``free``: no reader holds the
    checkpoints; otherwise it stays, and the next resume verifies it again)."""
    if not free:
        log.warning(
            "skipping checkpoint %s: %s. It stays in place while another command reads this run's "
            "checkpoints; resuming from %s, the newest that verifies",
            path.name,
            why,
            chosen,
        )
        return
    aside = path.with_name(f"{path.name}.corrupt")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.corrupt{n}")
    path.rename(aside)
    log.warning(
        "skipping checkpoint %s: %s. Moved aside to %s (inspect it, then delete it); resuming from %s, the "
        "newest that verifies (train.resume=latest would stop instead)",
        path.name,
        why,
        aside,
        chosen,
    )


def read_yaml(folder: Path, name: str) -> Any:
    """A YAML file of a checkpoint or an export, parsed; text that is not YAML is a ``CheckpointError``."""
    text = members.read_text(folder, name, error=CheckpointError)
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as err:
        brief = " ".join(str(err).split())[:200]
        raise CheckpointError(f"{Path(folder) / name} is not YAML ({brief}); {members.FIX}") from None


def check_compatible(path: Path, cfg: Config, vocab: str | None = None) -> None:
    """Refuse a checkpoint of another model config or tokenizer (``vocab``: the tokenizer's hash, when
    known), naming what differs."""
    saved = read_yaml(path, CONFIG)
    members.check_type(saved, dict, f"{path / CONFIG}", CheckpointError)
    dumped = cfg.model_dump(mode="json")
    idle = set(legacy.absent_and_idle(saved, dumped))  # added since, and of no effect on this model
    differing = _diff(legacy.fill(saved).get("model", {}), dumped["model"], "model")
    differences = [text for key, text in differing if key not in idle]
    if differences:
        raise CheckpointError(
            f"{path} was written by another model ({'; '.join(differences[:6])}); resume it with its own "
            "model settings, or start a new run directory (train.run_dir) or train.resume=never"
        )
    trainer = members.read_json(path, TRAINER, error=CheckpointError)
    if vocab is not None and trainer.get("vocab_hash") != vocab:
        raise CheckpointError(
            f"{path} was trained with another tokenizer (vocabulary hash {trainer.get('vocab_hash')} against "
            f"{vocab}); resume with the data settings the run was started with, or start a new run directory"
        )


def _diff(saved: Any, ours: Any, prefix: str) -> list[tuple[str, str]]:
    """Each dotted key whose value differs, with the sentence that says how."""
    if isinstance(saved, dict) and isinstance(ours, dict):
        out = []
        for key in sorted(set(saved) | set(ours)):
            out += _diff(saved.get(key), ours.get(key), f"{prefix}.{key}")
        return out
    return [] if saved == ours else [(prefix, f"{prefix} is {saved!r} there, {ours!r} here")]


def prune(root: Path, keep_last: int, keep_every: int, keep_steps: tuple[int, ...] = ()) -> list[Path]:
    """Remove all but the last ``keep_last`` complete checkpoints, keeping any whose step is a
    multiple of ``keep_every`` (> 0) or in ``keep_steps`` (the best validation's), and remove the save
    protocol's own unfinished temporaries (``.tmp-*``). A ``step-*`` directory that is not complete (a
    manifest of a format this version does not know, a copy still coming in, files missing) is never
    the protocol's own leftover: it stays, with a warning naming it. Returns what was removed."""
    all_entries = entries(root)
    complete = [e for e in all_entries if e.complete]
    keep = {e.path for e in complete[-keep_last:]} if keep_last > 0 else set()
    keep |= {
        e.path for e in complete if (keep_every > 0 and e.step % keep_every == 0) or e.step in keep_steps
    }
    removed = []
    for e in all_entries:
        if e.complete or e.path.name.startswith(".tmp-"):
            if e.path not in keep:
                removed.append(e.path)
        else:
            log.warning(
                "not pruning %s: %s; it is not a checkpoint this version can read (inspect it, then move "
                "or delete it yourself)",
                e.path,
                e.reason,
            )
    for path in removed:
        # Out of the way in one rename first: a stop halfway through the deletion leaves a temporary
        # that the next pruning removes, not a half-deleted step-* that pruning would have to keep.
        doomed = path if path.name.startswith(".tmp-") else path.with_name(f".tmp-pruned-{path.name}")
        if doomed != path:
            path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed
