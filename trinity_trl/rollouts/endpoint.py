"""A policy-backed endpoint inside the training process, in the wire formats agents speak (the ``agents`` extra).

Agents call ``http://127.0.0.1:<port>/v1`` with the client they already use, and the trainer's policy answers:

* OpenAI chat completions, ``POST /v1/chat/completions`` (``openai.AsyncOpenAI``, LangGraph, smolagents, verifiers),
* the OpenAI Responses API, ``POST /v1/responses`` (the OpenAI Agents SDK, Codex-style harnesses),
* Anthropic Messages, ``POST /v1/messages`` (``anthropic.AsyncAnthropic``, Claude-style harnesses),

each streamed (server-sent events, as the format's own client reads them) or not. The server is FastAPI on uvicorn, in
a background thread with its own event loop, bound to loopback on a port the OS chooses. Request bodies are typed per
format (`chat_request`, `responses_request`, `messages_request`): a malformed one is refused with a 4xx naming the
field before anything reaches the training thread; `wire` writes the answers.
Each agent run gets its own API key, sent as a bearer token or ``x-api-key``, or put in the path by a per-run base
URL (``/runs/<key>/v1``, for clients that cannot send a per-run key): a request without the key of a live run is
refused (401), a request of a run that is over (finished, timed out or cut) is refused too (409) and counted.

Requests are not answered one by one: the handler queues the request and waits, while the training thread (the one
that owns the model) takes the queued requests in batches (`PolicyEndpoint.next_batch`, driven by
`trinity_trl.rollouts.agent.AgentRollout`) and answers a whole batch with one generation call. Every answer, whatever
its format, is recorded under its run in one way (`Call`): the prompt token ids as the chat template rendered them
(tool schemas included), the completion token ids and their sampling log-probs, and the policy version (optimizer
steps taken by the weights that sampled it). Training reads those ids; the text sent back is never tokenized again.

**Token history.** Every format's request is read as one conversation (`Request.messages`, the chat template's
form). When a request's messages are an earlier call's messages, then the assistant message that call returned, then
new messages (tool results, a user turn), its prompt is that call's prompt + the sampled completion (+ EOS if the turn
was cut) + the chat-template tokens of the new messages: the model reads its own turn as it was sampled, and the call
*extends* the earlier one (they share a prefix and train in one packed row), whichever format either call used. Any
other request (an agent that summarises or drops turns) is rendered anew and starts a new segment.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotation at run time
import asyncio
import concurrent.futures
import functools
import logging
import math
import queue
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from .generation import Generator
from .request import Call, Choice, Pending, RequestError, RunRecord

logger = logging.getLogger(__name__)

#: the model id ``GET /v1/models`` lists (a request's ``model`` may be any string: the policy answers it)
POLICY_MODEL_ID = "policy"

#: seconds open connections get to finish when the server stops
STOP_GRACE_S = 5.0

#: fault and request counters of one rollout (logged under ``agent/``)
COUNTERS = (
    "requests",
    "late_calls",
    "rejected_requests",
    "context_overflows",
    "malformed_tool_calls",
    "turn_limit_hits",
)


def _same_turn(returned: dict[str, Any], sent: dict[str, Any]) -> bool:
    """Whether the assistant message an agent sent back is the one the endpoint returned (ids of tool calls aside)."""
    if sent.get("role") != "assistant" or returned["content"].strip() != sent["content"].strip():
        return False
    mine = [(c["function"]["name"], c["function"]["arguments"]) for c in returned.get("tool_calls", [])]
    theirs = [(c["function"]["name"], c["function"]["arguments"]) for c in sent.get("tool_calls", [])]
    return mine == theirs


class ChatRenderer:
    """The chat template of the policy: ``render(messages, tools, add_generation_prompt) -> ids`` and tool-call
    parsing of a sampled turn (TRL's ``parse_response``, with the response template TRL knows for the chat template).

    Args:
        tokenizer: the trainer's tokenizer (``processing_class``).
        chat_template: a template replacing the tokenizer's (the trainer's ``chat_template``), or ``None``.
        chat_template_kwargs: extra arguments of ``apply_chat_template`` (the trainer's).
    """

    def __init__(self, tokenizer, chat_template: str | None = None, chat_template_kwargs: dict | None = None):
        import copy

        from trl import add_response_schema

        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.kwargs = dict(chat_template_kwargs or {})
        self.parser = None
        if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
            self.parser = tokenizer
        else:
            try:
                self.parser = add_response_schema(copy.copy(tokenizer))
            except (ValueError, KeyError):  # a chat template TRL has no response template for: no tool calls
                self.parser = None
        # the tool-call opener of the response template: a turn that has it but no parsable call is malformed
        template = getattr(self.parser, "response_template", None) or {}
        spec = template.get("fields", {}).get("tool_calls", {}) if isinstance(template, dict) else {}
        self.opener = spec.get("open_pattern") or (re.escape(spec["open"]) if spec.get("open") else None)
        if self.opener is None and self.parser is not None:
            self.opener = re.escape("<tool_call>")

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template puts tool schemas in the prompt (a probe rendered with and without a tool
        differs); a template that does not would silently drop a request's ``tools``."""
        probe = [{"role": "user", "content": "probe"}]
        tool = {
            "type": "function",
            "function": {"name": "probe_tool", "description": "Probe.", "parameters": {"type": "object"}},
        }
        try:
            return self.render(probe, [tool], True) != self.render(probe, None, True)
        except Exception:  # a template that fails on tools does not render them
            return False

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                chat_template=self.chat_template,
                **self.kwargs,
            )
        )

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools: list[dict] | None) -> tuple[dict, bool]:
        """The assistant message of a sampled turn, and whether it holds a tool call the parser could not read (TRL
        then takes the turn as text, and so does the endpoint)."""
        from ..chat_template_seams import parse_response

        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        if not tools or self.parser is None:
            return {"role": "assistant", "content": text}, False
        parsed = parse_response(self.parser, completion_ids, prefix=prompt_ids, tools=tools)
        calls = [
            {
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})},
            }
            for c in parsed.get("tool_calls") or []
        ]
        message = {"role": "assistant", "content": parsed.get("content") or ""}
        if calls:
            message["tool_calls"] = calls
            return message, False
        malformed = self.opener is not None and re.search(self.opener, text) is not None
        return {"role": "assistant", "content": text}, malformed


