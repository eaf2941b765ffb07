"""CISPO (MiniMax-M1): REINFORCE weighted by a clipped, detached importance ratio."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..algorithms import POLICY_LOSS_FN
from ..algorithms.policy_loss.cispo import CISPOPolicyLossFn
from .config import TrinityConfig
from .trinity import TrinityTrainer


@dataclass
class CISPOConfig(TrinityConfig):
    r"""
    Configuration of [`CISPOTrainer`] (Trinity-RFT's CISPO, docs/algorithms/policy-losses.md#cispo).

    The per-token loss is `−A · sg(w) · M · log π`, with the weight
    `w = clamp(r, 1 − clip_range_low, 1 + clip_range_high)` and `r` the importance ratio.
    Tokens are never dropped by the weight clip, only by the optional mask clip.

    <Tip warning={true}>
    TRL's `GRPOConfig(loss_type="cispo")` caps the ratio at the **absolute** value `epsilon_high`,
    which defaults to `epsilon = 0.2` when unset, so even the on-policy ratio 1.0 becomes 0.2 and
    updates shrink about five-fold. Here `clip_range_high` is **relative**: the cap is
    `1 + clip_range_high` (1.28 by default). TRL's `epsilon_high = 1 + clip_range_high` gives the same
    loss (with `clip_range_low = 1`, i.e. no lower clip).
    </Tip>

    Parameters:
        clip_range_low (`float`, *optional*, defaults to `1.0`):
            Lower clip of the weight: `w >= 1 − clip_range_low` (1.0 = no lower clip).
        clip_range_high (`float`, *optional*, defaults to `0.28`):
            Upper clip of the weight: `w <= 1 + clip_range_high`.
        enable_mask_clip (`bool`, *optional*, defaults to `False`):
            Drop tokens whose ratio is above `1 + mask_clip_range_high` with a positive advantage,
            or below `1 − mask_clip_range_low` with a negative one.
        mask_clip_range_low (`float`, *optional*, defaults to `1.0`): See `enable_mask_clip`.
        mask_clip_range_high (`float`, *optional*, defaults to `0.28`): See `enable_mask_clip`.

    Defaults otherwise follow the `cispo` preset: GRPO advantages, k2 KL loss (coefficient 0.001),
    `token-mean` aggregation.
    """

    algorithm: str = field(default="cispo", metadata={"help": "Algorithm preset."})
    clip_range_low: float = field(default=1.0, metadata={"help": "Weight lower clip: w >= 1 - clip_range_low."})
    clip_range_high: float = field(default=0.28, metadata={"help": "Weight upper clip: w <= 1 + clip_range_high."})
    enable_mask_clip: bool = field(default=False, metadata={"help": "Drop tokens outside the mask clip range."})
    mask_clip_range_low: float = field(default=1.0, metadata={"help": "Mask clip: drop r < 1 - low when A < 0."})
    mask_clip_range_high: float = field(default=0.28, metadata={"help": "Mask clip: drop r > 1 + high when A > 0."})

    def _user_overrides(self) -> dict[str, Any]:
        if not issubclass(POLICY_LOSS_FN.get(self._policy_loss_name()), CISPOPolicyLossFn):
            raise ValueError(f"CISPOConfig needs the 'cispo' policy loss, got {self._policy_loss_name()!r}")
        return {
            "policy_loss_fn_args": {
                "clip_range_low": self.clip_range_low,
                "clip_range_high": self.clip_range_high,
                "enable_mask_clip": self.enable_mask_clip,
                "mask_clip_range_low": self.mask_clip_range_low,
                "mask_clip_range_high": self.mask_clip_range_high,
            }
        }


class CISPOTrainer(TrinityTrainer):
    """[`TrinityTrainer`] with Trinity-RFT's CISPO loss (see [`CISPOConfig`])."""

    _name = "CISPO"
    config_class = CISPOConfig
