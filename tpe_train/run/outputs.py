"""Output folders that a command writes whole (exports, averaged models, reports, token stores), and
the one rule they follow: no command deletes what it did not write.

Each such folder holds a marker, ``.tpe-output.json``: the command and the kind of output that wrote it
and every file it wrote (``record`` adds the files another command of this project writes into it later,
such as ``tpe-eval --out``'s figures in an export). An existing ``--out`` is reused only when it is empty
or holds an earlier output of the same kind and nothing else; it is then replaced atomically: the new
output is built in a hidden temporary sibling, swapped in (``renameat2(RENAME_EXCHANGE)`` where the
kernel and file system have it, else two renames) and only then is the old one removed. Anything else
is refused before any work starts, with one paragraph naming the folder and the fix: a run directory, a
folder holding a user's files, a folder inside a checkpoint, a run's ``checkpoints`` or another output,
and a folder that is, holds or lies inside what the command reads.

    check_output(out, "tpe-ckpt export", "export", sources=[ckpt])  # early, before the long work
    with written_directory(out, "tpe-ckpt export", "export", sources=[ckpt]) as tmp:
        ...  # fill tmp; an exception leaves out as it was

Standard library only (the layer every other one may import).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tpe_train.run import members
from tpe_train.run.atomic import TEMP_MARK, fsync_dir, temp_name, write_json

log = logging.getLogger(__name__)

MARKER = ".tpe-output.json"
VERSION = 1
#: What a folder is that no output may replace (a phrase, and whether nothing may be written inside it
#: either), or None: ``ckpt.rundir.RunDir.what`` knows run directories, their checkpoints and checkpoints.
Protected = Callable[[Path], "tuple[str, bool] | None"]
_FIX = "choose another --out (a new or empty folder), or move or remove it yourself"


class OutputRefused(ValueError):
    """An output folder that a command will not write into or replace; the message names it and the fix."""


def marker(folder: Path) -> dict[str, Any] | None:
    """The marker of ``folder`` (None when it has none or an unreadable one). Read as a file of a folder
    from elsewhere: a regular file, not through a symlink, at most 1 MiB."""
    if members.lstat_regular(Path(folder) / MARKER) is None:  # only a plain file is opened at all
        return None
    try:
        data = json.loads(members.read_text(Path(folder), MARKER, members.MIB))
    except (OSError, ValueError):  # MemberError is a ValueError
        return None
    ok = isinstance(data, dict) and isinstance(data.get("kind"), str) and isinstance(data.get("files"), list)
    return data if ok and isinstance(data.get("also", []), list) else None  # ``record`` extends "also"


def files_of(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative, ``/``-separated, sorted), the marker excepted."""
    found = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = Path(dirpath, name).relative_to(folder).as_posix()
            if rel != MARKER:
                found.append(rel)
    return sorted(found)


def _foreign(folder: Path, known: set[str]) -> list[str]:
    """What ``folder`` holds that ``known`` does not list: files, and folders with no listed file below."""
    out = [rel for rel in files_of(folder) if rel not in known]
    prefixes = {p.as_posix() for rel in known for p in Path(rel).parents}
    for dirpath, dirs, _ in os.walk(folder):
        for name in dirs:
            rel = Path(dirpath, name).relative_to(folder).as_posix()
            if rel not in prefixes and not any(f.startswith(rel + "/") for f in out):
                out.append(rel + "/")
    return sorted(out)


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _refuse(out: Path, why: str) -> OutputRefused:
    return OutputRefused(f"--out {out} {why}; nothing was written or removed. {_FIX[0].upper()}{_FIX[1:]}")


def _check_place(out: Path, sources: Iterable[Path], protected: Protected | None) -> None:
    """Refuse an ``out`` that overlaps a source or lies inside another output or a ``protected`` place."""
    real = Path(os.path.realpath(out))
    for source in sources:
        src = Path(os.path.realpath(source))
        if _within(src, real):
            raise _refuse(out, f"is or holds {source}, which this command reads")
        if _within(real, src):
            raise _refuse(out, f"lies inside {source}, which this command reads")
    for parent in real.parents:
        found = marker(parent)
        if found is not None and not found.get("nested"):  # (a resharded run directory holds exports)
            raise _refuse(out, f"lies inside {parent}, an output of tpe-train that is replaced whole")
        what = protected(parent) if protected is not None else None
        if what is not None and what[1]:
            raise _refuse(out, f"lies inside {parent}, {what[0]}")


