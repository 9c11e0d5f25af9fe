"""The readers' lock of a run's checkpoints: ``<run_dir>/checkpoints/.readers.lock``.

``tpe-ckpt average`` and ``export`` and ``tpe-eval`` hold a shared ``flock`` on it while they choose and
read checkpoints or exports of the run; the run's own pruning and its moving aside of a checkpoint that
fails its hashes (``step-N.corrupt``) need it exclusively and do not wait for it: while anyone reads,
they leave every checkpoint where it is (pruning catches up at the next save). Readers wait for a prune
in progress, which takes a moment.

Where the lock file cannot be made (a read-only copy of a run) there is nobody to prune it, and readers
go on without it. The lock file is opened with ``O_NOFOLLOW``: a symlink in its place is refused.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

READERS = ".readers.lock"
_UNLOCKABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


def _open(root: Path) -> int | None:
    path = Path(root) / READERS
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OSError(
                err.errno, f"{path} is a symlink, where tpe-train keeps its readers' lock; remove it"
            ) from None
        if err.errno not in (*_UNLOCKABLE, errno.ENOENT):
            raise
        log.debug("no readers' lock at %s (%s): reading without it", path, os.strerror(err.errno or 0))
        return None


@contextlib.contextmanager
def reading(root: Path | None) -> Iterator[None]:
    """Hold the shared lock of the checkpoints folder ``root`` (None: nothing to lock)."""
    fd = _open(root) if root is not None and Path(root).is_dir() else None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as err:
                if err.errno not in _UNLOCKABLE:
                    raise
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def alone(root: Path) -> Iterator[bool]:
    """Try the exclusive lock of ``root`` without waiting: True while it is held, False when a reader
    holds the shared one (the caller then leaves the checkpoints as they are)."""
    fd = _open(root) if Path(root).is_dir() else None
    if fd is None:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        except BlockingIOError:
            held = False
        except OSError as err:
            if err.errno not in _UNLOCKABLE:
                raise
            held = True
        yield held
    finally:
        os.close(fd)
