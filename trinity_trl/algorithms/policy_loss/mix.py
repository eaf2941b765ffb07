"""MIX: PPO on on-policy rows plus SFT on expert rows, per-sample normalised (spec §9.1-§9.2)."""

from __future__ import annotations

from typing import Any

import torch

from ..masked import check_loss_agg_mode
from .base import POLICY_LOSS_FN, PolicyLossFn


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
    return value


def _unit_interval(owner: str, name: str, value: Any) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}: {name} must be in [0, 1], got {value!r}")
    return float(value)


class ExpertMixLossFn(PolicyLossFn):
    """Shared machinery of ``mix`` and ``mix_chord``: split rows by ``expert_mask``, run the inner
    PPO loss on usual rows and the inner SFT loss on expert rows, weight each by ``n·w``.

    ``w`` makes every sample weigh the same within an optimizer step, whatever the make-up of the
    micro-batch (spec §9.1): ``w_u = gradient_accumulation / Bu`` (fixed micro-batch size) or
    ``experience_per_gpu / (B·Bu)`` (dynamic batch size), likewise ``w_e`` with ``Be``.
    """

    inputs = ("old_logprob", "action_mask", "advantages", "expert_mask")
    # TRL's epsilon / epsilon_high are the PPO part's relative clip bounds
    trl_config_fields = {"epsilon": "clip_range", "epsilon_high": "clip_range_high"}

    @property
    def weighs_samples_itself(self) -> bool:
        return True  # per-sample weights w_u, w_e over the optimizer step (spec §9.1)

    def __init__(
        self,
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        use_dynamic_bsz: bool | None = None,
        ppo_mini_batch_size: int = 1,
        ppo_micro_batch_size_per_gpu: int = 1,
        ngpus_trainer: int = 1,
        train_batch_size_usual: int = 1,
        train_batch_size_expert: int = 1,
        loss_agg_mode: str = "token-mean",
        sft_loss_agg_mode: str | None = None,
        grpo_loss_agg_mode: str | None = None,
        backend: str = "trl",
    ):
        super().__init__(backend)
        owner = type(self).__name__
        for name, value in (
            ("ppo_mini_batch_size", ppo_mini_batch_size),
            ("ppo_micro_batch_size_per_gpu", ppo_micro_batch_size_per_gpu),
            ("ngpus_trainer", ngpus_trainer),
            ("train_batch_size_usual", train_batch_size_usual),
            ("train_batch_size_expert", train_batch_size_expert),
        ):
            _positive_int(owner, name, value)
        self.use_dynamic_bsz = bool(use_dynamic_bsz)
        self.experience_per_gpu = ppo_mini_batch_size // ngpus_trainer
        self.gradient_accumulation = ppo_mini_batch_size // ppo_micro_batch_size_per_gpu
        self.train_batch_size_usual = train_batch_size_usual // ngpus_trainer
        self.train_batch_size_expert = train_batch_size_expert // ngpus_trainer
        # a zero here would silently zero a loss or divide by zero at call time
        derived = {
            "train_batch_size_usual // ngpus_trainer": self.train_batch_size_usual,
            "train_batch_size_expert // ngpus_trainer": self.train_batch_size_expert,
        }
        if self.use_dynamic_bsz:
            derived["ppo_mini_batch_size // ngpus_trainer"] = self.experience_per_gpu
        else:
            derived["ppo_mini_batch_size // ppo_micro_batch_size_per_gpu"] = self.gradient_accumulation
        for name, value in derived.items():
            if value < 1:
                raise ValueError(f"{owner}: {name} must be >= 1, got {value}")
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        self.grpo_loss_fn = POLICY_LOSS_FN.get("ppo")(
            clip_range=clip_range,
            clip_range_low=clip_range_low,
            clip_range_high=clip_range_high,
            loss_agg_mode=grpo_loss_agg_mode or loss_agg_mode,
        )
        self.sft_loss_fn = self.build_sft_loss_fn(sft_loss_agg_mode or loss_agg_mode)

    def build_sft_loss_fn(self, loss_agg_mode: str) -> PolicyLossFn:
        return POLICY_LOSS_FN.get("sft")(loss_agg_mode=loss_agg_mode)

    def expert_mask_of(self, expert_mask: Any, logprob: torch.Tensor) -> torch.Tensor:
        """``expert_mask`` as a ``(B,)`` bool tensor on ``logprob``'s device."""
        mask = torch.as_tensor(expert_mask, device=logprob.device).to(torch.bool)
        if mask.shape != logprob.shape[:1]:
            raise ValueError(f"{getattr(self, 'name', type(self).__name__)}: expert_mask must have shape ({logprob.shape[0]},), got {tuple(mask.shape)}")
        return mask

    def mixed_loss(self, logprob, old_logprob, action_mask, advantages, expert_mask, mu: float):
        """``(1−μ)·L_u + μ·L_e`` and the scaled ``usual/*``, ``expert/*`` and ``loss`` metrics.

        ``logprob``, ``old_logprob``, ``action_mask``, ``advantages``: ``(B, T)``;
        ``expert_mask``: ``(B,)`` bool. A subset with no rows contributes a 0 loss and no metrics.
        """
        batch_size = logprob.shape[0]
        expert = self.expert_mask_of(expert_mask, logprob)
        usual = ~expert
        n_expert = int(expert.sum())
        n_usual = batch_size - n_expert
        if self.use_dynamic_bsz:
            w_usual = self.experience_per_gpu / (batch_size * self.train_batch_size_usual)
            w_expert = self.experience_per_gpu / (batch_size * self.train_batch_size_expert)
        else:
            w_usual = self.gradient_accumulation / self.train_batch_size_usual
            w_expert = self.gradient_accumulation / self.train_batch_size_expert

        zero = torch.zeros((), dtype=logprob.dtype, device=logprob.device)
        metrics: dict[str, Any] = {}
        loss_usual = loss_expert = zero
        if n_usual > 0:
            loss_usual, met = self.grpo_loss_fn.evaluate(
                logprob=logprob[usual],
                old_logprob=old_logprob[usual],
                action_mask=action_mask[usual],
                advantages=advantages[usual],
            )
            scale = n_usual * w_usual
            loss_usual = loss_usual * scale
            metrics.update({f"usual/{k}": v * scale for k, v in met.items()})
        if n_expert > 0:
            loss_expert, met = self.sft_loss_fn.evaluate(logprob=logprob[expert], action_mask=action_mask[expert])
            scale = n_expert * w_expert
            loss_expert = loss_expert * scale
            metrics.update({f"expert/{k}": v * scale for k, v in met.items()})
        loss = (1.0 - mu) * loss_usual + mu * loss_expert
        metrics["loss"] = loss.detach()
        return loss, metrics


@POLICY_LOSS_FN.register("mix")
class MIXPolicyLossFn(ExpertMixLossFn):
    """MIX: ``(1−mu)·L_u + mu·L_e`` with a constant ``mu`` (spec §9.2).

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``;
    ``expert_mask``: ``(B,)`` bool, True for SFT demonstration rows.
    """

    def __init__(self, mu: float = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        self.mu = _unit_interval("mix", "mu", mu)

    @classmethod
    def default_args(cls) -> dict[str, Any]:
        return {"mu": 0.1, "clip_range": 0.2, "loss_agg_mode": "token-mean"}

    def compute(self, logprob, old_logprob, action_mask, advantages, expert_mask, **_):
        return self.mixed_loss(logprob, old_logprob, action_mask, advantages, expert_mask, self.mu)
