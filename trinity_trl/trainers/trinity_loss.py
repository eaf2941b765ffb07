"""The loss of a micro-batch once the policy's log-probs are known: one code path for every trainer of rollouts.

`TrinityTrainer` (TRL's ``GRPOTrainer``, padded rows) and `AsyncTrinityTrainer` (TRL's ``AsyncGRPOTrainer``, packed
rows, `trinity_trl.trainers.async_trinity`) differ in how a micro-batch reaches the model and how its log-probs come
back; from the `trinity_trl.training.loss.LossBatch` and the ``(B, T)`` log-probs on, they run this same code: the
numerical guards (`trinity_trl.training.checks`), the policy loss's inputs, the policy loss, entropy and KL terms with
their aggregation (`trinity_trl.training.loss.micro_batch_loss`), gradient accumulation, the MoE auxiliary loss and the
skip of a non-finite loss (docs/guarantees.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..training import checks
from ..training.loss import LossBatch, micro_batch_loss
from ..training.metrics import append_metrics


class TrinityLossMixin:
    """Trainer mixin: ``_micro_batch_loss`` and the two hooks a trainer overrides (``_loss_inputs``,
    ``_policy_loss_for``). A mixin because subclasses override the hooks by name (ChordTrainer and AsyncChordTrainer
    add expert rows through `trinity_trl.trainers.chord_trainer.ExpertRowsLoss`).

    What it reads of its host: ``components``, ``algorithm``, ``loss_normalizer``, ``model``, ``_metrics`` and TRL's
    ``current_gradient_accumulation_steps``, ``aux_loss_enabled``, ``router_aux_loss_coef``.
    """

    def _loss_inputs(self, batch: LossBatch, logps: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
        """Keyword inputs of the policy loss; subclasses add theirs (ChordTrainer: ``expert_mask``, ``step``)."""
        advantages = batch.advantages
        if batch.importance_sampling_ratio is not None:
            # TRL weights each token's loss by the vLLM IS ratio; a loss linear in the advantage gets the
            # same weighting from scaled advantages (ratio >= 0 keeps signs and clip branches)
            advantages = (
                advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            ) * batch.importance_sampling_ratio
        inputs = {
            "logprob": logps,
            "old_logprob": logps.detach() if batch.old_logps is None else batch.old_logps,
            "action_mask": mask,
            "advantages": advantages,
            "ref_logprob": batch.ref_logps,
        }
        if batch.step_mask is not None:  # the part of the optimizer step's mask (a loss with needs_step_mask)
            inputs["step_mask"] = batch.step_mask
        return inputs

    def _policy_loss_for(self, mode: str):
        """The policy loss of a training or evaluation micro-batch (ChordTrainer weighs eval rows apart)."""
        return self.components.policy_loss

    def _micro_batch_loss(
        self,
        model: torch.nn.Module,
        batch: LossBatch,
        logps: torch.Tensor,
        entropies: torch.Tensor | None,
        aux_loss: torch.Tensor | None,
        mode: str,
    ) -> torch.Tensor:
        """The loss to back-propagate for one micro-batch: ``logps`` / ``entropies`` ``(B, T)`` of ``batch``'s rows
        under ``model`` (``entropies`` ``None`` when no entropy term runs), ``aux_loss`` the MoE auxiliary loss (or
        ``None``). Appends the ``actor/*`` and ``guards/*`` metrics of ``mode``."""
        # numerical guards (checks.py): trained tokens with non-finite inputs leave the mask, and every
        # untrained position is zeroed (`micro_batch_loss`), so no NaN/inf reaches the loss or its gradient
        mask, guard_metrics = checks.guard_loss_mask(batch.mask, logps, batch, entropies)
        loss, metrics = micro_batch_loss(
            self._policy_loss_for(mode),
            self.components,
            self.loss_normalizer,
            self.algorithm.loss_agg_mode,
            batch,
            self._loss_inputs(batch, logps, mask),
            entropies,
            mask,
        )
        if mode == "train":  # both TRL trainers set loss_is_scaled_for_ga: transformers does not divide
            loss = loss / self.current_gradient_accumulation_steps
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / (
                self.current_gradient_accumulation_steps if mode == "train" else 1.0
            )
            metrics["aux_loss"] = aux_loss.detach()
        guard_metrics["guards/nonfinite_loss"] = float(not checks.is_finite(loss))
        if guard_metrics["guards/nonfinite_loss"]:  # e.g. an unclamped ratio overflowed: skip this micro-batch
            loss = checks.zero_loss(model)
        metrics["actor/loss"] = loss.detach()
        append_metrics(self._metrics[mode], {**metrics, **guard_metrics})
        return loss
