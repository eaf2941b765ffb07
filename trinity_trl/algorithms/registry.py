"""Name -> class registries for every algorithm component family, and loading components from outside the
package: modules named with ``--import`` (`import_components`) and the ``trinity_trl.components``
entry point group (`load_entry_points`, run the first time a registry is asked for a name it lacks).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

# packages declare ``[project.entry-points."trinity_trl.components"] my_losses = "my_pkg.losses"``; loading the
# entry point imports the module, whose ``@POLICY_LOSS_FN.register(...)`` decorators register its components
ENTRY_POINT_GROUP = "trinity_trl.components"
_entry_points_loaded = False


def load_entry_points() -> None:
    """Import every ``trinity_trl.components`` entry point once (they register their components)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry_point.load()


def import_components(target: str):
    """Import ``target``, a module name (``my_losses``, ``pkg.losses``) or a ``.py`` file path, so the
    components it registers can be named in a config; returns the module. A file is imported under its
    stem as module name (once: a second call returns the same module)."""
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise ImportError(f"--import {target}: no such file")
        name = os.path.splitext(os.path.basename(path))[0]
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
            return loaded
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as err:
        if err.name != target.split(".")[0] and err.name != target:
            raise
        raise ImportError(
            f"--import {target}: no module named {target!r} (give a module on sys.path or a .py file)"
        ) from None


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
        if isinstance(name, str) and name not in self._entries:
            load_entry_points()
        if not isinstance(name, str) or name not in self._entries:
            raise ValueError(f"Unknown {self.kind} {name!r}; known names: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        load_entry_points()
        return list(self._entries)

    list = names  # Trinity spelling

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str) and name not in self._entries:
            load_entry_points()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
