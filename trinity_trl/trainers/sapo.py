"""SAPO: a soft, temperature-controlled gate on the importance ratio instead of a hard clip."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..algorithms import POLICY_LOSS_FN
from ..algorithms.policy_loss.sapo import SAPOPolicyLossFn
from .config import TrinityConfig
from .trinity import TrinityTrainer

SAPO_FORMS = ("paper", "trinity")


@dataclass
class SAPOConfig(TrinityConfig):
    r"""
    Configuration of [`SAPOTrainer`].

    With `f(r) = σ(τ·(r − 1))·4/τ` (`τ = sapo_temperature_pos` where the advantage is positive,
    else `sapo_temperature_neg`):

    * `sapo_form="paper"` (default): the SAPO paper's objective, per-token loss `−A·f(r)`
      differentiated through the ratio `r` (gradient `−A·∇log π` on-policy), aggregated per sequence
      (`seq-mean-token-mean`) and without a KL term: the same loss and gradients as TRL's
      `GRPOConfig(loss_type="sapo")`.
    * `sapo_form="trinity"`: Trinity-RFT's form, `−A·sg(f(r))·log π` (on-policy gradient `2/τ` times
      larger, not vanishing for large ratios). Use `algorithm="sapo"` in [`TrinityConfig`] for the
      full Trinity preset (token-mean, k2 KL loss).

    Parameters:
        sapo_form (`str`, *optional*, defaults to `"paper"`): `"paper"` or `"trinity"`.
        sapo_temperature_pos (`float`, *optional*, defaults to `1.0`): Gate temperature for A > 0.
        sapo_temperature_neg (`float`, *optional*, defaults to `1.05`): Gate temperature for A ≤ 0;
            must be ≥ `sapo_temperature_pos`.
    """

    algorithm: str = field(default="sapo", metadata={"help": "Algorithm preset."})
    sapo_form: str = field(default="paper", metadata={"help": "'paper' (TRL/SAPO paper) or 'trinity'."})
    loss_agg_mode: str | None = field(default="seq-mean-token-mean", metadata={"help": "Loss aggregation mode."})
    kl_loss_fn: str | None = field(default="none", metadata={"help": "KL loss (none in the SAPO paper)."})

    def _user_overrides(self) -> dict[str, Any]:
        if self.sapo_form not in SAPO_FORMS:
            raise ValueError(f"sapo_form must be one of {SAPO_FORMS}, got {self.sapo_form!r}")
        if not issubclass(POLICY_LOSS_FN.get(self._policy_loss_name()), SAPOPolicyLossFn):
            raise ValueError(f"SAPOConfig needs the 'sapo' policy loss, got {self._policy_loss_name()!r}")
        return {"policy_loss_fn_args": {"form": self.sapo_form}}


class SAPOTrainer(TrinityTrainer):
    """[`TrinityTrainer`] with the SAPO soft gate (see [`SAPOConfig`])."""

    _name = "SAPO"
    config_class = SAPOConfig