def check_output(
    out: Path,
    command: str,
    kind: str,
    sources: Iterable[Path] = (),
    legacy: Callable[[Path], bool] | None = None,
    protected: Protected | None = None,
) -> None:
    """Raise ``OutputRefused`` unless ``command`` may write its ``kind`` of output at ``out``: a new
    folder, an empty one, or an earlier output of this kind (its marker's, or, where ``legacy`` says so,
    one written before markers existed) that holds nothing else. ``sources``: what the command reads;
    ``protected``: what no output may replace (see ``Protected``)."""
    out = Path(out)
    _check_place(out, [Path(s) for s in sources], protected)
    if out.is_symlink():
        raise _refuse(out, "is a symbolic link (its target would not be replaced, the link would)")
    if not out.exists():
        return
    if not out.is_dir():
        raise _refuse(out, "is a file, not a folder")
    if not any(out.iterdir()):
        return
    found = marker(out)
    if found is None:
        if legacy is not None and legacy(out):
            return
        what = protected(out) if protected is not None else None
        if what is not None:
            raise _refuse(out, f"is {what[0]}")
        shown = ", ".join(_foreign(out, set())[:4])
        raise _refuse(out, f"exists and holds files that {command} did not write ({shown})")
    if found["kind"] != kind:
        other = f"{found['kind']}, written by {found.get('command')}"
        raise _refuse(out, f"holds another kind of output ({other})")
    foreign = _foreign(out, {str(f) for f in found["files"]})
    if foreign:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        raise _refuse(out, f"holds an earlier {kind}, and also files that tpe-train did not write ({shown})")


def _fsync_tree(folder: Path) -> None:
    for dirpath, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def mark_output(folder: Path, command: str, kind: str) -> None:
    """Write the marker of a finished output built in ``folder`` (before it is renamed into place), for
    a writer that publishes on its own (a token store, which is never replaced, only reused)."""
    _write_marker(folder, command, kind)


def _write_marker(folder: Path, command: str, kind: str, nested: bool = False) -> None:
    data = {"version": VERSION, "command": command, "kind": kind, "files": files_of(folder)}
    if nested:  # a run directory: other outputs (its exports) may be written inside it
        data["nested"] = True
    write_json(folder / MARKER, data)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2``); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE))
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` at ``out``; an older ``out`` is removed only once ``tmp`` is in place."""
    if not out.exists():
        os.rename(tmp, out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp)  # now the old output
    else:
        old = temp_name(out, "old")
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    fsync_dir(out.parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(out: Path) -> None:
    """Tidy what a writer of ``out`` on this host left when it was killed (its temporaries carry host and
    pid): a half-built ``new`` folder is removed; an ``old`` one, moved aside during a swap, is put back
    when ``out`` is missing (the swap stopped halfway), else removed (the swap had finished)."""
    out = Path(out)
    host = socket.gethostname().split(".")[0] or "host"
    prefix = re.escape(f".{out.name}{TEMP_MARK}")
    pattern = re.compile(rf"^{prefix}(new|old)-{re.escape(host)}-(\d+)-[0-9a-f]+$")
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.iterdir()):
        m = pattern.match(path.name)
        if m is None or not path.is_dir() or _alive(int(m.group(2))):
            continue
        if m.group(1) == "old" and not out.exists() and not out.is_symlink():
            os.rename(path, out)
            log.warning("put %s back: a replacement of it was stopped halfway", out)
        else:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, left by a stopped writer of %s", path.name, out)


@contextlib.contextmanager
def written_directory(
    out: Path,
    command: str,
    kind: str,
    sources: Iterable[Path] = (),
    legacy: Callable[[Path], bool] | None = None,
    protected: Protected | None = None,
) -> Iterator[Path]:
    """A folder to fill that appears at ``out`` only once complete (see the module docstring): the caller
    writes into the yielded temporary sibling; the marker is added, every file synced, and the folder
    swapped in. An exception removes the temporary folder and leaves ``out`` as it was."""
    out = Path(out)
    sources = [Path(s) for s in sources]
    recover(out)
    check_output(out, command, kind, sources, legacy, protected)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(out, "new")
    tmp.mkdir()
    try:
        yield tmp
        _write_marker(tmp, command, kind)
        _fsync_tree(tmp)
        check_output(out, command, kind, sources, legacy, protected)  # unchanged while this one was written
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def replaced_in_place(
    out: Path, command: str, kind: str, sources: Iterable[Path] = (), protected: Protected | None = None
) -> Iterator[Path]:
    """For an output that must be written at its own path (a run directory, whose files name it): an
    earlier output of this kind is moved aside to a hidden sibling, ``out`` is yielded to fill, and the
    old one is removed once the caller returns (the marker then lists what was written); an exception
    removes the new files and moves the old output back."""
    out = Path(out)
    check_output(out, command, kind, sources, protected=protected)
    aside = None
    if out.exists():
        aside = temp_name(out, "aside")  # not "old": ``recover`` must not take the partial new one for it
        os.rename(out, aside)
    try:
        yield out
        _write_marker(out, command, kind, nested=True)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        if aside is not None:
            os.rename(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside)


def record(folder: Path, names: Iterable[str], command: str) -> None:
    """Add ``names`` (relative to ``folder``) to its marker, when it has one: files another command of
    this project wrote into an output, which a later replacement of that output may then remove."""
    found = marker(folder)
    if found is None:
        return
    files = sorted({*map(str, found["files"]), *names})
    also = sorted({*found.get("also", []), command})
    write_json(Path(folder) / MARKER, {**found, "files": files, "also": also})
