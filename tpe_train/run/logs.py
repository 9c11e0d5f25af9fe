"""Logging for every command, through the standard ``logging`` module, configured once at start-up.

Every module logs to ``logging.getLogger(__name__)`` (a child of ``tpe_train``, or ``launcher``) and never
decides who prints: ``configure`` does, once per process. Rank 0 shows progress (INFO) on stdout and
warnings and errors on stderr, each line as ``<prog>: message`` / ``<prog>: warning: message`` as the
commands have always printed; every other rank shows warnings and errors only, marked with its rank
(``tpe-train [rank 3]: warning: ...``). ``--quiet`` keeps warnings and errors, ``--verbose`` adds DEBUG.
A command whose stdout is its product (``tpe-translate``'s translations, ``tpe-launch``'s dry-run
command) sends its progress to stderr too (``info_stream="stderr"``); results stay ``print``-ed.
``add_file`` also writes every record (DEBUG included, with time and rank) to a file in the run directory.

Standard library only: the launcher, which runs without torch, uses it too.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

#: The loggers this module configures: the package's, the launcher's, the benchmarks', and that of a
#: module run as ``python -m`` (its ``__name__`` is ``__main__``: ``python -m tpe_train.study.cli``).
ROOTS = ("tpe_train", "launcher", "benchmarks", "__main__")

QUIET, NORMAL, VERBOSE = -1, 0, 1


class _ConsoleHandler(logging.Handler):
    """INFO and below to stdout (or stderr: ``info_stream``), WARNING and above to stderr; the streams are
    looked up at each record (pytest's capture and ``contextlib.redirect_stdout`` replace ``sys.stdout``
    after start-up), and written through tqdm so that a progress bar on the terminal is not torn."""

    def __init__(self, level: int, info_stream: str) -> None:
        super().__init__(level=level)
        self.info_to_stderr = info_stream == "stderr"

    def emit(self, record: logging.LogRecord) -> None:
        try:
            to_stderr = self.info_to_stderr or record.levelno >= logging.WARNING
            stream = sys.stderr if to_stderr else sys.stdout
            message = self.format(record)
            from tqdm import (
                tqdm,
            )  # a dependency of the package; imported here so that this module stays light

            tqdm.write(message, file=stream)
            stream.flush()
        except Exception:  # logging must never stop a run (a closed pipe, a full disk)
            self.handleError(record)


class _ConsoleFormat(logging.Formatter):
    def __init__(self, prog: str, rank: int) -> None:
        super().__init__()
        self.prog = prog if rank == 0 else f"{prog} [rank {rank}]"

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{self.formatException(record.exc_info)}"
        if record.levelno >= logging.ERROR:
            return f"{self.prog}: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"{self.prog}: warning: {message}"
        return f"{self.prog}: {message}"


def env_rank() -> int:
    """This process's global rank as launchers set it (``RANK``, else ``SLURM_PROCID``), 0 alone."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def configure(
    prog: str, *, rank: int | None = None, verbosity: int = NORMAL, info_stream: str = "stdout"
) -> None:
    """Set up the console for this process: called once by each command's ``main``, again only to change
    ``prog``, ``rank``, ``verbosity`` or ``info_stream`` (handlers are replaced, never added twice).
    ``info_stream``: ``"stderr"`` for a command whose stdout carries its product."""
    if info_stream not in ("stdout", "stderr"):
        raise ValueError(f"info_stream must be 'stdout' or 'stderr', not {info_stream!r}")
    rank = env_rank() if rank is None else rank
    level = {QUIET: logging.WARNING, NORMAL: logging.INFO, VERBOSE: logging.DEBUG}[
        max(QUIET, min(verbosity, VERBOSE))
    ]
    console = _ConsoleHandler(level if rank == 0 else max(level, logging.WARNING), info_stream)
    console.setFormatter(_ConsoleFormat(prog, rank))
    console.set_name("tpe-console")
    for name in ROOTS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # a host application's root handlers do not print our lines twice
        for old in [h for h in logger.handlers if h.get_name() == "tpe-console"]:
            logger.removeHandler(old)
        logger.addHandler(console)


def add_file(path: Path, *, rank: int | None = None) -> logging.Handler:
    """Append every record of this process (DEBUG and up) to ``path``, with time, rank and logger; returns
    the handler so that the caller can close it (``remove_file``) when the run ends."""
    rank = env_rank() if rank is None else rank
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    for name in ROOTS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    return handler


def remove_file(handler: logging.Handler) -> None:
    """Detach and close a handler from ``add_file``."""
    for name in ROOTS:
        logging.getLogger(name).removeHandler(handler)
    handler.close()


def verbosity(quiet: bool, verbose: bool) -> int:
    """The level from a command's ``--quiet`` / ``--verbose`` flags."""
    return QUIET if quiet else VERBOSE if verbose else NORMAL
