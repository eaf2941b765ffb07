"""``StepGRPOTrainer(agent=...)``: an agent written with the ``openai`` package alone, trained through the policy
endpoint (trinity_trl/rollouts/agent.py, endpoint.py); every model call a step, trained on the ids it sampled.

The tiny model cannot write tool calls by itself, so its turns are forced exactly as in
tests/trainers/test_step_grpo_tools.py (``force_turns``: transformers ``generate`` at temperature 1, only the scripted
token allowed, its sampling log-prob read from the raw logits); the agent, the endpoint, the chat template, the
tool-call parsing and the training are the real ones.
"""

from __future__ import annotations

import json
import math
import os

import openai
import pytest
import torch
from datasets import Dataset
from helpers import tiny_grpo_kwargs
from tolerance import assert_close
from trainers import test_step_grpo_tools as tool_tests
from trainers.test_step_grpo_tools import Recording, force_turns, logs_of, task_of, tool_call

from trinity_trl.rollouts.envs import NumberGuessEnv, number_guess_dataset
from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

tool_model_dir = tool_tests.tool_model_dir  # the tiny Qwen2 with TRL's Qwen2.5 chat template (tools)

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression."}},
            "required": ["expression"],
        },
    },
}


def evaluate(expression: str) -> str:
    """``a*b`` or ``a*b-c`` on whole numbers (the tool the scripted turns call)."""
    left, _, right = expression.partition("*")
    factor, *minus = right.split("-")
    return str(int(left) * int(factor) - sum(int(x) for x in minus))


async def calculator_agent(client, row):
    """A tool-using agent with the openai package alone: call the model, run its tool calls, stop on an answer."""
    messages = [{"role": "user", "content": f"Solve task {row['task']}: what is {row['task']}*3-1?"}]
    for _ in range(4):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(str(row["task"] * 3 - 1) in message.content)
        for call in message.tool_calls:
            result = evaluate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def three_turns(text: str) -> str:
    task, turn = task_of(text), text.count("<tool_response>")
    return [
        f"Task {task}. " + tool_call("calc", expression=f"{task}*3"),
        f"Task {task} again. " + tool_call("calc", expression=f"{task}*3-1"),
        f"Task {task}: {task * 3 - 1}.",
    ][min(turn, 2)]


def tasks(n: int) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"task {i}"}] for i in range(n)], "task": list(range(n))}
    )


def make(tmp_path, model_dir, agent, data, script=three_turns, record=None, **config):
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / "out"), max_steps=1, shuffle_dataset=False, max_completion_length=512, temperature=1.0
    )
    kwargs.update(config)
    trainer = Recording(model=model_dir, args=StepGRPOConfig(**kwargs), train_dataset=data, agent=agent)
    return force_turns(trainer, script, record)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_agent_turns_train_with_their_sampled_log_probs(tmp_path, tool_model_dir, shared_prefix):
    # items 2-4: each model call is a step; training rows hold the sampled ids after exactly the sampled context,
    # and the training forward's log-probs of them equal the sampling log-probs, turn by turn, at temperature 1
    record = []
    trainer = make(
        tmp_path,
        tool_model_dir,
        calculator_agent,
        tasks(2),
        record=record,
        num_generations=2,
        per_device_train_batch_size=4,
        shared_prefix=shared_prefix,
        learning_rate=0.0,
    )
    assert trainer.environment_protocol == "agent"
    trainer.train()
    assert len(record) == 12  # 4 runs x 3 calls
    batch = trainer.batches[0]
    if shared_prefix:  # each run's three calls extend one another: one row per run
        assert batch["sample_count"].tolist() == [3, 3, 3, 3]
    else:
        assert sorted(batch["sample_count"].tolist()) == [1] * 12
    rows = []
    for input_ids, logps in trainer.forwards:
        prompt_width = input_ids.size(1) - logps.size(1)
        for ids, row_logps in zip(input_ids.tolist(), logps):
            left = next(i for i, t in enumerate(ids) if t != trainer.processing_class.pad_token_id)
            rows.append((ids[left:], row_logps, prompt_width - left))
    for context, sampled, sampled_logps in record:
        found = [
            (lp, start)
            for seq, lp, start in rows
            if seq[: len(context) + len(sampled)] == context + sampled and len(context) >= start
        ]
        assert found, "a sampled turn is missing from the training rows (or its context changed)"
        for lp, start in found:
            trained = lp[len(context) - start : len(context) - start + len(sampled)]
            assert_close(trained, torch.tensor(sampled_logps), terms=len(context) + len(sampled))
    logs = logs_of(trainer)
    assert logs["multi_step/steps_per_run"] == 3.0 and logs["multi_step/run_reward"] == 1.0
    assert logs["agent/calls_per_run"] == 3.0 and logs["agent/segments_per_run"] == 1.0


