"""Metrics of our trainers in TRL's per-mode lists: appending, pooling across processes, guard counts.

TRL averages ``self._metrics[mode][name]`` lists at logging time. Our components append per
micro-batch and per process without a collective (ranks may log different key sets, e.g. CHORD's
``usual/*`` needs usual rows), so before TRL averages, every rank's values of our keys are pooled
(one ``gather_object``). Guard metrics are event counts: their values are summed, not averaged.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..algorithms.inputs import metrics_to_floats

# keys our trainers log (TRL's own keys are gathered by TRL)
OWN_METRIC_PREFIXES = (
    "actor/",
    "critic/",
    "chord/",
    "group_advantages/",
    "multi_step/",
    "raft/",
    "kl/",
    "advantages/",
    "filtered_count",
    "unscorable_count",
    "experience_count",
    "skipped_group_ratio",
    "guards/",
    "refill/",
    "remax/",
    "packing/",
)
COUNT_PREFIX = "guards/"


def append_metrics(store: MutableMapping[str, list[float]], metrics: dict[str, Any]) -> None:
    """Append each metric (tensors become floats with one device sync) to ``store[name]``."""
    for key, value in metrics_to_floats(metrics).items():
        store[key].append(value)


def append_process_means(
    store: MutableMapping[str, list[float]], metrics: dict[str, Any], gather: Callable, device: Any
) -> None:
    """Average each metric over processes and append it to ``store[name]`` (TRL's list of one mode).

    For the trainers built on TRL's SFT/DPO trainers, whose every process logs the same keys each micro-batch: one
    ``gather`` (accelerate's, of a ``(1, K)`` float64 tensor on ``device``) instead of `pool_metrics`'s object gather.
    """
    floats = metrics_to_floats(metrics)
    if not floats:
        return
    keys = sorted(floats)
    values = torch.tensor([floats[k] for k in keys], dtype=torch.float64, device=device)
    means = gather(values.unsqueeze(0)).mean(dim=0).tolist()
    for key, value in zip(keys, means):
        store[key].append(value)


def pool_metrics(store: MutableMapping[str, list[float]], gather_object: Callable[[list], list] | None) -> None:
    """Pool every process's values of our keys into ``store`` (``gather_object`` is accelerate's;
    ``None`` for one process), then turn count metrics into one summed value."""
    if gather_object is not None:
        own = {k: list(v) for k, v in store.items() if k.startswith(OWN_METRIC_PREFIXES)}
        pooled: dict[str, list[float]] = {}
        for rank_metrics in gather_object([own]):
            for key, values in rank_metrics.items():
                pooled.setdefault(key, []).extend(values)
        for key, values in pooled.items():
            store[key] = values
    for key in [k for k in store if k.startswith(COUNT_PREFIX)]:
        store[key] = [sum(store[key])]


def replace_logged_advantages(logged, gather: Callable, advantages, mask) -> None:
    """Put our advantages into TRL's completions table (``logged``: TRL's deque of this batch's values,
    every process's), one per row: the value, or the masked mean of ``(B, T)`` advantages."""
    per_row = advantages if advantages.dim() == 1 else (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
    values = gather(per_row.float()).tolist()
    for _ in range(min(len(values), len(logged))):  # drop TRL's values of this batch
        logged.pop()
    logged.extend(values)


# the labels of the one-line progress summary, in order
SUMMARY_LABELS = ("reward", "loss", "rl", "sft", "kl", "value", "mu", "staleness")
# the seconds of a step, the first one logged: TRL's synchronous trainers' step time; the asynchronous trainers' step
# (from the end of the step before; the first step has none) or, for the first, its forward and backward
STEP_SECONDS = ("step_time", "perf/step_s", "perf/fwd_bwd_s")


def summary_metrics(policy_loss: Any = None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(label, keys)`` pairs of the progress summary (the first key logged wins): reward and loss, the
    terms the policy loss class declares (`trinity_trl.algorithms.PolicyLossFn.summary_metrics`), the
    KL loss, the critic's value loss and the asynchronous trainers' mean staleness (optimizer steps)."""
    keys: dict[str, tuple[str, ...]] = {
        "reward": ("reward",),
        "loss": ("loss",),
        "kl": ("actor/kl_loss",),
        "value": ("critic/vf_loss",),
        "staleness": ("async/staleness",),
    }
    if policy_loss is not None:
        keys.update(
            {label: tuple(f"actor/{n}" for n in names) for label, names in policy_loss.summary_metrics().items()}
        )
    ordered = [label for label in SUMMARY_LABELS if label in keys] + [k for k in keys if k not in SUMMARY_LABELS]
    return tuple((label, keys[label]) for label in ordered)


def summary_line(step: int, max_steps: int, logs: dict[str, Any], metrics: tuple | None = None) -> str:
    """``step 3/20 | reward 0.250 | loss 0.1230 | rl -0.0400 | sft 0.5100 | mu 0.620 | 14.2 s``
    (``metrics``: `summary_metrics` of the trainer's policy loss; the seconds: `STEP_SECONDS`)."""
    parts = [f"step {step}/{max_steps}" if max_steps and max_steps > 0 else f"step {step}"]
    for label, keys in metrics if metrics is not None else summary_metrics():
        key = next((k for k in keys if k in logs), None)
        if key is not None:
            parts.append(f"{label} {_number(logs[key], '.4g')}")
    seconds = next((key for key in STEP_SECONDS if logs.get(key) is not None), None)
    if seconds is not None:
        parts.append(f"{_number(logs[seconds], '.1f')} s")
    return " | ".join(parts)


def _number(value: Any, spec: str) -> str:
    """A logged value for the summary line: a number formatted by ``spec``; anything else (``None`` where the Trainer
    logged a non-finite value as null, a string) as it is, so a strange value never stops training at a log step."""
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


class ConciseProgress(ProgressCallback):
    """transformers' progress bar, with one `summary_line` per logging step instead of the metric dict."""

    def __init__(self, metrics: tuple, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.metrics = metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs and "loss" in logs:
            self.training_bar.write(summary_line(state.global_step, state.max_steps, logs, self.metrics))


class ConcisePrinter(PrinterCallback):
    """transformers' printer (``disable_tqdm=True``), with one `summary_line` per logging step."""

    def __init__(self, metrics: tuple):
        self.metrics = metrics

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(summary_line(state.global_step, state.max_steps, logs, self.metrics), flush=True)


def use_concise_progress(trainer: Any) -> None:
    """Replace transformers' ``ProgressCallback`` (or ``PrinterCallback`` with ``disable_tqdm=True``), which prints
    every logged metric dict (dozens of keys) on every logging step, by one `summary_line` per logging step;
    every metric still goes to ``trainer.state.log_history`` and the trackers. A progress display the user put in
    its place stays, and a second call does nothing. ``trainer``: one of ours (it reads ``trainer.algorithm``)."""
    from ..algorithms import POLICY_LOSS_FN

    metrics = summary_metrics(POLICY_LOSS_FN.get(trainer.algorithm.policy_loss.name))
    for default, concise in ((ProgressCallback, ConciseProgress), (PrinterCallback, ConcisePrinter)):
        if any(type(cb) is default for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(default)
            trainer.add_callback(concise(metrics))


def _logged(entry: dict[str, Any], name: str) -> float | None:
    """``name`` of a log entry, under its synchronous spelling or the asynchronous trainers' (``<name>_total``)."""
    value = entry.get(name, entry.get(f"{name}_total"))
    return None if value is None else float(value)


def every_agent_run_failed(log_history: list[dict[str, Any]]) -> str | None:
    """The closing remark of a run in which every agent run failed (raised or timed out) at every logged step, else
    None: such a run trains on nothing its agents did, yet ends as a good run does."""
    steps = [entry for entry in log_history if _logged(entry, "agent/runs")]
    if not steps:
        return None
    failed = [(_logged(e, "agent/errors") or 0.0) + (_logged(e, "agent/timeouts") or 0.0) for e in steps]
    if any(f < _logged(e, "agent/runs") for f, e in zip(failed, steps)):
        return None
    errors = sum(_logged(e, "agent/errors") or 0.0 for e in steps)
    timeouts = sum(_logged(e, "agent/timeouts") or 0.0 for e in steps)
    cut = sum(_logged(e, "agent/errors_after_cut_answer") or 0.0 for e in steps)
    after_cut = f", {cut:g} of them right after an answer cut at max_completion_length" if cut else ""
    return (
        f"every agent run failed at every logged step ({errors:g} raised{after_cut}, {timeouts:g} timed out, over "
        "the logged steps), so the policy learned nothing from its agents; the warning lines of each step name the "
        "first failure (docs/environments.md#agent-metrics)"
    )


def no_learning_signal(log_history: list[dict[str, Any]]) -> str | None:
    """The closing remark of a run that learned nothing from its rewards, else None: every agent run failed
    (`every_agent_run_failed`), or the reward never varied within any group of rollouts.

    GRPO-style advantages are each rollout's reward against its group's: when every group's rollouts got the same
    reward at every logged step (TRL's ``frac_reward_zero_std`` was 1 throughout), every advantage was zero and the
    policy loss had no gradient from the rewards, whatever the loss curve shows (PPO's advantages come from its
    critic, but a reward that never varied gives it nothing to learn either). A trainer with an SFT term on
    demonstrations (CHORD, MIX: ``actor/mu`` logged) still trained that term, and the remark says so: what the model
    learned came from the demonstrations. ``log_history``: ``trainer.state.log_history``.
    """
    if remark := every_agent_run_failed(log_history):
        return remark
    fractions = [entry["frac_reward_zero_std"] for entry in log_history if "frac_reward_zero_std" in entry]
    if not fractions or min(fractions) < 1.0:
        return None
    rewards = {round(float(entry["reward"]), 4) for entry in log_history if "reward" in entry}
    same = f"every rollout got reward {rewards.pop():g}" if len(rewards) == 1 else "no group's rewards differed"
    mus = [float(entry["actor/mu"]) for entry in log_history if entry.get("actor/mu") is not None]
    if mus and max(mus) > 0:
        return (
            f"no learning signal from the rewards: the reward never varied within a group of rollouts ({same} at "
            "every logged step), so the RL term learned nothing; what the model learned came from the SFT term on "
            f"the demonstrations (its weight mu {mus[0]:.3g} -> {mus[-1]:.3g}); for the RL term, use prompts the "
            "model sometimes solves, more rollouts per prompt (num_generations) or a reward with partial credit"
        )
    return (
        f"no learning signal: the reward never varied within a group of rollouts ({same} at every logged step), "
        "so the policy learned nothing from its rewards; use prompts the model sometimes solves, more rollouts per "
        "prompt (num_generations), a higher temperature or a reward with partial credit"
    )
