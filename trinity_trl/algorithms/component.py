"""One typed value that chooses a component and sets its arguments, and the check of those arguments.

``Component("cispo", clip_range_high=5.0)`` in Python, ``policy_loss: {name: cispo, clip_range_high: 5.0}``
in YAML and ``--policy_loss.clip_range_high 5.0`` on the command line are the same value. Its keys are
the component's constructor arguments, checked against the constructor's signature by
`check_arguments` (one-line errors that list the allowed keys and their types). A component may
accept TRL's names for its arguments (``epsilon_high`` for ``clip_range_high``): it declares them in
``trl_config_fields``, and `rename_trl_arguments` renames them.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Mapping
from typing import Any


class Component:
    """A component's registry name (``None``: the preset's choice) and its constructor arguments.

    ``Component("cispo", clip_range_high=5.0)``; ``Component(clip_range_high=5.0)`` keeps the preset's
    loss and sets one of its arguments. `parse` reads the YAML / command-line spellings.
    """

    __slots__ = ("name", "args")

    def __init__(self, name: str | None = None, /, **args: Any):
        if name is not None and not isinstance(name, str):
            raise ValueError(f"a component's name must be a string, got {name!r}")
        self.name = name
        self.args = dict(args)

    @classmethod
    def parse(cls, owner: str, field: str, value: Any) -> Component | None:
        """``value`` as a `Component`: ``None``, a ``Component``, a mapping with an optional ``name``
        key (YAML), a JSON object string (command line) or a bare name (``"cispo"``)."""
        if value is None or isinstance(value, Component):
            return value
        if isinstance(value, str):
            text = value.strip()
            if not text.startswith("{"):
                return cls(text)
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"{owner}: {field} is not a JSON object ({err.msg}): {value!r}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{owner}: {field} must be a name, a mapping {{name: ..., argument: value}} or a Component, "
                f"got {type(value).__name__}"
            )
        args = dict(value)
        return cls(args.pop("name", None), **args)

    def copy(self) -> Component:
        """A new `Component` with the same name and a copy of the arguments."""
        return Component(self.name, **self.args)

    def with_args(self, **args: Any) -> Component:
        """A new `Component` with the same name and ``args`` laid over these arguments
        (``component.with_args(loss_agg_mode=mode)``)."""
        return Component(self.name, **{**self.args, **args})

    def to_dict(self) -> dict[str, Any]:
        """The YAML spelling: ``{"name": ..., **args}`` (no ``name`` key when it is ``None``)."""
        return ({"name": self.name} if self.name is not None else {}) | self.args

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Component) and (self.name, self.args) == (other.name, other.args)

    def __hash__(self) -> int:
        return hash((self.name, json.dumps(self.args, sort_keys=True, default=repr)))

    def __repr__(self) -> str:
        parts = ([repr(self.name)] if self.name is not None else []) + [f"{k}={v!r}" for k, v in self.args.items()]
        return f"Component({', '.join(parts)})"


# ------------------------------------------------------------------------------- argument checking
def _parameters(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The named constructor parameters of ``cls`` and whether it also takes ``**kwargs``."""
    params = inspect.signature(cls).parameters
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that cannot be evaluated here: check names only
        return {}


def _type_text(hint: Any) -> str:
    if hint is inspect.Parameter.empty or hint is Any:
        return "any"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (an ``int`` fits ``float``; a ``bool`` fits only
    ``bool``; a list fits a ``tuple``; elements of containers are not checked)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None) or hint is None:
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (tuple, list) or hint in (tuple, list):
        return isinstance(value, list | tuple)
    if origin is not None:
        return not isinstance(origin, type) or isinstance(value, origin)
    return not isinstance(hint, type) or isinstance(value, hint)


def argument_types(cls: type) -> dict[str, str]:
    """``{argument: type}`` of every argument a component's constructor takes (``backend`` left out)."""
    named, _ = _parameters(cls)
    hints = _hints(cls)
    return {n: _type_text(hints.get(n, p.annotation if hints else inspect.Parameter.empty)) for n, p in named.items()}


def rename_trl_arguments(kind: str, name: str, cls: type, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with TRL's names of arguments (``cls.trl_config_fields``, e.g. ``epsilon_high``) renamed to
    ours (``clip_range_high``); a value given under both names is an error."""
    aliases: Mapping[str, str] = getattr(cls, "trl_config_fields", {}) or {}
    out: dict[str, Any] = {}
    for key, value in args.items():
        ours = aliases.get(key, key)
        if ours in out or (ours != key and ours in args):
            raise ValueError(f"{kind} {name!r}: {key!r} is TRL's name of {ours!r}; set it once")
        out[ours] = value
    return out


def check_arguments(kind: str, name: str, cls: type, args: Mapping[str, Any]) -> None:
    """Every key of ``args`` a parameter of ``cls``'s constructor and every value of its annotated type;
    otherwise a one-line ``ValueError`` naming the allowed keys and their types."""
    named, takes_kwargs = _parameters(cls)
    allowed = "; ".join(f"{n}: {t}" for n, t in argument_types(cls).items() if n != "backend") or "none"
    unknown = sorted(k for k in args if k not in named)
    if unknown and not takes_kwargs:
        aliases: Mapping[str, str] = getattr(cls, "trl_config_fields", {}) or {}
        trl = f" (TRL's names: {', '.join(f'{t} -> {o}' for t, o in aliases.items())})" if aliases else ""
        raise ValueError(f"{kind} {name!r} takes no argument(s) {unknown}; its arguments are: {allowed}{trl}")
    hints = _hints(cls)
    for key, value in args.items():
        hint = hints.get(key, inspect.Parameter.empty)
        if key in named and not _matches(value, hint):
            raise ValueError(
                f"{kind} {name!r}: {key} must be {_type_text(hint)}, got {type(value).__name__} {value!r}; "
                f"its arguments are: {allowed}"
            )
