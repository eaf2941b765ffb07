"""CISPO (MiniMax-M1): REINFORCE weighted by a clipped, detached importance ratio."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..algorithms import POLICY_LOSS_FN
from ..algorithms.policy_loss.cispo import CISPOPolicyLossFn
from .config import TrinityConfig
from .spellings import component_argument_spelling
from .trinity import TrinityTrainer

# the cispo loss's arguments that CISPOConfig took as its own fields before `policy_loss` (removed in 0.2)
REMOVED_FIELDS = (
    "clip_range_low",
    "clip_range_high",
    "enable_mask_clip",
    "mask_clip_range_low",
    "mask_clip_range_high",
)


@dataclass
class CISPOFields:
    """CISPO's defaults and check, shared by [`CISPOConfig`][] and the asynchronous
    [`AsyncCISPOConfig`][trinity_trl.trainers.async_algorithms.AsyncCISPOConfig]."""

    removed_spellings = {
        **TrinityConfig.removed_spellings,
        **{name: component_argument_spelling("policy_loss", name) for name in REMOVED_FIELDS},
    }

    algorithm: str = field(default="cispo", metadata={"help": "Algorithm preset."})

    def _check_own_fields(self) -> None:
        if not issubclass(POLICY_LOSS_FN.get(self._policy_loss_name()), CISPOPolicyLossFn):
            raise ValueError(f"{type(self).__name__} needs the 'cispo' policy loss, got {self._policy_loss_name()!r}")


@dataclass
class CISPOConfig(CISPOFields, TrinityConfig):
    r"""
    Configuration of [`CISPOTrainer`][] (Trinity-RFT's CISPO, docs/algorithms/policy-losses.md#cispo).

    The per-token loss is `−A · sg(w) · M · log π`, with the weight
    `w = clamp(r, 1 − clip_range_low, 1 + clip_range_high)` and `r` the importance ratio.
    Tokens are never dropped by the weight clip, only by the optional mask clip.

    Warning:
        TRL's `GRPOConfig(loss_type="cispo")` caps the ratio at the **absolute** value `epsilon_high`,
        which defaults to `epsilon = 0.2` when unset, so even the on-policy ratio 1.0 becomes 0.2 and
        updates shrink about five-fold. Here `clip_range_high` is **relative**: the cap is
        `1 + clip_range_high` (1.28 by default). TRL's `epsilon_high = 1 + clip_range_high` gives the same
        loss (with `clip_range_low = 1`, i.e. no lower clip).

    Its arguments are the `cispo` loss's, set in `policy_loss`: e.g.
    `policy_loss={"clip_range_high": 5.0}` (YAML `policy_loss: {clip_range_high: 5.0}`, command line
    `--policy_loss.clip_range_high 5.0`):

    * `clip_range_low` (default `1.0`): lower clip of the weight, `w >= 1 − clip_range_low` (1.0 = none).
    * `clip_range_high` (default `0.28`): upper clip of the weight, `w <= 1 + clip_range_high`.
    * `enable_mask_clip` (default `False`): drop tokens whose ratio is above `1 + mask_clip_range_high`
      with a positive advantage, or below `1 − mask_clip_range_low` with a negative one.
    * `mask_clip_range_low` (default `1.0`), `mask_clip_range_high` (default `0.28`): see `enable_mask_clip`.

    Defaults otherwise follow the `cispo` preset: GRPO advantages, `token-mean` aggregation; no KL term unless
    `kl_loss` names one (the preset's Trinity default: `kl_loss="k2"`, coefficient 0.001).
    """


class CISPOTrainer(TrinityTrainer):
    """[`TrinityTrainer`][] with Trinity-RFT's CISPO loss (see [`CISPOConfig`][])."""

    _name = "CISPO"
    config_class = CISPOConfig
