"""Name -> class registries for every algorithm component family."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from a Trinity-RFT key (e.g. ``"ppo"``) to a component class.

    ``get`` of an unknown name raises ``ValueError`` listing every known name, so a typo in a
    config fails with the list of what is allowed.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = obj
            obj.name = name
            return obj

        return decorator

    def unregister(self, name: str) -> T:
        """Remove ``name`` and return what it named. For tests and plugins that register a component
        for a while (``register`` refuses a name that is taken); an unknown name is a ``ValueError``."""
        if name not in self._entries:
            raise ValueError(f"{self.kind} {name!r} is not registered; known names: {', '.join(self.names())}")
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"Unknown {self.kind} {name!r}; known names: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)

    list = names  # Trinity spelling

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
