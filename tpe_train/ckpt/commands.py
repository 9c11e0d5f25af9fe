"""The commands of ``tpe-ckpt`` (``cli``): list, average, export and reshard checkpoints. ``cli`` parses
the arguments first and imports this module (torch and the checkpoint code) only then."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tpe_train.ckpt.export import (
    KINDS,
    WEIGHTS,
    check_export_out,
    export_mean,
    load_export,
    read_meta,
    save_export,
)
from tpe_train.ckpt.rundir import CONFIG, TOKENIZER, RunDir
from tpe_train.ckpt.shards import read_index
from tpe_train.ckpt.store import (
    LATEST,
    MANIFEST,
    TRAINER,
    CheckpointError,
    Entry,
    entries,
    inspect,
    latest_complete,
    latest_named,
)
from tpe_train.config import ConfigError
from tpe_train.run import members
from tpe_train.run.outputs import check_output, replaced_in_place
from tpe_train.run.readers import reading

log = logging.getLogger(__name__)

COMMAND = "tpe-ckpt export"


def _complete(run_dir: Path) -> list[Entry]:
    found = [e for e in entries(RunDir(run_dir).checkpoints) if e.complete]
    if not found:
        raise CheckpointError(
            f"{run_dir} holds no complete checkpoint in {RunDir(run_dir).checkpoints}; pass a run directory "
            "of tpe-train (train.run_dir) that has saved at least once (train.save_every)"
        )
    return found


def _checkpoint(path: Path) -> Path:
    """A checkpoint directory, a run directory's latest complete one, or the one its
    ``checkpoints/latest`` names."""
    if path.name == LATEST and RunDir.of_checkpoints(path.parent) is not None:
        named = latest_named(path.parent)
        path = named if named is not None else path
    if (path / MANIFEST).is_file():  # a checkpoint, known by its manifest wherever it lies and however named
        entry = inspect(path)
        if not entry.complete:
            raise CheckpointError(f"{path} is incomplete ({entry.reason}); pick another")
        return path
    latest, _ = latest_complete(RunDir(path).checkpoints)
    if latest is None:
        raise CheckpointError(f"{path} is neither a complete checkpoint nor a run directory with one")
    return latest.path


def _read_from(source: Path) -> Path:
    """What a command reads of ``source``: a checkpoint or an export itself, a run directory's
    checkpoints (its own exports, such as ``averaged-last5``, may be written beside them)."""
    return source if (source / MANIFEST).is_file() or _is_export(source) else RunDir(source).checkpoints


def cmd_list(args: argparse.Namespace) -> None:
    root = RunDir(Path(args.run_dir)).checkpoints
    found = entries(root)
    named = latest_named(root)
    latest = named.name if named is not None else ""
    print(f"{'checkpoint':22s} {'step':>8s} {'state':10s} {'layout':28s} {'size':>10s}")
    for e in found:
        lay = e.layout
        layout = "?"
        if lay:
            dp, tp, zero = lay["dp_size"], lay["tp_size"], lay["zero_stage"]
            layout = f"world {lay['world_size']} (dp {dp} x tp {tp}) ZeRO {zero}"
        state = "complete" if e.complete else "INCOMPLETE"
        mark = "  <- latest" if e.path.name == latest else ""
        reason = f"  ({e.reason})" if e.reason else ""
        print(f"{e.path.name:22s} {e.step:8d} {state:10s} {layout:28s} {e.size / 2**20:8.1f}MB{mark}{reason}")


def cmd_average(args: argparse.Namespace) -> None:
    check_export_out(Path(args.out), "tpe-ckpt average", [_read_from(Path(args.run_dir))])
    with reading(RunDir.readers_root(Path(args.run_dir))):  # no prune while chosen and read
        chosen = _complete(Path(args.run_dir))[-args.last :]
        if len(chosen) < args.last:
            log.warning("only %d complete checkpoints; averaging those", len(chosen))
        out = export_mean([e.path for e in chosen], Path(args.out), "tpe-ckpt average")
    print(f"averaged {', '.join(e.path.name for e in chosen)} -> {out}")


def _is_export(path: Path) -> bool:
    """An export directory (what ``load_export`` reads), not a checkpoint or a run directory."""
    return not (path / MANIFEST).is_file() and all((path / n).is_file() for n in (WEIGHTS, CONFIG, TOKENIZER))


def cmd_export(args: argparse.Namespace) -> None:
    with reading(RunDir.readers_root(Path(args.checkpoint))):  # no prune while chosen and read
        _export(args)


def _export(args: argparse.Namespace) -> None:
    source, out = Path(args.checkpoint), Path(args.out)
    if args.quantization and args.format != "ctranslate2":
        raise ConfigError(
            f"--quantization {args.quantization} applies to --format ctranslate2 only (this is --format "
            f"{args.format}, whose weights are written in fp32); drop --quantization or choose ctranslate2"
        )
    if not source.exists():
        raise CheckpointError(f"{source} does not exist; pass a checkpoint, a run directory or an export")
    read = [_read_from(source)]
    if args.format == "native":  # before any long work
        check_export_out(out, COMMAND, read)
    else:
        check_output(out, COMMAND, KINDS[args.format], read, protected=RunDir.what)
    if args.format == "native" and not _is_export(source):
        path = _checkpoint(source)
        print(f"exported {path} -> {export_mean([path], out, COMMAND)}")
        return
    with tempfile.TemporaryDirectory(prefix="tpe-export-") as tmp:
        if _is_export(source):
            native = source
        else:
            native = export_mean([_checkpoint(source)], Path(tmp) / "native")
        try:
            model, cfg, tok = load_export(native)
        except ValueError as err:  # a hash or shape that does not match: the export is damaged
            raise CheckpointError(str(err)) from None
        step = read_meta(native).get("step", 0)
        if args.format == "native":
            written = save_export(out, model, cfg, tok, step, COMMAND, [source])
        elif args.format == "hf":
            from tpe_train.ckpt.hf import export_hf

            written = export_hf(model, cfg, tok, out, step, source=str(source))
        else:
            from tpe_train.ckpt.ct2 import export_ctranslate2

            written = export_ctranslate2(model, cfg, tok, out, args.quantization or "float32")
    print(f"exported {source} (step {step}) -> {written} ({args.format})")


def cmd_reshard(args: argparse.Namespace) -> None:
    with reading(RunDir.readers_root(Path(args.checkpoint))):  # no prune while the new layout reads it
        _reshard(args)


def _reshard(args: argparse.Namespace) -> None:
    path = _checkpoint(Path(args.checkpoint))
    step = members.read_json(path, TRAINER, {"step": int}, error=CheckpointError)["step"]
    read_index(path)  # the index against its files here, before a new layout is launched to read them
    out = Path(args.out)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.config_file,
        "-m", "tpe_train.train", "--preset", str(path / CONFIG),
        f"train.run_dir={out}", f"train.resume={path}", f"train.max_steps={step}", "eval.at_end=false",
        "train.progress=false", f"train.deepspeed_shards={args.deepspeed_shards}",
    ]  # fmt: skip
    # a new run directory, or an earlier reshard's (moved aside, removed once this one has finished)
    with replaced_in_place(out, "tpe-ckpt reshard", "reshard", [path], RunDir.what):
        result = subprocess.run(cmd, env={**os.environ})
        if result.returncode != 0:
            raise SystemExit(result.returncode)
    print(f"resharded {path} -> {RunDir(out).checkpoints} (layout of {args.config_file})")
