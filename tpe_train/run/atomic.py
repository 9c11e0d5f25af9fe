"""Files that a resume, a study or a reader depends on, written so that a crash leaves the old one or
the new one, never half of either: a temporary sibling, fsync, rename, fsync of the folder.

Temporary names carry the host, the process and a random part, so that two processes, on one node or on
two nodes of a shared file system, never write or delete each other's temporaries.

Standard library only: the launcher uses it too.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any

#: What every temporary name of this project starts with, after the leading dot: ``.NAME.tpe-tmp-...``.
TEMP_MARK = ".tpe-tmp-"


def temp_name(path: Path, kind: str = "tmp") -> Path:
    """A hidden sibling of ``path`` that no other process, here or on another host, will choose."""
    host = socket.gethostname().split(".")[0] or "host"
    tag = f"{kind}-{host}-{os.getpid()}-{secrets.token_hex(4)}"
    return path.with_name(f".{path.name}{TEMP_MARK}{tag}")


def is_temp(path: Path) -> bool:
    """Whether ``path`` is a temporary that ``temp_name`` made (for cleaners: only these are ours)."""
    return path.name.startswith(".") and TEMP_MARK in path.name


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically and durably."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    """Replace ``path`` with ``data`` as JSON atomically and durably."""
    write_text(path, json.dumps(data, indent=indent) + "\n")
