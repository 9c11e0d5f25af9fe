"""A small explicit registry: one per plug point, decorator next to the implementation."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to classes (or builders). Duplicate names raise; a miss lists the valid names."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

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
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.what} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
