"""One registry per extension point (encoders, tasks, partition schemes, algorithms).

Follows torchvision's rules: a decorator registers by name, a duplicate name is an
error, and lookups of unknown names list what exists.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from utils.errors import TaskHetError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects (classes or factories) of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")``; raises on a duplicate name."""

        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return decorator

    def get(self, name: str) -> T:
        """The entry called ``name``; a :class:`TaskHetError` listing the choices otherwise."""
        if name not in self._entries:
            raise TaskHetError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
