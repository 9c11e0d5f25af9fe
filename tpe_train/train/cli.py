"""``tpe-train [--preset P] [--quiet | --verbose] [key=value ...]`` and ``python -m tpe_train.train``:
load the config, set up logging once (``run.logs``), run the loop (``loop.run``), turn what stops a run
into an exit status (0 done, 2 bad config, data or checkpoint, 75 preempted with its checkpoint saved).

Only the standard library and ``run`` are imported before the arguments are parsed: ``--help`` and a
wrong option answer without loading torch (docs/testing.md)."""

from __future__ import annotations

import argparse
import os
import sys

from tpe_train.run import logs
from tpe_train.run.exits import EXIT_BAD_INPUT, EXIT_PREEMPTED, end_process, preempted_exit
from tpe_train.run.lock import RunDirBusy
from tpe_train.run.members import MemberError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tpe-train",
        description="Train an encoder-decoder Transformer. Without arguments: the demo preset.",
        epilog="Example: tpe-train --preset demo model.position.kind=rope train.max_steps=200. "
        f"Exit status: 0 done, 2 bad config/data/checkpoint, {EXIT_PREEMPTED} preempted (checkpoint saved).",
    )
    parser.add_argument("--preset", default="demo", help="preset name in configs/presets or a YAML path")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.position.kind=rope")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("--quiet", action="store_true", help="warnings and errors only on the terminal")
    loud.add_argument("--verbose", action="store_true", help="also debug messages on the terminal")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-train`` and ``python -m tpe_train.train``."""
    args = parse_args(argv)
    from tpe_train.ckpt.store import CheckpointError  # torch and the rest: after the arguments parse
    from tpe_train.config import ConfigError, load_config
    from tpe_train.data.sources import CorpusError
    from tpe_train.train.loop import Preempted, run

    # rank 0: progress on stdout, warnings on stderr; other ranks: warnings and errors, with their rank
    logs.configure("tpe-train", verbosity=logs.verbosity(args.quiet, args.verbose))
    main_rank = os.environ.get("RANK", "0") == "0"  # every rank finds the error; one reports it
    try:
        cfg = load_config(args.preset, args.overrides)
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        run(cfg)
    except (ConfigError, CorpusError, CheckpointError, MemberError, RunDirBusy) as err:  # no traceback
        if main_rank and not getattr(err, "reported", False):
            print(f"tpe-train: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Preempted:
        return preempted_exit()  # 75, and the node's launcher is told this rank's checkpoint is complete
    return 0


def entry() -> None:
    """The ``tpe-train`` command and ``python -m tpe_train.train``: ``main``, then the exit of a launched
    rank (``end_process``: no interpreter finalization once a process group was joined)."""
    end_process(main())
