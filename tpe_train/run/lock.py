"""Ownership of a run directory: one run at a time, by an ``flock`` on ``<dir>/run.lock``.

The first process of a run (rank 0, before any work) takes an exclusive, non-blocking ``flock`` on the
lock file and writes who it is into it (host, pid, Slurm job id, start time). A second run on the same
directory finds the lock taken and stops before any work with a message naming the owner. The kernel
releases an ``flock`` when the process that holds it dies, however it dies (SIGKILL, a crash, the end
of a Slurm job), so a dead owner never blocks a rerun, a resume or a requeue; nothing ever has to be
cleaned up by hand, and the file itself is never deleted (deleting a lock file lets two processes lock
two different files of the same name).

Where ``flock`` is not reliable across machines (NFS mounted with ``nolock`` or ``local_lock=flock``,
Lustre with ``localflock``, file systems that keep locks per client), the lock still stops a second run
on the same node only; ``scope_warning`` says so from the mount table, and a file system that refuses
locks altogether (``ENOLCK``, ``ENOSYS``, ``EOPNOTSUPP``) gets a warning and the run goes on unlocked.

    with RunLock(run_dir):          # raises RunDirBusy (exit status 2) when another run owns it
        ...                         # the whole run

Self-contained on purpose (standard library only): the trainer, ``tpe-study`` and tests use it alike.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

LOCK_NAME = "run.lock"
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # the file system cannot flock

# File systems whose locks may or may not reach other machines, by mount type (/proc/mounts).
_SHARED = {
    "gpfs": "GPFS / Storage Scale",
    "beegfs": "BeeGFS (locks are per client unless tuneUseGlobalFileLocks=true on the clients)",
    "ceph": "CephFS",
    "cifs": "SMB/CIFS",
    "smb3": "SMB/CIFS",
    "9p": "9p",
    "virtiofs": "virtiofs",
    "glusterfs": "GlusterFS",
    "afs": "AFS",
    "panfs": "PanFS",
    "wekafs": "WekaFS",
}


class RunDirBusy(Exception):
    """Another live run owns the directory; the message names it and what to do."""

    reported = False  # already printed (by rank 0, before the other ranks were let go)


def _owner_text(path: Path) -> str:
    """What the lock file says about its owner, as one phrase."""
    info: dict[str, object] = {}
    for _ in range(20):  # the owner writes its record right after locking: give it a moment
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                found = json.loads(f.read(1 << 16) or b"{}")
            info = found if isinstance(found, dict) else {}
        except (OSError, ValueError):
            info = {}
        if info:
            break
        time.sleep(0.05)
    if not info:
        return "a process that has not written its name yet"
    job = f", Slurm job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return (
        f"pid {info.get('pid')} on host {info.get('host')}{job}, started {info.get('started')} "
        f"({info.get('command', '?')})"
    )


class RunLock:
    """An exclusive ``flock`` on ``<directory>/run.lock``, held from ``acquire`` to ``release`` (or
    the death of this process). ``fix`` ends the refusal message: how to run elsewhere."""

    def __init__(
        self, directory: Path, fix: str = "pass another train.run_dir", prog: str = "tpe-train"
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.fix, self.prog = fix, prog
        self.fd: int | None = None
        self.warnings: list[str] = []  # said once, by whoever acquires (printed by acquire)

    def acquire(self) -> RunLock:
        """Take the lock or raise ``RunDirBusy``; record this process in the lock file."""
        self.directory.mkdir(parents=True, exist_ok=True)
        warning = scope_warning(self.directory)
        if warning:
            self.warnings.append(warning)
        try:  # never through a symlink: the record would be written wherever it points
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise RunDirBusy(
                f"{self.path} is a symlink; {self.prog} writes its lock record into this file and does not "
                "follow a link (it could point at any file). Remove the link and run the same command again, "
                f"or {self.fix}."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusy(
                f"{self.directory} is in use by another run: {_owner_text(self.path)} holds its lock "
                f"{self.path}. Two runs in one directory would overwrite each other's checkpoints, "
                f"events and results, so this one stops before any work. Wait for that run to end (or stop "
                f"it: kill that pid, scancel that job) and run the same command again to continue it, or "
                f"{self.fix}. A lock whose process has died is released by the system and never blocks a "
                "rerun (on NFS, a lock of a node that crashed lasts until the server lets it go; if that "
                "process is surely gone, delete the lock file)."
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in NO_LOCKS:
                raise
            self.warnings.append(
                f"cannot lock {self.path} ({os.strerror(err.errno)}): this file system does not support "
                "flock, so nothing stops a second run on this directory; make sure only one runs"
            )
            self._say()
            return self
        self.fd = fd
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "started_unix": round(time.time(), 3),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._say()
        return self

    def _say(self) -> None:
        for line in self.warnings:
            print(f"{self.prog}: warning: {line}", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Give the lock up (the record stays: it names the last owner)."""
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@contextlib.contextmanager
def own(directory: Path, is_main: bool, agree: Callable[[bool], bool]) -> Iterator[RunLock]:
    """The run's lock, for every rank of a launch: rank 0 takes it, and ``agree`` (true on every rank
    when it is true on any, e.g. ``ParallelContext.any``) makes every rank stop with ``RunDirBusy``
    when rank 0 could not, instead of waiting for rank 0 at the first collective."""
    lock = RunLock(directory)
    refused: RunDirBusy | None = None
    if is_main:
        try:
            lock.acquire()
        except RunDirBusy as err:
            refused = err
    if agree(refused is not None):
        if refused is not None:
            print(f"{lock.prog}: {refused}", file=sys.stderr, flush=True)
            refused.reported = True
        agree(True)  # the others leave only now: a launcher stops every rank as soon as one has exited
        raise refused or RunDirBusy(f"rank 0 could not take the lock of {directory} (its message says why)")
    try:
        yield lock
    finally:
        lock.release()


def mount_of(path: Path, mounts: str | None = None) -> tuple[str, str, str]:
    """(mount point, file system type, options) of the mount holding ``path``, from /proc/mounts."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return ("", "", "")
    target = os.path.realpath(path)
    best = ("", "", "")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2], fields[3])
    return best


def scope_warning(path: Path, mounts: str | None = None) -> str | None:
    """Why the lock on ``path`` may not stop a run on another machine, or None where it does (local
    disks) or where nothing is known about the file system."""
    point, fstype, options = mount_of(path, mounts)
    opts = set(options.split(","))
    where = f"{path} is on {fstype} ({point})"
    if fstype in ("nfs", "nfs4"):
        local = sorted(opts & {"nolock", "local_lock=flock", "local_lock=all"})
        if local:
            return (
                f"{where} mounted with {','.join(local)}"
                ": its locks are local to each machine, so the run-directory lock does not stop a second "
                "run on another node; make sure only one job uses this directory"
            )
        return None  # flock is a lock on the server (NLM / NFSv4), released when the client lets go
    if fstype == "lustre":
        if "flock" in opts:
            return None
        scope = (
            "local to each client (localflock)" if "localflock" in opts else "not enabled (no flock option)"
        )
        return (
            f"{where}: its flock is {scope}, so the run-directory lock does not stop a second run on another "
            "node; make sure only one job uses this directory (or mount with -o flock)"
        )
    name = _SHARED.get(fstype) or ("FUSE" if fstype.startswith("fuse") else None)
    if name is not None:
        return (
            f"{where}, a {name} file system: whether its flock reaches other machines depends on how it is "
            "set up, so the run-directory lock may stop a second run on this node only"
        )
    return None
