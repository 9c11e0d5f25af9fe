"""Stop points of a writer: every call that creates or opens a file for writing, syncs, renames or
swaps, counted, or made to fail (an ``OSError``, as a full disk or a lost mount gives) or to kill the
process (SIGKILL) at the k-th one. The fault-injection tests and their child processes use it."""

from __future__ import annotations

import builtins
import os
import pathlib
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tpe_train.run import outputs

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class Stopped(OSError):
    """The injected failure."""


class Stops:
    """Counts stop points; ``stop_at`` k > 0 fails (or with ``kill`` kills the process) at the k-th."""

    def __init__(self, stop_at: int = 0, kill: bool = False) -> None:
        self.stop_at, self.kill = stop_at, kill
        self.points: list[str] = []

    @property
    def count(self) -> int:
        return len(self.points)

    def hit(self, what: str) -> None:
        self.points.append(what)
        if len(self.points) == self.stop_at:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise Stopped(f"stopped before {what} (stop point {self.stop_at})")


def _writes(mode: Any) -> bool:
    return isinstance(mode, str) and any(c in mode for c in "wxa+")


@contextmanager
def instrumented(stops: Stops) -> Iterator[Stops]:
    """While inside, every write, sync, rename and swap of this process passes ``stops.hit`` first."""
    real_open, real_path_open, real_os_open = builtins.open, pathlib.Path.open, os.open
    real = {name: getattr(os, name) for name in ("fsync", "replace", "rename", "unlink", "rmdir")}
    real_exchange = outputs._exchange

    def named(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            stops.hit(f"{name} {args[0] if args else ''}")
            return fn(*args, **kw)

        return wrapper

    def open_(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if _writes(mode):
            stops.hit(f"open {file}")
        return real_open(file, mode, *args, **kw)

    def path_open(self: pathlib.Path, mode: str = "r", *args: Any, **kw: Any) -> Any:
        if _writes(mode):
            stops.hit(f"open {self}")
        return real_path_open(self, mode, *args, **kw)

    def os_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & _WRITE_FLAGS:
            stops.hit(f"os.open {path}")
        return real_os_open(path, flags, *args, **kw)

    builtins.open = open_
    pathlib.Path.open = path_open  # type: ignore[method-assign]
    os.open = os_open
    for name, fn in real.items():
        setattr(os, name, named(f"os.{name}", fn))
    outputs._exchange = named("renameat2", real_exchange)
    try:
        yield stops
    finally:
        builtins.open = real_open
        pathlib.Path.open = real_path_open  # type: ignore[method-assign]
        os.open = real_os_open
        for name, fn in real.items():
            setattr(os, name, fn)
        outputs._exchange = real_exchange
