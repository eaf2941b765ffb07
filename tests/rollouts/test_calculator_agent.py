"""The bundled agent (trinity_trl/rollouts/envs/calculator_agent.py) and its recipe config
(recipes/configs/step_grpo_agent_cpu.yaml)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from trinity_trl.rollouts.envs.calculator_agent import MAX_CALLS, calculator_agent

ROW = {
    "problem": "Anna has 6 boxes with 7 apples in each box. How many apples does Anna have in total?",
    "answer": "42",
}


class ScriptedClient:
    """Answers ``chat.completions.create`` with scripted texts and keeps the messages of each request."""

    def __init__(self, *texts: str):
        self.texts, self.requests = list(texts), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, model, messages, **kwargs):
        self.requests.append(json.loads(json.dumps(messages)))
        message = SimpleNamespace(content=self.texts.pop(0), tool_calls=None)
        return SimpleNamespace(choices=[SimpleNamespace(message=message)])


def play(*texts: str):
    client = ScriptedClient(*texts)
    return asyncio.run(calculator_agent(client, ROW)), client.requests


def test_right_at_the_first_try_scores_1():
    (reward, info), requests = play("6 * 7 = 42. The answer is 42.")
    assert reward == 1.0 and info == {"calc_calls": 0, "right_at_try": 1} and len(requests) == 1
    assert ROW["problem"] in requests[0][0]["content"] and "calc(" in requests[0][0]["content"]


def test_the_calculator_answers_and_the_run_goes_on():
    (reward, info), requests = play("calc(6*7)", "The answer is 42.")
    assert reward == 1.0 and info == {"calc_calls": 1, "right_at_try": 1}
    # the second request extends the first: its messages, the model's turn, the calculator's value
    assert requests[1][:2] == requests[0] + [{"role": "assistant", "content": "calc(6*7)"}]
    assert requests[1][2] == {"role": "user", "content": "calc(6*7) = 42"}
    (reward, _), requests = play("calc(6/7)", "The answer is 1.", "The answer is 2.")
    assert reward == 0.0 and requests[1][2]["content"].startswith("calc error: unsupported expression")


def test_a_wrong_answer_gets_one_second_try_worth_half():
    (reward, info), requests = play("The answer is 40.", "The answer is 42.")
    assert reward == 0.5 and info["right_at_try"] == 2
    assert requests[1][-1]["content"].startswith("That is not right. Try again.")
    (reward, info), requests = play("The answer is 40.", "The answer is 41.")
    assert reward == 0.0 and info["right_at_try"] is None and len(requests) == 2


def test_calls_per_run_are_bounded():
    (reward, info), requests = play(*["calc(1+1)"] * MAX_CALLS)
    assert reward == 0.0 and len(requests) == MAX_CALLS and info["calc_calls"] == MAX_CALLS


def test_the_agent_recipe_config_trains_two_steps(tmp_path, tiny_model_dir):
    pytest.importorskip("fastapi", reason="the `agents` extra is not installed")
    from trinity_trl.cli import run as cli

    trainer = cli(
        [
            "step_grpo",
            "--config",
            "step_grpo_agent_cpu",
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path / "run"),
            "--max_steps",
            "2",
            "--num_tasks",
            "8",
            "--max_completion_length",
            "8",
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "2",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
        ]
    )
    assert trainer.state.global_step == 2 and trainer.environment_protocol == "agent"
    logged = [e for e in trainer.state.log_history if "agent/calls_per_run" in e]
    assert len(logged) == 2
    for entry in logged:  # every run called the model (the random tiny model never answers right: 2 tries)
        assert entry["agent/errors"] == 0.0 and entry["agent/runs_without_calls"] == 0.0
        assert 1.0 <= entry["agent/calls_per_run"] <= MAX_CALLS
    assert (tmp_path / "run" / "training_log.json").is_file()
