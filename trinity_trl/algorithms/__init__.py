"""Pure-PyTorch implementations of Trinity-RFT's algorithm components (docs/algorithms/index.md).

Registries (name -> class, ``.get(name)``, ``.names()``):

* ``POLICY_LOSS_FN``: ppo, gspo, cispo, sapo, topr, sppo, rec, opmd, sft, sft_is, sft_phi, dpo,
  importance_sampling, mix, mix_chord
* ``KL_FN``: none, k1, k2, k3, low_var_kl, abs, corrected_k3
* ``ENTROPY_LOSS_FN``: default, mix, none
* ``ADVANTAGE_FN``: group operators (grpo, step_wise_grpo, opmd, asymre, reinforce, rec) and
  batch functions (ppo, reinforceplusplus, rloo, remax, grpo_verl, opmd_verl, asymre_verl,
  on_policy_distill)
* ``ALGORITHM_TYPE``: the presets (Trinity-RFT's 19 and ``m2po``)

Trinity-RFT's class names that differ from ours are importable too: ``MIXCHORDPolicyLossFn`` (the
``mix_chord`` loss, ``CHORDPolicyLossFn``) and ``StepWiseGRPOAdvantageFn`` (``StepWiseGRPOAdvantage``).

The PPO critic's clipped value loss is ``clipped_value_loss`` (``value_loss.py``).

This package imports only torch and the standard library.
"""

from .advantage import ADVANTAGE_FN, AdvantageFn, BatchAdvantageFn, GroupAdvantageFn, StepWiseGRPOAdvantageFn
from .entropy import ENTROPY_LOSS_FN, EntropyLossFn
from .experience import EID, Experience, ExperienceOperator, gather_metrics, group_by
from .functional import compute_policy_loss, kl_penalty
from .kl import KL_FN, KLFn
from .masked import LOSS_AGG_MODES, agg_loss, masked_mean, masked_sum, masked_var, masked_whiten
from .policy_loss import POLICY_LOSS_FN, MIXCHORDPolicyLossFn, PolicyLossFn, mu_schedule_function, phi_function
from .presets import ALGORITHM_TYPE, GLOBAL_DEFAULTS, AlgorithmConfig, AlgorithmType, resolve_algorithm_config
from .value_loss import clipped_value_loss

__all__ = [
    "AdvantageFn",
    "BatchAdvantageFn",
    "EntropyLossFn",
    "GroupAdvantageFn",
    "KLFn",
    "PolicyLossFn",
    "ALGORITHM_TYPE",
    "AlgorithmConfig",
    "AlgorithmType",
    "GLOBAL_DEFAULTS",
    "compute_policy_loss",
    "kl_penalty",
    "resolve_algorithm_config",
    "ADVANTAGE_FN",
    "ENTROPY_LOSS_FN",
    "KL_FN",
    "POLICY_LOSS_FN",
    "EID",
    "Experience",
    "ExperienceOperator",
    "LOSS_AGG_MODES",
    "MIXCHORDPolicyLossFn",
    "StepWiseGRPOAdvantageFn",
    "agg_loss",
    "clipped_value_loss",
    "gather_metrics",
    "group_by",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mu_schedule_function",
    "phi_function",
]
