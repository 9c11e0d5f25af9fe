"""Files of a folder that came from elsewhere: a checkpoint, an export, a token store.

Such a folder is handed between people and clusters, so every name read from its own files (an index's
chunk files, a manifest's entries, an export's hashes, ``latest``) is data, never a path: it must be a
plain name that the folder's index or manifest lists (no separator, not ``..`` or ``.``, not absolute,
no NUL, at most ``MAX_NAME`` characters), and the file it names must be a regular file of the folder
itself (opened with ``O_NOFOLLOW``, so that a symlink is refused, and checked with ``fstat``, so that a
device or a fifo is refused) of at most a given size. JSON is read only up to a size and checked for the
types its reader expects. Each refusal is one ``MemberError`` naming the file and the fix.

Standard library only: every layer reads such folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

MAX_NAME = 255
MIB = 1 << 20
#: The largest JSON file read from a checkpoint, an export or a token store (an index of a large model
#: with many ranks is a few MiB).
MAX_JSON = 256 * MIB
#: The largest text file (a config, a tokenizer) read from one.
MAX_TEXT = 256 * MIB
#: No limit on a data file's size (weights, shards): only that it is a regular file.
ANY_SIZE = -1

FIX = (
    "the folder was damaged or made by something other than tpe-train; use another copy, or write it "
    "again with the tpe-train command that made it"
)


class MemberError(ValueError):
    """A file of a checkpoint, an export or a token store that is not what tpe-train writes there."""


Error = type[Exception]


def check_name(
    name: object, where: Path, listed: object = None, nested: bool = False, error: Error = MemberError
) -> str:
    """``name`` if it is a plain file name (``nested``: ``/``-separated plain names) that ``listed``
    holds (when given); otherwise ``error`` naming ``where`` (the file that holds the name)."""
    problem = _name_problem(name, nested)
    if problem is None and listed is not None and name not in listed:  # type: ignore[operator]
        problem = "is not listed in the folder's manifest"
    if problem is not None:
        raise error(
            f"{where} names the file {name!r}, which {problem}; a name in it must be a plain file name of "
            f"its own folder. Nothing was read through it: {FIX}"
        )
    return str(name)


def _name_problem(name: object, nested: bool) -> str | None:
    if not isinstance(name, str):
        return f"is of type {type(name).__name__}, not a string"
    if not name or len(name) > MAX_NAME * (8 if nested else 1):
        return "is empty or too long"
    if "\0" in name:
        return "holds a NUL character"
    if not name.isprintable() or any("\ud800" <= c <= "\udfff" for c in name):
        return "holds an unprintable character or a lone surrogate"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "is absolute"
    if name == ".." or name.startswith(("../", "..\\")) or "/../" in name:
        return "points outside its folder"
    parts = name.split("/") if nested else [name]
    for part in parts:
        if part in ("", ".", ".."):
            return "points outside its folder" if part == ".." else "holds an empty or '.' part"
        separators = {os.sep, os.altsep or os.sep, "\\", "/"}
        if any(s in part for s in separators):
            return "holds a path separator"
        if len(part) > MAX_NAME:
            return "is too long"
    return None


def open_member(
    folder: Path, name: str, limit: int = MAX_TEXT, error: Error = MemberError, nested: bool = False
) -> int:
    """A read-only descriptor of ``folder/name``: a regular file of the folder (not a symlink, a device
    or a fifo, no symlink on the way) of at most ``limit`` bytes (``ANY_SIZE``: any)."""
    check_name(name, Path(folder) / name, nested=nested, error=error)
    path = Path(folder) / name
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a fifo opens without waiting
    parts = name.split("/")
    for depth in range(1, len(parts)):  # a nested name: no folder on the way is a symlink
        inner = Path(folder, *parts[:depth])
        if _is_link(inner):
            raise error(f"{inner} is a symlink, where a folder of {folder} is expected; {FIX}")
    try:
        member = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path} does not exist; the folder is incomplete: {FIX}") from None
    except OSError as err:
        kind = "a symlink" if _is_link(path) else os.strerror(err.errno or 0)
        raise error(f"{path} cannot be read as a file of {folder} ({kind}); {FIX}") from None
    info = os.fstat(member)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"is not a regular file ({_kind(info.st_mode)})"
    elif limit >= 0 and info.st_size > limit:
        problem = f"is {info.st_size / MIB:,.0f} MiB, more than the {limit / MIB:,.0f} MiB such a file can be"
    if problem is not None:
        os.close(member)
        raise error(f"{path} {problem}; nothing was read from it: {FIX}")
    os.set_blocking(member, True)
    return member


def _is_link(path: Path) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    kinds = {
        stat.S_IFCHR: "a character device",
        stat.S_IFBLK: "a block device",
        stat.S_IFIFO: "a fifo",
        stat.S_IFSOCK: "a socket",
        stat.S_IFDIR: "a folder",
    }
    return kinds.get(stat.S_IFMT(mode), "not a plain file")


@contextlib.contextmanager
def opened(
    folder: Path, name: str, limit: int = ANY_SIZE, error: Error = MemberError, nested: bool = False
) -> Iterator[BinaryIO]:
    """``open_member`` as a binary file object."""
    with os.fdopen(open_member(folder, name, limit, error, nested), "rb") as f:
        yield f


def read_bytes(folder: Path, name: str, limit: int = MAX_TEXT, error: Error = MemberError) -> bytes:
    with opened(folder, name, limit, error) as f:
        return f.read(limit + 1 if limit >= 0 else -1)


def read_text(folder: Path, name: str, limit: int = MAX_TEXT, error: Error = MemberError) -> str:
    data = read_bytes(folder, name, limit, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        where = Path(folder) / name
        raise error(f"{where} is not UTF-8 text ({err.reason} at byte {err.start}); {FIX}") from None


def read_json(
    folder: Path,
    name: str,
    fields: Mapping[str, type | tuple[type, ...]] | None = None,
    limit: int = MAX_JSON,
    error: Error = MemberError,
) -> dict[str, Any]:
    """A JSON object of at most ``limit`` bytes whose ``fields`` (name: type; every one required) have
    their types (``int`` never a boolean)."""
    path = Path(folder) / name
    try:
        data = loads(read_text(folder, name, limit, error))
    except ValueError as err:
        if isinstance(err, error):
            raise
        raise error(f"{path} is not valid JSON ({err}); {FIX}") from None
    if not isinstance(data, dict):
        raise error(f"{path} holds a JSON {type(data).__name__}, where an object is expected; {FIX}")
    for key, kind in (fields or {}).items():
        check_type(data.get(key), kind, f"{path}: {key!r}", error)
    return data


def loads(text: str | bytes) -> Any:
    """``json.loads``, where nesting too deep for the parser is a ``ValueError`` like any other bad JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested deeper than a JSON parser follows") from None


