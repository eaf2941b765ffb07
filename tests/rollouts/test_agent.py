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

import openai
import pytest
import torch
from datasets import Dataset
from helpers import tiny_grpo_kwargs
from tolerance import assert_close
from trainers import test_step_grpo_tools as tool_tests
from trainers.test_step_grpo_tools import Recording, force_turns, logs_of, task_of, tool_call

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


def test_chord_trainer_refuses_agents_and_environments(tmp_path):
    # issue 24 item 7: CHORD's expert rows have no environment
    from trinity_trl.trainers import ChordTrainer

    expert = Dataset.from_dict({"prompt": ["1+1?"], "completion": ["2"]})
    for name, value in (("agent", calculator_agent), ("environment_factory", object)):
        with pytest.raises(ValueError, match=f"ChordTrainer does not support {name}: .*StepGRPOTrainer"):
            ChordTrainer(model="unused", expert_dataset=expert, **{name: value})
