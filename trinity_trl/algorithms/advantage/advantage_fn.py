"""Base classes of the two kinds of advantage functions (docs/algorithms/advantages.md#two-kinds)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..args import ComponentArgs
from ..experience import ExperienceOperator
from ..inputs import INPUT_ALIASES, pick_input
from ..registry import Registry


class AdvantageFn(ComponentArgs):
    """Common interface: ``default_args()``, ``compute_in_trainer()`` and what a trainer must
    provide (the ``needs_*`` flags), so trainers never compare registry names.

    ``default_args()`` is derived from the constructor signature and, unlike the losses', lists
    ``None``-default arguments too (docs/algorithms/advantages.md: the constructor is the default args).
    """

    omit_none_defaults = False

    name: ClassVar[str]
    # batch inputs beyond token-level rewards and the response mask
    needs_old_logprobs: ClassVar[bool] = False  # behaviour log-probs ``old_log_probs`` (B, T)
    needs_teacher_logprobs: ClassVar[bool] = False  # a teacher's ``teacher_logprobs`` (B, T)
    needs_values: ClassVar[bool] = False  # a critic's ``values`` (B, T)
    needs_reward_baselines: ClassVar[bool] = False  # ``reward_baselines`` (B,): a greedy rollout's reward
    # whitens over every response token of the batch (needs at least two)
    whitens: ClassVar[bool] = False
    # scores whole runs and broadcasts the score to each of the run's steps (multi-step agents)
    step_wise: ClassVar[bool] = False
    # reads each step's state key and declared step reward (``exp.info["state_key"]``, ``exp.info["step_reward"]``),
    # which only trainers that play multi-step runs record (GiGPO)
    needs_step_states: ClassVar[bool] = False

    @classmethod
    def compute_in_trainer(cls) -> bool:
        raise NotImplementedError

    @property
    def equals_trl_group_zscore(self) -> bool:
        """Whether this advantage, with these arguments, is the group z-score of the rewards that TRL's asynchronous
        vLLM worker computes itself, so that the worker's advantages may stand in for it
        (docs/asynchronous.md#with-vllm)."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class GroupAdvantageFn(AdvantageFn, ExperienceOperator):
    """Experience operator: ``exps_out, metrics = fn(exps)`` (runs before batching).

    Writes ``exp.advantages = score · action_mask`` and ``exp.returns`` in place. Output order is
    group order (see `group_by`), not input order.
    """

    @property
    def needs_logprobs(self) -> bool:
        """Whether each experience must carry its behaviour ``logprobs`` (e.g. GRPO's rank penalty)."""
        return False

    @property
    def refills_filtered_groups(self) -> bool:
        """Whether the output holds copies of kept experiences in place of filtered groups."""
        return False

    @property
    def uses_batch_statistics(self) -> bool:
        """Whether a group's scores depend on the other groups of the call (e.g. GRPO's ``std_cal_level="batch"``):
        a trainer that scores each group alone (the asynchronous trainers) cannot run it."""
        return False

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return False


class BatchAdvantageFn(AdvantageFn):
    """Trainer-side function on padded tensors: ``batch, metrics = fn(batch)``.

    Reads ``token_level_rewards`` (falls back to ``token_level_scores``) ``(B, T)``,
    ``response_mask`` (or ``action_mask`` / ``completion_mask``) ``(B, T)`` and, for grouped
    functions, ``uid`` (one group id per row). Writes ``advantages`` and ``returns`` ``(B, T)``.
    """

    @classmethod
    def compute_in_trainer(cls) -> bool:
        return True

    def __call__(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        return self.process(batch)

    def process(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        raise NotImplementedError


def batch_get(batch: dict[str, Any], name: str) -> Any:
    """Read ``name`` from a batch dict under any of its aliases; ``ValueError`` if absent, or if two
    aliases carry different values (as `inputs.resolve_inputs`).

    ``token_level_rewards`` falls back to ``token_level_scores``: that is not an alias (the rewards are
    the scores minus a KL penalty, when there is one), so the rewards win when both are present.
    """
    if name == "token_level_rewards":
        aliases: tuple[str, ...] = ("token_level_rewards", "token_level_scores")
        for alias in aliases:
            if batch.get(alias) is not None:
                return batch[alias]
    else:
        internal = next((k for k, names in INPUT_ALIASES.items() if name in names), name)
        aliases = INPUT_ALIASES.get(internal, (name,))
        found = pick_input(batch, internal, aliases)
        if found:
            return found[1]
    raise ValueError(f"The batch has no {name!r} (looked for: {', '.join(aliases)}); present: {', '.join(batch)}")


def group_index(uid: Any) -> tuple[torch.Tensor, int]:
    """Map per-row group ids (strings, ints, a tensor or array) to dense indices ``0..G-1``
    in order of first appearance. Returns ``(index (B,), G)``."""
    if isinstance(uid, torch.Tensor):
        uid = uid.tolist()
    ids: dict[Any, int] = {}
    index = [ids.setdefault(u if not isinstance(u, list) else tuple(u), len(ids)) for u in uid]
    return torch.tensor(index, dtype=torch.long), len(ids)


def scalar_rewards_to_token_level(rewards: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar reward at its last position whose mask is 1 (docs/algorithms/advantages.md#experiences).

    ``rewards``: ``(B,)``; ``attention_mask``: ``(B, T)`` over the response. Rows with an empty
    mask get no reward (all zeros).
    """
    mask = attention_mask != 0
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_token = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_token]
    out[rows, last[has_token]] = rewards.to(out.dtype)[has_token]
    return out


ADVANTAGE_FN: Registry[type[AdvantageFn]] = Registry("advantage function")


def batch_get_token_level(batch: dict[str, Any], *names: str) -> list[Any]:
    """`batch_get` of each of ``names`` and then of ``action_mask``: ``(B, T)`` tensors of one shape, else a one-line
    ``ValueError`` naming each shape."""
    tensors = [batch_get(batch, name) for name in (*names, "action_mask")]
    if len({tuple(t.shape) for t in tensors}) != 1 or tensors[0].dim() != 2:
        shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(names, tensors))
        raise ValueError(f"{shapes} and response_mask {tuple(tensors[-1].shape)} must all be (B, T)")
    return tensors
