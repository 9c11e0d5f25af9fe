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

The arguments are parsed before torch and the commands (``commands``) are imported: ``--help`` and a
wrong option answer at once.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tpe_train.run import logs

log = logging.getLogger(__name__)

FORMATS = ("native", "hf", "ctranslate2")
QUANTIZATIONS = ("int8", "int8_float16", "float16", "float32")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpe-ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="checkpoints of a run: step, layout, size, complete or not")
    p.add_argument("run_dir")
    p.set_defaults(fn="cmd_list")
    p = sub.add_parser("average", help="average the weights of the last N checkpoints into an export")
    p.add_argument("run_dir")
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--out", required=True)
    p.set_defaults(fn="cmd_average")
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
    p.set_defaults(fn="cmd_export")
    p = sub.add_parser("reshard", help="re-save a checkpoint under another launch layout")
    p.add_argument("checkpoint")
    p.add_argument("--config_file", required=True, help="accelerate launch file of the new layout")
    p.add_argument("--out", required=True, help="a new run directory")
    p.add_argument("--deepspeed-shards", action="store_true", help="also write DeepSpeed's own shard files")
    p.set_defaults(fn="cmd_reshard")
    args = parser.parse_args(argv)
    logs.configure("tpe-ckpt")
    if getattr(args, "last", 1) < 1:
        parser.error("--last must be at least 1")
    from tpe_train.ckpt import commands  # torch and the checkpoint code: after the arguments parse
    from tpe_train.ckpt.store import CheckpointError
    from tpe_train.config import ConfigError
    from tpe_train.run.outputs import OutputRefused

    try:
        getattr(commands, args.fn)(args)
    except (CheckpointError, ConfigError, FileNotFoundError, OutputRefused) as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
