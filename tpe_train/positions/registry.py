"""A small explicit registry: one per plug point, decorator next to the implementation.

A registry may also be given a loader (``load_with``) that adds entries from elsewhere (installed
packages' entry points) on its first lookup, once; entries it could not add are recorded as broken with
the reason, which a lookup of that name reports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes (or builders). Duplicate names raise; a miss lists the valid names."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}
        self._broken: dict[str, str] = {}  # name -> why the loader could not add it
        self._loader: Callable[[Registry[T]], None] | None = None

    def load_with(self, loader: Callable[[Registry[T]], None]) -> None:
        """Run ``loader(self)`` once, at the first lookup (not now: importing stays cheap)."""
        self._loader = loader

    def _load(self) -> None:
        loader, self._loader = self._loader, None
        if loader is not None:
            loader(self)

    def mark_broken(self, name: str, why: str) -> None:
        """Record that ``name`` was asked to be added but could not be, and why."""
        self._broken.setdefault(name, why)

    def broken(self, name: str) -> str | None:
        """Why ``name`` could not be added (a broken plugin), or None."""
        self._load()
        return self._broken.get(name)

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` above a class."""

        def deco(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The entry called ``name``; a ``KeyError`` naming the valid choices otherwise."""
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            if name in self._broken:
                raise KeyError(f"{self.what} {name!r}: {self._broken[name]}") from None
            raise KeyError(
                f"unknown {self.what} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        self._load()
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(self._entries)