# per task, the kinds of its two runs: 8 concurrent runs per generation, good ones and every fault
FAULTS = [("ok", "raises"), ("hangs", "malformed"), ("too_long", "ok"), ("drops_history", "ok")]


def faulty_agent():
    import asyncio
    from collections import Counter

    seen = Counter()

    async def agent(client, row):
        # the runs start in the order of their rows, so the n-th run of a task is its n-th start
        task = row["task"]
        kind = FAULTS[task][seen[task] % 2]
        seen[task] += 1
        if kind == "raises":
            raise RuntimeError("agent bug")
        if kind == "hangs":
            await asyncio.sleep(3600)
        if kind == "too_long":  # refused (400): the agent sees an openai.BadRequestError
            try:
                await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x " * 5000}])
            except openai.BadRequestError:
                return 0.0
        if kind == "drops_history":  # a second call that does not continue the first: two segments
            messages = [{"role": "user", "content": f"Solve task {task}: now."}]
            await client.chat.completions.create(model="p", messages=messages, tools=[CALC])
            await client.chat.completions.create(model="p", messages=messages + [{"role": "user", "content": "again"}])
            return 1.0
        return await calculator_agent(client, {**row, "kind": kind})

    return agent


def test_eight_concurrent_runs_with_faults_train_on(tmp_path, tool_model_dir):
    def script(text):
        task = task_of(text)
        if task == 1:  # the 'malformed' run (the 'hangs' run never calls)
            return f"Task {task} " + '<tool_call>\n{"name": "calc", "arguments": {oops}\n</tool_call>'
        if task == 3 and "now." in text:
            return f"Task {task} thinking."
        return three_turns(text)

    trainer = make(
        tmp_path,
        tool_model_dir,
        faulty_agent(),
        tasks(4),
        script=script,
        num_generations=2,
        per_device_train_batch_size=8,
        max_steps=2,
        agent_timeout=4.0,
        agent_batch_window=0.5,
    )
    trainer.train()  # nothing raises, nothing hangs: 2 steps of 8 concurrent runs
    assert trainer.state.global_step == 2 and len(trainer.batches) == 2
    history = [e for e in trainer.state.log_history if "agent/errors" in e]
    assert len(history) == 2
    for entry in history:  # logged per step
        assert entry["agent/errors"] == 1.0 and entry["agent/timeouts"] == 1.0
        assert entry["agent/malformed_tool_calls"] == 1.0 and entry["agent/context_overflows"] == 1.0
        assert entry["agent/runs_without_calls"] == 3.0  # raises, hangs, too_long
        assert math.isfinite(entry["loss"])
    for batch in trainer.batches:
        # ok x3 and malformed: a row each; drops_history: two segments; runs without a call: no row
        assert (batch["sample_count"] > 0).sum().item() == 3 + 1 + 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"agent_timeout": 0}, "agent_timeout"),
        ({"agent_on_failure": "skip"}, "agent_on_failure"),
        ({"agent_batch_window": -1}, "agent_batch_window"),
    ],
)
def test_bad_agent_options_fail_at_config_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)), **kwargs)


@pytest.mark.parametrize("option", [{"agent_timeout": 60.0}, {"agent_on_failure": "drop"}, {"agent_batch_window": 0.2}])
def test_an_agent_option_without_an_agent_is_refused(tmp_path, tool_model_dir, option):
    args = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)), **option)
    with pytest.raises(ValueError, match=f"{next(iter(option))} set, but there is no agent="):
        StepGRPOTrainer(
            model=tool_model_dir, args=args, train_dataset=number_guess_dataset(4), environment_factory=NumberGuessEnv
        )


def test_agent_is_checked_when_the_trainer_is_built(tmp_path, tool_model_dir):
    args = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)))

    def not_async(client, row):
        return 1.0

    with pytest.raises(TypeError, match="async function"):
        StepGRPOTrainer(model=tool_model_dir, args=args, train_dataset=tasks(2), agent=not_async)
    with pytest.raises(ValueError, match="without environment_factory"):
        StepGRPOTrainer(
            model=tool_model_dir, args=args, train_dataset=tasks(2), agent=calculator_agent, environment_factory=object
        )
    with pytest.raises(ValueError, match="needs a train_dataset"):
        StepGRPOTrainer(model=tool_model_dir, args=args, agent=calculator_agent)
    # vLLM colocated with one engine per process trains (tests/vllm_cpu); what makes each generation call a
    # collective across processes is refused before anything is loaded
    for vllm, message in (
        ({"vllm_mode": "server"}, "vllm_mode='server': .*collective.*NCCL.*vllm_mode='colocate' .*agent-limits"),
        ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2: .*collective.*=1 .*agent-limits"),
    ):
        refused = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), use_vllm=True, **vllm))
        with pytest.raises(NotImplementedError, match=message):
            StepGRPOTrainer(model=tool_model_dir, args=refused, train_dataset=tasks(2), agent=calculator_agent)


