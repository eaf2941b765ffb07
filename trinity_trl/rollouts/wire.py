"""The wire formats of the policy endpoint (`endpoint`): for each, where it is served, how its body is read
(`chat_request`, `responses_request`, `messages_request`), how a recorded call is answered, and how an error looks.

An answer is built from the call as recorded (`request.Call`: the parsed assistant message, the sampled ids and
log-probs) with the types of the package that speaks the format: ``openai``'s ``ChatCompletion`` /
``ChatCompletionChunk`` and ``Response`` / ``ResponseStreamEvent``, ``anthropic``'s ``Message`` /
``RawMessageStreamEvent``. A streamed answer is generated whole (the policy samples a batch at once) and then written
as the server-sent events the format's client reads, in the order its API sends them. Imported when an endpoint
serves.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import chat_request, messages_request, responses_request
from .request import Choice, Pending, RequestError

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class Format:
    """A wire format: ``name`` (recorded in `request.Call.wire`), ``path`` (under ``/v1``), ``parse(raw)`` (the typed
    body, or `body.BodyError`), ``reply(pending, model, decode)`` (a JSON object, or the list of server-sent events of
    a streamed answer) and ``error_body(err)``."""

    name: str
    path: str
    parse: Callable[[bytes], Any]
    reply: Callable[[Pending, str, Decode], dict[str, Any] | list[str]]
    error_body: Callable[[RequestError], dict[str, Any]]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _json(arguments: Any) -> str:
    """Tool-call arguments as the JSON string the OpenAI formats carry."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _mapping(arguments: Any) -> dict[str, Any]:
    """Tool-call arguments as the object Anthropic's ``tool_use.input`` is (text the parser could not read as an
    object is kept under ``"input"``)."""
    return arguments if isinstance(arguments, dict) else {"input": arguments}


def _token_logprobs(choice: Choice, decode: Decode) -> list[dict[str, Any]]:
    return [
        {"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode()), "top_logprobs": []}
        for t, lp in zip(choice.completion_ids, choice.logprobs or [])
    ]


def _sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _openai_error(err: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(err), "type": err.code, "code": err.code, "param": err.param}}


# ------------------------------------------------------------------------------------------------- chat completions
def _chat_reply(pending: Pending, model: str, decode: Decode) -> dict[str, Any] | list[str]:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    call, request = pending.call, pending.request
    choices = []
    for index, choice in enumerate(call.choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.message["content"]}
        if choice.message.get("tool_calls"):
            message["tool_calls"] = [
                {
                    "id": _id("call"),
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": _json(c["function"]["arguments"])},
                }
                for c in choice.message["tool_calls"]
            ]
        logprobs = {"content": _token_logprobs(choice, decode)} if request.logprobs else None
        choices.append(
            {"index": index, "message": message, "finish_reason": choice.finish_reason, "logprobs": logprobs}
        )
    completion_tokens = sum(len(c.completion_ids) for c in call.choices)
    usage = {
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(call.prompt_ids) + completion_tokens,
    }
    head = {"id": _id("chatcmpl"), "created": int(time.time()), "model": model}
    completion = ChatCompletion.model_validate(
        {**head, "object": "chat.completion", "choices": choices, "usage": usage}
    )
    if not request.stream:
        return completion.model_dump(exclude_none=True)
    # the answer as chunks: per choice its text (and log-probs), its tool calls, its finish reason; then the usage
    # when asked (stream_options.include_usage), as a chunk with no choices; then [DONE]
    options = pending.body.stream_options
    chunks = []

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> None:
        piece = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [piece]})

    for data in choices:
        message, index = data["message"], data["index"]
        chunk(index, {"role": "assistant", "content": message["content"]}, logprobs=data["logprobs"])
        if message.get("tool_calls"):
            chunk(index, {"tool_calls": [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]})
        chunk(index, {}, finish=data["finish_reason"])
    if options is not None and options.include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    events = [_sse(ChatCompletionChunk.model_validate(c).model_dump(exclude_none=True)) for c in chunks]
    return [*events, _sse("[DONE]")]


chat = Format("chat", "/chat/completions", chat_request.parse_request, _chat_reply, _openai_error)


