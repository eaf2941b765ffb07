"""``VerifiersAgent`` (trinity_trl/rollouts/verifiers.py): a verifiers environment built from verifiers' own classes
(``vf.ToolEnv``, multi-turn with a tool, scored by a ``vf.Rubric``) trained by ``StepGRPOTrainer`` offline.

The tiny model's turns are forced as in tests/rollouts/test_agent.py (``force_turns``); verifiers' rollout loop, its
client, its tool execution and its rubric are the real ones, talking to the real policy endpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import tiny_grpo_kwargs
from trainers import test_step_grpo_tools as tool_tests
from trainers.test_step_grpo_tools import Recording, force_turns, logs_of, task_of, tool_call

from trinity_trl.trainers import StepGRPOConfig

vf = pytest.importorskip(
    "verifiers", reason="the `verifiers` extra is not installed (pip install trinity-trl[verifiers])"
)
pytest.importorskip("verifiers.legacy", reason="verifiers without its classic API (>=0.4) is installed")

from trinity_trl.rollouts.verifiers import VerifiersAgent  # noqa: E402

tool_model_dir = tool_tests.tool_model_dir  # the tiny Qwen2 with TRL's Qwen2.5 chat template (tools)

TOOL_CALLS: list[str] = []


def calc(expression: str) -> str:
    """Evaluate a product minus a number.

    Args:
        expression: e.g. 4*3-1
    """
    TOOL_CALLS.append(expression)
    left, _, right = expression.partition("*")
    factor, *minus = right.split("-")
    return str(int(left) * int(factor) - sum(int(x) for x in minus))


def correct_answer(completion, answer, **kwargs) -> float:
    """1 when the final message states the answer."""
    return float(answer in (completion[-1].content or ""))


def calculator_env(tasks: int = 2):
    data = Dataset.from_dict(
        {
            "question": [f"task {i}: what is {i}*3-1?" for i in range(tasks)],
            "answer": [str(i * 3 - 1) for i in range(tasks)],
        }
    )
    return vf.ToolEnv(dataset=data, tools=[calc], rubric=vf.Rubric(funcs=[correct_answer]), max_turns=4)


def script(text: str) -> str:
    """Task 0: calc, then the right answer (reward 1). Task 1: a wrong answer at once (reward 0)."""
    task, turn = task_of(text), text.count("<tool_response>")
    if task == 1:
        return "Task 1: it is 99."
    return f"Task {task}. " + tool_call("calc", expression=f"{task}*3-1") if turn == 0 else f"Task {task}: it is -1."


def test_a_verifiers_tool_env_trains_two_steps_with_its_rubric_rewards(tmp_path, tool_model_dir):
    TOOL_CALLS.clear()
    agent = VerifiersAgent(calculator_env())
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        shuffle_dataset=False,
        max_completion_length=512,
        temperature=1.0,
        num_generations=2,
        per_device_train_batch_size=4,
        max_env_steps=4,
    )
    trainer = Recording(model=tool_model_dir, args=StepGRPOConfig(**kwargs), train_dataset=agent.dataset(), agent=agent)
    force_turns(trainer, script)
    trainer.train()
    assert trainer.state.global_step == 2
    # verifiers ran its tool: two runs of task 0 per step, one calc call each
    assert TOOL_CALLS == ["0*3-1"] * 4
    for batch in trainer.batches:
        # task 0's runs: tool call + answer extend each other (one row of 2 steps); task 1's: one call each
        assert sorted(batch["sample_count"].tolist()) == [1, 1, 2, 2]
    history = [e for e in trainer.state.log_history if "agent/errors" in e]
    assert len(history) == 2
    for entry in history:
        assert entry["agent/errors"] == 0.0 and entry["agent/calls_per_run"] == 1.5
        # the rubric's rewards: 1 for task 0's two runs, 0 for task 1's
        assert entry["multi_step/run_reward"] == pytest.approx(0.5)
    assert logs_of(trainer)["agent/segments_per_run"] == 1.0
    # the rubric's metrics reach the run's info
    assert [info["metrics"]["correct_answer"] for info in trainer.rollout.infos] == [1.0, 1.0, 0.0, 0.0]


def test_group_rubrics_and_non_environments_are_refused():
    with pytest.raises(TypeError, match="verifiers Environment"):
        VerifiersAgent(object())

    def relative(completions, **kwargs) -> list[float]:  # a group reward function (plural argument names)
        return [0.0 for _ in completions]

    env = calculator_env()
    env.rubric.add_reward_func(relative)
    if not env.requires_group_rollouts:
        pytest.fail("verifiers no longer reads `completions` as a group reward function: update this test")
    with pytest.raises(ValueError, match="group reward"):
        VerifiersAgent(env)
    with pytest.raises(ValueError, match="n=1"):
        VerifiersAgent(calculator_env(), sampling_args={"n": 2})


def test_without_the_classic_api_the_error_says_what_to_install(monkeypatch):
    # verifiers without verifiers.legacy nor a v1 stack VerifiersAgent takes, as if installed: the import fails with
    # the extra to install
    monkeypatch.setitem(sys.modules, "verifiers.legacy", None)
    with pytest.raises(ImportError, match=r"verifiers>=0.3.1,<0.4.*verifiers 0.4.*trinity-trl\[verifiers\].*found"):
        VerifiersAgent(object())


def test_the_v1_preview_of_verifiers_0_3_1_is_refused_naming_the_version(monkeypatch):
    # 0.3.1 also ships an early verifiers.v1, which differs from 0.4's: its environments are refused in one line
    import verifiers.v1 as vf1

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))  # the taskset module, loaded by name
    config = vf1.SingleAgentEnvConfig(
        taskset={"id": "verifiers_v1_calc"}, agent={"runtime": {"type": "subprocess"}, "harness": {"id": "null"}}
    )
    with pytest.raises(TypeError, match=r"verifiers.v1 environments from verifiers 0.4 on \(found verifiers 0.3.1"):
        VerifiersAgent(vf1.SingleAgentEnv(config))


def test_a_single_turn_env_trains_with_its_weighted_rubric(tmp_path, tool_model_dir):
    data = Dataset.from_dict(
        {"question": [f"task {i}: what is {i}*3-1?" for i in range(2)], "answer": [str(i * 3 - 1) for i in range(2)]}
    )

    def answered(completion, **kwargs) -> float:
        """1 for any non-empty answer."""
        return float(bool(completion[-1].content))

    rubric = vf.Rubric(funcs=[correct_answer, answered], weights=[1.0, 0.5])
    agent = VerifiersAgent(vf.SingleTurnEnv(dataset=data, rubric=rubric))
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        shuffle_dataset=False,
        max_completion_length=64,
        temperature=1.0,
        num_generations=2,
        per_device_train_batch_size=4,
    )
    trainer = Recording(model=tool_model_dir, args=StepGRPOConfig(**kwargs), train_dataset=agent.dataset(), agent=agent)
    force_turns(trainer, lambda text: "Task 0: it is -1." if task_of(text) == 0 else "Task 1: it is 99.")
    trainer.train()
    # task 0: right (1) and answered (0.5 x 1); task 1: wrong, answered: the rubric's weighted sums are the rewards
    assert [run.reward for run in trainer.agent_runs] == [1.5, 1.5, 0.5, 0.5]
    assert all(len(run.steps) == 1 for run in trainer.agent_runs)
    assert logs_of(trainer)["rewards/environment_reward/mean"] == pytest.approx(1.0)
