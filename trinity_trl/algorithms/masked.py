"""Masked primitives and loss aggregation (docs/algorithms/aggregation.md).

All per-token tensors are ``(B, T)`` over response tokens. A mask may be bool (1 = train on the
token) or float (a weight, multiplied once). Values at positions whose mask is zero are replaced
by 0 before use, so NaN/inf in padding can never leak into a result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

# an aggregation given as a function of (loss_mat (B, T), loss_mask (B, T)) -> 0-d tensor
Aggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: what an aggregation divides its weighted token sum by (see `AggregationMode`)
Divisor = Literal["tokens", "samples", "width"]


@dataclass(frozen=True)
class AggregationMode:
    """One ``loss_agg_mode``: a weighted token sum ``Σ ℓ·m·w`` divided by one count ``D``.

    This is the only definition of a mode: `agg_loss` (one micro-batch, a row is a sample) and the
    trainers' loss plan (``trinity_trl.training.loss``: packed samples, counts over the whole optimizer
    step) both build their weights and count from it, each supplying the counts of its own batch. A new
    mode is a new entry of `AGGREGATION_MODES`.

    Attributes:
        name: the ``loss_agg_mode`` string.
        mean_within_sample: ``w = 1 / n_s`` (``n_s``: the trained tokens of the token's sample), else ``w = 1``.
        divide_by: ``"tokens"`` (the trained tokens), ``"samples"`` (rows, or packed samples, empty ones
            included in a micro-batch) or ``"width"`` (the padded width of the widest sample; never pooled
            across micro-batches).
    """

    name: str
    mean_within_sample: bool
    divide_by: Divisor

    def token_weights(self, mask: torch.Tensor, sample_tokens: torch.Tensor) -> torch.Tensor:
        """``m·w``: ``mask`` (token weights, or per-sample sums), divided by ``sample_tokens`` (the trained
        tokens of each one's sample, broadcastable, never 0) when the mode means within a sample."""
        return mask / sample_tokens if self.mean_within_sample else mask

    @property
    def per_sample(self) -> bool:
        """Whether the mode weighs or counts samples, so a sample's tokens can be summed first."""
        return self.mean_within_sample or self.divide_by == "samples"

    def divisor(
        self,
        tokens: Callable[[], torch.Tensor],
        samples: Callable[[], torch.Tensor],
        width: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """The count ``D``: the batch's ``tokens``, ``samples`` or ``width`` (each computed only when chosen)."""
        return {"tokens": tokens, "samples": samples, "width": width}[self.divide_by]()


AGGREGATION_MODES: dict[str, AggregationMode] = {
    mode.name: mode
    for mode in (
        AggregationMode("token-mean", mean_within_sample=False, divide_by="tokens"),
        AggregationMode("seq-mean-token-sum", mean_within_sample=False, divide_by="samples"),
        AggregationMode("seq-mean-token-mean", mean_within_sample=True, divide_by="samples"),
        AggregationMode("seq-mean-token-sum-norm", mean_within_sample=False, divide_by="width"),
    )
}

LOSS_AGG_MODES = tuple(AGGREGATION_MODES)


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
    """A mode name of `AGGREGATION_MODES`, or an `Aggregation` callable (trainers)."""
    if callable(loss_agg_mode):
        return loss_agg_mode
    if loss_agg_mode not in AGGREGATION_MODES:
        raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; allowed: {', '.join(AGGREGATION_MODES)}")
    return loss_agg_mode


def aggregation_mode(loss_agg_mode: str) -> AggregationMode:
    """The `AggregationMode` named ``loss_agg_mode``; an unknown name is an error listing the modes."""
    check_loss_agg_mode(loss_agg_mode)
    return AGGREGATION_MODES[loss_agg_mode]


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str | Aggregation = "token-mean",
    normalizer: float | None = None,
) -> torch.Tensor:
    """Aggregate a ``(B, T)`` per-token loss into a scalar (docs/algorithms/aggregation.md#loss-agg-mode,
    verl-compatible signature).

    ``loss_agg_mode`` may also be an `Aggregation`, a callable ``(loss_mat, loss_mask) ->
    scalar``: trainers pass one to normalise over more than the micro-batch (see
    ``trinity_trl.training.loss``). A mode string must name an entry of `AGGREGATION_MODES`
    (the four below); each row is one sample.

    * ``token-mean``: one mean over every unmasked token of the micro-batch.
    * ``seq-mean-token-sum``: per-row masked sum, then mean over all ``B`` rows.
    * ``seq-mean-token-mean``: per-row masked mean, then mean over all ``B`` rows.
    * ``seq-mean-token-sum-norm``: masked sum divided by ``normalizer`` (default: the padded
      width ``loss_mask.shape[-1]``); not divided by ``B``.

    Rows with an empty mask still count in ``B`` for the seq-mean modes.
    """
    if callable(check_loss_agg_mode(loss_agg_mode)):
        return loss_agg_mode(loss_mat, loss_mask)
    mode = aggregation_mode(loss_agg_mode)
    weight = _as_weight(loss_mat, loss_mask)

    # one row is one sample; 1e-8 is added to the counts that can be 0 (docs/algorithms/aggregation.md)
    if mode.per_sample:  # each row's sum (or mean, w = 1/n_s), then the rows' total, accumulated as torch's mean does
        rows = mode.token_weights(masked_sum(loss_mat, loss_mask, dim=-1), weight.sum(dim=-1) + 1e-8)
        total = rows.to(torch.promote_types(rows.dtype, torch.float32)).sum()
    else:
        total = masked_sum(loss_mat, loss_mask)
    width = float(loss_mask.shape[-1]) if normalizer is None else float(normalizer)
    divisor = mode.divisor(
        tokens=lambda: weight.sum() + 1e-8,
        samples=lambda: torch.tensor(float(loss_mask.shape[0]), dtype=total.dtype, device=total.device),
        width=lambda: torch.tensor(width + 1e-8, dtype=total.dtype, device=total.device),
    )
    return (total / divisor.to(total.dtype)).to(loss_mat.dtype)
