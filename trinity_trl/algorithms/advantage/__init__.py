"""Advantage functions (docs/algorithms/advantages.md); importing this package registers every key in
``ADVANTAGE_FN``."""

from . import (  # noqa: F401
    asymre,
    gae,
    gigpo,
    grpo,
    on_policy_distill,
    opmd_advantage,
    rec_advantage,
    reinforce,
    reinforceplusplus,
    remax,
    rloo,
    step_wise_grpo,
)
from .advantage_fn import ADVANTAGE_FN, AdvantageFn, BatchAdvantageFn, GroupAdvantageFn, scalar_rewards_to_token_level
from .gigpo import GiGPOAdvantage, GiGPOAdvantageFn
from .step_wise_grpo import StepWiseGRPOAdvantage, StepWiseGRPOAdvantageFn

__all__ = [
    "ADVANTAGE_FN",
    "AdvantageFn",
    "BatchAdvantageFn",
    "GiGPOAdvantage",
    "GiGPOAdvantageFn",
    "GroupAdvantageFn",
    "StepWiseGRPOAdvantage",
    "StepWiseGRPOAdvantageFn",
    "scalar_rewards_to_token_level",
]
