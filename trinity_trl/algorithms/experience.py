"""Experiences (one trained sample each) and their grouping helpers (docs/algorithms/advantages.md#experiences)."""

from __future__ import annotations

import abc
import math
import random
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

GROUP_LEVELS = {"task": "tid", "run": "rid", "step": "sid"}
#: ``Experience.info`` key: the state a step of a multi-step run acted from (a string, or ``None`` when unknown)
STATE_KEY = "state_key"
#: ``Experience.info`` key: the immediate reward the environment declared for the step (absent: none declared)
STEP_REWARD = "step_reward"


def _id_of(*fields: str) -> property:
    """An `EID` property: its ``fields`` joined by ``/``."""
    return property(lambda eid: "/".join(str(getattr(eid, name)) for name in fields), doc=f"``{'/'.join(fields)}``")


@dataclass
class EID:
    """Experience id. ``task`` groups GRPO-like advantages, ``run`` is one trajectory, ``step`` a turn."""

    batch: int | str = 0
    task: int | str = 0
    run: int = 0
    step: int = 0
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))

    tid = _id_of("batch", "task")
    """The task's id ``batch/task``: the group of GRPO-like advantages."""
    rid = _id_of("batch", "task", "run")
    """The run's id ``batch/task/run``: one trajectory."""
    sid = _id_of("batch", "task", "step")
    """The step's id ``batch/task/step``: the same turn of every run of a task."""
    uid = _id_of("batch", "task", "run", "step", "suffix")
    """The experience's own id ``batch/task/run/step/suffix``."""


@dataclass
class Experience:
    """One training sample: prompt + response tokens and what the algorithms need about them.

    Per-token fields (``logprobs``, ``action_mask``, ``advantages``, ``returns``,
    ``token_level_reward``, ``teacher_logprobs``) cover the response only: length
    ``len(tokens) - prompt_length``. ``action_mask`` defaults to all ones (single-turn).

    An experience may also be known by its reward alone (``tokens=None``): group operators then
    write a 0-d score to ``advantages`` (trainers use this to score rollouts whose tokens live on
    other processes).
    """

    eid: EID
    tokens: torch.Tensor | None = None
    prompt_length: int = 0
    reward: float | None = None
    logprobs: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None
    token_level_reward: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    chosen: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens is None:  # known by its reward only: advantages are one scalar (0-d)
            if self.prompt_length or self.action_mask is not None:
                raise ValueError(f"{self.eid.uid}: prompt_length and action_mask need tokens")
            return
        if not isinstance(self.tokens, torch.Tensor):
            self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        response_length = len(self.tokens) - int(self.prompt_length)
        if response_length < 0:
            raise ValueError(
                f"prompt_length {self.prompt_length} exceeds the {len(self.tokens)} tokens of {self.eid.uid}"
            )
        if self.action_mask is None:
            self.action_mask = torch.ones(response_length, dtype=torch.bool)
        elif len(self.action_mask) != response_length:
            raise ValueError(
                f"action_mask of {self.eid.uid} has length {len(self.action_mask)}, expected the response "
                f"length {response_length}"
            )

    @property
    def response_length(self) -> int:
        return 0 if self.tokens is None else len(self.tokens) - int(self.prompt_length)

    def set_advantage(self, score: float | torch.Tensor) -> None:
        """Write ``advantages = score · action_mask`` (float32) and ``returns = clone(advantages)``;
        a 0-d ``score`` tensor for an experience without tokens."""
        if self.action_mask is None:
            self.advantages = torch.as_tensor(score, dtype=torch.float32).clone()
        else:
            self.advantages = self.action_mask.to(torch.float32) * score
        self.returns = self.advantages.clone()


class ExperienceOperator(abc.ABC):
    """An operation on a list of experiences before they are batched for training (Trinity's
    experience pipeline; the group advantage functions are such operators).

    ``exps_out, metrics = op.process(exps)``; calling the operator does the same. Subclasses
    implement `process`: it may change experiences in place, drop or add some, and reorder
    them, and returns the experiences to train on with a ``dict[str, float]`` of metrics.

    An operator that draws random numbers declares ``draws_random = True`` and takes ``rng`` (a
    ``random.Random``) in `process`; calling it with ``rng=None`` draws from Python's global
    ``random`` module, as Trinity-RFT does. Trainers pass their own generator, so no global state is touched.
    """

    draws_random: ClassVar[bool] = False

    @abc.abstractmethod
    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        """``(experiences to train on, metrics)``."""

    def __call__(
        self, exps: list[Experience], rng: random.Random | None = None
    ) -> tuple[list[Experience], dict[str, float]]:
        return self.process(exps, rng=rng) if self.draws_random else self.process(exps)


def group_by(experiences: Iterable[Experience], level: str = "task") -> dict[str, list[Experience]]:
    """Group by ``tid`` (task), ``rid`` (run) or ``sid`` (step), in order of first appearance."""
    if level not in GROUP_LEVELS:
        raise ValueError(f"Unknown grouping level {level!r}; allowed: {', '.join(GROUP_LEVELS)}")
    attr = GROUP_LEVELS[level]
    groups: dict[str, list[Experience]] = {}
    for exp in experiences:
        groups.setdefault(getattr(exp.eid, attr), []).append(exp)
    return groups


def gather_metrics(metric_list: list[Mapping[str, Any]], prefix: str) -> dict[str, float]:
    """Reduce per-group metric dicts to ``{prefix}/{key}/mean|max|min`` over groups, skipping NaN."""
    if not metric_list:
        return {}
    keys: list[str] = []
    for metrics in metric_list:
        keys += [k for k, v in metrics.items() if k not in keys and isinstance(v, (int, float, torch.Tensor))]
    out: dict[str, float] = {}
    for key in keys:
        values = [float(m[key]) for m in metric_list if key in m]
        values = [v for v in values if not math.isnan(v)]
        if not values:
            continue
        out[f"{prefix}/{key}/mean"] = sum(values) / len(values)
        out[f"{prefix}/{key}/max"] = max(values)
        out[f"{prefix}/{key}/min"] = min(values)
    return out