# ------------------------------------------------------------------------------------------------------- Responses
def _responses_reply(pending: Pending, model: str, decode: Decode) -> dict[str, Any] | list[str]:
    from openai.types.responses import Response

    call, request, body = pending.call, pending.request, pending.body
    (choice,) = call.choices  # the Responses API samples one answer
    output: list[dict[str, Any]] = []
    text = choice.message["content"]
    if text or not choice.message.get("tool_calls"):
        part = {"type": "output_text", "text": text, "annotations": []}
        if request.logprobs:
            part["logprobs"] = _token_logprobs(choice, decode)
        output.append(
            {"type": "message", "id": _id("msg"), "role": "assistant", "status": "completed", "content": [part]}
        )
    for c in choice.message.get("tool_calls", []):
        output.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": _id("call"),
                "name": c["function"]["name"],
                "arguments": _json(c["function"]["arguments"]),
                "status": "completed",
            }
        )
    incomplete = choice.finish_reason == "length"
    tokens = len(choice.completion_ids)
    response = Response.model_validate(
        {
            "id": _id("resp"),
            "object": "response",
            "created_at": time.time(),
            "model": model,
            "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": len(call.prompt_ids),
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(call.prompt_ids) + tokens,
            },
        }
    )
    whole = response.model_dump(mode="json", exclude_none=True)
    if not request.stream:
        return whole
    return _responses_events(whole)


def _responses_events(whole: dict[str, Any]) -> list[str]:
    """The events of a streamed response, in the API's order: created, in progress, each output item (added, its
    content or arguments as one delta, done), then completed (or incomplete)."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    started = {**whole, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=started)
    emit("response.in_progress", response=started)
    for index, item in enumerate(whole["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            emit(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            )
            for k, part in enumerate(item["content"]):
                empty = {**part, "text": ""}
                empty.pop("logprobs", None)
                emit("response.content_part.added", **where, content_index=k, part=empty)
                logprobs = part.get("logprobs", [])
                emit("response.output_text.delta", **where, content_index=k, delta=part["text"], logprobs=logprobs)
                emit("response.output_text.done", **where, content_index=k, text=part["text"], logprobs=logprobs)
                emit("response.content_part.done", **where, content_index=k, part=part)
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.incomplete" if whole["status"] == "incomplete" else "response.completed", response=whole)
    return [
        _sse(adapter.validate_python(e).model_dump(mode="json", exclude_none=True), event=e["type"]) for e in events
    ]


responses = Format("responses", "/responses", responses_request.parse_request, _responses_reply, _openai_error)


# -------------------------------------------------------------------------------------------- Anthropic Messages
#: the finish reasons of the endpoint as Anthropic's stop reasons
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _messages_reply(pending: Pending, model: str, decode: Decode) -> dict[str, Any] | list[str]:
    from anthropic.types import Message

    call, request = pending.call, pending.request
    (choice,) = call.choices  # the Messages API samples one answer
    content: list[dict[str, Any]] = []
    text = choice.message["content"]
    if text or not choice.message.get("tool_calls"):
        content.append({"type": "text", "text": text})
    for c in choice.message.get("tool_calls", []):
        content.append(
            {
                "type": "tool_use",
                "id": _id("toolu"),
                "name": c["function"]["name"],
                "input": _mapping(c["function"]["arguments"]),
            }
        )
    stop_reason = "stop_sequence" if choice.stop_sequence is not None else STOP_REASONS[choice.finish_reason]
    message = Message.model_validate(
        {
            "id": _id("msg"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": choice.stop_sequence,
            "usage": {"input_tokens": len(call.prompt_ids), "output_tokens": len(choice.completion_ids)},
        }
    )
    whole = message.model_dump(mode="json", exclude_none=True)
    whole.setdefault("stop_sequence", None)
    if not request.stream:
        return whole
    return _messages_events(whole)


def _messages_events(whole: dict[str, Any]) -> list[str]:
    """The events of a streamed message, in the API's order: message_start, each content block (start, its text or
    input JSON as one delta, stop), message_delta (the stop reason and output tokens), message_stop."""
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(RawMessageStreamEvent)
    usage = whole["usage"]
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                **whole,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {**usage, "output_tokens": 0},
            },
        }
    ]
    for index, block in enumerate(whole["content"]):
        if block["type"] == "text":
            events.append({"type": "content_block_start", "index": index, "content_block": {**block, "text": ""}})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            events.append({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": whole["stop_reason"], "stop_sequence": whole["stop_sequence"]},
            "usage": {"output_tokens": usage["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return [
        _sse(adapter.validate_python(e).model_dump(mode="json", exclude_none=True), event=e["type"]) for e in events
    ]


#: Anthropic's error types by HTTP status
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


def _anthropic_error(err: RequestError) -> dict[str, Any]:
    kind = ANTHROPIC_ERRORS.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(err)}}


messages = Format("messages", "/messages", messages_request.parse_request, _messages_reply, _anthropic_error)

#: every format the endpoint serves
FORMATS = (chat, responses, messages)
