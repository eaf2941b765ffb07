"""Masked primitives and loss aggregation (docs/algorithms/aggregation.md).

All per-token tensors are ``(B, T)`` over response tokens. A mask may be bool (1 = train on the
token) or float (a weight, multiplied once). Values at positions whose mask is zero are replaced
by 0 before use, so NaN/inf in padding can never leak into a result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# an aggregation given as a function of (loss_mat (B, T), loss_mask (B, T)) -> 0-d tensor
Aggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _as_weight(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mask.to(x.dtype)


def masked_fill_invalid(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` with every position whose mask is zero set to 0 (gradient there is exactly 0)."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``MSUM``: sum of ``x'·m`` over all positions (``dim=None``) or along ``dim``."""
    prod = masked_fill_invalid(x, mask) * _as_weight(x, mask)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``MMEAN``: ``MSUM / (Σm + 1e-8)``; an all-zero mask gives exactly 0 (never NaN)."""
    count = _as_weight(x, mask).sum() if dim is None else _as_weight(x, mask).sum(dim=dim)
    return masked_sum(x, mask, dim) / (count + 1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``MVAR``: Bessel-corrected masked variance over every unmasked entry of the batch.

    Raises ``ValueError`` when fewer than two entries are unmasked (the correction is undefined).
    """
    n = _as_weight(x, mask).sum()
    n_value = float(n)
    if n_value == 0:
        raise ValueError("masked_var: the mask is empty; at least 2 unmasked values are needed")
    if n_value == 1:
        raise ValueError("masked_var: only one unmasked value; at least 2 are needed for an unbiased variance")
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask) * (n / (n - 1))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``WHITEN``: ``(x − MMEAN) / sqrt(MVAR + 1e-8)`` applied to every entry (mean not re-added)."""
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def check_loss_agg_mode(loss_agg_mode: str | Aggregation) -> str | Aggregation:
    """A mode name of :data:`LOSS_AGG_MODES`, or an :data:`Aggregation` callable (trainers)."""
    if callable(loss_agg_mode):
        return loss_agg_mode
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")
    return loss_agg_mode


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str | Aggregation = "token-mean",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Aggregate a ``(B, T)`` per-token loss into a scalar (docs/algorithms/aggregation.md#loss-agg-mode,
    verl-compatible signature).

    ``loss_agg_mode`` may also be an :data:`Aggregation`, a callable ``(loss_mat, loss_mask) ->
    scalar``: trainers pass one to normalise over more than the micro-batch (see
    ``trinity_trl.training.loss``). Mode strings other than the four below are an error.

    * ``token-mean``: one mean over every unmasked token of the micro-batch.
    * ``seq-mean-token-sum``: per-row masked sum, then mean over all ``B`` rows.
    * ``seq-mean-token-mean``: per-row masked mean, then mean over all ``B`` rows.
    * ``seq-mean-token-sum-norm``: masked sum divided by ``normalizer`` (default: the padded
      width ``loss_mask.shape[-1]``); not divided by ``B``.

    Rows with an empty mask still count in ``B`` for the seq-mean modes.
    """
    check_loss_agg_mode(loss_agg_mode)
    if callable(loss_agg_mode):
        return loss_agg_mode(loss_mat, loss_mask)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, loss_mask, dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, loss_mask, dim=-1).mean()
    denom = float(loss_mask.shape[-1]) if normalizer is None else float(normalizer)
    return masked_sum(loss_mat, loss_mask) / (denom + 1e-8)
