"""Step-wise GRPO for multi-step (agentic) runs — key ``step_wise_grpo`` (docs/algorithms/advantages.md#step-wise-grpo).

Each turn of a run is its own Experience. Runs of a task are compared by the reward of their
**last** step (the last experience of the run in input order); the resulting score is broadcast
to every step of the run. Rewards of earlier steps are ignored.
"""

from __future__ import annotations

from typing import Any

import torch

from ..experience import Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, GroupAdvantageFn
from .grpo import check_choice, check_positive, experience_rewards

STEP_WISE_STD_CAL_LEVELS = ("group", "batch", "none")


@ADVANTAGE_FN.register("step_wise_grpo")
class StepWiseGRPOAdvantage(GroupAdvantageFn):
    """GRPO over runs, broadcast to steps.

    Args:
        epsilon: added to the std (> 0).
        enable_step_norm: divide a run's advantages by its number of steps.
        std_cal_level: ``"group"`` (σ of the task's runs), ``"batch"`` (σ of the last-step rewards
            of every run in the call) or ``"none"`` (score = reward − μ, no division; newest
            agentscope).
        std_threshold: drop a task whose run-reward std is ``≤`` this, and every one-run task.
        **kwargs: ignored, as in the reference (so a preset may pass GRPO-only arguments).

    Writes ``advantages = returns = score·action_mask (/ L_run)`` ``(T_resp,)`` float32 in place.
    """

    step_wise = True

    def __init__(
        self,
        epsilon: float = 1e-6,
        enable_step_norm: bool = False,
        std_cal_level: str = "group",
        std_threshold: float | None = None,
        **kwargs: Any,
    ):
        self.epsilon = check_positive("epsilon", epsilon)
        self.enable_step_norm = bool(enable_step_norm)
        self.std_cal_level = check_choice("std_cal_level", std_cal_level, STEP_WISE_STD_CAL_LEVELS)
        self.std_threshold = None if std_threshold is None else float(std_threshold)

    @property
    def uses_batch_statistics(self) -> bool:
        return self.std_cal_level == "batch"

    def calculate_last_step_advantage(
        self,
        exps: dict[str, Experience],
        precomputed_std: torch.Tensor | None = None,
        *,
        batch_std: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], dict[str, float], bool]:
        """Scores ``{rid: float}`` of one task's runs, ``{reward_mean, reward_std}`` and the skip flag.

        ``exps`` maps each run id to the last step of that run. ``precomputed_std`` is the batch std
        used when ``std_cal_level="batch"`` (``batch_std`` is its former name, still accepted).
        """
        if batch_std is not None:
            if precomputed_std is not None:
                raise ValueError(
                    "calculate_last_step_advantage: pass precomputed_std or its old name batch_std, not both"
                )
            precomputed_std = batch_std
        rewards = experience_rewards(list(exps.values()))
        if len(exps) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = rewards.mean(), rewards.std()
        skip = self.std_threshold is not None and (len(exps) == 1 or float(std) <= self.std_threshold)
        if self.std_cal_level == "none":
            scores = rewards - mean
        else:
            denominator = precomputed_std if self.std_cal_level == "batch" else std
            scores = (rewards - mean) / (denominator + self.epsilon)
        return dict(zip(exps, scores.tolist())), {"reward_mean": mean.item(), "reward_std": std.item()}, skip

    def broadcast_advantages(
        self, runs: dict[str, list[Experience]], scores: dict[str, float]
    ) -> dict[str, list[Experience]]:
        """Give every step of run ``rid`` the score of the run (divided by its length if step norm).

        Updates the experiences in place and returns ``runs`` (run id -> its steps, in input order).
        """
        for rid, steps in runs.items():
            for exp in steps:
                exp.set_advantage(scores[rid])
                if self.enable_step_norm:
                    exp.advantages = exp.advantages / len(steps)
                    exp.returns = exp.advantages.clone()
        return runs

    def process(self, experiences: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        if not experiences:
            return [], {}
        task_runs = {tid: group_by(exps, "run") for tid, exps in group_by(experiences, "task").items()}
        precomputed_std = None
        if self.std_cal_level == "batch":
            last_rewards = experience_rewards([run[-1] for runs in task_runs.values() for run in runs.values()])
            precomputed_std = last_rewards.std() if len(last_rewards) > 1 else torch.tensor(1.0)
        output: list[Experience] = []
        metric_list: list[dict[str, float]] = []
        filtered_count = skipped_tasks = 0
        for runs in task_runs.values():
            scores, metrics, skip = self.calculate_last_step_advantage(
                {rid: run[-1] for rid, run in runs.items()}, precomputed_std=precomputed_std
            )
            metric_list.append(metrics)
            if skip:
                filtered_count += sum(len(run) for run in runs.values())
                skipped_tasks += 1
                continue
            output.extend(exp for run in self.broadcast_advantages(runs, scores).values() for exp in run)
        metrics = gather_metrics(metric_list, "group_advantages")
        metrics["experience_count"] = float(len(output))
        metrics["filtered_count"] = float(filtered_count)
        metrics["skipped_group_ratio"] = skipped_tasks / len(task_runs) if task_runs else 0.0
        return output, metrics


StepWiseGRPOAdvantageFn = StepWiseGRPOAdvantage  # the class's name in Trinity-RFT
