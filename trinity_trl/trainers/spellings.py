"""The configuration spellings that 0.2 removed (CHANGELOG.md), each refused in one line that gives its replacement.

A config class lists its removed spellings in ``removed_spellings`` (``{old name: what to write instead}``).
Python keyword arguments are refused by `refuse_removed_spellings` (called from the config's ``__new__``,
before the dataclass would raise a bare ``unexpected keyword`` error); the recipes' parser names the same
replacement for a YAML key or a command-line option (``recipes/common.py``).
"""

from __future__ import annotations

from typing import Any, ClassVar

#: each component field and the flat pair (``<old>``, ``<old>_args``) it replaced
FLAT_COMPONENT_FIELDS = {
    "policy_loss": "policy_loss_fn",
    "advantage": "advantage_fn",
    "kl_loss": "kl_loss_fn",
    "kl_penalty": "kl_penalty_fn",
    "entropy_loss": "entropy_loss_fn",
}


def flat_component_spellings(*components: str) -> dict[str, str]:
    """The removed ``<flat>`` / ``<flat>_args`` pair of each of ``components`` and what to write instead."""
    removed = {}
    for new in components:
        old = FLAT_COMPONENT_FIELDS[new]
        removed[old] = f"{new}={{'name': ...}} (YAML `{new}: {{name: ...}}`, command line --{new}.name ...)"
        removed[f"{old}_args"] = (
            f"{new}={{'argument': value}} (YAML `{new}: {{argument: value}}`, command line --{new}.argument value)"
        )
    return removed


def component_argument_spelling(component: str, argument: str) -> str:
    """What to write instead of a removed flat field that was one argument of ``component``."""
    return (
        f"{component}={{'{argument}': value}} (YAML `{component}: {{{argument}: value}}`, command line "
        f"--{component}.{argument} value)"
    )


def removed_spelling_message(owner: str, old: str, replacement: str) -> str:
    return f"{owner}: {old} was removed in trinity_trl 0.2; write {replacement} (CHANGELOG.md)"


def refuse_removed_spellings(cls: type, kwargs: dict[str, Any]) -> None:
    """A ``TypeError`` naming the replacement of the first removed spelling among ``kwargs``."""
    removed: dict[str, str] = getattr(cls, "removed_spellings", {})
    for old in kwargs:
        if old in removed:
            raise TypeError(removed_spelling_message(cls.__name__, old, removed[old]))


class RefusesRemovedSpellings:
    """Base of the trinity_trl configs: ``Config(policy_loss_fn=...)`` is a one-line ``TypeError`` giving the new
    spelling, not the dataclass's bare ``unexpected keyword argument``."""

    removed_spellings: ClassVar[dict[str, str]] = {}

    def __new__(cls, *args: Any, **kwargs: Any):
        refuse_removed_spellings(cls, kwargs)
        return super().__new__(cls)
