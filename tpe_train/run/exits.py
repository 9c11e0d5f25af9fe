"""Exit statuses of tpe-train's commands, shared with the launch layer (no heavy imports here)."""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import NoReturn

#: Done.
EXIT_OK = 0
#: Bad config, data, layout or checkpoint: a one-paragraph message, nothing written or lost.
EXIT_BAD_INPUT = 2
#: Preempted (SIGTERM or SIGUSR1): the checkpoint is complete; requeue the job (EX_TEMPFAIL).
EXIT_PREEMPTED = 75

#: Set by ``tpe-launch run`` for the processes it starts: a directory (on the node) where each rank that
#: exits 75 leaves ``rank-<RANK>.exit``. accelerate's launcher reports any non-zero exit of a rank as
#: one failure, so this is how the node learns that every one of its ranks checkpointed and exited 75.
EXIT_RECORDS = "TPE_EXIT_RECORD_DIR"
#: TEST ONLY (the Slurm tests' fault injection): ``<rank>:<seconds>[:<code>][,...]`` makes global rank
#: <rank>, once its preemption checkpoint is complete, wait <seconds> and then exit with <code> instead of
#: 75 (a real failure after the checkpoint). Never set it outside the tests.
TEST_EXIT = "TPE_TEST_EXIT"


def record_path(directory: str, rank: int | str) -> str:
    return os.path.join(directory, f"rank-{rank}.exit")


def preempted_exit() -> int:
    """The exit status of a rank whose preemption checkpoint is complete: 75, recorded for the node's
    launcher (``TPE_EXIT_RECORD_DIR``), or what the test hook ``TPE_TEST_EXIT`` asks for."""
    rank = os.environ.get("RANK", "0")
    code = EXIT_PREEMPTED
    for item in filter(None, os.environ.get(TEST_EXIT, "").split(",")):
        parts = item.split(":")
        if parts[0] == rank:
            time.sleep(float(parts[1]))
            code = int(parts[2]) if len(parts) > 2 else EXIT_PREEMPTED
    records = os.environ.get(EXIT_RECORDS)
    if records and code == EXIT_PREEMPTED:
        with open(record_path(records, rank), "w") as f:
            f.write(f"{code}\n")
    return code


def end_process(code: int) -> NoReturn:
    """Exit with ``code``. A process that joined a ``torch.distributed`` group runs its exit handlers
    (they destroy the groups, see ``parallel/context.py``; close logging; stop compile workers; join
    child processes), flushes its output and leaves with ``os._exit``, skipping interpreter
    finalization: there, gloo's worker threads that free tensors ask for the GIL and the thread is
    unwound through C++ code that may not throw, which aborts a finished rank (SIGABRT, "terminate
    called without an active exception"; pytorch/pytorch#190489). Destroying the groups at exit is
    not enough when DeepSpeed still holds the group objects: they are freed in finalization. Any
    other process exits the usual way."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group joined, nothing imported here
    if dist is None or not dist.is_available() or not dist.is_initialized():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
