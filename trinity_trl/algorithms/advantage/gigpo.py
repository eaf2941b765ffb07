"""GiGPO, Group-in-Group Policy Optimization — key ``gigpo`` (docs/algorithms/advantages.md#gigpo).

Feng et al., arXiv:2505.10978 (verl-agent; Trinity-RFT's ``gigpo``). Each turn of a multi-step run is its own
Experience. A step's advantage is the run's episode advantage (GRPO over the task's runs, on the runs' summed
immediate rewards) plus ``omega`` times a step advantage: the step's discounted return compared with the returns of
the other steps **of the same task** that acted from the same state (an *anchor group*). The state a step acted from
and the reward its environment declared for it travel in ``exp.info`` (`STATE_KEY`, `STEP_REWARD`); the trainers
that play multi-step runs fill them in (docs/trainers/step-grpo.md#gigpo).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..experience import STATE_KEY, STEP_REWARD, Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, GroupAdvantageFn
from .grpo import check_choice, experience_rewards

GIGPO_FNORMS = ("std", "none")


def _finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@ADVANTAGE_FN.register("gigpo")
class GiGPOAdvantage(GroupAdvantageFn):
    """Episode advantage plus ``omega`` times the anchor-state step advantage, per step of a multi-step run.

    Args:
        omega: weight of the step advantage (verl-agent's ``step_advantage_w``); 0 leaves the episode advantage alone.
        gamma: discount of the step returns ``G_t = Σ_{k≥t} γ^(k−t) r_k``, in ``[0, 1]``.
        fnorm: the divisor ``F`` of both levels: ``"none"`` (``F = 1 + epsilon``, Trinity-RFT's default and
            verl-agent's ``mean_norm``) or ``"std"`` (``F = std + epsilon``, unbiased; ``mean_std_norm``).
        epsilon: added to ``F`` (>= 0; > 0 with ``fnorm="std"``).

    Each experience needs ``info["state_key"]`` (a string, or ``None`` for a step without a key) and either a
    ``reward`` on its run's last step or ``info["step_reward"]`` on every step of its run. Steps of a run are taken
    in input order (feed them in step order). Writes ``advantages = returns = A·action_mask`` ``(T_resp,)`` float32
    in place; output order: tasks, runs (first appearance), then steps in input order.
    """

    step_wise = True
    needs_step_states = True

    def __init__(self, omega: float = 1.0, gamma: float = 1.0, fnorm: str = "none", epsilon: float = 1e-6):
        self.omega = _finite("omega", omega)
        self.gamma = _finite("gamma", gamma)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
        self.fnorm = check_choice("fnorm", fnorm, GIGPO_FNORMS)
        self.epsilon = _finite("epsilon", epsilon)
        if self.epsilon < 0 or (self.fnorm == "std" and self.epsilon == 0):
            raise ValueError(f"epsilon must be >= 0 (> 0 with fnorm='std', whose std may be 0), got {epsilon!r}")

    def _divisor(self, values: torch.Tensor) -> torch.Tensor:
        """``F`` of a group of at least two values."""
        return (values.std() if self.fnorm == "std" else torch.tensor(1.0)) + self.epsilon

    def immediate_rewards(self, steps: list[Experience]) -> list[float]:
        """``r_t`` of one run's steps: the declared ``info["step_reward"]`` of every step, or, when none is declared,
        the run's reward on its last step and 0 on the others."""
        declared = [STEP_REWARD in exp.info for exp in steps]
        if all(declared):
            return [_finite(f"info['step_reward'] of {exp.eid.uid}", exp.info[STEP_REWARD]) for exp in steps]
        if any(declared):
            raise ValueError(
                f"run {steps[0].eid.rid} declares info['step_reward'] on {sum(declared)} of its {len(steps)} steps: "
                "declare it on every step of a run, or on none (then the run's last-step reward is used)"
            )
        return [0.0] * (len(steps) - 1) + experience_rewards(steps[-1:]).tolist()

    def discounted_returns(self, rewards: list[float]) -> list[float]:
        """``G_t = r_t + γ·G_{t+1}`` of one run."""
        returns, running = [0.0] * len(rewards), 0.0
        for t in range(len(rewards) - 1, -1, -1):
            running = rewards[t] + self.gamma * running
            returns[t] = running
        return returns

    def task_advantages(self, runs: dict[str, list[Experience]]) -> tuple[dict[tuple[str, int], float], dict, int]:
        """One task's advantages ``{(rid, t): A}``, its ``{reward_mean, reward_std}`` and the number of its steps
        beyond a run's first whose state recurs in the task (the anchor hits)."""
        rewards = {rid: self.immediate_rewards(steps) for rid, steps in runs.items()}
        totals = torch.tensor([sum(r) for r in rewards.values()], dtype=torch.float32)
        if len(runs) == 1:  # the single-run rule of GRPO: mean 0, std 1
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
            divisor = std + self.epsilon
        else:
            mean, std = totals.mean(), totals.std()
            divisor = self._divisor(totals)
        episode = dict(zip(runs, ((totals - mean) / divisor).tolist()))

        anchors: dict[Any, list[tuple[str, int, float]]] = {}
        for rid, steps in runs.items():
            for t, (exp, g) in enumerate(zip(steps, self.discounted_returns(rewards[rid]))):
                if STATE_KEY not in exp.info:
                    raise ValueError(
                        f"experience {exp.eid.uid} has no info['state_key']: gigpo compares steps that acted from the "
                        "same state, which only the multi-step trainers record (StepGRPOTrainer, "
                        "AsyncStepGRPOTrainer); a step without a state has the key None"
                    )
                key = exp.info[STATE_KEY]
                anchors.setdefault(("state", key) if key is not None else ("alone", rid, t), []).append((rid, t, g))
        step: dict[tuple[str, int], float] = {}
        hits = 0
        for members in anchors.values():
            if len(members) == 1:  # a state no other step of the task acted from: no step advantage
                step[members[0][:2]] = 0.0
                continue
            returns = torch.tensor([g for _, _, g in members], dtype=torch.float32)
            scores = ((returns - returns.mean()) / self._divisor(returns)).tolist()
            for (rid, t, _), score in zip(members, scores):
                step[(rid, t)] = score
            hits += sum(1 for _, t, _ in members if t > 0)
        advantages = {(rid, t): episode[rid] + self.omega * a for (rid, t), a in step.items()}
        return advantages, {"reward_mean": mean.item(), "reward_std": std.item()}, hits

    def process(self, experiences: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        if not experiences:
            return [], {}
        output: list[Experience] = []
        metric_list: list[dict[str, float]] = []
        hits = later = 0
        for exps in group_by(experiences, "task").values():
            runs = group_by(exps, "run")
            advantages, metrics, task_hits = self.task_advantages(runs)
            metric_list.append(metrics)
            hits += task_hits
            for rid, steps in runs.items():
                later += len(steps) - 1
                for t, exp in enumerate(steps):
                    exp.set_advantage(advantages[(rid, t)])
                    output.append(exp)
        metrics = gather_metrics(metric_list, "group_advantages")
        metrics["experience_count"] = float(len(output))
        metrics["gigpo/later_steps"] = float(later)
        if later:  # the share of steps beyond a run's first whose state another step of the task acted from
            metrics["gigpo/anchor_hit_ratio"] = hits / later
        return output, metrics


GiGPOAdvantageFn = GiGPOAdvantage  # the class's name in Trinity-RFT
