"""The typed body of ``POST /v1/chat/completions`` on the policy endpoint (`endpoint`).

Pydantic models that mirror the ``openai`` package's request types (``openai.types.chat.CompletionCreateParams`` and
the message, content-part and tool types it names), strictly: a wrong type is refused as a wrong type (no ``"1"`` read
as a number, no ``1`` read as a string), a field the endpoint does not know is refused by name, and a field it knows
but cannot honour (one that would change the distribution the recorded log-probs come from) is refused with the
reason. `parse_request` turns a raw body into a `ChatRequest` or a `BodyError` that names the
field; nothing that fails here reaches the training thread.

Fields accepted and not used, because they do not change what is sampled: ``model`` (every name is answered by the
policy), ``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``,
``stream_options`` with ``stream`` false, ``parallel_tool_calls=True`` and ``response_format={"type": "text"}``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

Number = StrictInt | StrictFloat


class BodyError(ValueError):
    """A request body the endpoint refuses; ``param`` is the dotted path of the first bad field (or ``None``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    """A content part; only ``{"type": "text", "text": ...}`` is rendered by a text chat template."""

    model_config = ConfigDict(extra="allow", strict=True)  # other part kinds carry their own fields: named below
    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got a {self.type!r} part")
        if self.text is None:
            raise ValueError("a text part needs 'text' (a string)")
        if self.model_extra:
            raise ValueError(f"a text part takes 'type' and 'text' only, got {sorted(self.model_extra)}")
        return self


Content = StrictStr | list[TextPart] | None


class FunctionCall(_Strict):
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr | dict[str, Any]  # the protocol's JSON string; a mapping is taken too


class ToolCall(_Strict):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: StrictStr | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: StrictStr | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    # fields of a returned ``ChatCompletionMessage`` an agent may send back as they came (model_dump): only empty
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    # reasoning text of OpenAI-compatible servers (vLLM, DeepSeek; verifiers sends the field back): the endpoint
    # returns none, so a turn it answered carries none; a non-empty one would not be rendered: refused
    reasoning_content: Annotated[StrictStr, Field(max_length=0)] | None = None
    reasoning: Annotated[StrictStr, Field(max_length=0)] | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(_Strict):
    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatRequest(_Strict):
    """The fields of a chat-completions request the endpoint honours (see the module docstring for the rest)."""

    messages: Annotated[list[Message], Field(min_length=1)]
    model: StrictStr
    temperature: Number | None = None
    top_p: Number | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: Literal[True] | None = None
    stream: Literal[False] | None = None
    stream_options: dict[str, Any] | None = None
    frequency_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    presence_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    response_format: ResponseFormat | None = None
    # bookkeeping fields that do not change what is sampled
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


#: why a known field with a value other than its neutral one is refused
REFUSED = {
    "n": "n must be an integer >= 1",
    "top_logprobs": "top_logprobs is not supported (only the sampled token's log-prob is recorded): leave it out or 0",
    "tool_choice": (
        "tool_choice is not supported beyond 'auto' and 'none': the policy's sampling is not constrained (a forced "
        "choice would change the distribution the recorded log-probs come from)"
    ),
    "parallel_tool_calls": "parallel_tool_calls=false cannot be enforced on unconstrained sampling: leave it out",
    "stream": "streaming is not supported: leave stream out or false",
    "frequency_penalty": "penalties change the sampled distribution: leave frequency_penalty out or 0",
    "presence_penalty": "penalties change the sampled distribution: leave presence_penalty out or 0",
    "response_format": "only response_format {'type': 'text'} is supported (the sampling is not constrained)",
}
#: fields of the OpenAI API the endpoint does not take, and why
UNSUPPORTED = {
    "logit_bias": "it changes the sampled distribution",
    "seed": "the trainer's generator owns the random state",
    "functions": "the deprecated functions API: use tools",
    "function_call": "the deprecated functions API: use tools",
    "modalities": "the policy answers text only",
    "audio": "the policy answers text only",
    "prediction": "it is not supported",
    "reasoning_effort": "the policy has no reasoning setting",
    "verbosity": "the policy has no verbosity setting",
    "web_search_options": "the policy has no web search",
}


ROLES = ("system", "developer", "user", "assistant", "tool")


def _where(loc: tuple) -> str:
    """The dotted field path of an error location, without pydantic's union branch tags (``str``, ``list[...]``,
    ``TextPart``, the role tag of a message)."""
    parts: list[str] = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(str(item))
        elif item in ROLES and i >= 2 and loc[0] == "messages" and isinstance(loc[i - 1], int) and i == 2:
            continue  # the discriminator tag of messages.N
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", item) and item not in (
            "str",
            "int",
            "float",
            "bool",
            "list",
            "dict",
            "none",
        ):
            parts.append(item)
    return ".".join(parts)


def _expected(message: str) -> str:
    return message.removeprefix("Input should be ").removeprefix("a valid ").removeprefix("an ")


def _describe(errors: list[dict]) -> tuple[str, str | None]:
    """One line naming the bad field (the most specific error) and what was wrong with it."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return f"the body is not JSON: {first['msg']}", None
    if first["type"] == "model_type" and not first["loc"]:
        return f"the body must be a JSON object, got {type(first['input']).__name__}", None
    deepest = max(len(_where(e["loc"]).split(".")) for e in errors)
    errors = [e for e in errors if len(_where(e["loc"]).split(".")) == deepest]
    first = errors[0]
    where, kind, got = _where(first["loc"]), first["type"], first.get("input")
    if kind == "extra_forbidden":
        if where in UNSUPPORTED:
            return f"{where} is not supported: {UNSUPPORTED[where]}", where
        return f"unknown field {where!r}: the policy endpoint does not take it", where
    if kind == "missing":
        return f"{where} is required", where
    if where in REFUSED and kind in ("literal_error", "greater_than_equal", "less_than_equal"):
        return f"{where}={got!r}: {REFUSED[where]}", where
    if kind == "union_tag_invalid":
        role = got.get("role") if isinstance(got, dict) else got
        return f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r:.40}", f"{where}.role"
    if kind == "value_error":
        return f"{where}: {first['msg'].removeprefix('Value error, ')}", where
    if all(e["type"] == "literal_error" for e in errors):
        return f"{where}: {got!r:.60} is not allowed, expected {_expected(first['msg'])}", where
    if all(e["type"].endswith("_type") or e["type"] in ("none_required", "literal_error") for e in errors):
        expected = " or ".join(dict.fromkeys(_expected(e["msg"]) for e in errors))
        return f"{where}: wrong type {type(got).__name__} ({got!r:.60}); expected {expected}", where
    return f"{where}: {first['msg']} (got {got!r:.60})", where


def parse_request(raw: bytes | str | dict) -> ChatRequest:
    """The typed request of ``raw`` (the HTTP body, or an already decoded object), or `BodyError`."""
    try:
        if isinstance(raw, (bytes, str)):
            return ChatRequest.model_validate_json(raw)
        return ChatRequest.model_validate(raw)
    except ValidationError as err:
        message, param = _describe(err.errors(include_url=False))
        raise BodyError(message, param) from None
