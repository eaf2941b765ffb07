"""What the typed request bodies of the policy endpoint share (`chat_request`, `responses_request`,
`messages_request`): a strict pydantic base, the error that names a bad field, and the one function that turns a
raw body into a typed one.

Each format's models mirror the request types of the package that speaks it (``openai`` for chat completions and
Responses, ``anthropic`` for Messages), strictly: a wrong type is refused as a wrong type (no ``"1"`` read as a
number, no ``1`` read as a string), a field the endpoint does not know is refused by name, and a field it knows but
cannot honour (one that would change what is sampled, so that the recorded log-probs would not be the sampled ones)
is refused with the reason. Imported only when an endpoint serves (pydantic comes with the ``agents`` extra).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

Number = StrictInt | StrictFloat


class BodyError(ValueError):
    """A request body the endpoint refuses; ``param`` is the dotted path of the first bad field (or ``None``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    """A request object: unknown fields refused, no type coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


class OpenAIBookkeeping(Strict):
    """The bookkeeping fields of OpenAI's chat-completions and Responses requests: accepted and unused, since they do
    not change what is sampled."""

    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None


@dataclass(frozen=True)
class Rules:
    """How a format's validation errors are worded.

    Attributes:
        refused: ``{dotted field: why}`` for a known field given a value other than its neutral one.
        unsupported: ``{dotted field: why}`` for a field of the API the endpoint does not take.
        tags: the tags of the format's tagged unions (a message's role, an item's or block's type): pydantic puts the
            tag in an error's location before the member's fields; it is no part of the field's path.
    """

    refused: Mapping[str, str] = field(default_factory=dict)
    unsupported: Mapping[str, str] = field(default_factory=dict)
    tags: frozenset[str] = frozenset()


#: pydantic's names of a union's branches, which appear in error locations and are no part of a field's path
_BRANCHES = ("str", "int", "float", "bool", "list", "dict", "none")


def where(loc: tuple, tags: frozenset[str] = frozenset()) -> str:
    """The dotted field path of an error location, without pydantic's union branch names (``str``,
    ``list[...]``, a model's class name) and the tags of tagged unions."""
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(str(item))
        elif item in tags and i < len(loc) - 1:
            continue  # the tag of a tagged union's member (a field of that name would be the last element)
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", item) and item not in _BRANCHES:
            parts.append(item)
    return ".".join(parts)


def _expected(message: str) -> str:
    return message.removeprefix("Input should be ").removeprefix("a valid ").removeprefix("an ")


def describe(errors: list[dict], rules: Rules) -> tuple[str, str | None]:
    """One line naming the bad field (the most specific error) and what was wrong with it, and the field."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the body is not JSON: {first['msg']}", None
    if first["type"] in ("model_type", "model_attributes_type") and not first["loc"]:
        return f"the body must be a JSON object, got {type(first['input']).__name__}", None

    def path(error: dict) -> str:
        return where(error["loc"], rules.tags)

    deepest = max(len(path(e).split(".")) for e in errors)
    errors = [e for e in errors if len(path(e).split(".")) == deepest]
    # a value of the right type that breaks a constraint says more than the other branches' "wrong type"
    constraints = [e for e in errors if not (e["type"].endswith("_type") or e["type"] == "none_required")]
    if constraints and len(constraints) < len(errors) and all(e["type"] != "literal_error" for e in constraints):
        errors = constraints
    first = errors[0]
    at, kind, got = path(first), first["type"], first.get("input")
    field_name = re.sub(r"\.\d+", "", at)  # the field whatever the list positions: input.3.role -> input.role
    if kind == "extra_forbidden":
        if field_name in rules.unsupported:
            return f"{at} is not supported: {rules.unsupported[field_name]}", at
        return f"unknown field {at!r}: the policy endpoint does not take it", at
    if kind == "missing":
        return f"{at} is required", at
    refusable = ("literal_error", "greater_than_equal", "less_than_equal", "none_required")
    if field_name in rules.refused and kind in refusable:
        return f"{at}={got!r:.80}: {rules.refused[field_name]}", at
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        context = first.get("ctx") or {}
        name = str(context.get("discriminator", "type")).strip("'").removesuffix("()").rstrip("_")
        tag = context.get("tag") if kind == "union_tag_invalid" else None
        expected = context.get("expected_tags", "")
        return f"{at}.{name}: must be one of {expected}, got {tag!r:.40}", f"{at}.{name}"
    if kind == "value_error":
        return f"{at}: {first['msg'].removeprefix('Value error, ')}", at
    if all(e["type"] == "literal_error" for e in errors):
        return f"{at}: {got!r:.60} is not allowed, expected {_expected(first['msg'])}", at
    if all(e["type"].endswith("_type") or e["type"] in ("none_required", "literal_error") for e in errors):
        expected = " or ".join(dict.fromkeys(_expected(e["msg"]) for e in errors))
        return f"{at}: wrong type {type(got).__name__} ({got!r:.60}); expected {expected}", at
    return f"{at}: {first['msg']} (got {got!r:.60})", at


def parse_body(model: type[BaseModel], raw: bytes | str | dict, rules: Rules) -> Any:
    """The typed body of ``raw`` (the HTTP body, or an already decoded object), or `BodyError`."""
    try:
        if isinstance(raw, (bytes, str)):
            return model.model_validate_json(raw)
        return model.model_validate(raw)
    except ValidationError as err:
        message, param = describe(err.errors(include_url=False), rules)
        raise BodyError(message, param) from None
