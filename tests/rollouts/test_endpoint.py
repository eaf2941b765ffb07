"""The policy endpoint (trinity_trl/rollouts/endpoint.py) and the agent rollout over it (agent.py), with a scripted
generator: the real FastAPI/uvicorn server on 127.0.0.1 (an OS-chosen port), called by ``openai.AsyncOpenAI``.

The scripted generator answers each prompt with the turn ``script(prompt text)`` names, as token ids of the tiny
tokenizer (+ EOS) with made-up log-probs, and records every batch it is given, so the tests see what was batched,
what was recorded and which prompt ids the policy read.
"""

from __future__ import annotations

import asyncio
import json
import math

import openai
import pytest
from helpers import build_tiny_tokenizer

from trinity_trl.rollouts.agent import AgentRollout, run_segments
from trinity_trl.rollouts.endpoint import ChatRenderer, PolicyEndpoint


class Scripted:
    """``Generator`` whose turn for a prompt is ``script(decoded prompt)``; log-prob of token i is ``-(i + 1) / 10``."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_token_ids = {tokenizer.eos_token_id}
        self.batches: list[list[list[int]]] = []

    def generate(self, prompt_ids):
        self.batches.append([list(p) for p in prompt_ids])
        completions = []
        for ids in prompt_ids:
            text = self.script(self.tokenizer.decode(ids))
            completions.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id])
        return completions, [[-(i + 1) / 10 for i in range(len(c))] for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = build_tiny_tokenizer()
    tok.chat_template = qwen2_5_chat_template  # renders tools; TRL knows its response template
    return tok


def tool_call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def default_script(text: str) -> str:
    if "<tool_response>" in text:
        return "The sum is " + text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0] + "."
    if "use the tool" in text:
        return tool_call("add", a=2, b=3)
    if "broken call" in text:
        return '<tool_call>\n{"name": "add", "arguments": {oops}\n</tool_call>'
    return "Hello there friend."


@pytest.fixture
def endpoint(tokenizer):
    made = []

    def build(script=default_script, **kwargs):
        ep = PolicyEndpoint(Scripted(tokenizer, script), ChatRenderer(tokenizer), **kwargs).start()
        made.append(ep)
        return ep

    yield build
    for ep in made:
        ep.stop()


def play(endpoint, agent, rows, **kwargs):
    rollout = AgentRollout(endpoint, agent, **kwargs)
    return rollout, rollout(rows)


def test_loopback_models_and_keys(endpoint):
    ep = endpoint()
    assert ep.base_url.startswith("http://127.0.0.1:")

    async def agent(client, row):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        stranger = openai.AsyncOpenAI(base_url=ep.base_url, api_key="not-a-run", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await stranger.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        await stranger.close()
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        return float(reply.choices[0].message.content == "Hello there friend.")

    rollout, runs = play(ep, agent, [{}])
    assert runs[0].reward == 1.0 and len(runs[0].steps) == 1
    assert rollout.metrics["agent/requests"] == 1.0 and rollout.metrics["agent/errors"] == 0.0


def test_concurrent_runs_are_batched_and_recorded_exactly(endpoint, tokenizer):
    ep = endpoint()

    async def agent(client, row):
        messages = [{"role": "user", "content": f"Task {row['task']}: use the tool."}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], logprobs=True)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        call = message.tool_calls[0]
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
        assert [t.logprob for t in first.choices[0].logprobs.content][:2] == [-0.1, -0.2]
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        second = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        return float("5" in second.choices[0].message.content)

    # a long window: the endpoint generates as soon as every live run waits, so the batches do not depend on timing
    rollout, runs = play(ep, agent, [{"task": i} for i in range(8)], batch_window=30.0)
    assert [run.reward for run in runs] == [1.0] * 8
    # 8 runs, 2 calls each: answered in 2 batched generations of 8 prompts, not 16 calls
    assert [len(b) for b in ep.generator.batches] == [8, 8]
    for run in runs:
        first, second = run.steps
        assert run.segments == [[0, 1]] and run.prefix_preserving
        # the second prompt is the first prompt + the sampled ids (never re-tokenized) + the tool turn's tokens
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
        assert first.logprobs == [-(i + 1) / 10 for i in range(len(first.completion_ids))]
        # the first prompt is the chat template's rendering, tool schemas included
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": tokenizer.decode(first.prompt_ids).split("Task ")[1].join(["Task ", ""])}],
            tools=[ADD_TOOL],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        assert first.prompt_ids[:20] == list(rendered)[:20] and '"name": "add"' in tokenizer.decode(first.prompt_ids)
    assert rollout.metrics["agent/calls_per_run"] == 2.0 and rollout.metrics["agent/segments_per_run"] == 1.0


def test_rewritten_history_starts_a_new_segment_and_n_choices_are_steps(endpoint):
    turns = iter(["Alpha beta gamma.", "Delta epsilon zeta.", "Eta theta.", "Iota kappa."])
    ep = endpoint(script=lambda text: next(turns))

    async def agent(client, row):
        first = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=2
        )
        assert [c.finish_reason for c in first.choices] == ["length", "length"]
        kept = first.choices[1].message
        # continues choice 1 exactly: extends it
        await client.chat.completions.create(
            model="m",
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": kept.content},
                {"role": "user", "content": "more"},
            ],
        )
        # summarised history: rendered anew, a new segment
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "summary: hi"}])
        return 1.0

    _, runs = play(ep, agent, [{}])
    run = runs[0]
    assert [len(s.completion_ids) for s in run.steps[:2]] == [2, 2]
    assert run.segments == [[0], [1, 2], [3]] and not run.prefix_preserving
    # GiGPO's state of an agent's step: the request's conversation as rendered; the n choices of a call share it
    assert [s.state_key for s in run.steps] == [f"request_ids:{','.join(map(str, s.prompt_ids))}" for s in run.steps]
    assert run.steps[0].state_key == run.steps[1].state_key != run.steps[2].state_key
    # a cut turn is closed with EOS before the next turn's tokens
    assert run.steps[2].prompt_ids[: len(run.steps[1].prompt_ids) + 3] == (
        run.steps[1].prompt_ids + run.steps[1].completion_ids + [ep.generator.eos_token_id]
    )


def test_stop_strings_and_refused_sampling_settings(endpoint):
    ep = endpoint(sampling={"temperature": 1.0, "top_p": 1.0})

    async def agent(client, row):
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stop=["there"], temperature=1.0
        )
        assert reply.choices[0].message.content == "Hello "
        assert reply.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.2
            )
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], tools=[ADD_TOOL], tool_choice="required"
            )
        return 1.0

    rollout, runs = play(ep, agent, [{}])
    assert runs[0].reward == 1.0 and rollout.metrics["agent/errors"] == 0.0
    assert rollout.metrics["agent/rejected_requests"] == 2.0
    # the recorded turn ends with the token that completed the stop string
    assert "there" in ep.renderer.tokenizer.decode(runs[0].steps[0].completion_ids)


def test_faults_are_counted_and_scored_and_nothing_hangs(endpoint, caplog):
    ep = endpoint(max_context=1000, max_env_steps=2)
    late = {}

    async def agent(client, row):
        kind = row["kind"]
        hi = [{"role": "user", "content": "hi"}]
        if kind == "raises":
            await client.chat.completions.create(model="m", messages=hi)
            raise RuntimeError("agent bug")
        if kind == "hangs":
            await client.chat.completions.create(model="m", messages=hi)
            await asyncio.sleep(3600)
        if kind == "malformed":
            reply = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "broken call"}], tools=[ADD_TOOL]
            )
            return float(reply.choices[0].message.tool_calls is None)
        if kind == "too_long":
            with pytest.raises(openai.BadRequestError, match="context"):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 1500}])
            return 1.0
        if kind == "turn_limit":
            for _ in range(2):
                await client.chat.completions.create(model="m", messages=hi)
            with pytest.raises(openai.ConflictError):
                await client.chat.completions.create(model="m", messages=hi)
            return 1.0
        if kind == "late":
            late["key"] = client.api_key
            return 1.0
        if kind == "late_caller":  # calls with the key of a run that has ended
            await asyncio.sleep(0.3)
            stale = openai.AsyncOpenAI(base_url=ep.base_url, api_key=late["key"], max_retries=0)
            with pytest.raises(openai.ConflictError):
                await stale.chat.completions.create(model="m", messages=hi)
            await stale.close()
            return 1.0
        if kind == "no_number":
            return "great"
        if kind == "infinite":
            return float("inf")
        return None  # cannot score

    kinds = ["raises", "hangs", "malformed", "too_long", "turn_limit", "late", "late_caller", "no_number", "infinite"]
    kinds.append("unscorable")
    with caplog.at_level("WARNING", logger="trinity_trl.rollouts.agent"):
        rollout, runs = play(ep, agent, [{"kind": k} for k in kinds], timeout=4.0)
    # one log line per kind of fault, with its count (issue 36 item 3)
    lines = [r.getMessage() for r in caplog.records if r.name == "trinity_trl.rollouts.agent"]
    expected = [
        "2 of 10 agent runs raised (first: RuntimeError: agent bug)",  # and the run that returned 'great'
        "1 of 10 agent runs took more than agent_timeout=4 s",
        "agent/late_calls: 1 this step",
        "agent/context_overflows: 1 this step (first: the prompt has",
        "agent/malformed_tool_calls: 1 this step",
        "agent/turn_limit_hits: 1 this step",
    ]
    assert len(lines) == len(expected), lines
    for text in expected:
        assert sum(line.startswith(text) for line in lines) == 1, (text, lines)
    rewards = dict(zip(kinds, (run.reward for run in runs)))
    assert rewards["raises"] == 0.0 and rewards["hangs"] == 0.0 and rewards["no_number"] == 0.0
    # issue 46 item 6: inf, like None, is no fault: the run is unscorable (NaN), as a row of any other source
    assert math.isnan(rewards["infinite"]) and math.isnan(rewards["unscorable"])
    assert rewards["malformed"] == 1.0 and rewards["too_long"] == 1.0 and rewards["turn_limit"] == 1.0
    outcomes = {kind: recorded.outcome for kind, recorded in zip(kinds, rollout.recorded)}
    assert outcomes["no_number"] == "error" and outcomes["infinite"] == outcomes["unscorable"] == "ok"
    m = rollout.metrics
    assert (m["agent/errors"], m["agent/timeouts"]) == (2.0, 1.0) and "agent/bad_rewards" not in m
    assert m["agent/malformed_tool_calls"] == 1.0 and m["agent/context_overflows"] == 1.0
    assert m["agent/turn_limit_hits"] == 1.0 and runs[kinds.index("turn_limit")].cut
    assert m["agent/late_calls"] == 1.0 and rewards["late_caller"] == 1.0
    # runs without a call: a stand-in step in no segment (never trained)
    assert runs[kinds.index("late")].segments == []
    assert runs[kinds.index("late")].steps[0].state_key is None  # and a state of its own (GiGPO)

    # a call of an earlier step's run, during the next step, is refused as late too
    async def caller(client, row):
        stale = openai.AsyncOpenAI(base_url=ep.base_url, api_key=late["key"], max_retries=0)
        with pytest.raises(openai.ConflictError):
            await stale.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        await stale.close()
        return 1.0

    rollout.agent = caller
    runs = rollout([{}])
    assert runs[0].reward == 1.0 and rollout.metrics["agent/late_calls"] == 1.0


def test_failed_runs_are_dropped_when_asked(endpoint):
    ep = endpoint()

    async def agent(client, row):
        raise ValueError("no")

    rollout, runs = play(ep, agent, [{}, {}], on_failure="drop")
    assert all(math.isnan(run.reward) for run in runs) and rollout.metrics["agent/errors"] == 2.0


def test_run_segments_follow_parents():
    from trinity_trl.rollouts.request import Call, Choice, RunRecord

    def call(parent, n=1):
        return Call([], None, [], parent, [Choice([1], None, {"content": ""}, "stop") for _ in range(n)])

    record = RunRecord("k", calls=[call(None, n=2), call((0, 1)), call((0, 0)), call((1, 0)), call(None)])
    steps, segments = run_segments(record)
    assert steps == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (4, 0)]
    assert segments == [[0, 3], [1, 2, 4], [5]]


def test_a_blocking_agent_times_out_alone(endpoint):
    # issue 36 item 2: one run blocks its thread (time.sleep) for 3x the timeout; before runs were isolated it froze
    # the event loop every run shared, and its two neighbours were timed out too (scored 0 instead of 1)
    import time

    timeout = 1.0
    ep = endpoint()
    after_block = []

    async def agent(client, row):
        if row["kind"] == "blocks":
            time.sleep(3 * timeout)
            after_block.append(True)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return 1.0
        for _ in range(2):
            reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await asyncio.sleep(0.1 * timeout)
        return float(reply.choices[0].message.content == "Hello there friend.")

    kinds = ["blocks", "ok", "ok"]
    rollout, runs = play(ep, agent, [{"kind": k} for k in kinds], timeout=timeout)
    assert [run.reward for run in runs] == [0.0, 1.0, 1.0]  # the blocking run scores as a timeout (0); the rest 1
    assert rollout.metrics["agent/timeouts"] == 1.0 and rollout.metrics["agent/errors"] == 0.0
    assert [len(run.steps) for run in runs[1:]] == [2, 2] and runs[0].segments == []
    assert after_block == [True]  # it woke up after its run was over: cancelled at its next await, never answered


# renders tools (a line of their JSON) but has no response template TRL knows: tool calls could not be parsed
TOOLS_NO_PARSER = (
    "{% if tools %}{{ 'Tools: ' + (tools | tojson) + '\\n' }}{% endif %}{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["plain", "no_parser"])
def test_tools_the_chat_template_cannot_serve_are_refused(template):
    # issue 35: a chat template that renders a prompt with and without tools identically silently dropped tools=;
    # now the request is refused (400 naming tools) and counted, and a request without tools is answered
    from helpers import build_tiny_tokenizer

    tok = build_tiny_tokenizer()  # its template ignores tools
    if template == "no_parser":
        tok.chat_template = TOOLS_NO_PARSER
    ep = PolicyEndpoint(Scripted(tok, default_script), ChatRenderer(tok)).start()
    try:
        assert ep.renderer.renders_tools == (template == "no_parser")

        async def agent(client, row):
            hi = [{"role": "user", "content": "hi"}]
            with pytest.raises(openai.BadRequestError, match="tools") as refused:
                await client.chat.completions.create(model="m", messages=hi, tools=[ADD_TOOL])
            assert refused.value.body["param"] == "tools"
            reply = await client.chat.completions.create(model="m", messages=hi)
            return float(reply.choices[0].message.content == "Hello there friend.")

        rollout, runs = play(ep, agent, [{}])
    finally:
        ep.stop()
    assert runs[0].reward == 1.0 and rollout.metrics["agent/rejected_requests"] == 1.0
    assert len(runs[0].steps) == 1


# ------------------------------------------------------------------------------------- streaming and other formats
ADD_RESPONSES_TOOL = {"type": "function", **ADD_TOOL["function"]}
ADD_ANTHROPIC_TOOL = {
    "name": "add",
    "description": ADD_TOOL["function"]["description"],
    "input_schema": ADD_TOOL["function"]["parameters"],
}


def test_chat_streams_the_answer_as_the_openai_client_reads_it(endpoint):
    # issue 46 item 1: stream=true is answered with server-sent events: the text, the tool calls, the finish reason,
    # the usage in a last chunk when asked; the same turn as without streaming, recorded once
    ep = endpoint()

    async def agent(client, row):
        messages = [{"role": "user", "content": "hi"}]
        whole = await client.chat.completions.create(model="m", messages=messages)
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}, logprobs=True
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content == "Hello there friend."
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        logprobs = [
            t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
        ]
        assert logprobs == [-(i + 1) / 10 for i in range(whole.usage.completion_tokens)]
        # a tool call, streamed without usage
        tool_turn = [{"role": "user", "content": "use the tool"}]
        stream = await client.chat.completions.create(model="m", messages=tool_turn, tools=[ADD_TOOL], stream=True)
        chunks = [chunk async for chunk in stream]
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("add", {"a": 2, "b": 3})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and all(c.usage is None for c in chunks)
        return 1.0

    _, runs = play(ep, agent, [{}])
    assert len(runs[0].steps) == 3 and runs[0].steps[0].completion_ids == runs[0].steps[1].completion_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_api_calls_and_function_call_outputs_extend_the_run(endpoint, stream):
    # issue 46 item 2: POST /v1/responses, with instructions, a function tool and the function call's output sent
    # back as input items: the second call extends the first (one segment), whichever way it is answered
    ep = endpoint(policy_version=lambda: 7)

    async def create(client, **kwargs):
        if not stream:
            return await client.responses.create(**kwargs)
        events = [event async for event in await client.responses.create(stream=True, **kwargs)]
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        return events[-1].response

    async def agent(client, row):
        items = [{"role": "user", "content": "Please use the tool."}]
        first = await create(client, model="m", instructions="Be brief.", input=items, tools=[ADD_RESPONSES_TOOL])
        (call,) = first.output
        assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
        items += [
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ]
        second = await create(client, model="m", instructions="Be brief.", input=items, tools=[ADD_RESPONSES_TOOL])
        assert second.status == "completed" and second.output_text == "The sum is 5."
        assert second.usage.output_tokens == len(ep.renderer.tokenizer("The sum is 5.")["input_ids"]) + 1
        # the sampled tokens' log-probs, when asked for (a new conversation: a new segment)
        hello = await create(client, model="m", input="hi", include=["message.output_text.logprobs"])
        logprobs = [t.logprob for t in hello.output[0].content[0].logprobs]
        assert hello.output_text == "Hello there friend." and logprobs == [-(i + 1) / 10 for i in range(len(logprobs))]
        assert len(logprobs) == hello.usage.output_tokens
        return 1.0

    rollout, runs = play(ep, agent, [{}])
    run = runs[0]
    assert run.reward == 1.0 and run.segments == [[0, 1], [2]] and rollout.metrics["agent/rejected_requests"] == 0.0
    first, second, _ = run.steps
    assert (
        second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)]
        == first.prompt_ids + first.completion_ids
    )
    text = ep.renderer.tokenizer.decode(first.prompt_ids)
    assert text.startswith("<|im_start|>system\nBe brief.") and '"name": "add"' in text
    assert [s.policy_version for s in run.steps] == [7] * 3
    assert {c.wire for c in rollout.recorded[0].calls} == {"responses"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_messages_with_tool_use_and_tool_results_extend_the_run(endpoint, stream):
    # issue 46 item 3: POST /v1/messages through anthropic.AsyncAnthropic (the agent asks for it by annotation):
    # system, tool_use / tool_result blocks, stop sequences; the second call extends the first
    import anthropic

    ep = endpoint()

    async def create(client, **kwargs):
        if not stream:
            return await client.messages.create(**kwargs)
        async with client.messages.stream(**kwargs) as events:
            return await events.get_final_message()

    async def agent(client: anthropic.AsyncAnthropic, row):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Please use the tool."}]}]
        first = await create(
            client, model="m", max_tokens=512, system="Be brief.", messages=messages, tools=[ADD_ANTHROPIC_TOOL]
        )
        assert first.stop_reason == "tool_use"
        (use,) = [block for block in first.content if block.type == "tool_use"]
        assert use.name == "add" and use.input == {"a": 2, "b": 3}
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
        ]
        second = await create(
            client, model="m", max_tokens=512, system="Be brief.", messages=messages, tools=[ADD_ANTHROPIC_TOOL]
        )
        assert second.stop_reason == "end_turn" and second.content[0].text == "The sum is 5."
        stopped = await create(
            client, model="m", max_tokens=512, messages=[{"role": "user", "content": "hi"}], stop_sequences=["there"]
        )
        assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == (
            "stop_sequence",
            "there",
            "Hello ",
        )
        return 1.0

    rollout, runs = play(ep, agent, [{}])
    run = runs[0]
    assert run.reward == 1.0 and run.segments == [[0, 1], [2]] and rollout.metrics["agent/rejected_requests"] == 0.0
    assert ep.renderer.tokenizer.decode(run.steps[0].prompt_ids).startswith("<|im_start|>system\nBe brief.")
    assert {c.wire for c in rollout.recorded[0].calls} == {"messages"}


def test_a_conversation_continues_across_formats_and_a_run_url_carries_its_key(endpoint):
    # item 4: one recorder: a chat call continued by a Responses call extends it; item 5: a per-run base URL (the key
    # in the path) serves a client that sends no key of its own
    import httpx

    from trinity_trl.rollouts.agent import PolicyAccess

    ep = endpoint()

    async def agent(access: PolicyAccess, row):
        chat = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)
        messages = [{"role": "user", "content": "Please use the tool."}]
        first = await chat.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        await chat.close()
        call = first.choices[0].message.tool_calls[0]
        items = [
            *messages,
            {"type": "function_call", "call_id": call.id, "name": "add", "arguments": call.function.arguments},
            {"type": "function_call_output", "call_id": call.id, "output": "5"},
        ]
        async with httpx.AsyncClient() as http:  # no Authorization header: the key is in the URL
            answer = await http.post(
                f"{access.run_base_url}/responses", json={"input": items, "tools": [ADD_RESPONSES_TOOL]}
            )
            refused = await http.post(f"{access.base_url}/responses", json={"input": "hi"})
            unknown = await http.post(f"{access.run_base_url}/completions", json={"prompt": "hi"})
        assert refused.status_code == 401
        # a path the endpoint does not serve: a 404 that names what it serves, counted
        assert unknown.status_code == 404 and "serves GET /v1/models, POST /v1/chat/completions" in unknown.text
        return float(answer.json()["output"][0]["content"][0]["text"] == "The sum is 5.")

    rollout, runs = play(ep, agent, [{}])
    assert runs[0].reward == 1.0 and runs[0].segments == [[0, 1]]
    assert [c.wire for c in rollout.recorded[0].calls] == ["chat", "responses"]
    assert rollout.metrics["agent/rejected_requests"] == 2.0  # the request without a key, and the unknown path


def test_an_agent_asks_for_its_client_by_annotation():
    import anthropic

    from trinity_trl.rollouts.agent import PolicyAccess, check_agent, client_kind

    async def plain(client, row): ...

    async def claude(client: anthropic.AsyncAnthropic, row): ...

    async def access(access: PolicyAccess, row): ...

    async def wrong(client: int, row): ...

    assert [client_kind(f) for f in (plain, claude, access)] == ["openai", "anthropic", "access"]
    with pytest.raises(TypeError, match="annotated <class 'int'>: annotate it openai.AsyncOpenAI"):
        check_agent(wrong)


def test_max_tokens_above_the_completion_length_is_refused_in_every_format(endpoint):
    import anthropic

    from trinity_trl.rollouts.agent import PolicyAccess

    ep = endpoint(max_completion_length=16)
    answers = {}

    async def agent(client: PolicyAccess, row):
        oa = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        an = anthropic.AsyncAnthropic(base_url=client.root_url, api_key=client.api_key, max_retries=0)
        hi = [{"role": "user", "content": "hi"}]
        for name, call in (
            ("max_tokens", oa.chat.completions.create(model="m", messages=hi, max_tokens=17)),
            ("max_completion_tokens", oa.chat.completions.create(model="m", messages=hi, max_completion_tokens=99)),
            ("max_output_tokens", oa.responses.create(model="m", input="hi", max_output_tokens=17)),
            ("anthropic", an.messages.create(model="m", messages=hi, max_tokens=1024)),
        ):
            try:
                await call
            except (openai.BadRequestError, anthropic.BadRequestError) as err:
                answers[name] = str(err)
        ok = await an.messages.create(model="m", messages=hi, max_tokens=16)
        await oa.close()
        await an.close()
        return float(ok.content[0].text == "Hello there friend.")

    rollout, runs = play(ep, agent, [{}])
    assert runs[0].reward == 1.0 and rollout.metrics["agent/rejected_requests"] == 4.0
    assert "max_tokens=1024 is above the trainer's max_completion_length=16" in answers["anthropic"]
    assert all(f"{name}=" in answers[name] for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"))


def test_the_agents_sdk_defaults_are_taken_and_settings_that_would_change_sampling_are_refused(endpoint):
    # issue 46 item 2: an OpenAI Agents SDK agent as written (its default model settings: include=[],
    # reasoning.effort="none", text.verbosity="low") is answered; a model setting the policy cannot honour is
    # refused, naming the field
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
    from openai.types.shared import Reasoning

    ep = endpoint()

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    refused = {}

    async def agent(client, row):
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
        result = await Runner.run(Agent(name="greeter", instructions="Be brief."), "hi", run_config=config)
        assert result.final_output == "Hello there friend."
        for field, settings in (
            ("reasoning.effort", ModelSettings(reasoning=Reasoning(effort="high"))),
            ("tool_choice", ModelSettings(tool_choice="required")),
            ("truncation", ModelSettings(truncation="auto")),
            ("top_logprobs", ModelSettings(top_logprobs=3)),
        ):
            try:
                await Runner.run(Agent(name="a", tools=[add], model_settings=settings), "hi", run_config=config)
            except openai.BadRequestError as err:
                refused[field] = err.body["param"]
        return 1.0

    rollout, runs = play(ep, agent, [{}])
    assert runs[0].reward == 1.0 and len(runs[0].steps) == 1
    assert refused == {f: f for f in ("reasoning.effort", "tool_choice", "truncation", "top_logprobs")}
    assert rollout.metrics["agent/rejected_requests"] == 4.0
