"""How a micro-batch's token losses become the optimizer step's loss: one weighted sum and its count.

Every aggregation mode (docs/algorithms/aggregation.md#loss-agg-mode) is a weighted token sum divided by a count:

==========================  ===============================  =========================================
mode                        per-token weight ``w``           count ``D`` (``micro_batch`` / ``global``)
==========================  ===============================  =========================================
``token-mean``              ``m``                            trained tokens of the micro-batch / of
                                                             the optimizer step, per micro-step
``seq-mean-token-sum``      ``m``                            samples of the micro-batch / of the step
``seq-mean-token-mean``     ``m / n_s`` (tokens of sample s) samples, as above
``seq-mean-token-sum-norm`` ``m``                            the padded width (the widest sample)
==========================  ===============================  =========================================

A *sample* is a row, or, in a row that packs several turns of one run (``segment_ids``, StepGRPO),
one turn; rows that only pad the batch are no sample. ``global`` counts the whole generation batch
of every process (one gather per generation batch, ``global_loss_tokens`` / ``global_loss_rows``)
and divides by ``processes · steps_per_generation`` to get the count of one micro-step, so after
DDP's mean every token (sample) of the optimizer step weighs the same on any number of processes.
``seq-mean-token-sum-norm`` is always per micro-batch (docs/algorithms/aggregation.md#loss-agg-mode).

The loss terms receive `WeightedSum` as their aggregation, so each term *is* ``Σ m·w·ℓ / D``:
nothing is divided by one count and multiplied back by another. Gradient accumulation is applied by
the trainer on top (``loss / gradient_accumulation_steps``), as TRL does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..algorithms.masked import aggregation_mode, masked_sum
from .trl_seams import trained_mask

LOSS_NORMALIZATIONS = ("micro_batch", "global")


@dataclass(frozen=True)
class LossBatch:
    """What the loss of one micro-batch reads, taken once from TRL's batch dict (`from_trl`).

    TRL hands ``_compute_loss`` a dict that also carries the rows our trainers added to it (TRL's buffering
    and shuffling move every key along). Only `from_trl` reads that dict's optional keys; everything
    downstream (guards, loss inputs, the aggregation plan) reads these fields. ``None`` means the batch has
    no such field, with the meaning given for each.

    Attributes:
        mask: ``(B, T)`` the trained completion tokens (``completion_mask`` times TRL's ``tool_mask``).
        advantages: ``(B,)`` or ``(B, T)``; ``None`` only in a batch no policy loss reads (PPO's value loss).
        old_logps: ``(B, T)`` behaviour log-probs (``old_per_token_logps``); ``None``: on-policy, the
            current log-probs are the behaviour ones.
        ref_logps: ``(B, T)`` reference log-probs (``ref_per_token_logps``); ``None``: no reference pass ran.
        importance_sampling_ratio: TRL's vLLM importance weights, ``(B, T)`` or ``(B, 1)``; ``None``: none.
        expert_rows: ``(B,)`` bool, the demonstration rows ChordTrainer appends (``expert_mask``); ``None``:
            a trainer without expert rows.
        segment_ids: ``(B, T)`` the sample (step) each trained token belongs to, -1 elsewhere, for rows that
            pack several samples (StepGRPOTrainer); ``None``: each row is one sample.
        sample_count: ``(B,)`` samples per row (0 for a row that only pads the batch); ``None``: one per row.
        step_width: ``(B,)`` the widest sample of each row; ``None``: the padded width.
        global_tokens, global_samples: with ``loss_normalization="global"``, the trained tokens and samples
            of the generation batch of every process (``global_loss_tokens`` / ``global_loss_rows``).
    """

    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    importance_sampling_ratio: torch.Tensor | None = None
    expert_rows: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    sample_count: torch.Tensor | None = None
    step_width: torch.Tensor | None = None
    global_tokens: torch.Tensor | None = None
    global_samples: torch.Tensor | None = None

    @classmethod
    def from_trl(cls, inputs: dict[str, Any]) -> LossBatch:
        """The fields of TRL's batch dict ``inputs`` (the one place that reads its optional keys)."""
        return cls(
            mask=trained_mask(inputs),
            advantages=inputs.get("advantages"),
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps"),
            importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
            expert_rows=inputs.get("expert_mask"),
            segment_ids=inputs.get("segment_ids"),
            sample_count=inputs.get("sample_count"),
            step_width=inputs.get("step_width"),
            global_tokens=inputs.get("global_loss_tokens"),
            global_samples=inputs.get("global_loss_rows"),
        )


@dataclass(frozen=True)
class WeightedSum:
    """An aggregation (``agg_loss``'s ``loss_agg_mode``) returning ``Σ_{b,t} ℓ'·m·w / count``.

    ``m`` is the mask the loss passes (its trained tokens), ``w`` the per-token weights of the
    aggregation mode, ``ℓ'`` the loss with 0 where ``m`` is 0 (NaN/inf in padding never leaks). The
    loss itself keeps seeing its plain mask, so its statistics (clip fractions, sequence ratios) are
    those of docs/algorithms/aggregation.md.
    """

    weights: torch.Tensor  # (B, T)
    count: torch.Tensor  # 0-d

    def __call__(self, loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        if loss_mask.shape != self.weights.shape:
            raise ValueError(
                f"this aggregation was planned for a {tuple(self.weights.shape)} batch, got a mask of "
                f"shape {tuple(loss_mask.shape)}"
            )
        return masked_sum(loss_mat, loss_mask * self.weights.to(loss_mat.dtype)) / self.count.to(loss_mat.dtype)


class LossNormalizer:
    """Plans the aggregation (weights and count) of a micro-batch for a mode (see the module docs).

    Args:
        normalization: ``"micro_batch"`` or ``"global"``.
        num_processes: processes whose generation batches form one optimizer step.
        steps_per_generation: micro-steps a generation batch is split into.
    """

    def __init__(self, normalization: str, num_processes: int, steps_per_generation: int):
        if normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, got {normalization!r}")
        self.normalization = normalization
        self.micro_steps = num_processes * steps_per_generation

    @staticmethod
    def global_counts(batch: LossBatch) -> torch.Tensor:
        """This process's ``(trained tokens, samples)`` of a generation batch, to be summed over
        processes (``global_tokens``, ``global_samples``)."""
        mask = batch.mask
        samples = torch.tensor(mask.shape[0]) if batch.sample_count is None else batch.sample_count.sum()
        return torch.stack([mask.sum().float(), samples.float().to(mask.device)])

    def plan(self, batch: LossBatch, mask: torch.Tensor, loss_agg_mode: str) -> WeightedSum:
        """The aggregation of ``mask``'s tokens (``(B, T)``, 0 on untrained tokens) for ``loss_agg_mode``.

        Reads the batch's sample layout (``segment_ids``, ``sample_count``, ``step_width``) and, for
        ``global``, its ``global_tokens`` / ``global_samples``.
        """
        mode = aggregation_mode(loss_agg_mode)  # an unknown mode: the error lists the modes
        valid = mask != 0
        samples, tokens_per_sample = self._samples(batch, valid)
        ones = torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
        weights = mode.token_weights(ones, tokens_per_sample.clamp(min=1))
        # the width is always this micro-batch's widest sample; tokens and samples follow the normalization
        count = mode.divisor(
            tokens=lambda: self._global(batch.global_tokens, mask.to(torch.float32).sum()),
            samples=lambda: self._global(batch.global_samples, samples),
            width=lambda: (torch.tensor(mask.shape[1]) if batch.step_width is None else batch.step_width.max()).to(
                torch.float32
            ),
        )
        return WeightedSum(weights, torch.as_tensor(count, dtype=torch.float32, device=mask.device))

    def _global(self, global_count: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
        if self.normalization == "micro_batch":
            return torch.as_tensor(local, dtype=torch.float32).clamp(min=1.0)
        if global_count is None:
            raise ValueError(
                'loss_normalization="global" needs the global counts of the generation batch '
                "(LossBatch.global_tokens / global_samples), which this batch lacks"
            )
        # the average count of one micro-step of one process
        return (global_count.to(torch.float32) / self.micro_steps).clamp(min=1e-8)

    @staticmethod
    def _samples(batch: LossBatch, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(number of samples, (B, T) trained tokens of each token's sample)``."""
        if batch.segment_ids is not None:
            # a sample is one (row, segment) pair with trained tokens
            segments = batch.segment_ids.clamp(min=0)
            key = torch.arange(valid.shape[0], device=valid.device).unsqueeze(1) * valid.shape[1] + segments
            counts = torch.bincount(key[valid], minlength=valid.numel())
            return (counts > 0).sum(), counts[key].to(torch.float32)
        per_row = torch.ones(valid.shape[0], device=valid.device) if batch.sample_count is None else batch.sample_count
        tokens = valid.sum(1, keepdim=True).to(torch.float32).expand_as(valid)
        return per_row.sum(), tokens


def micro_batch_loss(
    policy_loss,
    components,
    normalizer: LossNormalizer,
    loss_agg_mode: str,
    batch: LossBatch,
    loss_inputs: dict[str, Any],
    entropies: torch.Tensor | None,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``policy loss − entropy term + KL loss`` of one micro-batch (before gradient accumulation), and the
    ``actor/*`` metrics of each term.

    Every term is aggregated by the normalizer's plan for its mode (the policy loss's own mode, the global
    ``loss_agg_mode`` for the KL and entropy terms), except with a loss that weighs its samples itself
    (MIX/CHORD, docs/algorithms/chord.md#normalisation), whose terms then aggregate over the micro-batch with the plain
    mode.
    ``batch``: the micro-batch; ``loss_inputs``: the policy loss's keyword inputs (``logprob``,
    ``old_logprob``, ``ref_logprob``, ...), already zero at untrained positions; ``entropies``: ``(B, T)``
    or ``None``; ``mask``: ``(B, T)``, the guarded trained tokens.
    """
    if policy_loss.weighs_samples_itself:
        aggregation: Any = loss_agg_mode
        loss, metrics = policy_loss.evaluate(**loss_inputs)
    else:
        # the policy loss receives its aggregation as an argument (its own mode, else the config's)
        own_mode = policy_loss.effective_loss_agg_mode or loss_agg_mode
        loss, metrics = policy_loss.evaluate(**loss_inputs, loss_agg_mode=normalizer.plan(batch, mask, own_mode))
        aggregation = normalizer.plan(batch, mask, loss_agg_mode)
    metrics = {f"actor/{k}": v for k, v in metrics.items()}
    entropy_loss, kl_loss = components.entropy_loss, components.kl_loss
    if entropy_loss.enabled:
        entropies = torch.where(mask != 0, entropies, torch.zeros((), dtype=entropies.dtype, device=entropies.device))
        if entropy_loss.entropy_coef == 0.0:
            entropies = entropies.detach()  # logged only: no backward through the entropy
        term, term_metrics = entropy_loss(
            entropy=entropies, action_mask=mask, expert_mask=batch.expert_rows, loss_agg_mode=aggregation
        )
        loss = loss - term
        metrics.update({f"actor/{k}": v for k, v in term_metrics.items()})
    if kl_loss.enabled:
        term, term_metrics = kl_loss.calculate_kl_loss(
            loss_inputs["logprob"],
            loss_inputs["ref_logprob"],
            mask,
            aggregation,
            old_logprob=loss_inputs["old_logprob"],
        )
        loss = loss + term
        metrics.update({f"actor/{k}": v for k, v in term_metrics.items()})
    return loss, metrics
