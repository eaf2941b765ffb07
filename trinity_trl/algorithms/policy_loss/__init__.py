"""Policy losses (docs/algorithms/policy-losses.md); importing this package registers every key in
``POLICY_LOSS_FN``."""

from . import chord, cispo, dpo, gspo, importance_sampling, m2po, mix, opmd, ppo, rec, sapo, sft, sppo, topr  # noqa: F401
from .base import POLICY_LOSS_FN, AggregatedLossFn, PolicyLossFn, RowClass
from .chord import CHORDPolicyLossFn, MIXCHORDPolicyLossFn, mu_schedule_function
from .m2po import M2POPolicyLossFn, second_moment_keep
from .mix import BatchGeometry, ExpertMixLossFn, MIXPolicyLossFn, step_sample_weights
from .sft import phi_function

__all__ = [
    "POLICY_LOSS_FN",
    "AggregatedLossFn",
    "BatchGeometry",
    "CHORDPolicyLossFn",
    "ExpertMixLossFn",
    "M2POPolicyLossFn",
    "MIXCHORDPolicyLossFn",
    "MIXPolicyLossFn",
    "PolicyLossFn",
    "RowClass",
    "mu_schedule_function",
    "phi_function",
    "second_moment_keep",
    "step_sample_weights",
]
