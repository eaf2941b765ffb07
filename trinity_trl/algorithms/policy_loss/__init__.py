"""Policy losses (spec §1-§9); importing this package registers every key in ``POLICY_LOSS_FN``."""

from . import chord, cispo, dpo, gspo, importance_sampling, mix, opmd, ppo, rec, sapo, sft, sppo, topr  # noqa: F401
from .base import POLICY_LOSS_FN, PolicyLossFn
from .chord import mu_schedule_function
from .sft import phi_function

__all__ = ["POLICY_LOSS_FN", "PolicyLossFn", "mu_schedule_function", "phi_function"]