def check_type(value: Any, kind: type | tuple[type, ...], what: str, error: Error = MemberError) -> Any:
    """``value`` when it is a ``kind`` (a boolean is no number); otherwise ``error`` naming ``what``."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        article = "an" if names[0] in "aeiou" else "a"
        raise error(f"{what} is {json.dumps(value)[:60]}, where {article} {names} is expected; {FIX}")
    return value


def check_file(
    folder: Path, name: str, limit: int = ANY_SIZE, error: Error = MemberError, nested: bool = False
) -> Path:
    """``folder/name`` checked as ``open_member`` checks it, for a library that opens it by path."""
    os.close(open_member(folder, name, limit, error, nested))
    return Path(folder) / name


def sha256(folder: Path, name: str, error: Error = MemberError, nested: bool = False) -> str:
    """The SHA-256 of a member file (regular, in the folder; any size)."""
    digest = hashlib.sha256()
    with opened(folder, name, ANY_SIZE, error, nested) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def lstat_regular(path: Path) -> os.stat_result | None:
    """``path``'s own status when it is a regular file (not through a symlink), else None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info if stat.S_ISREG(info.st_mode) else None


def tree_size(folder: Path) -> int:
    """The bytes of the regular files under ``folder``, never following a symlink."""
    total = 0
    for root, _, files in os.walk(folder):  # os.walk does not descend into symlinked folders
        for name in files:
            info = lstat_regular(Path(root) / name)
            total += info.st_size if info is not None else 0
    return total
