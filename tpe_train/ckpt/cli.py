"""``tpe-ckpt``: list, average, export and reshard training checkpoints.

    tpe-ckpt list RUN_DIR
    tpe-ckpt average RUN_DIR --last 5 --out DIR      # the mean of the last N checkpoints' weights
    tpe-ckpt export CHECKPOINT|RUN_DIR --out DIR     # one checkpoint (RUN_DIR: its latest)
    tpe-ckpt export SRC --out DIR --format hf        # a transformers model + fast tokenizer
    tpe-ckpt export SRC --out DIR --format ctranslate2 --quantization int8
    tpe-ckpt reshard CHECKPOINT --config_file configs/accelerate/X.yaml --out RUN_DIR

``average`` and ``export`` consolidate the checkpoints' weights from their shards, one tensor at a time
(every file verified against its manifest), into an export that ``tpe-eval --checkpoint DIR`` reads:
safetensors weights, the config and the tokenizer. ``reshard`` starts the trainer under another launch
file: it loads the checkpoint into the new layout and saves it there, so that each rank of that layout
then reads exactly its own files (``--deepspeed-shards``: DeepSpeed's own shards of that layout too).
A run resumed on another layout needs no reshard: it reads the regions it needs from any checkpoint.

``export --format hf|ctranslate2`` converts for use outside tpe-train (docs/export.md): SRC is a
checkpoint, a run directory (its latest complete checkpoint) or an export (e.g. ``averaged-last5``);
a checkpoint is first exported natively to a temporary directory, then the loaded model converted.
A model that the format cannot represent exactly is refused, with the reason.
"""

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
from tpe_train.run import logs, members
from tpe_train.run.outputs import OutputRefused, check_output, replaced_in_place
from tpe_train.run.readers import reading

log = logging.getLogger(__name__)


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


FORMATS = ("native", "hf", "ctranslate2")
COMMAND = "tpe-ckpt export"
QUANTIZATIONS = ("int8", "int8_float16", "float16", "float32")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpe-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="checkpoints of a run: step, layout, size, complete or not")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("average", help="average the weights of the last N checkpoints into an export")
    p.add_argument("run_dir")
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_average)
    p = sub.add_parser("export", help="one checkpoint (or a run's latest, or an export) as an export")
    p.add_argument("checkpoint", help="a checkpoint, a run directory (its latest) or an export directory")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="native",
        help="native: for tpe-eval/tpe-translate; hf: a transformers model; ctranslate2: a CTranslate2 model",
    )
    p.add_argument("--quantization", choices=QUANTIZATIONS, help="ctranslate2 only (default float32)")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("reshard", help="re-save a checkpoint under another launch layout")
    p.add_argument("checkpoint")
    p.add_argument("--config_file", required=True, help="accelerate launch file of the new layout")
    p.add_argument("--out", required=True, help="a new run directory")
    p.add_argument("--deepspeed-shards", action="store_true", help="also write DeepSpeed's own shard files")
    p.set_defaults(fn=cmd_reshard)
    args = parser.parse_args(argv)
    logs.configure("tpe-ckpt")
    if getattr(args, "last", 1) < 1:
        parser.error("--last must be at least 1")
    try:
        args.fn(args)
    except (CheckpointError, ConfigError, FileNotFoundError, OutputRefused) as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
