"""DeepSpeed's JIT-built ops, loaded so that a crashed build cannot hang every later run.

On CPU, ``deepspeed.init_distributed`` JIT-builds a shared-memory op through
``torch.utils.cpp_extension.load``, which serialises builders with a bare "baton" file: created with
``O_EXCL``, removed when the build ends, and waited on forever by every other process while it exists.
A build killed half-way (Ctrl-C, a job's time limit, a machine restart) leaves the file behind, and
from then on every DeepSpeed process on the machine sleeps at start-up without a word. We take an
OS lock of our own first (``flock``: the kernel drops it when its holder dies, so it is never stale),
and while holding it a baton that no process has open is a dead builder's: we remove it, say so, and
load (building if needed). Other ranks then find the op built and only import it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Without /proc (not Linux) we cannot see open files: a baton older than this is taken as stale.
STALE_AFTER_S = 15 * 60


def load_shm_comm_op() -> Any | None:
    """Load (building once per machine) DeepSpeed's CPU shared-memory op, as ``init_distributed``
    would, clearing a dead build's lock first. None where the accelerator has no such op."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(builder.name, verbose=False))
    with _machine_lock(build_dir.parent / f".{builder.name}.tpe-lock"):
        clear_stale_baton(build_dir / "lock")
        return builder.load(verbose=False)


def clear_stale_baton(baton: Path) -> bool:
    """Remove ``baton`` (torch's build lock) when no live process holds it; True if removed."""
    if not baton.exists() or _held_open(baton):
        return False
    log.warning(
        "removing %s: a build of this op was killed part-way and left its lock behind "
        "(no process has it open); without this every DeepSpeed start would wait on it forever",
        baton,
    )
    baton.unlink(missing_ok=True)
    return True


def _held_open(path: Path) -> bool:
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return time.time() - path.stat().st_mtime < STALE_AFTER_S
    target = str(path.resolve())
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            links = list(fd_dir.iterdir())
        except OSError:  # the process ended, or is not ours to look at
            continue
        for link in links:
            try:
                if os.readlink(link) == target:
                    return True
            except OSError:
                continue
    return False


@contextmanager
def _machine_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
