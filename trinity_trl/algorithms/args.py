"""Constructor arguments, the one source of every component's defaults (docs/algorithms/index.md#default-arguments).

A component declares its arguments once, as a typed constructor signature. What a preset uses when
the user gives no arguments, ``default_args()``, is derived from that signature by one rule
(`ComponentArgs.default_args`), so a default is never written twice. Where Trinity-RFT's preset
value differs from the constructor's default (PPO's ``clip_range`` is ``None`` in the constructor and
0.2 in a preset, REC's primes, GSPO's clip bounds, the entropy coefficient), the class declares
that value in ``preset_defaults``, next to the signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

# a constructor argument that selects naming only (docs/algorithms/index.md#default-arguments), never a preset setting
_NOT_PRESET = ("self", "backend")


def constructor_defaults(cls: type) -> dict[str, Any]:
    """``{name: default}`` for every constructor parameter of ``cls`` that has a default, keyword-only
    ones included (``backend``, ``*args`` and ``**kwargs`` left out).

    ``constructor_defaults(POLICY_LOSS_FN.get("cispo"))`` gives every default of the `cispo` loss, the documented
    values of its arguments.
    """
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name not in _NOT_PRESET and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty
    }


def _preset_parameters(cls: type) -> list[inspect.Parameter]:
    return [
        p
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if name not in _NOT_PRESET and p.kind is p.POSITIONAL_OR_KEYWORD
    ]


class ComponentArgs:
    """Mixin of every component base class: ``default_args()`` derived from the constructor.

    The rule: ``default_args()`` lists, in signature order, each positional-or-keyword constructor
    parameter except ``backend``, with its default,

    * leaving out parameters without a default and, when `omit_none_defaults` is true (policy
      losses, KL), parameters whose default is ``None`` (an unset option: Trinity's presets leave it
      out too);
    * then laying `preset_defaults` on top: a listed parameter takes that value and is
      always present.

    Keyword-only parameters (after ``*``) are never listed: they are ``trinity_trl``'s own options
    (SAPO's ``form``, DPO's ``allow_odd_rows``) or describe the trainer rather than the algorithm
    (MIX/CHORD's sample weights), which a preset does not set.
    """

    # Trinity-RFT's preset values that differ from the constructor's defaults
    preset_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    # leave ``None``-default parameters out of default_args() (unless in preset_defaults)
    omit_none_defaults: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = {p.name for p in _preset_parameters(cls)}
        unknown = sorted(set(cls.preset_defaults) - names)
        if unknown:
            raise TypeError(
                f"{cls.__name__}.preset_defaults names {unknown}, which are not positional-or-keyword "
                f"constructor parameters ({', '.join(sorted(names)) or 'none'})"
            )

    @classmethod
    def merged_args(cls, given: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments a component is built with when a user's ``given`` arguments are laid over its
        `default_args` (``component_args_mode="merge"``, docs/configuration.md). A component whose
        defaults would override one of the user's arguments in its constructor (GSPO's preset clip bounds over a
        user's symmetric ``clip_range``) drops them here."""
        return {**cls.default_args(), **given}

    @classmethod
    def default_args(cls) -> dict[str, Any]:
        """The arguments a preset uses when the user gives none (docs/algorithms/index.md#default-arguments): a fresh
        dict, derived from the constructor signature and `preset_defaults` (see the class docstring)."""
        args: dict[str, Any] = {}
        for p in _preset_parameters(cls):
            if p.name in cls.preset_defaults:
                args[p.name] = cls.preset_defaults[p.name]
            elif p.default is p.empty or (p.default is None and cls.omit_none_defaults):
                continue
            else:
                args[p.name] = p.default
        return args
