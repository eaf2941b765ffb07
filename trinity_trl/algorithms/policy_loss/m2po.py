"""M2PO: an unclipped policy gradient that masks the stale tokens with the largest squared log-ratio
(docs/algorithms/policy-losses.md#m2po)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..masked import check_loss_agg_mode, masked_mean
from .base import POLICY_LOSS_FN, PolicyLossFn


def second_moment_keep(log_ratio: torch.Tensor, advantages: torch.Tensor, threshold: float) -> torch.Tensor:
    """The tokens M2PO keeps, ``(N,)`` bool, of ``N`` trained tokens in a fixed order (their log-ratios ``ℓ − ℓo`` and
    advantages, ``(N,)`` each).

    The trust-region tokens are those where PPO's clip could act: ``A > 0`` and ``ℓ − ℓo > 0``, or both ``< 0``. When
    the mean of their second moments ``M2 = (ℓ − ℓo)²`` (float32) exceeds ``threshold``, they are sorted by ``M2``
    ascending (a stable sort: of equal values the earlier in the order comes first) and the longest prefix whose
    running mean is at most ``threshold`` is kept, the rest masked; otherwise every token is kept. Tokens outside the
    trust region are always kept. No host synchronisation.
    """
    if log_ratio.shape != advantages.shape or log_ratio.dim() != 1:
        raise ValueError(
            f"second_moment_keep takes (N,) log-ratios and advantages, got {tuple(log_ratio.shape)} and "
            f"{tuple(advantages.shape)}"
        )
    log_ratio = log_ratio.detach()
    trust = ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))
    keep = torch.ones_like(trust)
    second_moment = log_ratio.float().square()[trust]
    count = second_moment.numel()
    if count == 0:
        return keep
    order = torch.sort(second_moment, stable=True).indices
    # the running means in float64 (float32 on MPS, which has none): sums of up to millions of tokens stay exact to
    # far below any threshold's resolution
    exact = torch.float32 if second_moment.device.type == "mps" else torch.float64
    sums = torch.cumsum(second_moment[order].to(exact), 0)
    running = sums / torch.arange(1, count + 1, device=sums.device, dtype=exact)
    over = running > threshold
    # the longest prefix whose running mean is <= threshold (the whole of it when the mean itself is)
    kept = torch.where(over.any(), over.to(torch.int64).argmax(), torch.tensor(count, device=over.device))
    sorted_keep = torch.arange(count, device=over.device) < kept
    in_trust = torch.ones(count, dtype=torch.bool, device=keep.device)
    in_trust[order] = sorted_keep
    keep[trust.nonzero().squeeze(1)] = in_trust
    return keep


@POLICY_LOSS_FN.register("m2po")
class M2POPolicyLossFn(PolicyLossFn):
    """M2PO (Zheng et al. 2025, arXiv:2510.01161): per-token loss ``−A · exp(clamp(δ, −c, c)) · K``, ``δ = ℓ − ℓo``.

    The clamp is straight-through: the gradient of a kept token is ``−A · exp(clamp(δ)) · ∇ℓ`` even where ``δ``
    leaves ``[−c, c]`` (``c = log_ratio_clip``). ``K`` is 0 for the tokens `second_moment_keep` masks, chosen over
    the **whole optimizer step** (every micro-batch and process) under the current weights: a trainer computes it in
    a pass without gradient before the step's first backward and hands each micro-batch its part as ``step_mask``
    (`needs_step_mask`); a call without ``step_mask`` chooses over the tokens it is given. Masked tokens count in the
    token mean's denominator: the loss is only defined as ``token-mean``.

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``, ``step_mask``: ``(B, T)``.

    Metrics (over the tokens of the call): ``pg_loss``; ``m2po/m2_before`` and ``m2po/m2_after``, the mean ``M2`` of
    the trust-region tokens before and after masking; ``m2po/masked_fraction`` and ``m2po/trust_region_fraction``,
    the shares of the trained tokens masked and in the trust region.
    """

    optional_inputs = ("step_mask",)
    loss_metric = "pg_loss"
    needs_step_mask: ClassVar[bool] = True

    def __init__(
        self,
        backend: str = "trl",
        m2_threshold: float = 0.04,
        loss_agg_mode: str = "token-mean",
        log_ratio_clip: float = 20.0,
    ):
        super().__init__(backend)
        self.m2_threshold = float(m2_threshold)
        if not math.isfinite(self.m2_threshold) or self.m2_threshold < 0:
            raise ValueError(f"m2po: m2_threshold must be a finite number >= 0, got {m2_threshold}")
        self.log_ratio_clip = float(log_ratio_clip)
        if not math.isfinite(self.log_ratio_clip) or self.log_ratio_clip <= 0:
            raise ValueError(f"m2po: log_ratio_clip must be a finite number > 0, got {log_ratio_clip}")
        if check_loss_agg_mode(loss_agg_mode) != "token-mean":
            raise ValueError(
                f"m2po: loss_agg_mode must be 'token-mean' (its loss is the mean over every trained token, masked ones "
                f"included), got {loss_agg_mode!r}"
            )
        self.loss_agg_mode = loss_agg_mode

    def step_mask(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """The tokens kept, ``(N,)`` bool, of the optimizer step's ``N`` trained tokens (`second_moment_keep`)."""
        return second_moment_keep(log_ratio, advantages, self.m2_threshold)

    def token_losses(self, logprob, old_logprob, action_mask, advantages, step_mask=None, **_):
        valid = action_mask != 0
        log_ratio = logprob - old_logprob
        if step_mask is None:  # the tokens of this call are the step
            keep = torch.ones_like(valid)
            keep[valid] = self.step_mask(log_ratio[valid], advantages[valid])
        elif step_mask.shape != valid.shape:
            raise ValueError(f"m2po: step_mask has shape {tuple(step_mask.shape)}, the tokens {tuple(valid.shape)}")
        else:
            keep = step_mask != 0
        clamped = log_ratio.clamp(-self.log_ratio_clip, self.log_ratio_clip)
        ratio = torch.exp(log_ratio + (clamped - log_ratio).detach())  # the clamp's gradient taken as 1
        losses = torch.where(keep, -advantages * ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device))
        delta = log_ratio.detach()
        trust = valid & (((advantages > 0) & (delta > 0)) | ((advantages < 0) & (delta < 0)))
        second_moment = delta.float().square()
        metrics: dict[str, Any] = {
            "m2po/m2_before": masked_mean(second_moment, trust),
            "m2po/m2_after": masked_mean(second_moment, trust & keep),
            "m2po/masked_fraction": masked_mean((valid & ~keep).float(), valid),
            "m2po/trust_region_fraction": masked_mean(trust.float(), valid),
        }
        return losses, metrics
