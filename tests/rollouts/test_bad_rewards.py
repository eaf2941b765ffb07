"""One rule for bad rewards (issue 46 item 6, docs/guarantees.md#bad-rewards): a reward of None, NaN, +inf or -inf makes
its row unscorable (advantage 0, not trained, left out of its group's statistics, counted in ``unscorable_count``),
whether a reset/step environment, a TRL tool environment's ``get_reward``, an agent or a reward function gave it.

Each test trains one step of ``StepGRPOTrainer`` on 4 tasks x 3 single-turn runs: task t's first run gets the t-th bad
value, its other two runs 1.0 and 0.0. With the bad run left out, each group's two scored runs get advantages
``(a, -a)``, the same in every group; a bad value that reached the statistics would break that (inf: NaN advantages;
a bad value scored 0: a group of three, whose advantages are not symmetric).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import tiny_grpo_kwargs
from trainers import test_step_grpo_tools as tool_tests
from trainers.test_step_grpo_tools import Recording, force_turns, logs_of, task_of

from trinity_trl.rollouts import Environment, StepResult
from trinity_trl.trainers import StepGRPOConfig

tool_model_dir = tool_tests.tool_model_dir

BAD = [None, float("nan"), float("inf"), float("-inf")]


class Rewards:
    """Each task's runs, in the order they start: the task's bad value, then 1.0, then 0.0."""

    def __init__(self):
        self.started = Counter()

    def next(self, task: int):
        n = self.started[task]
        self.started[task] += 1
        return [BAD[task], 1.0, 0.0][n % 3]


def tasks():
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"task {t}"}] for t in range(4)], "task": [0, 1, 2, 3]}
    )


def reset_step_env(rewards):
    class Rewarded(Environment):
        def reset(self, task, **row):
            self.reward = rewards.next(task)
            return f"task {task}"

        def step(self, action):
            return StepResult(None, reward=self.reward, done=True)

    return {"environment_factory": Rewarded}


def tool_env(rewards):
    class RewardedTools:
        def reset(self, task, **row):
            self.reward = rewards.next(task)

        def echo(self, text: str) -> str:
            """Echo the text.

            Args:
                text: what to echo.
            """
            return text

        def get_reward(self):
            return self.reward

    return {"environment_factory": RewardedTools}


def agent(rewards):
    async def run(client, row):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": f"task {row['task']}"}]
        )
        return rewards.next(row["task"])

    return {"agent": run}


@pytest.mark.parametrize("source", [reset_step_env, tool_env, agent], ids=["reset_step", "tool_get_reward", "agent"])
def test_none_nan_and_inf_make_a_run_unscorable_from_every_source(tmp_path, tool_model_dir, source):
    kwargs = tiny_grpo_kwargs(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        shuffle_dataset=False,
        max_completion_length=32,
        temperature=1.0,
        num_generations=3,
        per_device_train_batch_size=12,
    )
    trainer = Recording(model=tool_model_dir, args=StepGRPOConfig(**kwargs), train_dataset=tasks(), **source(Rewards()))
    force_turns(trainer, lambda text: f"Task {task_of(text)} done.")
    trainer.train()
    logs, batch = logs_of(trainer), trainer.batches[0]
    assert logs["unscorable_count"] == 4.0  # one run of each task, whatever its bad value
    trained = batch["segment_ids"] >= 0
    per_run = [batch["advantages"][i][trained[i]] for i in range(12)]  # rows in run order, one per run
    # each run's reward: environments are reset in row order; concurrent agents return in any order (read it back)
    given = [r.reward for r in trainer.agent_runs] if source is agent else [math.nan, 1.0, 0.0] * 4
    for task in range(4):
        group = {("bad" if math.isnan(v) else v): i for i, v in enumerate(given[3 * task : 3 * task + 3], 3 * task)}
        bad, one, zero = per_run[group["bad"]], per_run[group[1.0]], per_run[group[0.0]]
        assert bad.numel() == 0, f"task {task}'s unscorable run was trained"
        assert one.numel() and zero.numel() and torch.isfinite(one).all() and torch.isfinite(zero).all()
        assert torch.allclose(one, one[0]) and torch.allclose(zero, -one[0]) and one[0] > 0
    firsts = [per_run[i][0].item() for i, v in enumerate(given) if v == 1.0]
    assert len(firsts) == 4 and len(set(firsts)) == 1  # the same statistics, of the same two rewards, in each group
    # and kept out of the logged reward means (each a mean over the scored runs: 1.0 and 0.0 per task)
    means = {k: v for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean")}
    assert means and all(v == 0.5 for v in means.values()), means
    if source is agent:
        assert logs["agent/errors"] == 0.0  # a bad reward is no fault of the agent
        assert sum(math.isnan(v) for v in given) == 4 and {r.outcome for r in trainer.agent_runs} == {"ok"}