def test_chord_trainer_refuses_agents_and_environments(tmp_path):
    # issue 24 item 7: CHORD's expert rows have no environment
    from trinity_trl.trainers import ChordTrainer

    expert = Dataset.from_dict({"prompt": ["1+1?"], "completion": ["2"]})
    for name, value in (("agent", calculator_agent), ("environment_factory", object)):
        with pytest.raises(ValueError, match=f"ChordTrainer does not support {name}: .*StepGRPOTrainer"):
            ChordTrainer(model="unused", expert_dataset=expert, **{name: value})
        # without an expert_dataset too: the agent is what is wrong, not the missing dataset (issue 36 item 3)
        with pytest.raises(ValueError, match=f"ChordTrainer does not support {name}"):
            ChordTrainer(model="unused", **{name: value})


HI = [{"role": "user", "content": "hi"}]
TOOL_TURN = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
# (name, body, the field the 4xx must name): every body is malformed in exactly one field. Sent during training,
# through the openai client and through raw HTTP, each gets a 4xx naming its field and is counted; training goes on.
MALFORMED = [
    ("stop list of ints", {"model": "p", "messages": HI, "stop": [5]}, "stop"),
    ("stop int", {"model": "p", "messages": HI, "stop": 5}, "stop"),
    ("temperature list", {"model": "p", "messages": HI, "temperature": [1]}, "temperature"),
    ("temperature text", {"model": "p", "messages": HI, "temperature": "hot"}, "temperature"),
    ("temperature bool", {"model": "p", "messages": HI, "temperature": True}, "temperature"),
    ("top_p text", {"model": "p", "messages": HI, "top_p": "1"}, "top_p"),
    ("tools int", {"model": "p", "messages": HI, "tools": 5}, "tools"),
    ("tool not a function", {"model": "p", "messages": HI, "tools": [{"type": "code"}]}, "tools.0"),
    ("tool name int", {"model": "p", "messages": HI, "tools": [{"type": "function", "function": {"name": 5}}]}, "name"),
    ("tool_calls text", {"model": "p", "messages": [*HI, {"role": "assistant", "tool_calls": "oops"}]}, "tool_calls"),
    ("tool call no function", {"model": "p", "messages": [*HI, TOOL_TURN]}, "function"),
    (
        "text part number",
        {"model": "p", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "text",
    ),
    ("image part", {"model": "p", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
    ("content int", {"model": "p", "messages": [{"role": "user", "content": 5}]}, "content"),
    ("content missing", {"model": "p", "messages": [{"role": "user"}]}, "content"),
    ("unknown role", {"model": "p", "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("message not an object", {"model": "p", "messages": ["hi"]}, "messages.0"),
    ("messages text", {"model": "p", "messages": "hi"}, "messages"),
    ("messages empty", {"model": "p", "messages": []}, "messages"),
    ("messages missing", {"model": "p"}, "messages"),
    ("model missing", {"messages": HI}, "model"),
    ("model int", {"model": 5, "messages": HI}, "model"),
    ("n zero", {"model": "p", "messages": HI, "n": 0}, "n"),
    ("n text", {"model": "p", "messages": HI, "n": "2"}, "n"),
    ("max_tokens zero", {"model": "p", "messages": HI, "max_tokens": 0}, "max_tokens"),
    ("max_tokens float", {"model": "p", "messages": HI, "max_tokens": 1.5}, "max_tokens"),
    ("logprobs text", {"model": "p", "messages": HI, "logprobs": "yes"}, "logprobs"),
    ("top_logprobs", {"model": "p", "messages": HI, "top_logprobs": 3}, "top_logprobs"),
    ("tool_choice required", {"model": "p", "messages": HI, "tools": [CALC], "tool_choice": "required"}, "tool_choice"),
    ("stream text", {"model": "p", "messages": HI, "stream": "yes"}, "stream"),
    ("stream_options text", {"model": "p", "messages": HI, "stream_options": {"include_usage": 1}}, "include_usage"),
    ("seed", {"model": "p", "messages": HI, "seed": 1}, "seed"),
    ("logit_bias", {"model": "p", "messages": HI, "logit_bias": {"5": 10}}, "logit_bias"),
    ("presence_penalty", {"model": "p", "messages": HI, "presence_penalty": 1.0}, "presence_penalty"),
    ("unknown field", {"model": "p", "messages": HI, "temprature": 1.0}, "temprature"),
    ("other temperature", {"model": "p", "messages": HI, "temperature": 0.5}, "temperature"),
    (
        "tool_call_id int",
        {"model": "p", "messages": [{"role": "tool", "content": "1", "tool_call_id": 3}]},
        "tool_call_id",
    ),
]
# bodies only raw HTTP can send (the openai client always sends a JSON object)
RAW_ONLY = [("not JSON", b'{"model": "p", "messages": [', None), ("a JSON list", b"[1, 2]", None)]

# issue 46 item 4: the same for the Responses API (POST /v1/responses) and Anthropic Messages (POST /v1/messages)
ITEMS = [{"role": "user", "content": "hi"}]
FUNCTION_CALL = {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}
RESPONSES_TOOL = {"type": "function", "name": "calc", "parameters": {"type": "object"}}
RESPONSES_MALFORMED = [
    ("input missing", {"model": "p"}, "input"),
    ("input int", {"input": 5}, "input"),
    ("input empty", {"input": []}, "input"),
    ("reasoning item", {"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ("unknown role", {"input": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("content int", {"input": [{"role": "user", "content": 5}]}, "content"),
    ("image part", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
    ("text part int", {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "text"),
    ("call without call_id", {"input": [*ITEMS, {**FUNCTION_CALL, "call_id": None}]}, "call_id"),
    ("call arguments object", {"input": [*ITEMS, {**FUNCTION_CALL, "arguments": {}}]}, "arguments"),
    ("output int", {"input": [*ITEMS, {"type": "function_call_output", "call_id": "c1", "output": 5}]}, "output"),
    ("tools object", {"input": ITEMS, "tools": {"name": "calc"}}, "tools"),
    ("web search tool", {"input": ITEMS, "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ("tool name empty", {"input": ITEMS, "tools": [{**RESPONSES_TOOL, "name": ""}]}, "name"),
    ("tool_choice required", {"input": ITEMS, "tools": [RESPONSES_TOOL], "tool_choice": "required"}, "tool_choice"),
    ("temperature text", {"input": ITEMS, "temperature": "hot"}, "temperature"),
    ("other temperature", {"input": ITEMS, "temperature": 0.5}, "temperature"),
    ("max_output_tokens zero", {"input": ITEMS, "max_output_tokens": 0}, "max_output_tokens"),
    ("max_output_tokens too many", {"input": ITEMS, "max_output_tokens": 100_000}, "max_output_tokens"),
    ("include reasoning", {"input": ITEMS, "include": ["reasoning.encrypted_content"]}, "include"),
    ("reasoning effort high", {"input": ITEMS, "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ("json output", {"input": ITEMS, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ("previous_response_id", {"input": ITEMS, "previous_response_id": "resp_1"}, "previous_response_id"),
    ("unknown field", {"input": ITEMS, "temprature": 1.0}, "temprature"),
    ("parallel_tool_calls false", {"input": ITEMS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ("stream text", {"input": ITEMS, "stream": "yes"}, "stream"),
    ("truncation auto", {"input": ITEMS, "truncation": "auto"}, "truncation"),
    ("top_logprobs", {"input": ITEMS, "top_logprobs": 5}, "top_logprobs"),
    ("instructions int", {"input": ITEMS, "instructions": 5}, "instructions"),
    ("background", {"input": ITEMS, "background": True}, "background"),
    ("metadata int", {"input": ITEMS, "metadata": {"k": 1}}, "metadata"),
]
HELLO = {"model": "p", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
TOOL_USE = {"type": "tool_use", "id": "t1", "name": "calc", "input": {}}
MESSAGES_MALFORMED = [
    ("max_tokens missing", {"model": "p", "messages": HELLO["messages"]}, "max_tokens"),
    ("max_tokens zero", {**HELLO, "max_tokens": 0}, "max_tokens"),
    ("max_tokens above the completion length", {**HELLO, "max_tokens": 100_000}, "max_tokens"),
    ("max_tokens text", {**HELLO, "max_tokens": "64"}, "max_tokens"),
    ("messages missing", {"model": "p", "max_tokens": 64}, "messages"),
    ("messages empty", {**HELLO, "messages": []}, "messages"),
    ("system role", {**HELLO, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    ("content int", {**HELLO, "messages": [{"role": "user", "content": 5}]}, "content"),
    ("image block", {**HELLO, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "type"),
    ("text int", {**HELLO, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "text"),
    ("tool_use from the user", {**HELLO, "messages": [{"role": "user", "content": [TOOL_USE]}]}, "type"),
    (
        "tool_result without its id",
        {**HELLO, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "1"}]}]},
        "tool_use_id",
    ),
    (
        "tool_use input text",
        {**HELLO, "messages": [*HELLO["messages"], {"role": "assistant", "content": [{**TOOL_USE, "input": "x"}]}]},
        "input",
    ),
    ("prefill", {**HELLO, "messages": [*HELLO["messages"], {"role": "assistant", "content": "The"}]}, "messages"),
    ("system int", {**HELLO, "system": 5}, "system"),
    ("tool without schema", {**HELLO, "tools": [{"name": "calc"}]}, "input_schema"),
    ("server tool", {**HELLO, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ("tool_choice any", {**HELLO, "tool_choice": {"type": "any"}}, "tool_choice"),
    (
        "no parallel tool use",
        {**HELLO, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
        "disable_parallel_tool_use",
    ),
    ("thinking", {**HELLO, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ("top_k", {**HELLO, "top_k": 5}, "top_k"),
    ("other temperature", {**HELLO, "temperature": 0.5}, "temperature"),
    ("stop_sequences text", {**HELLO, "stop_sequences": "stop"}, "stop_sequences"),
    ("stream text", {**HELLO, "stream": "yes"}, "stream"),
    ("model missing", {"max_tokens": 64, "messages": HELLO["messages"]}, "model"),
    ("unknown field", {**HELLO, "max_token": 64}, "max_token"),
    ("metadata user_id int", {**HELLO, "metadata": {"user_id": 5}}, "user_id"),
    ("container", {**HELLO, "container": "c"}, "container"),
    ("output_config", {**HELLO, "output_config": {"effort": "low"}}, "output_config"),
]


async def send_with_openai(client, body):
    """``body`` through ``client.chat.completions.create``: its keyword arguments, the rest in ``extra_body``."""
    import inspect

    known = set(inspect.signature(client.chat.completions.create).parameters)
    kwargs = {k: v for k, v in body.items() if k in known and k not in ("model", "messages")}
    extra = {k: v for k, v in body.items() if k not in known or k in ("model", "messages")}
    try:
        # model and messages go through extra_body so that the client sends them unchanged (even when missing)
        await client.chat.completions.create(
            model=openai.NOT_GIVEN, messages=openai.NOT_GIVEN, extra_body=extra, **kwargs
        )
    except openai.APIStatusError as err:
        return err.status_code, err.body
    return 200, None


async def send_raw(client, body, path="chat/completions"):
    """``body`` posted to ``path`` with the run's key (a bearer token, or Anthropic's ``x-api-key`` for messages)."""
    import httpx

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    auth = {"x-api-key": client.api_key} if path == "messages" else {"Authorization": f"Bearer {client.api_key}"}
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{client.base_url}{path}", content=content, headers={**auth, "Content-Type": "application/json"}
        )
    return response.status_code, response.json().get("error")


def test_malformed_requests_get_4xx_naming_the_field_and_training_goes_on(tmp_path, tool_model_dir):
    # issue 36 item 1: before the fix, stop=[5] killed trainer.train() (endpoint _choice) and several bodies got 500;
    # issue 46 item 4: every format's malformed bodies are refused alike (chat, Responses, Messages)
    answers, models = [], []

    async def agent(client, row):
        if row["task"] == 0:  # one run per step sends the whole table, both ways, then plays normally
            models.append([m.id for m in (await client.models.list()).data])
            for name, body, field in MALFORMED:
                answers.append(("openai", name, field, *await send_with_openai(client, body)))
            for name, body, field in MALFORMED + RAW_ONLY:
                answers.append(("raw", name, field, *await send_raw(client, body)))
            for path, table in (("responses", RESPONSES_MALFORMED), ("messages", MESSAGES_MALFORMED)):
                for name, body, field in table + RAW_ONLY:
                    answers.append((path, name, field, *await send_raw(client, body, path)))
        return await calculator_agent(client, row)

    trainer = make(
        tmp_path, tool_model_dir, agent, tasks(2), num_generations=2, per_device_train_batch_size=4, max_steps=2
    )
    trainer.train()
    assert trainer.state.global_step == 2
    bad = len(MALFORMED) * 2 + len(RESPONSES_MALFORMED) + len(MESSAGES_MALFORMED) + 3 * len(RAW_ONLY)
    assert len(MALFORMED) >= 30 and len(answers) == 2 * 2 * bad  # 2 steps x the 2 runs of task 0
    assert len(RESPONSES_MALFORMED) >= 20 and len(MESSAGES_MALFORMED) >= 20
    for how, name, field, status, error in answers:
        assert 400 <= status < 500, f"{how} {name}: HTTP {status}"
        message = error["message"]
        if field is not None:
            assert field in message, f"{how} {name}: {message!r} does not name {field!r}"
    assert [a for a in answers if a[1] == "temperature text"][0][4]["message"].startswith("temperature: wrong type str")
    assert "not JSON" in [a for a in answers if a[1] == "not JSON"][0][4]["message"]
    history = [e for e in trainer.state.log_history if "agent/rejected_requests" in e]
    assert [e["agent/rejected_requests"] for e in history] == [2.0 * bad] * 2
    # the well-formed calls of every run were answered and trained: every run solved its task
    assert all(e["agent/requests"] == 12.0 and e["agent/errors"] == 0.0 for e in history)
    assert logs_of(trainer)["multi_step/run_reward"] == 1.0
    assert models == [["policy"]] * 4  # the documented id, not the model's path


def test_each_runs_recorded_calls_are_readable_from_a_callback(tmp_path, tool_model_dir):
    # issue 36 item 4: trainer.agent_runs, read in on_step_end, holds each run's calls exactly as sampled and trained;
    # issue 46 item 6: a run that returns inf is unscorable (as None and NaN are), kept out of the logged reward mean
    from transformers import TrainerCallback

    seen = []

    class ReadRuns(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(list(trainer.agent_runs))

    async def agent(client, row):
        reward = await calculator_agent(client, row)
        return float("inf") if row["task"] == 1 else reward

    record = []
    trainer = make(
        tmp_path, tool_model_dir, agent, tasks(2), record=record, num_generations=2, per_device_train_batch_size=4
    )
    trainer.add_callback(ReadRuns())
    trainer.train()
    assert len(seen) == 1 and len(seen[0]) == 4
    runs = seen[0]
    assert [(r.row["task"], r.outcome, r.reward if r.row["task"] == 0 else "nan") for r in runs] == [
        (0, "ok", 1.0),
        (0, "ok", 1.0),
        (1, "ok", "nan"),
        (1, "ok", "nan"),
    ]
    assert all(math.isnan(r.reward) for r in runs[2:])
    steps = [step for run in runs for step in run.steps]
    assert len(steps) == 12 and all(len(run.calls) == 3 for run in runs)
    # every sampled turn (the generator's own record: context, ids, log-probs) is a recorded step, and back
    assert sorted((p, c, lp) for p, c, lp in steps) == sorted((p, c, lp) for p, c, lp in record)
    # the recorded ids are the trained ids: each run's last call ends its packed row
    rows = [r[r != trainer.processing_class.pad_token_id].tolist() for r in trainer.batches[0]["completion_ids"]]
    for run in runs:
        assert any(row[-len(run.steps[-1][1]) :] == run.steps[-1][1] for row in rows)
    logs = logs_of(trainer)
    assert logs["unscorable_count"] == 2.0 and logs["agent/errors"] == 0.0
    assert logs["rewards/environment_reward/mean"] == 1.0  # (1 + 1) / 2: the unscorable runs are left out, not inf


# ------------------------------------------------------------------------------------- every wire format, trained
ANSWER = "Solve task {task}: what is {task}*3-1?"
CALC_RESPONSES = {"type": "function", **CALC["function"]}
CALC_ANTHROPIC = {
    "name": "calc",
    "description": CALC["function"]["description"],
    "input_schema": CALC["function"]["parameters"],
}


async def chat_agent(access, row, stream):
    """`calculator_agent` over chat completions, its answers streamed or not."""
    client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)
    messages = [{"role": "user", "content": ANSWER.format(**row)}]
    try:
        for _ in range(4):
            if stream:
                async with client.chat.completions.stream(model="policy", messages=messages, tools=[CALC]) as events:
                    message = (await events.get_final_completion()).choices[0].message
            else:
                reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC])
                message = reply.choices[0].message
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    **({"tool_calls": [c.model_dump() for c in message.tool_calls]} if message.tool_calls else {}),
                }
            )
            if not message.tool_calls:
                return float(str(row["task"] * 3 - 1) in message.content)
            for call in message.tool_calls:
                result = evaluate(json.loads(call.function.arguments)["expression"])
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    return 0.0


async def responses_agent(access, row, stream):
    """The same loop over the Responses API: function calls and their outputs as input items."""
    client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)
    items: list = [{"role": "user", "content": ANSWER.format(**row)}]
    try:
        for _ in range(4):
            if stream:
                async with client.responses.stream(model="policy", input=items, tools=[CALC_RESPONSES]) as events:
                    response = await events.get_final_response()
            else:
                response = await client.responses.create(model="policy", input=items, tools=[CALC_RESPONSES])
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return float(str(row["task"] * 3 - 1) in response.output_text)
            for call in calls:
                output = evaluate(json.loads(call.arguments)["expression"])
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
    finally:
        await client.close()
    return 0.0


async def anthropic_agent(access, row, stream):
    """The same loop with the anthropic client: tool_use blocks answered by tool_result blocks."""
    import anthropic

    client = anthropic.AsyncAnthropic(base_url=access.root_url, api_key=access.api_key, max_retries=0)
    messages: list = [{"role": "user", "content": ANSWER.format(**row)}]
    try:
        for _ in range(4):
            kwargs = {"model": "policy", "max_tokens": 512, "messages": messages, "tools": [CALC_ANTHROPIC]}
            if stream:
                async with client.messages.stream(**kwargs) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(**kwargs)
            messages.append({"role": "assistant", "content": message.content})
            uses = [block for block in message.content if block.type == "tool_use"]
            if not uses:
                return float(str(row["task"] * 3 - 1) in message.content[0].text)
            results = [
                {"type": "tool_result", "tool_use_id": use.id, "content": evaluate(use.input["expression"])}
                for use in uses
            ]
            messages.append({"role": "user", "content": results})
    finally:
        await client.close()
    return 0.0


async def agents_sdk_agent(access, row, stream):
    """An OpenAI Agents SDK agent with a function tool, as written for OpenAI's service: only its client (the base
    URL and the run's key) and tracing (off) differ."""
    from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool

    @function_tool
    def calc(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return evaluate(expression)

    agent = Agent(name="calculator", instructions="Use the calc tool, then answer.", tools=[calc])
    client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    try:
        if stream:
            result = Runner.run_streamed(agent, ANSWER.format(**row), run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, ANSWER.format(**row), run_config=config)
    finally:
        await client.close()
    return float(str(row["task"] * 3 - 1) in result.final_output)


WIRE_AGENTS = [
    (agent, stream)
    for agent in (chat_agent, responses_agent, anthropic_agent, agents_sdk_agent)
    for stream in (False, True)
]


def test_every_wire_format_trains_on_its_sampled_ids_with_their_policy_version(tmp_path, tool_model_dir):
    # issue 46: in each step, 8 concurrent runs, one per client: the openai client over chat completions and the
    # Responses API, the anthropic client over Messages, an OpenAI Agents SDK agent with a function tool, each streamed
    # and not. Every run solves its task through two tool calls; every sampled turn is recorded as sampled, with the
    # policy version of the weights that sampled it, and trained as recorded.
    from transformers import TrainerCallback

    from trinity_trl.rollouts.agent import PolicyAccess

    started = []

    async def agent(access: PolicyAccess, row):
        # the runs start in the order of their rows (task 0's 4 runs, then task 1's): one client each per step
        fn, stream = WIRE_AGENTS[len(started) % len(WIRE_AGENTS)]
        started.append(fn.__name__ + (" streamed" if stream else ""))
        return await fn(access, row, stream)

    seen = []

    class ReadRuns(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((state.global_step, list(trainer.agent_runs)))

    record = []
    trainer = make(
        tmp_path,
        tool_model_dir,
        agent,
        tasks(2),
        record=record,
        num_generations=4,
        per_device_train_batch_size=8,
        max_steps=2,
    )
    trainer.add_callback(ReadRuns())
    trainer.train()
    assert len(started) == 16 and len(seen) == 2
    steps = []
    for (global_step, runs), batch in zip(seen, trainer.batches):
        assert [r.outcome for r in runs] == ["ok"] * 8 and [r.reward for r in runs] == [1.0] * 8, runs
        rows = [
            [t for t in prompt + completion if t != trainer.processing_class.pad_token_id]
            for prompt, completion in zip(batch["prompt_ids"].tolist(), batch["completion_ids"].tolist())
        ]
        for run in runs:
            assert len(run.calls) == 3 and {call.wire for call in run.calls} in ({"chat"}, {"responses"}, {"messages"})
            # sampled by the weights of this step's generation: global_step - 1 optimizer steps taken
            assert [call.policy_version for call in run.calls] == [global_step - 1] * 3
            for prompt, completion, _ in run.steps:  # trained as sampled: after exactly its context
                assert any(row[: len(prompt) + len(completion)] == prompt + completion for row in rows)
            steps += run.steps
    # every turn the generator sampled is a recorded step, ids and log-probs, and back
    assert sorted(steps) == sorted((p, c, lp) for p, c, lp in record) and len(steps) == 48
    logs = logs_of(trainer)
    assert logs["agent/rejected_requests"] == 0.0 and logs["agent/segments_per_run"] == 1.0


def project_threads():
    import threading

    return [
        t.name for t in threading.enumerate() if t.name.startswith(("trinity-policy-endpoint", "trinity-agent-run"))
    ]


def test_the_endpoint_and_agent_threads_end_with_training_and_on_error(tmp_path, tool_model_dir):
    # issue 33: every thread the project starts is stopped and joined, when training ends and when it fails
    import asyncio

    async def slow_agent(client, row):  # still waiting on a call when the policy fails
        await asyncio.sleep(0.05 * row["task"])
        return await calculator_agent(client, row)

    trainer = make(tmp_path, tool_model_dir, slow_agent, tasks(2), num_generations=2, per_device_train_batch_size=4)
    trainer.train()
    assert trainer.state.global_step == 1 and project_threads() == []

    def failing(text):
        if text.count("<tool_response>") == 1:
            raise RuntimeError("the policy failed")
        return three_turns(text)

    trainer = make(tmp_path, tool_model_dir, slow_agent, tasks(2), script=failing, num_generations=2)
    with pytest.raises(RuntimeError, match="the policy failed"):
        trainer.train()
    assert project_threads() == []


@pytest.mark.parametrize("engine", ["ddp", "zero2"])
def test_agents_train_on_two_processes_each_serving_its_own_runs(tmp_path, tiny_model_dir, engine):
    # issue 36 item 5: 2 processes on CPU (gloo): DDP through torchrun, DeepSpeed ZeRO-2 through accelerate launch
    # with the shipped recipes/accelerate/zero2.yaml; each process serves its own runs on its own endpoint and
    # generates with transformers when its agents ask; the trained ids are exactly the generated ones, on both ranks
    import sys
    from pathlib import Path

    from engines.engine_helpers import accelerate_launch
    from launching import run_launch

    root = Path(__file__).resolve().parents[2]
    script = root / "tests" / "trainers" / "dist_scripts" / "agent_ddp.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    run_launch(
        (lambda: torchrun + [tiny_model_dir, str(tmp_path)])
        if engine == "ddp"
        else (lambda: accelerate_launch("zero2", script, tiny_model_dir, str(tmp_path))),
        f"2-process agent training ({engine})",
        timeout_s=600,
        env=env,
        cwd=root,
    )
    ranks = [torch.load(tmp_path / f"agent_rank{r}.pt", weights_only=False) for r in range(2)]
    assert [(r["world"], r["rank"]) for r in ranks] == [(2, 0), (2, 1)]
    # rank 0 played the first prompt's group of 4 runs, rank 1 the second's
    assert [sorted(set(r["prompts"])) for r in ranks] == [["What is 1+1?"], ["What is 2+1?"]]
    for r in ranks:
        assert r["global_step"] == 1 and r["finite"]
        assert len(r["steps"]) == 8  # 4 runs x 2 calls
        # every recorded step is a generation of this rank's own generator, ids exactly as generated, and back
        assert sorted(r["steps"]) == sorted(r["generated"])
        # and is trained: its prompt + completion ids lie in a training row of this rank
        for prompt, completion in r["steps"]:
            sequence = prompt + completion
            assert any(row[: len(sequence)] == sequence for row in r["rows"]), "a step is not trained as sampled"
    # the agent/* metrics count both processes' runs
    assert ranks[0]["logs"]["agent/requests"] == 16.0 and ranks[0]["logs"]["agent/calls_per_run"] == 2.0


@pytest.mark.parametrize("engine, stage", [("fsdp", None), ("deepspeed", 3)])
def test_agents_are_refused_where_generation_needs_every_process(tmp_path, tool_model_dir, monkeypatch, engine, stage):
    # FSDP and ZeRO-3 gather sharded weights in every forward of generate: all processes must generate in lockstep
    from trinity_trl.trainers import step_grpo

    monkeypatch.setattr(step_grpo, "engine_of", lambda accelerator: engine)
    monkeypatch.setattr(step_grpo, "zero_stage", lambda accelerator: stage)
    args = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)))
    with pytest.raises(NotImplementedError, match="lockstep.*use DDP or ZeRO-1/2"):
        StepGRPOTrainer(model=tool_model_dir, args=args, train_dataset=tasks(2), agent=calculator_agent)


def test_the_agents_extra_names_every_client_and_make_install_installs_it():
    # issue 46 item 7: the clients an agent may ask for and the Agents SDK come with the agents extra, which
    # `make install` installs
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["agents"]
    names = {re.split(r"[<>=!~\[ ]", requirement)[0] for requirement in extra}
    assert {"fastapi", "uvicorn", "openai", "anthropic", "openai-agents"} <= names
    install = re.search(r'pip install --quiet -e "\.\[([\w,]+)\]"', (root / "Makefile").read_text())
    assert install and "agents" in install.group(1).split(",")


async def sdk_agent_without_tools(client, row):
    """An OpenAI Agents SDK agent over the run's client (the SDK raises on a Responses answer that is incomplete)."""
    from agents import Agent, OpenAIProvider, RunConfig, Runner

    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = await Runner.run(Agent(name="answerer", instructions="Answer."), f"task {row['task']}", run_config=config)
    return float(str(row["task"] * 3 - 1) in result.final_output)


def test_runs_that_raise_after_a_cut_answer_are_said_to_be_cut(tmp_path, tool_model_dir, caplog):
    """The OpenAI Agents SDK raises when the policy's answer is cut at max_completion_length (Responses status
    'incomplete'): the step's fault line says the runs raised right after a cut answer and what to raise, and they
    are counted (agent/errors_after_cut_answer)."""
    import logging

    trainer = make(
        tmp_path, tool_model_dir, sdk_agent_without_tools, tasks(2), num_generations=2, per_device_train_batch_size=4,
        max_completion_length=4,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        trainer.train()
    (entry,) = [e for e in trainer.state.log_history if "agent/errors" in e]
    assert entry["agent/errors"] == entry["agent/errors_after_cut_answer"] == 4.0
    assert "4 of 4 agent runs raised (first: ModelBehaviorError: Responses stream ended" in caplog.text
    assert "4 of them raised right after the policy's answer was cut at max_completion_length=4 tokens" in caplog.text
    assert "raise max_completion_length" in caplog.text
