"""Agents over the policy endpoint: ``async def agent(client, row) -> reward`` played G times per task.

`AgentRollout` is the `trinity_trl.rollouts.protocols.Rollout` of `trinity_trl.trainers.StepGRPOTrainer` when it is
given ``agent=``.
For a batch of dataset rows it opens one run per row on the trainer's `endpoint.PolicyEndpoint` (each its
own API key), starts every agent in its own thread with its own event loop (so a run that blocks stalls only itself)
with a client pointed at it, and, on the training thread, answers the agents' requests in batches until every run
has ended. The client is the one the agent's first parameter asks for (`client_kind`): an ``openai.AsyncOpenAI``
(unannotated, the default), an ``anthropic.AsyncAnthropic``, or a `PolicyAccess` (base URLs and the run's key, for an
agent that builds its own client). Each run's recorded
calls become a `multi_step.Run`: one step per sampled answer, in the order the calls were made, grouped in
*segments* (a call that extends an earlier call's prompt + completion continues that call's segment; a call whose
history was rewritten starts a new one).

Faults never stop training: an agent that raises (returning something that is not a number counts as raising) or
takes more than ``timeout`` seconds of its own time ends its run; the run is scored 0 (``on_failure="zero"``) or left
unscored (``"drop"``: its steps get no gradient), and the fault is counted in `AgentRollout.metrics` (logged under
``agent/``, with one warning line per kind of fault per rollout). A reward of ``None``, NaN or +-inf is no fault: the
run is unscorable, as a row of any other source with such a reward (docs/guarantees.md#bad-rewards).
`AgentRollout.recorded` keeps the last rollout's runs as played and trained (docs/environments.md#agent-runs). A
request the endpoint refuses (longer than the context, past the turn limit, after the run ended, malformed) is
answered with an HTTP error the agent sees as an exception of its client, and counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .endpoint import COUNTERS, ChatRenderer, PolicyEndpoint
from .protocols import PlayedRollout, RolloutContext
from .request import Call, RunRecord
from .runs import Run, Step, tokens_state

logger = logging.getLogger(__name__)

FAILURE_MODES = ("zero", "drop")
#: the protocol name StepGRPOTrainer reports for agent=
AGENT_PROTOCOL = "agent"
#: seconds a cancelled agent has to end before its run is abandoned
CANCEL_GRACE_S = 10.0

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class PolicyAccess:
    """How one agent run reaches the policy: what an agent gets when its first parameter is annotated with this class
    (``async def agent(access: PolicyAccess, row)``), to build its own client or hand the addresses to a program.

    Attributes:
        base_url: ``http://127.0.0.1:<port>/v1``, the base URL of OpenAI clients (chat completions, Responses).
        root_url: ``http://127.0.0.1:<port>``, for clients that add ``/v1`` themselves (``anthropic``).
        api_key: the run's key, sent as a bearer token or as ``x-api-key``.
        run_base_url: ``http://127.0.0.1:<port>/runs/<key>/v1``, the run's own base URL with its key in the path,
            for a client that cannot send a key of its own per run (whatever key it sends is then not read).
    """

    base_url: str
    root_url: str
    api_key: str
    run_base_url: str


#: the clients an agent may ask for, by the annotation of its first parameter (no annotation: ``openai``)
CLIENT_KINDS = {"AsyncOpenAI": "openai", "AsyncAnthropic": "anthropic", "PolicyAccess": "access"}


def client_kind(agent: Any) -> str:
    """Which client ``agent`` asks for: ``"openai"`` (``openai.AsyncOpenAI``; an unannotated first parameter),
    ``"anthropic"`` (``anthropic.AsyncAnthropic``) or ``"access"`` (`PolicyAccess`); ``TypeError`` for another
    annotation."""
    try:
        parameters = list(inspect.signature(agent, eval_str=True).parameters.values())
    except (NameError, TypeError, ValueError):  # an annotation that names what the agent's module does not import
        parameters = list(inspect.signature(agent).parameters.values())
    if not parameters:
        return "openai"
    annotation = parameters[0].annotation
    if annotation in (inspect.Parameter.empty, Any, object):
        return "openai"
    name = annotation.rsplit(".", 1)[-1] if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if name not in CLIENT_KINDS:
        raise TypeError(
            f"the agent's first parameter is annotated {annotation!r:.60}: annotate it openai.AsyncOpenAI (or leave it "
            "unannotated), anthropic.AsyncAnthropic, or trinity_trl.rollouts.agent.PolicyAccess (base URLs and the "
            "run's key)"
        )
    return CLIENT_KINDS[name]


def check_agent(agent: Any) -> None:
    """``TypeError`` unless ``agent`` is an ``async def agent(client, row)`` whose ``client`` is one the endpoint can
    give (`client_kind`)."""
    call = type(agent).__dict__.get("__call__") if not inspect.isfunction(agent) else None
    if not (inspect.iscoroutinefunction(agent) or (call is not None and inspect.iscoroutinefunction(call))):
        raise TypeError(
            f"agent must be an async function `async def agent(client, row) -> reward` (or (reward, info)), got "
            f"{agent!r:.80}"
        )
    client_kind(agent)


def check_agent_generation(use_vllm: bool, vllm_mode: str, tensor_parallel_size: int) -> None:
    """``NotImplementedError`` where TRL's generation cannot answer an agent endpoint.

    Each process answers its own agents whenever they ask, so its generation calls must not wait for the other
    processes. Transformers generation (DDP, ZeRO-1/2) and vLLM colocated with ``tensor_parallel_size=1`` (each process
    its own engine) generate alone, and vLLM returns the sampled token ids and log-probs that the endpoint records.
    The other vLLM setups make every generation call a collective (docs/environments.md#agent-limits).
    """
    if not use_vllm:
        return
    if vllm_mode == "server":
        raise NotImplementedError(
            "agent= cannot generate with vllm_mode='server': TRL's server generation gathers the prompts of all "
            "processes in every call (a collective: processes that answer their own agents at different times would "
            "wait on each other), and its weight transfer needs NCCL, so even one process cannot be tested here; use "
            "vllm_mode='colocate' (docs/environments.md#agent-limits)"
        )
    if tensor_parallel_size > 1:
        raise NotImplementedError(
            f"agent= cannot generate with vllm_tensor_parallel_size={tensor_parallel_size}: TRL's colocated vLLM "
            "gathers the prompts of a tensor-parallel group's processes in each call (a collective), while each "
            "process answers its own agents when they ask; use vllm_tensor_parallel_size=1 "
            "(docs/environments.md#agent-limits)"
        )


@dataclass
class _Worker:
    """One agent run in its own thread: the thread, its event loop, the agent's task and the run's outcome."""

    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    task: asyncio.Task
    outcome: concurrent.futures.Future


@dataclass
class RecordedRun:
    """One agent run as it was played and trained (`AgentRollout.recorded`).

    Attributes:
        row: the dataset row the agent was given.
        reward: the run's reward as trained (after ``on_failure``; NaN: unscored).
        outcome: ``"ok"``, ``"error"`` (the agent raised, or returned something that is not a number) or
            ``"timeout"``.
        info: what the agent returned beside its reward (or the fault's message).
        calls: the model calls the endpoint answered, in order (`request.Call`: ``prompt_ids``, and per
            choice ``completion_ids``, ``logprobs`` (the sampling log-probs), ``message``; and ``policy_version``,
            the optimizer steps taken by the weights that sampled it); each choice is one step.
    """

    row: dict[str, Any]
    reward: float
    outcome: str
    info: Any
    calls: list[Call]

    @property
    def steps(self) -> list[tuple[list[int], list[int], list[float] | None]]:
        """``(prompt_ids, completion_ids, logprobs)`` of each trained step, in call order."""
        return [(call.prompt_ids, c.completion_ids, c.logprobs) for call in self.calls for c in call.choices]


def run_segments(record: RunRecord) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """``(steps, segments)`` of a recorded run: ``steps[s] = (call, choice)`` in call order, and the step indices of
    each segment, every step of a segment extending the previous one (see the module docstring)."""
    steps, where = [], {}
    for c, call in enumerate(record.calls):
        for k in range(len(call.choices)):
            where[(c, k)] = len(steps)
            steps.append((c, k))
    segments: list[list[int]] = []
    tail_of: dict[int, int] = {}  # last step of a segment -> segment index
    for s, (c, _k) in enumerate(steps):
        parent = record.calls[c].parent
        owner = tail_of.pop(where[parent], None) if parent is not None and parent in where else None
        if owner is None:
            segments.append([s])
            owner = len(segments) - 1
        else:
            segments[owner].append(s)
        tail_of[s] = owner
    return steps, segments


def _last_answer_cut(record: RunRecord) -> bool:
    """Whether the last answer the policy gave ``record``'s run was cut at ``max_completion_length``."""
    return bool(record.calls and record.calls[-1].choices) and record.calls[-1].choices[-1].finish_reason == "length"


class AgentRollout(PlayedRollout):
    """Plays an agent function over the policy endpoint (see the module docstring).

    Args:
        endpoint: the endpoint (started for each rollout, on a fresh OS-chosen port, and stopped after it); ``None``:
            `start` builds one over the trainer's generation backend and chat template.
        agent: ``async def agent(client, row)`` returning a reward (a number; ``None``, NaN or +-inf: the run is
            unscorable) or ``(reward, info)``; ``client`` is what its annotation asks for (`client_kind`).
        timeout: seconds of its own time a run may take (time spent waiting for the policy's answers excluded, so a
            slow generation never times agents out); it is then cancelled and its calls refused.
        on_failure: ``"zero"`` (a run whose agent raised or timed out scores 0) or ``"drop"`` (it is unscored and
            gets no gradient).
        batch_window: seconds the endpoint waits, after a request arrives, for the other live runs' requests
            before it generates (it generates at once when every live run waits).
        empty_prompt: the prompt ids of the stand-in step of a run that made no call (its completion is one EOS; it
            belongs to no segment, so it is never trained; it carries the run's reward into its group); default: the
            EOS token, or the pad token when `start` builds the endpoint.
        max_env_steps: model calls per run at most, when `start` builds the endpoint (else the endpoint's).
        history: ``"tokens"`` (a request that continues an earlier call extends its sampled tokens) or
            ``"messages"`` (every request rendered anew), when `start` builds the endpoint.
    """

    protocol = AGENT_PROTOCOL

    def __init__(
        self,
        endpoint: PolicyEndpoint | None,
        agent: AgentFn,
        timeout: float = 300.0,
        on_failure: str = "zero",
        batch_window: float = 0.05,
        empty_prompt: list[int] | None = None,
        max_env_steps: int | None = None,
        history: str = "tokens",
    ):
        check_agent(agent)
        self.client_kind = client_kind(agent)
        if on_failure not in FAILURE_MODES:
            raise ValueError(f"on_failure must be one of {FAILURE_MODES}, got {on_failure!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.agent = agent
        self.timeout, self.on_failure, self.batch_window = float(timeout), on_failure, float(batch_window)
        self.environment_names = [getattr(agent, "__qualname__", type(agent).__qualname__)]
        self.history = history if endpoint is None else ("tokens" if endpoint.token_history else "messages")
        self.max_env_steps = max_env_steps if endpoint is None else endpoint.max_env_steps
        self._empty_prompt = empty_prompt
        self.endpoint: PolicyEndpoint | None = None
        if endpoint is not None:
            self._use(endpoint)
        self.metrics: dict[str, float] = {}
        self._previous: list[RunRecord] = []
        self._counted: Counter = Counter()
        self.infos: list[Any] = []
        #: the last rollout's runs, as played and trained (`RecordedRun`)
        self.recorded: list[RecordedRun] = []

    def _use(self, endpoint: PolicyEndpoint) -> None:
        self.endpoint = endpoint
        self.empty_prompt = list(self._empty_prompt or [endpoint.generator.eos_token_id])
        self.eos_token_id = endpoint.generator.eos_token_id

    def start(self, context: RolloutContext) -> None:
        if context.lockstep_engine is not None:
            # each process serves its own runs and generates when its agents ask, a number of times that differs
            # between processes; ZeRO-3 and FSDP gather the sharded weights in every forward of generate, so all
            # processes must generate in lockstep (DDP and ZeRO-1/2 keep whole weights: each generates alone)
            raise NotImplementedError(
                f"agent= cannot run under {context.lockstep_engine}: its generation needs every process to generate "
                "in lockstep, while each process answers its own agents when they ask; use DDP or ZeRO-1/2 "
                "(docs/environments.md#agent-limits)"
            )
        if self.endpoint is not None:
            return
        if self._empty_prompt is None:
            self._empty_prompt = [context.tokenizer.pad_token_id]
        self._use(
            PolicyEndpoint(
                context.generation,
                ChatRenderer(context.processing_class, context.chat_template, context.chat_template_kwargs),
                max_context=context.max_context,
                max_env_steps=self.max_env_steps,
                sampling=context.sampling,
                token_history=self.history == "tokens",
                max_completion_length=context.max_completion_length,
                policy_version=context.policy_version,
            )
        )

    def access(self, record: RunRecord) -> PolicyAccess:
        """How ``record``'s run reaches the policy (its URLs and key)."""
        endpoint = self.endpoint
        root = endpoint.root_url
        return PolicyAccess(endpoint.base_url, root, record.key, f"{endpoint.run_root_url(record)}/v1")

    def _client(self, record: RunRecord) -> Any:
        """The client the agent asked for, pointed at the endpoint with the run's key."""
        access = self.access(record)
        if self.client_kind == "access":
            return access
        if self.client_kind == "anthropic":
            try:
                import anthropic
            except ImportError as err:
                raise ImportError('an agent asking for anthropic.AsyncAnthropic needs "trinity-trl[agents]"') from err
            return anthropic.AsyncAnthropic(base_url=access.root_url, api_key=access.api_key, max_retries=0)
        import openai

        return openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)

    async def _one(self, record: RunRecord, row: dict[str, Any]) -> tuple[str, Any, Any]:
        """``(outcome, reward, info)`` of one run (``outcome``: ok / error; a cancelled run raises ``CancelledError``,
        read as a timeout by `_start`). A reward of None, NaN or +-inf is the run's and makes it unscorable (NaN)."""
        client = self._client(record)
        try:
            result = await self.agent(client, dict(row))
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the agent's own failure: counted, the run scored by on_failure
            return "error", None, f"{type(err).__name__}: {err}"
        finally:
            self.endpoint.close_run(record)
            if hasattr(client, "close"):
                await client.close()
        reward, info = result if isinstance(result, tuple) and len(result) == 2 else (result, None)
        if reward is None:
            return "ok", math.nan, info
        try:
            value = float(reward)
        except (TypeError, ValueError):  # an agent's bug, as if it had raised
            return "error", None, f"the agent returned {result!r:.80}: a reward is a number, or None (unscorable)"
        return "ok", (value if math.isfinite(value) else math.nan), info

    def _start(self, record: RunRecord, row: dict[str, Any], index: int) -> _Worker:
        """Start one run in its own thread with its own event loop: an agent that blocks (``time.sleep``, blocking
        I/O, heavy computation) stalls only itself, and only its own time counts against ``timeout``."""
        loop = asyncio.new_event_loop()
        task = loop.create_task(self._one(record, row))
        outcome: concurrent.futures.Future = concurrent.futures.Future()

        def main():
            asyncio.set_event_loop(loop)
            try:
                outcome.set_result(loop.run_until_complete(task))
            except asyncio.CancelledError:  # cancelled by the watchdog (timeout)
                outcome.set_result(("timeout", None, None))
            except BaseException as err:  # e.g. SystemExit raised by an agent: its run fails, training goes on
                outcome.set_result(("error", None, f"{type(err).__name__}: {err}"))
            finally:
                # tasks the agent spawned and left running end with its run
                left = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in left:
                    t.cancel()
                if left:
                    loop.run_until_complete(asyncio.wait(left, timeout=CANCEL_GRACE_S))
                loop.close()

        thread = threading.Thread(target=main, name=f"trinity-agent-run-{index}", daemon=True)
        thread.start()
        return _Worker(thread, loop, task, outcome)

    def _watch(self, workers: list[_Worker], records: list[RunRecord], cancelled: dict[int, float]) -> None:
        """Cancel the runs whose agents took more than ``timeout`` seconds of their own time (time spent waiting for
        the policy does not count): their calls are refused from now on."""
        now = time.monotonic()
        for i, (worker, record) in enumerate(zip(workers, records)):
            if worker.outcome.done() or i in cancelled or record.own_time(now) <= self.timeout:
                continue
            record.timed_out = True
            self.endpoint.close_run(record)
            try:
                worker.loop.call_soon_threadsafe(worker.task.cancel)
            except RuntimeError:  # its loop has just closed: the run is over anyway
                pass
            cancelled[i] = now

    def __call__(self, rows: list[dict[str, Any]]) -> list[Run]:
        endpoint = self.endpoint.start()
        records = [endpoint.open_run() for _ in rows]
        cancelled: dict[int, float] = {}  # run -> when the watchdog cancelled it
        workers: list[_Worker] = []

        def live() -> int:
            return sum(1 for w, r in zip(workers, records) if not w.outcome.done() and r.open)

        def abandoned(i: int) -> bool:  # an agent that ignores its cancellation is let go after a grace period
            return i in cancelled and time.monotonic() - cancelled[i] > CANCEL_GRACE_S

        try:
            workers.extend(self._start(r, row, i) for i, (r, row) in enumerate(zip(records, rows)))
            while not all(w.outcome.done() or abandoned(i) for i, w in enumerate(workers)):
                self._watch(workers, records, cancelled)
                batch = endpoint.next_batch(live, self.batch_window)
                if batch:
                    endpoint.answer(batch)
            # requests that arrived after their run ended (refused) are still queued: answer them
            leftover = endpoint.next_batch(lambda: 0, 0.0, poll=0.0)
            if leftover:
                endpoint.answer(leftover)
        finally:
            for record in records:
                endpoint.close_run(record)
            # the server runs only during a rollout: between steps nothing listens, and nothing keeps the trainer
            # alive through the server thread
            endpoint.stop()
            for worker in workers:  # ended runs: their threads are done (an abandoned one cannot be joined)
                if worker.outcome.done():
                    worker.thread.join(CANCEL_GRACE_S)
        stuck = [i for i, w in enumerate(workers) if not w.outcome.done()]
        if stuck:
            logger.warning(
                "%d agent run(s) ignored their cancellation for %.0f s and were abandoned (their threads keep running "
                "until the agent returns; an agent must not block forever, see docs/environments.md#agent-rules)",
                len(stuck),
                CANCEL_GRACE_S,
            )
        outcomes = [w.outcome.result() if w.outcome.done() else ("timeout", None, None) for w in workers]
        counts = {"error": 0, "timeout": 0, "error_after_cut": 0}
        first: dict[str, Any] = {}
        runs, self.infos, self.recorded = [], [], []
        for row, record, (outcome, reward, info) in zip(rows, records, outcomes):
            if outcome != "ok":
                counts[outcome] += 1
                first.setdefault(outcome, info)
                counts["error_after_cut"] += outcome == "error" and _last_answer_cut(record)
                reward = 0.0 if self.on_failure == "zero" else math.nan
            runs.append(self._run(record, reward))
            self.infos.append(info)
            self.recorded.append(RecordedRun(dict(row), reward, outcome, info, list(record.calls)))
        # a run's key is kept (closed) through the next rollout, so a late call of its agent is refused as late
        # (409) and counted rather than taken for a stranger's (401)
        endpoint.forget(self._previous)
        self._previous = records
        counters = {name: endpoint.counters[name] - self._counted[name] for name in COUNTERS}
        self._counted = Counter(endpoint.counters)
        n = max(1, len(runs))
        self.metrics = {
            "agent/runs": float(len(runs)),
            "agent/errors": float(counts["error"]),
            "agent/timeouts": float(counts["timeout"]),
            "agent/errors_after_cut_answer": float(counts["error_after_cut"]),
            **{f"agent/{name}": float(counters[name]) for name in COUNTERS},
            "agent/calls_per_run": sum(len(r.calls) for r in records) / n,
            "agent/runs_without_calls": float(sum(not r.calls for r in records)),
            "agent/segments_per_run": sum(len(run.segments or []) for run in runs) / n,
        }
        self._log_faults(counts, first, counters, endpoint.take_examples(), len(runs))
        return runs

    def _log_faults(self, counts, first, counters, examples, n: int) -> None:
        """One warning line per kind of fault of this rollout, with its count and the first instance; runs that
        raised right after the policy's answer was cut at ``max_completion_length`` are said to have (the OpenAI
        Agents SDK raises on a Responses answer whose status is ``incomplete``)."""
        scored = "scored 0" if self.on_failure == "zero" else "left unscored"
        cut = ""
        if counts["error_after_cut"]:
            limit = self.endpoint.max_completion_length
            cut = (
                f"; {counts['error_after_cut']} of them raised right after the policy's answer was cut at "
                f"max_completion_length={limit} tokens (finish reason 'length'; a Responses answer's status "
                "'incomplete', on which the OpenAI Agents SDK raises): raise max_completion_length "
                "(docs/environments.md#cut-answers)"
            )
        lines = {
            "error": f"agent runs raised (first: {first.get('error')}); {scored}{cut}",
            "timeout": f"agent runs took more than agent_timeout={self.timeout:g} s of their own time; {scored}",
        }
        for kind, text in lines.items():
            if counts[kind]:
                logger.warning("%d of %d %s", counts[kind], n, text)
        for name in COUNTERS:
            if name != "requests" and counters[name]:
                logger.warning("agent/%s: %d this step (first: %s)", name, counters[name], examples.get(name))

    def _run(self, record: RunRecord, reward: float) -> Run:
        steps, segments = run_segments(record)
        if not steps:  # no call: a stand-in step carries the run's reward into its group; no segment, never trained
            stand_in = Step(self.empty_prompt, [self.eos_token_id], [0.0], reward, "")
            return Run(steps=[stand_in], reward=reward, done=True, prefix_preserving=False, segments=[])
        out = []
        for c, k in steps:
            call, choice = record.calls[c], record.calls[c].choices[k]
            out.append(
                Step(
                    call.prompt_ids,
                    choice.completion_ids,
                    choice.logprobs,
                    reward,
                    choice.message["content"],
                    policy_version=call.policy_version,
                    # the request's conversation before the policy's answer, as rendered (GiGPO's anchor state)
                    state_key=tokens_state("request_ids", call.prompt_ids),
                )
            )
        return Run(
            steps=out,
            reward=reward,
            done=True,
            prefix_preserving=len(segments) == 1,
            cut=record.cut,
            segments=segments,
        )