class PolicyEndpoint:
    """The policy's server of a trainer (see the module docstring). ``start()`` serves, ``stop()`` ends.

    Args:
        generator: the trainer's generation backend (one completion per prompt, batched).
        renderer: the policy's chat template and tool-call parser.
        model_name: the model id ``GET /v1/models`` lists (`POLICY_MODEL_ID`); a request's ``model`` may be
            any string: whatever it names, the policy answers.
        max_context: prompt tokens at most (a longer request is refused with ``context_length_exceeded``).
        max_env_steps: model calls per run at most (the trainer's ``max_env_steps``); a call past it is refused and the
            run is cut.
        sampling: the trainer's sampling settings (``temperature``, ``top_p``): a request may repeat them or leave
            them out; another value is refused, since the recorded log-probs would not be the sampled ones.
        token_history: extend an earlier call's sampled tokens when a request continues it (see the module
            docstring); ``False`` renders every request anew (the trainer's ``history="messages"``).
        max_completion_length: completion tokens the generator samples at most (the trainer's): a request asking for
            more (``max_tokens`` and its kin) is refused, since it could not be honoured.
        policy_version: returns the number of optimizer steps taken by the weights the generator samples with (the
            trainer's ``global_step``); each call records it (`Call.policy_version`).
    """

    def __init__(
        self,
        generator: Generator,
        renderer: ChatRenderer,
        model_name: str = POLICY_MODEL_ID,
        max_context: int | None = None,
        max_env_steps: int | None = None,
        sampling: dict[str, float | None] | None = None,
        token_history: bool = True,
        max_calls: None = None,
        max_completion_length: int | None = None,
        policy_version: Callable[[], int] | None = None,
    ):
        if max_calls is not None:  # its name until issue 37
            raise TypeError("PolicyEndpoint's max_calls is now max_env_steps (model calls per run at most)")
        self.generator, self.renderer = generator, renderer
        self.model_name, self.max_context, self.max_env_steps = model_name, max_context, max_env_steps
        self.sampling = {k: v for k, v in (sampling or {}).items() if v is not None}
        self.token_history = token_history
        self.max_completion_length = max_completion_length
        self.policy_version = policy_version
        self.runs: dict[str, RunRecord] = {}
        self.queue: queue.Queue[Pending] = queue.Queue()
        self.counters: Counter = Counter()
        self.examples: dict[str, str] = {}
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self.port: int | None = None

    # ------------------------------------------------------------------------------ server life
    @property
    def root_url(self) -> str:
        """``http://127.0.0.1:<port>``: the base URL of clients that add ``/v1`` themselves (``anthropic``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``: the base URL of OpenAI clients."""
        return f"{self.root_url}/v1"

    def run_root_url(self, record: RunRecord) -> str:
        """The run's own root URL, its key in the path (``.../runs/<key>``; ``/v1`` follows), for clients that
        cannot send a per-run key."""
        return f"{self.root_url}/runs/{record.key}"

    def start(self) -> "PolicyEndpoint":
        import uvicorn

        if self._thread is not None:
            return self
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))  # loopback only, a port the OS chooses
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app(),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self._server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def serve():
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_until_complete(self._server.serve(sockets=[sock]))

        self._thread = threading.Thread(target=serve, name="trinity-policy-endpoint", daemon=True)
        self._thread.start()
        started.wait(30)
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError("the policy endpoint did not start within 30 s")
        return self

    def stop(self) -> None:
        """Stop serving and join the server thread: requests still queued are refused (409) so that their handlers
        return, open connections get ``STOP_GRACE_S`` seconds to finish, then the server closes them."""
        if self._thread is None:
            return
        while True:
            try:
                pending = self.queue.get_nowait()
            except queue.Empty:
                break
            late = RequestError(409, "the rollout is over", "run_closed", "late_calls")
            self._count("late_calls", late)
            self._fail(pending, late)
        self._server.should_exit = True
        self._thread.join(STOP_GRACE_S + 30)
        if self._thread.is_alive():  # not expected: uvicorn closes connections after its graceful timeout
            logger.warning("the policy endpoint's server thread did not end within %.0f s", STOP_GRACE_S + 30)
        self._thread, self._server = None, None
        if self.loop is not None and not self.loop.is_running():
            self.loop.close()

    def _count(self, counter: str, err: Any) -> None:
        """Count a fault and keep the first message of its kind (for the rollout's log line)."""
        with self._lock:
            self.counters[counter] += 1
            self.examples.setdefault(counter, str(err))

    def take_examples(self) -> dict[str, str]:
        """The first message of each fault counted since the last call."""
        with self._lock:
            examples, self.examples = self.examples, {}
        return examples

    # ------------------------------------------------------------------------------ runs
    def open_run(self) -> RunRecord:
        record = RunRecord(key="run-" + secrets.token_urlsafe(16))
        with self._lock:
            self.runs[record.key] = record
        return record

    def close_run(self, record: RunRecord) -> None:
        """The run is over: its later requests are refused (409) and counted as late calls."""
        with self._lock:
            record.open = False

    def forget(self, records: list[RunRecord]) -> None:
        with self._lock:
            for record in records:
                self.runs.pop(record.key, None)

    # ------------------------------------------------------------------------------ HTTP
    def app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response

        from .wire import FORMATS, chat

        app = FastAPI(title="trinity_trl policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def error(err: RequestError, wire) -> JSONResponse:
            return JSONResponse(wire.error_body(err), status_code=err.status)

        async def models(request: Request):
            try:
                self._authorize(request)
            except RequestError as err:
                return error(err, chat)
            from openai.types import Model

            model = Model(id=self.model_name, created=0, object="model", owned_by="trinity_trl")
            return {"object": "list", "data": [model.model_dump()]}

        def serving(wire):
            async def handler(request: Request):
                try:
                    record = self._authorize(request)
                    pending = self._parse(record, await request.body(), wire)
                except RequestError as err:
                    self._count(err.counter or "rejected_requests", err)
                    return error(err, wire)
                with self._lock:
                    if record.waiting == 0:
                        record.waiting_since = time.monotonic()
                    record.waiting += 1
                self.queue.put(pending)
                try:
                    reply = await asyncio.wrap_future(pending.future)
                except RequestError as err:
                    return error(err, wire)
                finally:
                    with self._lock:
                        record.waiting -= 1
                        if record.waiting == 0 and record.waiting_since is not None:
                            record.waited += time.monotonic() - record.waiting_since
                            record.waiting_since = None
                if isinstance(reply, list):  # a streamed answer: its server-sent events, written whole
                    return Response("".join(reply), media_type="text/event-stream")
                return reply

            return handler

        for prefix in ("", "/runs/{key}"):
            app.add_api_route(f"{prefix}/v1/models", models, methods=["GET"])
            for wire in FORMATS:
                app.add_api_route(f"{prefix}/v1{wire.path}", serving(wire), methods=["POST"])
        served = ", ".join(["GET /v1/models", *(f"POST /v1{wire.path}" for wire in FORMATS)])

        async def unknown(request: Request, path: str):
            # e.g. /v1/completions or /v1/embeddings: named and counted, in the shape of the format it resembles
            wire = next((w for w in FORMATS if path.startswith(f"v1{w.path}")), chat)
            refused = RequestError(
                404, f"{request.method} /{path} is not served: the policy endpoint serves {served}", "not_found"
            )
            self._count("rejected_requests", refused)
            return error(refused, wire)

        app.add_api_route("/{path:path}", unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        return app

    def _authorize(self, request) -> RunRecord:
        """The live run whose key the request carries: in the path (a per-run base URL), as a bearer token, or as
        ``x-api-key`` (Anthropic's header)."""
        key = request.path_params.get("key")
        if key is None:
            header = request.headers.get("authorization", "")
            key = header[7:].strip() if header.lower().startswith("bearer ") else ""
            key = key or request.headers.get("x-api-key", "").strip()
        with self._lock:
            record = self.runs.get(key)
        if record is None:
            raise RequestError(401, "unknown API key: each agent run has its own key", "invalid_api_key")
        if not record.open:
            raise RequestError(409, "this run is over (finished, timed out or cut)", "run_closed", "late_calls")
        return record

    def _parse(self, record: RunRecord, raw: bytes, wire) -> Pending:
        """The typed request of ``raw`` in its format (``wire``), checked against the trainer's settings; every
        refusal is a `RequestError` naming the field, raised here, on the server's thread, before anything is
        queued for the training thread."""
        from .body import BodyError  # pydantic: the agents extra's, imported when serving

        try:
            body = wire.parse(raw)
        except BodyError as err:
            raise RequestError(400, str(err), param=err.param) from None
        request = body.to_request()
        for name, value in self.sampling.items():
            asked = request.sampling.get(name)
            if asked is not None and not math.isclose(float(asked), float(value)):
                raise RequestError(
                    400,
                    f"{name}={asked} differs from the trainer's {name}={value}: the policy samples with the "
                    f"trainer's settings (leave {name} out)",
                    param=name,
                )
        limit = self.max_completion_length
        if limit is not None and request.max_tokens is not None and request.max_tokens > limit:
            raise RequestError(
                400,
                f"{request.max_tokens_field}={request.max_tokens} is above the trainer's max_completion_length="
                f"{limit}: the policy samples at most {limit} tokens a call (ask for at most that)",
                param=request.max_tokens_field,
            )
        if request.tools and not self.renderer.renders_tools:
            raise RequestError(
                400,
                "tools were given but the policy's chat template does not render tool schemas (a prompt with and "
                "without tools renders the same), so the model would never see them: give the trainer a chat "
                "template that renders tools (chat_template, e.g. TRL's qwen2_5 template) or leave tools out",
                param="tools",
            )
        if request.tools and request.tool_choice != "none" and self.renderer.parser is None:
            raise RequestError(
                400,
                "tools were given but TRL knows no response template for the policy's chat template, so the "
                "model's tool calls could not be parsed: give the trainer a chat template TRL can parse (e.g. "
                "qwen2_5) or leave tools out",
                param="tools",
            )
        with self._lock:
            if self.max_env_steps is not None and len(record.calls) >= self.max_env_steps:
                record.open, record.cut = False, True
                raise RequestError(
                    409,
                    f"this run made {self.max_env_steps} model calls, the trainer's max_env_steps: the run is cut",
                    "turn_limit",
                    "turn_limit_hits",
                )
        return Pending(
            run=record,
            call=Call(messages=request.messages, tools=request.tools, prompt_ids=[], parent=None, wire=wire.name),
            request=request,
            wire=wire,
            body=body,
            future=concurrent.futures.Future(),
        )

    # ------------------------------------------------------------------------------ the training thread's side
    def waiting_runs(self) -> int:
        with self._lock:
            return sum(1 for r in self.runs.values() if r.open and r.waiting > 0)

    def next_batch(self, live: Callable[[], int], window: float, poll: float = 0.01) -> list[Pending]:
        """The queued requests, once every live run waits (``live()`` runs still going) or ``window`` seconds after
        the first one arrived; empty when none arrived within ``poll`` seconds."""
        try:
            first = self.queue.get(timeout=poll)
        except queue.Empty:
            return []
        batch = [first]
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            try:
                batch.append(self.queue.get(timeout=0.002))
                continue
            except queue.Empty:
                pass
            if len({id(p.run) for p in batch}) >= live():
                break
        while True:
            try:
                batch.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def answer(self, batch: list[Pending]) -> None:
        """Answer ``batch`` with one generation call and record every choice under its run (training thread)."""
        ready = []
        for pending in batch:
            if not pending.run.open:
                self._fail(pending, RequestError(409, "this run is over (timed out or cut)", "run_closed"))
                continue
            try:
                self._prompt(pending)
            except RequestError as err:
                self._count(err.counter or "rejected_requests", err)
                self._fail(pending, err)
                continue
            except Exception as err:  # the chat template refused the conversation (e.g. roles out of order)
                refused = RequestError(
                    400, f"the chat template cannot render these messages: {type(err).__name__}: {err}"
                )
                self._count("rejected_requests", refused)
                self._fail(pending, refused)
                continue
            ready.append(pending)
        if not ready:
            return
        prompts = [p.call.prompt_ids for p in ready for _ in range(p.request.n)]
        # the weights that answer this batch: read on the training thread, which alone steps the optimizer
        version = None if self.policy_version is None else int(self.policy_version())
        try:
            completions, logprobs = self.generator.generate(prompts)
        except Exception as err:  # the agents get an error; the trainer's exception propagates
            for pending in ready:
                self._fail(
                    pending, RequestError(500, f"generation failed: {type(err).__name__}: {err}", "server_error")
                )
            raise
        index = 0
        for pending in ready:
            start, index = index, index + pending.request.n
            pending.call.policy_version = version
            try:
                pending.call.choices = [
                    self._choice(
                        pending, list(completions[i]), None if logprobs is None else [float(x) for x in logprobs[i]]
                    )
                    for i in range(start, index)
                ]
                if pending.request.logprobs and any(c.logprobs is None for c in pending.call.choices):
                    raise RequestError(
                        400,
                        "logprobs were asked for but the generation backend returns none (transformers generation; "
                        "use_vllm returns them)",
                    )
                response = pending.wire.reply(pending, self.model_name, self.renderer.tokenizer.decode)
            except RequestError as err:
                self._count("rejected_requests", err)
                self._fail(pending, err)
                continue
            except Exception as err:  # a fault of the endpoint itself: this request fails, training goes on
                logger.exception("the policy endpoint could not answer a request")
                failed = RequestError(500, f"{type(err).__name__}: {err}", "server_error")
                self._count("rejected_requests", failed)
                self._fail(pending, failed)
                continue
            with self._lock:
                if not pending.run.open:  # cut while generating: not recorded, refused
                    self._fail(pending, RequestError(409, "this run is over (timed out or cut)", "run_closed"))
                    continue
                pending.run.calls.append(pending.call)
                self.counters["requests"] += 1
            if not pending.future.done():
                pending.future.set_result(response)

    @staticmethod
    def _fail(pending: Pending, err: RequestError) -> None:
        if not pending.future.done():
            pending.future.set_exception(err)

    def _prompt(self, pending: Pending) -> None:
        call, record = pending.call, pending.run
        call.prompt_ids, call.parent = None, None
        if self.token_history:
            call.prompt_ids, call.parent = self._extend(record, call)
        if call.prompt_ids is None:
            call.prompt_ids = self.renderer.render(call.messages, call.tools, True)
        if self.max_context is not None and len(call.prompt_ids) >= self.max_context:
            raise RequestError(
                400,
                f"the prompt has {len(call.prompt_ids)} tokens, the policy's context is {self.max_context}",
                "context_length_exceeded",
                "context_overflows",
            )

    def _extend(self, record: RunRecord, call: Call) -> tuple[list[int] | None, tuple[int, int] | None]:
        """The prompt of ``call`` as an extension of an earlier call of its run (latest first), or ``(None, None)``."""
        messages = call.messages
        for c in range(len(record.calls) - 1, -1, -1):
            earlier = record.calls[c]
            size = len(earlier.messages)
            if earlier.tools != call.tools or len(messages) <= size + 1 or messages[:size] != earlier.messages:
                continue
            for k, choice in enumerate(earlier.choices):
                if not _same_turn(choice.message, messages[size]):
                    continue
                suffix = self._suffix(messages[: size + 1], messages, call.tools)
                if suffix is None:
                    return None, None
                eos = self.generator.eos_token_ids
                history = earlier.prompt_ids + choice.completion_ids
                if not choice.completion_ids or choice.completion_ids[-1] not in eos:
                    history = history + [self.generator.eos_token_id]
                return history + suffix, (c, k)
        return None, None

    def _suffix(self, before: list[dict], full: list[dict], tools) -> list[int] | None:
        """Chat-template tokens of ``full`` after ``before`` (which ends with an assistant turn), from that turn's EOS
        on; ``None`` when the template does not extend a conversation by appending tokens."""
        prefix = self.renderer.render(before, tools, False)
        whole = self.renderer.render(full, tools, True)
        eos = [i for i, t in enumerate(prefix) if t in self.generator.eos_token_ids]
        if eos:
            prefix = prefix[: eos[-1] + 1]
        if whole[: len(prefix)] != prefix:
            return None
        return whole[len(prefix) :]

    def _choice(self, pending: Pending, ids: list[int], logprobs: list[float] | None) -> Choice:
        """Cut ``ids`` at ``max_tokens`` and after the token that completes a stop string (a sample cut short is still
        a sample of the same policy), then parse the turn."""
        decode = self.renderer.tokenizer.decode
        request = pending.request
        finish = "stop" if ids and ids[-1] in self.generator.eos_token_ids else "length"
        if request.max_tokens is not None and len(ids) > request.max_tokens:
            ids, finish = ids[: request.max_tokens], "length"
        content_cut = stop_sequence = None
        if request.stop:
            for end in range(1, len(ids) + 1):
                text = decode(ids[:end], skip_special_tokens=True)
                hits = sorted((text.find(s), s) for s in request.stop if s and s in text)
                if hits:
                    ids, (content_cut, stop_sequence), finish = ids[:end], hits[0], "stop"
                    break
        if logprobs is not None:
            logprobs = logprobs[: len(ids)]
        message, malformed = (
            self.renderer.parse(ids, pending.call.prompt_ids, pending.call.tools)
            if request.parse_tools
            else ({"role": "assistant", "content": decode(ids, skip_special_tokens=True)}, False)
        )
        if content_cut is not None:
            message = {"role": "assistant", "content": decode(ids, skip_special_tokens=True)[:content_cut]}
        if malformed:
            self._count("malformed_tool_calls", f"a turn with an unparsable tool call: {message['content']!r:.120}")
        if message.get("tool_calls"):
            finish = "tool_calls"
        return Choice(ids, logprobs, message, finish, stop_sequence)
