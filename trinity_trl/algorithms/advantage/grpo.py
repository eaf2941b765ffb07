"""GRPO advantages: the group operator ``grpo`` (docs/algorithms/advantages.md#grpo) and the batch function
``grpo_verl`` (docs/algorithms/advantages.md#batch-functions).

This module also holds the helpers that the other advantage families share:

* for group operators, `experience_rewards` (rewards of a group as float32);
* for grouped batch functions, `row_scores`, `row_groups`, `group_mean`,
  `group_unbiased_std` and `write_row_advantages`. Group statistics over ``uid`` are
  index ops (``index_add``/``bincount``), so 10 000 rows cost a few tensor ops, not a Python loop.

Row scores are ``Σ_t token_level_rewards[b, t]`` over the **full** width, as in the reference.
Rewards are placed at the last attention-valid token (docs/algorithms/advantages.md#experiences), which in multi-turn
data may sit under a zero of ``response_mask`` (a tool token); summing only unmasked tokens would drop that
reward silently. The price: a NaN in a padded reward position makes its whole group NaN.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import torch

from ..experience import Experience, gather_metrics, group_by
from .advantage_fn import ADVANTAGE_FN, BatchAdvantageFn, GroupAdvantageFn, batch_get, group_index

GRPO_STD_CAL_LEVELS = ("group", "batch")


# ---------------------------------------------------------------------------------------------
# argument checks shared by the advantage modules


def check_positive(name: str, value: Any) -> float:
    """``float(value)`` if it is a finite number > 0, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> Any:
    if value not in allowed:
        raise ValueError(f"Unknown {name} {value!r}; allowed: {', '.join(repr(a) for a in allowed)}")
    return value


# ---------------------------------------------------------------------------------------------
# helpers for group operators


