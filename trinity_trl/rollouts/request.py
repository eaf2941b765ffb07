"""The request types of the policy endpoint, apart from the server so that the wire formats can use them: a request
of any format as the recorder reads it (`Request`), the refusal (`RequestError`), and what is recorded of each run
(`RunRecord`, its `Call`s and their `Choice`s) and queued for the training thread (`Pending`). The server is in
`endpoint`, the typed bodies in `chat_request`, `responses_request` and `messages_request`, the answers in `wire`.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any


class RequestError(Exception):
    """A request the endpoint refuses: answered with ``status`` and the error body of its format (`wire`)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        counter: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.counter, self.param = status, code, counter, param


@dataclass
class Request:
    """A request of any wire format, as the recorder reads it (each typed body's ``to_request``).

    Attributes:
        messages: the conversation in the chat template's form (``role``, ``content`` text, an assistant's
            ``tool_calls`` with parsed arguments, a tool result's ``tool_call_id``).
        tools: function tools in the chat-completions form the chat template renders, or ``None``.
        n: answers to sample.
        max_tokens: completion tokens at most, or ``None``; ``max_tokens_field`` names it as the format does.
        stop: stop strings.
        logprobs: the answer carries the sampled tokens' log-probs.
        parse_tools: tool calls are parsed out of the answer.
        tool_choice: the format's tool choice, as a string (``"auto"``, ``"none"``) or ``None``.
        stream: answered as server-sent events.
        sampling: the request's ``temperature`` and ``top_p`` (``None``: left out).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    parse_tools: bool = False
    tool_choice: str | None = None
    stream: bool = False
    sampling: dict[str, float | None] = field(default_factory=dict)


@dataclass
class Choice:
    """One sampled answer of a call: exactly what training reads (``completion_ids``, ``logprobs``) and the assistant
    message sent back (``message``, the form the agent returns in its next request); ``stop_sequence``: the stop
    string that ended it, if one did."""

    completion_ids: list[int]
    logprobs: list[float] | None
    message: dict[str, Any]
    finish_reason: str
    stop_sequence: str | None = None


@dataclass
class Call:
    """One request of a run, whatever its wire format. ``parent``: ``(call index, choice index)`` whose prompt +
    completion this call's prompt extends, or ``None`` (rendered anew: a new segment). ``policy_version``: the number
    of optimizer steps the weights that sampled this call's answers had taken (the trainer's ``global_step`` at
    generation; ``None`` when the endpoint was given no version). ``wire``: the format it came in (``"chat"``,
    ``"responses"``, ``"messages"``)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    parent: tuple[int, int] | None
    choices: list[Choice] = field(default_factory=list)
    policy_version: int | None = None
    wire: str = "chat"


@dataclass
class RunRecord:
    """The calls of one agent run, recorded by the endpoint; ``open`` is false once the run is over."""

    key: str
    calls: list[Call] = field(default_factory=list)
    open: bool = True
    cut: bool = False  # stopped by the turn limit
    waiting: int = 0  # requests queued or being answered
    started: float = field(default_factory=time.monotonic)
    waited: float = 0.0  # seconds spent waiting for the policy's answers (not the agent's own time)
    waiting_since: float | None = None
    timed_out: bool = False

    def own_time(self, now: float) -> float:
        """Seconds the agent itself has taken so far: wall time since the start, less the time waiting for answers."""
        waiting = 0.0 if self.waiting_since is None else now - self.waiting_since
        return now - self.started - self.waited - waiting


@dataclass
class Pending:
    """A parsed request waiting for the training thread: ``wire`` is its format (`wire.Format`), ``body`` its typed
    body, ``reply`` the answer once made (a JSON object, or the server-sent events of a streamed one)."""

    run: RunRecord
    call: Call
    request: Request
    wire: Any
    body: Any
    future: concurrent.futures.Future
