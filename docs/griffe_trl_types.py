"""A griffe extension for the API reference (mkdocs.yml, mkdocstrings): TRL-style parameter types read as types.

The configs document their fields as TRL documents its own, ``name (`float`, *optional*, defaults to `1.0`):``.
mkdocstrings' Google parser takes everything in the parentheses as the type, so the reference's "Type" column would
show that markdown as raw text. This rewrites such a line before the docstring is parsed to
``name (float): *Defaults to* `1.0`. ...``: the types joined with ``|`` (a type expression the column renders), the
default moved to the description. Docstrings in the code stay in TRL's style.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# an entry's first line in a Parameters/Args section whose type holds TRL's markdown (backticks, *optional*)
_ENTRY = re.compile(r"^(?P<indent>\s+)(?P<name>\*{0,2}\w+(?:, \w+)*) \((?P<type>[^`]*`.*?)\):(?P<rest>.*)$")
_DEFAULT = re.compile(r",?\s*defaults to (?P<default>.+)$")


def plain_type(text: str) -> tuple[str, str | None]:
    """``("float", "`1.0`")`` from ``"`float`, *optional*, defaults to `1.0`"``: the types (backticks dropped, ``or``
    and commas as ``|``) and the default as written (``None`` when the text names none)."""
    default = None
    if found := _DEFAULT.search(text):
        default, text = found["default"].strip(), text[: found.start()]
    text = re.sub(r"\s*\([^)]*\)", "", text.replace("*optional*", ""))  # notes such as `str` (JSON)
    parts = [p.strip().strip("`").strip() for p in re.split(r",| or ", text)]
    return " | ".join(p for p in parts if p), default


def rewrite_docstring(text: str) -> str:
    """Every TRL-style parameter line of ``text`` in the form the Google parser reads as a type and a description."""
    lines = []
    for line in text.splitlines():
        found = _ENTRY.match(line)
        if found:
            types, default = plain_type(found["type"])
            default_text = f" *Defaults to* {default}." if default else ""
            line = f"{found['indent']}{found['name']} ({types}):{default_text}{found['rest']}"
        lines.append(line)
    return "\n".join(lines)


class TRLStyleTypes(griffe.Extension):
    """Rewrite the TRL-style parameter types of every docstring once the object tree is built."""

    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None and "`" in obj.docstring.value:
            obj.docstring.value = rewrite_docstring(obj.docstring.value)
