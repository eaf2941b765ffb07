"""Advantages of a generation batch, from the rewards TRL gathered from every process.

TRL computes GRPO advantages itself; our trainers replace them with the configured component:

* a **group operator** (``grpo``, ``opmd``, ``asymre``, ``rec``, ...) runs on every process's rewards,
  grouped by prompt (``num_generations`` consecutive completions), and each process keeps its slice,
  so N processes give the same advantages as one;
* a **batch function** (``reinforceplusplus``, ``rloo``, ``on_policy_distill``, GAE, ...) runs on the
  padded token batch of every process, after an optional KL penalty on the token rewards;
* a policy loss that reads no advantages (an SFT loss: the ``raft`` preset) trains on the
  best-rewarded completions of each group instead.

Rows that a group operator filters out (``std_threshold``) and completions no reward function
scored get advantage 0 and leave the loss (``loss_rows``). Inputs that only some functions need
(behaviour or teacher log-probs, critic values) are computed on demand through
`AdvantageSources`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algorithms import EID, Experience
from ..algorithms.advantage import AdvantageFn, scalar_rewards_to_token_level
from ..algorithms.kl import KLFn
from ..algorithms.policy_loss import PolicyLossFn


@dataclass
class AdvantageSources:
    """Per-token inputs of this process's rows, computed only if an advantage function asks.

    Each is a callable returning a ``(B, T)`` tensor over the completion (``None``: not available).
    """

    behaviour_logps: Callable[[], torch.Tensor]
    reference_logps: Callable[[], torch.Tensor | None]
    teacher_logps: Callable[[], torch.Tensor] | None = None
    values: Callable[[], torch.Tensor] | None = None
    #: ``(N,)`` every process's rows: the reward of a greedy completion of each row's prompt (ReMax)
    reward_baselines: Callable[[], torch.Tensor] | None = None


@dataclass
class Advantages:
    """This process's advantages: ``(B,)`` (one per row) or ``(B, T)``; ``loss_rows`` ``(B,)`` bool
    (rows to train on); ``returns`` ``(B, T)`` from batch functions, and the whole gathered
    ``batch`` they ran on (every process's rows); ``metrics``."""

    advantages: torch.Tensor
    loss_rows: torch.Tensor
    #: ``(N,)`` for every process's rows: the row whose sample each row trains on (refilled groups), or None
    source_rows: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    batch: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum of every reward function's value per completion, NaN where none scored
    (``rewards_per_func``: ``(N, n_funcs)`` with NaN for "not scored", as TRL gathers it). A value that is not
    finite (NaN, +-inf, e.g. from a reward model) is "not scored", as ``None`` is (docs/guarantees.md#bad-rewards)."""
    scored = torch.where(torch.isfinite(rewards_per_func), rewards_per_func, torch.nan)
    rewards = (scored * weights.to(scored.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(scored).all(dim=1)] = torch.nan
    return rewards


def check_declared_step_rewards(
    step_states: list[list[tuple[Any, float | None]]], reward_func_names: list[str], weights: torch.Tensor
) -> None:
    """One line when steps declare their rewards (``step_states``: per run, per step, ``(state, declared reward or
    None)``) while the runs are also scored by reward functions beyond the environment's (``reward_func_names``, the
    environment's first, and their ``weights``): the return GiGPO compares is then the sum of the declared rewards,
    and those functions would be ignored."""
    declared = any(reward is not None for run in step_states for _, reward in run)
    if declared and (len(reward_func_names) != 1 or float(weights[0]) != 1.0):
        raise ValueError(
            "the environment declares info['step_reward'], so a run's return is the sum of its declared step "
            f"rewards; the reward functions {list(reward_func_names)} (weights {weights.tolist()}) would be ignored: "
            "score runs by the environment alone (no reward_funcs, weight 1), or declare no step rewards"
        )


def best_of_group(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N,)`` bool: the completions with their group's highest reward, in groups whose rewards
    are not all equal (RAFT). Unscored completions (NaN) are never kept."""
    grouped = rewards.view(-1, group_size)
    best = torch.nan_to_num(grouped, nan=-torch.inf).max(dim=1, keepdim=True).values
    worst = torch.nan_to_num(grouped, nan=torch.inf).min(dim=1, keepdim=True).values  # over scored rows only
    return ((grouped == best) & (best > worst) & torch.isfinite(grouped)).view(-1)


def group_advantages(
    advantage_fn: AdvantageFn,
    rewards: torch.Tensor,
    group_size: int,
    batch_index: int,
    logprobs: list[torch.Tensor] | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Run a group operator over every completion: ``(advantages (N,), kept (N,) bool, source (N,), metrics)``.

    Completion ``i`` is run ``i % group_size`` of task ``i // group_size``; unscored ones are left out of
    their group's statistics. ``logprobs``: each completion's behaviour log-probs (GRPO's rank penalty).
    ``source[i]`` is the row whose sample row ``i`` trains on: ``i`` itself, or, when the operator refills
    filtered groups with copies of kept ones (GRPO's ``duplicate_experiences``), a row of the copied group;
    the k-th copied group takes the place of the k-th filtered group. The copies are drawn with a
    generator seeded from ``seed`` and ``batch_index``, so every process draws the same.
    """
    experiences = [
        Experience(
            eid=EID(batch=batch_index, task=row // group_size, run=row % group_size),
            reward=value,
            logprobs=None if logprobs is None else logprobs[row],
        )
        for row, value in enumerate(rewards.tolist())
        if math.isfinite(value)
    ]
    # the same generator on every process (same seed and batch), and Python's global random state untouched
    scored, metrics = advantage_fn(experiences, rng=random.Random(seed * 1_000_003 + batch_index))
    advantages = torch.zeros(len(rewards), dtype=torch.float32)
    kept = torch.zeros(len(rewards), dtype=torch.bool)
    source = torch.arange(len(rewards))
    given = {id(exp) for exp in experiences}  # the operator appends deep copies after the kept groups
    originals = [exp for exp in scored if id(exp) in given]
    copies = [exp for exp in scored if id(exp) not in given]
    for exp in originals:
        row = exp.eid.task * group_size + exp.eid.run
        advantages[row] = exp.advantages
        kept[row] = True
    if copies:
        filtered = sorted({e.eid.task for e in experiences} - {e.eid.task for e in originals})
        copied_groups: list[list[Experience]] = []
        for exp in copies:  # a new copied group starts where the task changes or the run index restarts
            last = copied_groups[-1][-1] if copied_groups else None
            if last is None or last.eid.task != exp.eid.task or exp.eid.run <= last.eid.run:
                copied_groups.append([])
            copied_groups[-1].append(exp)
        for task, group in zip(filtered, copied_groups):
            for exp in group:
                row = task * group_size + exp.eid.run
                advantages[row] = exp.advantages
                kept[row] = True
                source[row] = exp.eid.task * group_size + exp.eid.run
    if advantage_fn.refills_filtered_groups:
        metrics["refill/rows"] = float((source != torch.arange(len(rewards))).sum())
    return advantages, kept, source, metrics


def refill_rows(
    output: dict[str, Any],
    source: torch.Tensor,
    local: slice,
    gather: Callable,
    pad_across_processes: Callable,
    pad_values: dict[str, float],
) -> dict[str, Any]:
    """``output`` with each of this process's rows replaced by its ``source`` row (``(N,)``, over every
    process's rows; any process may hold the source). Every per-row tensor is gathered (prompts padded on the
    left, the rest on the right, with ``pad_values[key]`` or 0), so all processes must call this together."""
    rows = output["prompt_ids"].shape[0]
    index = source[local].to(output["prompt_ids"].device)
    refilled = dict(output)
    for key, value in output.items():
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != rows:
            continue
        if value.dim() > 1:
            value = pad_across_processes(
                value, dim=1, pad_index=pad_values.get(key, 0), pad_first=key.startswith("prompt_")
            )
        refilled[key] = gather(value)[index]
    return refilled


@dataclass(eq=False)
class AdvantageEstimator:
    """Computes a generation batch's advantages with the trainer's components.

    Args:
        advantage_fn: the advantage component (``None`` when the preset uses none).
        policy_loss: the policy loss (asked whether it reads advantages).
        kl_penalty: the KL reward penalty of batch functions (``enabled`` False: none).
        gather: accelerate's ``gather`` (concatenates every process's tensor along dim 0).
        pad_across_processes: accelerate's ``pad_across_processes``.
        seed: the run's seed (the draws of operators that refill filtered groups derive from it).
    """

    advantage_fn: AdvantageFn | None
    policy_loss: PolicyLossFn
    kl_penalty: KLFn
    gather: Callable[[torch.Tensor], torch.Tensor]
    pad_across_processes: Callable[..., torch.Tensor]
    seed: int = 0

    def __call__(
        self,
        rewards: torch.Tensor,
        loss_mask: torch.Tensor,
        local: slice,
        group_size: int,
        batch_index: int,
        training: bool,
        sources: AdvantageSources,
    ) -> Advantages:
        """``rewards``: ``(N,)`` every process's weighted rewards (NaN: unscored), process-major;
        ``loss_mask``: this process's ``(B, T)`` trained tokens; ``local``: its rows in ``rewards``."""
        unscored = ~torch.isfinite(rewards)
        metrics: dict[str, Any] = {"unscorable_count": float(unscored.sum())}
        device = loss_mask.device
        if not self.policy_loss.reads_advantages:  # RAFT: SFT on the best completion(s) of each group
            keep = best_of_group(rewards, group_size)
            metrics["raft/kept_fraction"] = float(keep.float().mean())
            return Advantages(torch.zeros(loss_mask.shape[0], device=device), keep[local].to(device), metrics=metrics)
        if not self.advantage_fn.compute_in_trainer():
            logprobs = self._gathered_logprobs(sources, loss_mask) if self.advantage_fn.needs_logprobs else None
            advantages, kept, source, group_metrics = group_advantages(
                self.advantage_fn, rewards, group_size, batch_index, logprobs, self.seed
            )
            refilled = source if bool((source != torch.arange(len(source))).any()) else None
            return Advantages(
                advantages[local].to(device),
                kept[local].to(device),
                source_rows=refilled,
                metrics={**metrics, **group_metrics},
            )
        return self._batch_advantages(rewards, loss_mask, local, group_size, training, sources, metrics)

    def _gathered_logprobs(self, sources: AdvantageSources, loss_mask: torch.Tensor) -> list[torch.Tensor]:
        """Every process's behaviour log-probs, one 1-D tensor of trained tokens per completion."""
        logps = self.gather(self.pad_across_processes(sources.behaviour_logps(), dim=1, pad_index=0)).cpu()
        mask = self.gather(self.pad_across_processes(loss_mask, dim=1, pad_index=0)).cpu() != 0
        return [row[m] for row, m in zip(logps, mask)]

    def _batch_advantages(self, rewards, loss_mask, local, group_size, training, sources, metrics) -> Advantages:
        local_rewards = rewards[local].to(loss_mask.device)
        scorable = torch.isfinite(local_rewards)
        response_mask = loss_mask * scorable.unsqueeze(1).to(loss_mask.dtype)
        # rows whose mask is empty (mask_truncated_completions) keep their reward, on the last column, as
        # TRL keeps them in the group baseline; the mask still excludes them from the loss
        placement = torch.where(loss_mask.sum(1, keepdim=True) > 0, loss_mask, torch.ones_like(loss_mask))
        batch: dict[str, torch.Tensor] = {
            "token_level_scores": scalar_rewards_to_token_level(torch.nan_to_num(local_rewards), placement),
            "response_mask": response_mask,
        }
        fn = self.advantage_fn
        if self.kl_penalty.enabled or fn.needs_old_logprobs:
            batch["old_log_probs"] = sources.behaviour_logps()
        if self.kl_penalty.enabled:
            batch["ref_log_prob"] = sources.reference_logps()
        if fn.needs_teacher_logprobs:
            batch["teacher_logprobs"] = sources.teacher_logps()
        if fn.needs_values:
            batch["values"] = sources.values()
        global_batch = {
            key: self.gather(self.pad_across_processes(value, dim=1, pad_index=0)) for key, value in batch.items()
        }
        if fn.needs_reward_baselines:
            global_batch["reward_baselines"] = sources.reward_baselines().to(global_batch["response_mask"].device)
        controller_state = self.kl_penalty.state_dict()
        global_batch, penalty_metrics = self.kl_penalty.apply_kl_penalty_to_reward(global_batch)
        if not training:  # evaluation measures; only training moves the adaptive coefficient
            self.kl_penalty.load_state_dict(controller_state)
        metrics.update({f"critic/{k}": v for k, v in penalty_metrics.items()})
        uid = torch.arange(global_batch["response_mask"].shape[0]) // group_size
        # unscorable rows form their own groups so they cannot bias a group baseline
        unscored = ~torch.isfinite(rewards.cpu())
        uid[unscored] = -1 - torch.arange(int(unscored.sum()))
        global_batch["uid"] = uid
        if fn.whitens and int((global_batch["response_mask"] != 0).sum()) < 2:
            # whitening needs two tokens; with fewer (e.g. every completion truncated and masked) nothing
            # is trained, so every advantage is 0 instead of an error deep inside the whitening
            zeros = torch.zeros_like(global_batch["token_level_rewards"], dtype=torch.float32)
            global_batch.update(advantages=zeros, returns=zeros.clone())
        else:
            global_batch, adv_metrics = fn(global_batch)
            metrics.update(adv_metrics)
        width = loss_mask.shape[1]
        return Advantages(
            global_batch["advantages"][local, :width].to(loss_mask.device),
            scorable,
            returns=global_batch["returns"][local, :width].to(loss_mask.device),
            batch=global_batch,
            metrics=metrics,
        )
