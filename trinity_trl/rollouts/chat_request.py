"""The typed body of ``POST /v1/chat/completions`` on the policy endpoint (`endpoint`).

Pydantic models that mirror the ``openai`` package's request types (``openai.types.chat.CompletionCreateParams`` and
the message, content-part and tool types it names), strictly (`body`). `parse_request` turns a raw body into a
`ChatRequest` or a `body.BodyError` that names the field; `ChatRequest.to_request` gives the recorder's
`request.Request`. Nothing that fails here reaches the training thread.

Fields accepted and not used, because they do not change what is sampled: ``model`` (every name is answered by the
policy), ``user``, ``metadata``, ``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``,
``prompt_cache_retention``, ``verbosity`` (a hint the policy has no setting for), ``stream_options``,
``parallel_tool_calls=True``, ``reasoning_effort="none"`` and ``response_format={"type": "text"}``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from .body import BodyError, Number, OpenAIBookkeeping, Rules, Strict, parse_body
from .request import Request

__all__ = ["BodyError", "ChatRequest", "parse_request"]


class TextPart(Strict):
    """A content part; only ``{"type": "text", "text": ...}`` is rendered by a text chat template."""

    model_config = Strict.model_config | {"extra": "allow"}  # other part kinds carry their own fields: named below
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


class FunctionCall(Strict):
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr | dict[str, Any]  # the protocol's JSON string; a mapping is taken too
    # the openai client's streaming helper returns the arguments parsed beside them: sent back as they came
    parsed_arguments: dict[str, Any] | None = None


class ToolCall(Strict):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: StrictInt | None = None  # a streamed call's position, kept by the client's streaming helper


class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: Content
    name: StrictStr | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: Content
    name: StrictStr | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: Content = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    # fields of a returned ``ChatCompletionMessage`` an agent may send back as they came (model_dump): only empty
    refusal: None = None
    parsed: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    # reasoning text of OpenAI-compatible servers (vLLM, DeepSeek; verifiers sends the field back): the endpoint
    # returns none, so a turn it answered carries none; a non-empty one would not be rendered: refused
    reasoning_content: Annotated[StrictStr, Field(max_length=0)] | None = None
    reasoning: Annotated[StrictStr, Field(max_length=0)] | None = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(Strict):
    name: Annotated[StrictStr, Field(min_length=1)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(Strict):
    type: Literal["text"]


class StreamOptions(Strict):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


class ChatRequest(OpenAIBookkeeping):
    """The fields of a chat-completions request the endpoint honours (see the module docstring for the rest), and the
    bookkeeping fields it accepts."""

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
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    presence_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_request(self) -> Request:
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        return Request(
            messages=normalize_messages(self.messages),
            tools=tools,
            n=self.n or 1,
            max_tokens=self.completion_limit,
            max_tokens_field="max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens",
            stop=self.stops,
            logprobs=bool(self.logprobs),
            parse_tools=bool(tools) and self.tool_choice != "none",
            tool_choice=self.tool_choice,
            stream=bool(self.stream),
            sampling={"temperature": self.temperature, "top_p": self.top_p},
        )


#: why a known field with a value other than its neutral one is refused
REFUSED = {
    "n": "n must be an integer >= 1",
    "top_logprobs": "top_logprobs is not supported (only the sampled token's log-prob is recorded): leave it out or 0",
    "tool_choice": (
        "tool_choice is not supported beyond 'auto' and 'none': the policy's sampling is not constrained (a forced "
        "choice would change the distribution the recorded log-probs come from)"
    ),
    "parallel_tool_calls": "parallel_tool_calls=false cannot be enforced on unconstrained sampling: leave it out",
    "frequency_penalty": "penalties change the sampled distribution: leave frequency_penalty out or 0",
    "presence_penalty": "penalties change the sampled distribution: leave presence_penalty out or 0",
    "response_format": "only response_format {'type': 'text'} is supported (the sampling is not constrained)",
    "reasoning_effort": "the policy has no reasoning setting: leave reasoning_effort out or 'none'",
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
    "web_search_options": "the policy has no web search",
    "moderation": "the endpoint does not moderate",
    "prompt_cache_options": "it is not supported",
}

ROLES = ("system", "developer", "user", "assistant", "tool")
RULES = Rules(refused=REFUSED, unsupported=UNSUPPORTED, tags=frozenset(ROLES))


def _text(content: str | list | None) -> str:
    """A typed message content (a string, ``None`` or a list of text parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def arguments(value: Any) -> Any:
    """Tool-call arguments for the chat template: the JSON string of the OpenAI protocol, parsed (templates render a
    mapping); text that is not JSON stays text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def normalize_messages(messages: list) -> list[dict[str, Any]]:
    """The typed request's messages in the form the chat template renders and calls are compared in."""
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": _text(message.content)}
        if role == "assistant" and message.tool_calls:
            item["tool_calls"] = [
                {
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": arguments(c.function.arguments)},
                }
                for c in message.tool_calls
            ]
        if role == "tool":
            if message.tool_call_id is not None:
                item["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                item["name"] = message.name
        out.append(item)
    return out


def parse_request(raw: bytes | str | dict) -> ChatRequest:
    """The typed request of ``raw`` (the HTTP body, or an already decoded object), or `BodyError`."""
    return parse_body(ChatRequest, raw, RULES)
