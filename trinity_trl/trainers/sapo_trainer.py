"""SAPO: a soft, temperature-controlled gate on the importance ratio instead of a hard clip."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..algorithms import POLICY_LOSS_FN
from ..algorithms.component import Component
from ..algorithms.policy_loss.sapo import SAPOPolicyLossFn
from .config import TrinityConfig
from .spellings import component_argument_spelling
from .trinity import TrinityTrainer


@dataclass
class SAPOFields:
    """SAPO's defaults (the paper's loss: `seq-mean-token-mean`, no KL) and check, shared by [`SAPOConfig`][] and the
    asynchronous [`AsyncSAPOConfig`][trinity_trl.trainers.async_algorithms.AsyncSAPOConfig]."""

    removed_spellings = {
        **TrinityConfig.removed_spellings,
        "sapo_form": component_argument_spelling("policy_loss", "form"),
    }

    algorithm: str = field(default="sapo", metadata={"help": "Algorithm preset."})
    loss_agg_mode: str | None = field(default="seq-mean-token-mean", metadata={"help": "Loss aggregation mode."})
    kl_loss: dict | str | None = field(default="none", metadata={"help": "KL loss (none in the SAPO paper)."})

    def _implied_components(self) -> dict[str, Component]:
        if not issubclass(POLICY_LOSS_FN.get(self._policy_loss_name()), SAPOPolicyLossFn):
            raise ValueError(f"{type(self).__name__} needs the 'sapo' policy loss, got {self._policy_loss_name()!r}")
        if self.policy_loss is None or "form" not in self.policy_loss.args:
            return {"policy_loss": Component(form="paper")}  # this trainer's default: the SAPO paper's (and TRL's)
        return {}


@dataclass
class SAPOConfig(SAPOFields, TrinityConfig):
    r"""
    Configuration of [`SAPOTrainer`][].

    With `f(r) = σ(τ·(r − 1))·4/τ` (`τ = sapo_temperature_pos` where the advantage is positive,
    else `sapo_temperature_neg`):

    * `policy_loss={"form": "paper"}` (default): the SAPO paper's objective, per-token loss `−A·f(r)`
      differentiated through the ratio `r` (gradient `−A·∇log π` on-policy), aggregated per sequence
      (`seq-mean-token-mean`) and without a KL term: the same loss and gradients as TRL's
      `GRPOConfig(loss_type="sapo")`.
    * `policy_loss={"form": "trinity"}`: Trinity-RFT's form, `−A·sg(f(r))·log π` (on-policy gradient `2/τ` times
      larger, not vanishing for large ratios). Use `algorithm="sapo"` in [`TrinityConfig`][] for the
      full Trinity preset (token-mean; its k2 KL loss when you name it, `kl_loss="k2"`).

    Parameters:
        policy_loss (`dict`, *optional*): the `sapo` loss's arguments, e.g. `{"form": "trinity", "tau_pos": 1.0}`;
            `form` defaults to `"paper"` here.
        sapo_temperature_pos (`float`, *optional*, defaults to `1.0`): Gate temperature for A > 0.
        sapo_temperature_neg (`float`, *optional*, defaults to `1.05`): Gate temperature for A ≤ 0;
            must be ≥ `sapo_temperature_pos`.
    """


class SAPOTrainer(TrinityTrainer):
    """[`TrinityTrainer`][] with the SAPO soft gate (see [`SAPOConfig`][])."""

    _name = "SAPO"
    config_class = SAPOConfig
