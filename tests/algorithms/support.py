"""Helpers shared by the algorithm tests (not test data: the builders of docs/algorithms/reference-values.md are in
conftest.py)."""

from __future__ import annotations

import torch
from tolerance import approx

from trinity_trl.algorithms import POLICY_LOSS_FN

POLICY_KEYS = [
    "ppo",
    "gspo",
    "cispo",
    "sapo",
    "topr",
    "sppo",
    "rec",
    "opmd",
    "sft",
    "sft_is",
    "sft_phi",
    "dpo",
    "importance_sampling",
    "mix",
    "mix_chord",
    "m2po",
]
KL_KEYS = ["none", "k1", "k2", "k3", "low_var_kl", "abs", "corrected_k3"]
ENTROPY_KEYS = ["default", "mix", "none"]
GROUP_ADV_KEYS = ["grpo", "step_wise_grpo", "gigpo", "opmd", "asymre", "reinforce", "rec"]
BATCH_ADV_KEYS = [
    "ppo",
    "reinforceplusplus",
    "rloo",
    "remax",
    "grpo_verl",
    "opmd_verl",
    "asymre_verl",
    "on_policy_distill",
]
PRESETS = [
    "sft",
    "ppo",
    "grpo",
    "reinforceplusplus",
    "rloo",
    "opmd",
    "asymre",
    "dpo",
    "topr",
    "cispo",
    "gspo",
    "sapo",
    "mix",
    "mix_chord",
    "raft",
    "sppo",
    "rec",
    "multi_step_grpo",
    "gigpo",
    "on_policy_distill",
    "m2po",
]


PPO_KL = -0.21663446724414825


AVG_RATIO = 1.630766749382019


MY_KEYS = ("gspo", "cispo", "sapo", "topr", "sppo", "importance_sampling", "opmd", "sft", "sft_is", "sft_phi", "dpo")


DYN = dict(
    use_dynamic_bsz=True,
    ppo_mini_batch_size=320,
    ppo_micro_batch_size_per_gpu=4,
    ngpus_trainer=4,
    train_batch_size_usual=256,
    train_batch_size_expert=64,
)


SCHEDULE = dict(mu_warmup_steps=200, mu_decay_steps=400, mu_peak=0.5, mu_valley=0.02)


def build(key: str, **overrides):
    cls = POLICY_LOSS_FN.get(key)
    return cls(**{**cls.default_args(), **overrides})


def as_double(data):
    return {k: v.double() if v.is_floating_point() else v for k, v in data.items()}


# Tolerance of the reference values (docs/algorithms/reference-values.md#policy-loss-values). They are printed as
# float32 results with 17 significant digits, so half a unit of the last printed digit (< 1e-16) is far below
# float32's rounding, which sets the tolerance: weighted sums over the (5, 20) batch's 100 tokens
# (tests/tolerance.py), whose rounding errors are relative to the weighted mean magnitude of the terms, since the
# advantages' signs cancel: |A| * exp(ℓ - ℓo) averages 0.8 over the 48 trained tokens, so the scale is 1, or the value
# itself where it is larger (seq-mean-token-sum sums a row's terms). The documented masked mean divides by (count +
# 1e-8): a hand formula dividing by the count differs by 1e-8 relative at most (counts >= 1), beyond rounding:
# `known_rtol` of tests/tolerance.py
MEAN_EPSILON = 1e-8
# The KL and entropy data (docs/algorithms/reference-values.md#kl-entropy-values): (4, 10), log-probs in [-1, 1], so
# the same scale of 1 for the per-token terms.
SPEC_TERMS, KL_SPEC_TERMS = 5 * 20, 4 * 10


def spec_value(expected: float, terms: int = SPEC_TERMS, scale: float = 1.0):
    """``expected`` within the tolerance of a float32 value computed from the reference data
    (docs/algorithms/reference-values.md#policy-loss-values by default, or ``terms=KL_SPEC_TERMS``); ``scale``: the
    mean magnitude of the summed terms (times a coefficient applied after)."""
    return approx(expected, terms=terms, scale=max(scale, abs(expected)))


def check(result, loss, metrics):
    value, got = result
    assert value.item() == spec_value(loss)
    for name, expected in metrics.items():
        assert got[name] == spec_value(expected), name


LOSS_METRIC = {
    "gspo": "pg_loss", "cispo": "cispo_loss", "sapo": "sapo_loss", "topr": "topr_loss", "sppo": "pg_loss",
    "importance_sampling": "pg_loss", "opmd": "opmd_loss", "sft": "sft_loss", "sft_is": "sft_is_loss",
    "sft_phi": "sft_phi_loss", "dpo": "dpo_loss",
}  # fmt: skip


METRIC_NAMES = {
    "gspo": {"pg_clipfrac", "ppo_kl", "pg_loss", "ppo_kl_seq"},
    "cispo": {"cispo_loss", "ppo_kl", "unmasked_frac", "pg_clipfrac"},
    "sapo": {"sapo_loss", "ppo_kl", "avg_soft_gate", "avg_ratio", "pos_adv_frac"},
    "topr": {"topr_loss", "avg_alpha", "avg_ratio"},
    "sppo": {"pg_clipfrac", "pg_loss"},
    "importance_sampling": {"pg_loss", "ratio/mean", "approx_kl"},
    "opmd": {"opmd_loss"},
    "sft": {"sft_loss"},
    "sft_is": {"sft_is_loss"},
    "sft_phi": {"sft_phi_loss"},
    "dpo": {"chosen_reward", "rejected_reward", "accuracy_mean", "dpo_loss"},
}


def assert_reference_values(policy_data, key, overrides, loss, metrics):
    """The loss and metrics of ``key`` (from its default_args() plus ``overrides``) on
    docs/algorithms/reference-values.md#policy-loss-values data."""
    value, got = build(key, **overrides)(**policy_data)
    assert value.dim() == 0 and value.requires_grad is False  # the reference batch holds plain tensors
    assert value.item() == spec_value(loss)
    assert set(got) == METRIC_NAMES[key]
    assert all(type(v) is float for v in got.values())
    assert got[LOSS_METRIC[key]] == spec_value(loss)
    for name, expected in metrics.items():
        assert got[name] == spec_value(expected), name


def small_data(seed: int = 0, batch: int = 4, width: int = 6) -> dict[str, torch.Tensor]:
    """float64 data with log-ratios in ±0.6, one row partly masked at the end, one at the start."""
    gen = torch.Generator().manual_seed(seed)
    logprob = -2.0 * torch.rand(batch, width, generator=gen, dtype=torch.float64) - 0.05
    old_logprob = logprob - (1.2 * torch.rand(batch, width, generator=gen, dtype=torch.float64) - 0.6)
    ref_logprob = -2.0 * torch.rand(batch, width, generator=gen, dtype=torch.float64)
    advantages = 2.0 * torch.rand(batch, width, generator=gen, dtype=torch.float64) - 1.0
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[1::4, 4:] = False
    mask[2::4, :2] = False
    return {
        "logprob": logprob,
        "old_logprob": old_logprob,
        "ref_logprob": ref_logprob,
        "advantages": advantages,
        "action_mask": mask,
    }


def _assert_off_edges(values: torch.Tensor, edges) -> None:
    """A finite-difference step (1e-6) must never cross a kink of the loss."""
    for edge in edges:
        assert (values - edge).abs().min() > 1e-3, edge


def _grad(fn, data):
    logprob = data["logprob"].clone().requires_grad_(True)
    loss, _ = fn(**{**data, "logprob": logprob})
    (grad,) = torch.autograd.grad(loss, logprob)
    return grad