def experience_rewards(experiences: list[Experience]) -> torch.Tensor:
    """Scalar rewards of ``experiences`` as a float32 tensor ``(n,)``; a missing one is an error."""
    missing = [exp.eid.uid for exp in experiences if exp.reward is None]
    if missing:
        raise ValueError(f"Experiences without a reward cannot get an advantage: {', '.join(missing)}")
    return torch.tensor([float(exp.reward) for exp in experiences], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# helpers for grouped batch functions


def row_scores(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Row scores ``S (B,)`` float32 (full-width sum, see the module doc) and the mask ``(B, T)``."""
    rewards = batch_get(batch, "token_level_rewards")
    mask = batch_get(batch, "action_mask")
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} must both be (B, T)"
        )
    return rewards.to(torch.float32).sum(dim=-1), mask


def row_groups(batch: dict[str, Any], rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense group index ``(B,)`` of each row's ``uid`` and the group sizes ``(G,)``."""
    uid = batch_get(batch, "uid")
    if len(uid) != rows:
        raise ValueError(f"uid has {len(uid)} entries but the batch has {rows} rows")
    index, num_groups = group_index(uid)
    index = index.to(device)
    return index, torch.bincount(index, minlength=num_groups)


def group_mean(x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-group mean ``(G,)`` of row values ``x (B,)``."""
    sums = torch.zeros(counts.shape[0], dtype=x.dtype, device=x.device).index_add_(0, index, x)
    return sums / counts.to(x.dtype)


def group_unbiased_std(x: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Per-group unbiased (N−1) std ``(G,)``; two-pass for accuracy. Singletons give 0 (callers override)."""
    squares = torch.zeros(counts.shape[0], dtype=x.dtype, device=x.device).index_add_(0, index, (x - mean[index]) ** 2)
    return (squares / (counts - 1).clamp(min=1).to(x.dtype)).sqrt()


def write_row_advantages(batch: dict[str, Any], row_advantages: torch.Tensor, mask: torch.Tensor) -> None:
    """``advantages = returns = A[b]·M[b, t]`` (float32, ``(B, T)``)."""
    advantages = row_advantages.unsqueeze(-1) * mask.to(row_advantages.dtype)
    batch["advantages"] = advantages
    batch["returns"] = advantages.clone()


# ---------------------------------------------------------------------------------------------


@ADVANTAGE_FN.register("grpo")
class GRPOGroupAdvantage(GroupAdvantageFn):
    """Group-normalised reward ``(R_i − μ_G) / (σ + ε)`` per task (docs/algorithms/advantages.md#grpo).

    Args:
        epsilon: added to the std (> 0).
        std_threshold: skip (drop) a group whose reward std is ``≤`` this, and every singleton.
        duplicate_experiences: with ``std_threshold``, refill the batch with deep copies of groups
            drawn uniformly with replacement (from ``rng``, else Python's ``random`` module; seed it
            for reproducibility) from the remaining groups, one per skipped group.
        rank_penalty: in ``[0, 1)``; scales rewards by ``1 − rank·penalty`` (rank by mean behaviour
            log-prob, 0 for the lowest) for μ and σ only.
        std_cal_level: ``"group"`` (σ of the group) or ``"batch"`` (σ of every reward in the call).

    Each experience needs ``reward`` (and ``logprobs`` when ``rank_penalty`` is set). Writes
    ``advantages = returns = score·action_mask`` ``(T_resp,)`` float32 in place.
    """

    draws_random = True  # the refill copies

    def __init__(
        self,
        epsilon: float = 1e-6,
        std_threshold: float | None = None,
        duplicate_experiences: bool = False,
        rank_penalty: float | None = None,
        std_cal_level: str = "group",
    ):
        self.epsilon = check_positive("epsilon", epsilon)
        self.std_threshold = None if std_threshold is None else float(std_threshold)
        self.duplicate_experiences = bool(duplicate_experiences)
        if rank_penalty is not None and (
            isinstance(rank_penalty, bool) or not isinstance(rank_penalty, (int, float)) or not 0 <= rank_penalty < 1
        ):
            raise ValueError(f"rank_penalty must be in [0, 1) or None, got {rank_penalty!r}")
        self.rank_penalty = rank_penalty
        self.std_cal_level = check_choice("std_cal_level", std_cal_level, GRPO_STD_CAL_LEVELS)

    @property
    def needs_logprobs(self) -> bool:
        return self.rank_penalty is not None

    @property
    def refills_filtered_groups(self) -> bool:
        return self.duplicate_experiences and self.std_threshold is not None

    @property
    def uses_batch_statistics(self) -> bool:
        return self.std_cal_level == "batch"

    @property
    def equals_trl_group_zscore(self) -> bool:
        """True at the default arguments only: every other argument changes the scores or the groups kept."""
        return type(self) is GRPOGroupAdvantage and vars(self) == vars(GRPOGroupAdvantage())

    def group_scores(
        self, group: list[Experience], batch_std: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Scores ``(|G|,)``, μ, σ and whether the group is skipped."""
        rewards = experience_rewards(group)
        if len(group) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
            skip = self.std_threshold is not None
        else:
            stat_rewards = rewards
            if self.rank_penalty is not None:
                if any(exp.logprobs is None for exp in group):
                    raise ValueError("rank_penalty needs the behaviour logprobs of every experience")
                quality = torch.stack([exp.logprobs.to(torch.float32).mean() for exp in group])
                # stable so that tied log-probs rank in input order (deterministic)
                rank = torch.argsort(torch.argsort(quality, stable=True), stable=True) / len(group)
                stat_rewards = rewards * (1 - rank * self.rank_penalty)
            mean, std = stat_rewards.mean(), stat_rewards.std()
            skip = self.std_threshold is not None and float(std) <= self.std_threshold
        denominator = batch_std if self.std_cal_level == "batch" else std
        # the original reward: the rank penalty moves only μ and σ
        return (rewards - mean) / (denominator + self.epsilon), mean, std, skip

    def process(
        self, experiences: list[Experience], rng: random.Random | None = None
    ) -> tuple[list[Experience], dict[str, float]]:
        groups = group_by(experiences, "task")
        batch_std = None
        if self.std_cal_level == "batch":
            all_rewards = experience_rewards(list(experiences))
            batch_std = all_rewards.std() if len(all_rewards) > 1 else torch.tensor(1.0)
        kept: list[list[Experience]] = []
        metric_list: list[dict[str, float]] = []
        filtered_count = 0
        for group in groups.values():
            scores, mean, std, skip = self.group_scores(group, batch_std)
            metric_list.append({"reward_mean": mean.item(), "reward_std": std.item()})
            if skip:
                filtered_count += len(group)
                continue
            for exp, score in zip(group, scores.tolist()):
                exp.set_advantage(score)
            kept.append(group)
        output = [exp for group in kept for exp in group]
        skipped_groups = len(groups) - len(kept)
        if self.duplicate_experiences and self.std_threshold is not None and kept and skipped_groups:
            for i in (rng or random).choices(range(len(kept)), k=skipped_groups):
                output.extend(copy.deepcopy(exp) for exp in kept[i])
        metrics = gather_metrics(metric_list, "group_advantages")
        metrics["filtered_count"] = float(filtered_count)
        return output, metrics


@ADVANTAGE_FN.register("grpo_verl")
class GRPOBatchAdvantage(BatchAdvantageFn):
    """verl's GRPO outcome advantage (deprecated in Trinity): ``(S − mean_g)/(std_g + ε)·M``.

    Reads ``token_level_rewards (B, T)``, ``response_mask (B, T)``, ``uid`` (B ids). Singleton
    groups use mean 0 and std 1. Writes ``advantages = returns (B, T)`` float32. Metrics ``{}``.
    """

    def __init__(self, epsilon: float = 1e-6):
        self.epsilon = check_positive("epsilon", epsilon)

    @torch.no_grad()
    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        scores, mask = row_scores(batch)
        index, counts = row_groups(batch, scores.shape[0], scores.device)
        mean = group_mean(scores, index, counts)
        std = group_unbiased_std(scores, index, counts, mean)
        singleton = counts == 1
        mean = torch.where(singleton, torch.zeros_like(mean), mean)
        std = torch.where(singleton, torch.ones_like(std), std)
        write_row_advantages(batch, (scores - mean[index]) / (std[index] + self.epsilon), mask)
        return batch, {}
