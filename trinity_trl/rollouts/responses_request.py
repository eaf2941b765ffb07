"""The typed body of ``POST /v1/responses`` (the OpenAI Responses API) on the policy endpoint (`endpoint`).

Pydantic models that mirror the ``openai`` package's request types (``openai.types.responses.ResponseCreateParams``
and the input-item, content and tool types it names), strictly (`body`); `parse_request` gives a `ResponsesRequest` or
a `body.BodyError` naming the field, and `ResponsesRequest.to_request` the recorder's `request.Request`: the
``instructions`` become the system message, message items the conversation's turns, an assistant's ``function_call``
items its tool calls and ``function_call_output`` items the tool results.

What the OpenAI Agents SDK sends by default is taken: ``include=[]``, ``reasoning={"effort": "none"}`` (the policy
does not reason before it answers, which is what ``"none"`` asks) and ``text={"verbosity": ...}`` (a hint the policy
has no setting for: accepted and unused, as are ``model``, ``store``, ``metadata``, ``user``, ``service_tier``,
``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention`` and ``stream_options``, which do not change
what is sampled). A setting that would change what is sampled, or that the endpoint cannot keep (another reasoning
effort, a forced tool choice, structured output, ``previous_response_id``), is refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag

from .body import BodyError, Number, OpenAIBookkeeping, Rules, Strict, parse_body
from .chat_request import arguments
from .request import Request

__all__ = ["BodyError", "ResponsesRequest", "parse_request"]

Name = Annotated[StrictStr, Field(min_length=1)]
Status = Literal["in_progress", "completed", "incomplete"]


def type_(value: Any) -> str | None:
    """The tag of an input item or a content part: its ``type``; an item without one is a message (as the API reads
    an ``EasyInputMessage``)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


class InputText(Strict):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(Strict):
    """The text of an assistant message, as the endpoint returned it (its annotations and log-probs come back)."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


Part = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")], Discriminator(type_)
]


class MessageItem(Strict):
    """A turn: ``{"role", "content"}`` (an easy input message), or a message item as the endpoint returned it."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[Part]
    id: StrictStr | None = None
    status: Status | None = None
    phase: None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    """A tool call of an assistant turn, as the endpoint returned it."""

    model_config = Strict.model_config | {"populate_by_name": True}
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: StrictStr
    id: StrictStr | None = None
    status: Status | None = None
    namespace: None = None
    caller: None = None
    async_: Annotated[None, Field(alias="async")] = None


class FunctionCallOutputItem(Strict):
    """The result of a tool call."""

    type: Literal["function_call_output"]
    call_id: Name
    output: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: Status | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(type_),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: Name
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Reasoning(Strict):
    effort: Literal["none"] | None = None
    summary: None = None
    generate_summary: None = None


class TextFormat(Strict):
    type: Literal["text"]


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(Strict):
    include_obfuscation: StrictBool | None = None


class ResponsesRequest(OpenAIBookkeeping):
    """The fields of a Responses request the endpoint takes (see the module docstring), the bookkeeping fields among
    them."""

    input: StrictStr | Annotated[list[Item], Field(min_length=1)]
    model: StrictStr | None = None
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: Literal[True] | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None

    def to_request(self) -> Request:
        tools = None
        if self.tools:
            tools = [
                {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                for tool in self.tools
            ]
        return Request(
            messages=self.messages(),
            tools=tools,
            max_tokens=self.max_output_tokens,
            max_tokens_field="max_output_tokens",
            logprobs="message.output_text.logprobs" in (self.include or []),
            parse_tools=bool(tools) and self.tool_choice != "none",
            tool_choice=self.tool_choice,
            stream=bool(self.stream),
            sampling={"temperature": self.temperature, "top_p": self.top_p},
        )

    def messages(self) -> list[dict[str, Any]]:
        """The conversation in the chat template's form: the instructions as the system message, then each item (an
        assistant message and the function calls after it are one assistant turn)."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        turn: dict[str, Any] | None = None  # the assistant turn that function calls join
        for item in items:
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text})
                turn = out[-1] if role == "assistant" else None
            elif isinstance(item, FunctionCallItem):
                if turn is None:
                    turn = {"role": "assistant", "content": ""}
                    out.append(turn)
                call = {"type": "function", "function": {"name": item.name, "arguments": arguments(item.arguments)}}
                turn.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
                turn = None
        return out


#: why a known field with a value other than its neutral one is refused
REFUSED = {
    "tool_choice": (
        "tool_choice is not supported beyond 'auto' and 'none': the policy's sampling is not constrained (a forced "
        "choice would change the distribution the recorded log-probs come from)"
    ),
    "parallel_tool_calls": "parallel_tool_calls=false cannot be enforced on unconstrained sampling: leave it out",
    "top_logprobs": "top_logprobs is not supported (only the sampled token's log-prob is recorded): leave it out or 0",
    "include": "the endpoint can include only 'message.output_text.logprobs' (it has nothing else to include)",
    "reasoning.effort": "the policy has no reasoning setting: leave reasoning out or its effort 'none'",
    "reasoning.summary": "the policy writes no reasoning to summarise: leave reasoning.summary out",
    "reasoning.generate_summary": "the policy writes no reasoning to summarise: leave it out",
    "text.format.type": "only text output is supported (the sampling is not constrained to a format)",
    "truncation": "truncation='auto' is not supported: the endpoint never drops input (an overflow is refused)",
    "background": "background responses are not supported: the endpoint answers while the request waits",
    "input.phase": "phase labels are not supported: leave phase out",
}
#: fields of the Responses API the endpoint does not take, and why
UNSUPPORTED = {
    "previous_response_id": "the endpoint keeps no responses: send the whole conversation as input",
    "conversation": "the endpoint keeps no conversations: send the whole conversation as input",
    "prompt": "stored prompt templates are not supported: send instructions and input",
    "max_tool_calls": "it limits built-in tools, which the policy has none of",
    "context_management": "the endpoint never compacts input (an overflow is refused)",
    "moderation": "the endpoint does not moderate",
    "image": "the policy answers text only",
    "access_programs": "it is not supported",
    "background_options": "background responses are not supported",
    "prompt_cache_options": "it is not supported",
}
TAGS = frozenset({"message", "function_call", "function_call_output", "input_text", "output_text"})
RULES = Rules(refused=REFUSED, unsupported=UNSUPPORTED, tags=TAGS)


def parse_request(raw: bytes | str | dict) -> ResponsesRequest:
    """The typed request of ``raw`` (the HTTP body, or an already decoded object), or `BodyError`."""
    return parse_body(ResponsesRequest, raw, RULES)
