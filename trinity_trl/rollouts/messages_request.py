"""The typed body of ``POST /v1/messages`` (Anthropic Messages) on the policy endpoint (`endpoint`).

Pydantic models that mirror the ``anthropic`` package's request types (``anthropic.types.MessageCreateParams`` and
the message, content-block and tool types it names), strictly (`body`); `parse_request` gives a `MessagesRequest` or
a `body.BodyError` naming the field, and `MessagesRequest.to_request` the recorder's `request.Request`: ``system``
becomes the system message, an assistant's ``tool_use`` blocks its tool calls, a user's ``tool_result`` blocks the
tool results (one tool message each, before the user's text).

``max_tokens`` is required, as in the API, and must be at most the trainer's ``max_completion_length`` (the endpoint
checks it). Accepted and unused, because they do not change what is sampled: ``model``, ``metadata``,
``service_tier``, ``cache_control`` (top level and on blocks and tools) and the empty fields a returned block carries
back (``citations``, ``caller``, ``toolset_name``). Refused by name: ``thinking`` other than disabled, ``top_k``, a
forced ``tool_choice`` (``any``, ``tool``), ``disable_parallel_tool_use``, server tools, images and documents, a
final assistant message (prefill), and the options of Anthropic's own service (``container``, ``output_config``, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, field_validator

from .body import BodyError, Number, Rules, Strict, parse_body
from .request import Request

__all__ = ["BodyError", "MessagesRequest", "parse_request"]

Name = Annotated[StrictStr, Field(min_length=1)]


def type_(value: Any) -> str | None:
    """The tag of a content block or a tool choice: its ``type``."""
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: StrictStr | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: None = None
    toolset_name: None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: Name
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: CacheControl | None = None
    toolset_name: None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


UserBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolResultBlock, Tag("tool_result")], Discriminator(type_)
]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")], Discriminator(type_)
]


class UserMessage(Strict):
    role: Literal["user"]
    content: StrictStr | Annotated[list[UserBlock], Field(min_length=1)]


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: StrictStr | list[AssistantBlock]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class Tool(Strict):
    """A client tool (the agent runs it); Anthropic's server tools carry a versioned ``type`` and are refused."""

    type: Literal["custom"] | None = None  # first: a server tool is named by its type, not by what it lacks
    name: Name
    input_schema: dict[str, Any]
    description: StrictStr | None = None
    cache_control: CacheControl | None = None
    strict: StrictBool | None = None


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: Literal[False] | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


ToolChoice = Annotated[
    Annotated[ToolChoiceAuto, Tag("auto")] | Annotated[ToolChoiceNone, Tag("none")], Discriminator(type_)
]


class ThinkingDisabled(Strict):
    type: Literal["disabled"]


class Metadata(Strict):
    user_id: StrictStr | None = None


class MessagesRequest(Strict):
    """The fields of a Messages request the endpoint takes (see the module docstring)."""

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[StrictStr] | None = None
    stream: StrictBool | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    thinking: ThinkingDisabled | None = None
    # bookkeeping fields that do not change what is sampled
    metadata: Metadata | None = None
    service_tier: StrictStr | None = None
    cache_control: CacheControl | None = None

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, messages: list) -> list:
        if messages[-1].role == "assistant":
            raise ValueError(
                "the last message is the assistant's (a prefill to continue): not supported, the policy answers a "
                "user turn (end with a user message)"
            )
        return messages

    def to_request(self) -> Request:
        tools = None
        if self.tools:
            tools = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        **({"description": tool.description} if tool.description is not None else {}),
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
        choice = None if self.tool_choice is None else self.tool_choice.type
        return Request(
            messages=self.conversation(),
            tools=tools,
            max_tokens=self.max_tokens,
            max_tokens_field="max_tokens",
            stop=list(self.stop_sequences or []),
            parse_tools=bool(tools) and choice != "none",
            tool_choice=choice,
            stream=bool(self.stream),
            sampling={"temperature": self.temperature, "top_p": self.top_p},
        )

    def conversation(self) -> list[dict[str, Any]]:
        """The messages in the chat template's form: ``system`` first; a user turn's tool results as tool messages,
        then its text; an assistant turn's text and tool calls as one assistant message."""
        out: list[dict[str, Any]] = []
        if self.system is not None:
            text = self.system if isinstance(self.system, str) else "".join(block.text for block in self.system)
            out.append({"role": "system", "content": text})
        for message in self.messages:
            blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else []
            blocks = blocks or message.content
            if message.role == "assistant":
                turn: dict[str, Any] = {
                    "role": "assistant",
                    "content": "".join(b.text for b in blocks if isinstance(b, TextBlock)),
                }
                calls = [
                    {"type": "function", "function": {"name": b.name, "arguments": b.input}}
                    for b in blocks
                    if isinstance(b, ToolUseBlock)
                ]
                if calls:
                    turn["tool_calls"] = calls
                out.append(turn)
                continue
            for block in blocks:
                if isinstance(block, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
            text = [b.text for b in blocks if isinstance(b, TextBlock)]
            if text:
                out.append({"role": "user", "content": "".join(text)})
        return out


#: why a known field with a value other than its neutral one is refused
REFUSED = {
    "thinking.type": "thinking is not supported: the policy does not think before it answers (leave thinking out)",
    "tool_choice.disable_parallel_tool_use": (
        "disable_parallel_tool_use=true cannot be enforced on unconstrained sampling: leave it out"
    ),
    "tools.type": "only client tools (the agent runs them) are supported, not Anthropic's server tools",
}
#: fields of the Messages API the endpoint does not take, and why
UNSUPPORTED = {
    "top_k": "it changes the sampled distribution (the trainer's sampling settings are used)",
    "container": "the endpoint runs no code containers",
    "output_config": "structured output and effort settings are not supported (the sampling is not constrained)",
    "diagnostics": "it is not supported",
    "inference_geo": "it is not supported",
    "speed": "it is not supported",
    "user_profile_id": "it is not supported",
    "workspace_id": "it is not supported",
    "mcp_servers": "the endpoint connects to no MCP servers",
    "context_management": "the endpoint never edits the context (an overflow is refused)",
}
TAGS = frozenset({"user", "assistant", "text", "tool_use", "tool_result", "auto", "none"})
RULES = Rules(refused=REFUSED, unsupported=UNSUPPORTED, tags=TAGS)


def parse_request(raw: bytes | str | dict) -> MessagesRequest:
    """The typed request of ``raw`` (the HTTP body, or an already decoded object), or `BodyError`."""
    return parse_body(MessagesRequest, raw, RULES)
