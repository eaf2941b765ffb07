"""Contract tests that run over every registered component (issue: public contract)."""

from __future__ import annotations

import math

import pytest
import torch

from trinity_trl.algorithms import (
    ADVANTAGE_FN,
    ALGORITHM_TYPE,
    ENTROPY_LOSS_FN,
    KL_FN,
    POLICY_LOSS_FN,
    agg_loss,
    compute_policy_loss,
    kl_penalty,
)

POLICY_KEYS = ["ppo", "gspo", "cispo", "sapo", "topr", "sppo", "rec", "opmd", "sft", "sft_is", "sft_phi", "dpo",
               "importance_sampling", "mix", "mix_chord"]
KL_KEYS = ["none", "k1", "k2", "k3", "low_var_kl", "abs", "corrected_k3"]
ENTROPY_KEYS = ["default", "mix", "none"]
GROUP_ADV_KEYS = ["grpo", "step_wise_grpo", "opmd", "asymre", "reinforce", "rec"]
BATCH_ADV_KEYS = ["ppo", "reinforceplusplus", "rloo", "remax", "grpo_verl", "opmd_verl", "asymre_verl", "on_policy_distill"]
PRESETS = ["sft", "ppo", "grpo", "reinforceplusplus", "rloo", "opmd", "asymre", "dpo", "topr", "cispo", "gspo", "sapo",
           "mix", "mix_chord", "raft", "sppo", "rec", "multi_step_grpo", "on_policy_distill"]


@pytest.mark.parametrize(
    "registry, expected",
    [(POLICY_LOSS_FN, POLICY_KEYS), (KL_FN, KL_KEYS), (ENTROPY_LOSS_FN, ENTROPY_KEYS),
     (ADVANTAGE_FN, GROUP_ADV_KEYS + BATCH_ADV_KEYS), (ALGORITHM_TYPE, PRESETS)],
)
def test_registry_lists_exactly_the_spec_keys(registry, expected):
    assert sorted(registry.names()) == sorted(expected)
    assert sorted(registry.list()) == sorted(expected)
    for name in expected:
        assert name in registry


@pytest.mark.parametrize("registry", [POLICY_LOSS_FN, KL_FN, ENTROPY_LOSS_FN, ADVANTAGE_FN, ALGORITHM_TYPE])
def test_unknown_name_lists_known_names(registry):
    with pytest.raises(ValueError) as info:
        registry.get("no_such_component")
    message = str(info.value)
    assert "no_such_component" in message
    for name in registry.names():
        assert name in message


@pytest.mark.parametrize("registry", [POLICY_LOSS_FN, KL_FN, ENTROPY_LOSS_FN, ADVANTAGE_FN])
def test_every_component_builds_from_default_args(registry):
    for name in registry.names():
        cls = registry.get(name)
        args = cls.default_args()
        assert isinstance(args, dict)
        assert cls.default_args() is not args, "default_args must return a fresh dict"
        cls(**args)


def test_advantage_kinds():
    for name in GROUP_ADV_KEYS:
        assert ADVANTAGE_FN.get(name).compute_in_trainer() is False
    for name in BATCH_ADV_KEYS:
        assert ADVANTAGE_FN.get(name).compute_in_trainer() is True


def _batch(dtype=torch.float64, rows=6, width=7, seed=0):
    """Inputs every policy loss accepts; ratios kept away from clip edges by construction noise."""
    g = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(rows, width, generator=g, dtype=dtype) * 2 - 0.05
    old = logprob + (torch.rand(rows, width, generator=g, dtype=dtype) - 0.5) * 0.6
    ref = logprob + (torch.rand(rows, width, generator=g, dtype=dtype) - 0.5) * 0.6
    mask = torch.rand(rows, width, generator=g) > 0.3
    mask[:, 0] = True
    adv = (torch.rand(rows, width, generator=g, dtype=dtype) - 0.5) * 2
    return {
        "logprob": logprob,
        "old_logprob": old,
        "ref_logprob": ref,
        "action_mask": mask,
        "advantages": adv,
        "expert_mask": torch.tensor([False, True] * (rows // 2)),
        "step": torch.full((rows,), 5),
    }


def _build(name, **overrides):
    cls = POLICY_LOSS_FN.get(name)
    return cls(**{**cls.default_args(), **overrides})


@pytest.mark.parametrize("name", POLICY_KEYS)
def test_policy_loss_returns_scalar_with_float_metrics(name):
    batch = _batch(torch.float32)
    batch["logprob"].requires_grad_(True)
    loss, metrics = _build(name)(**batch)
    assert loss.dim() == 0 and loss.requires_grad and torch.isfinite(loss)
    assert metrics and all(type(v) is float for v in metrics.values())
    loss.backward()
    assert torch.isfinite(batch["logprob"].grad).all()


@pytest.mark.parametrize("name", POLICY_KEYS)
def test_policy_loss_all_zero_mask_is_zero_not_nan(name):
    batch = _batch(torch.float32)
    batch["action_mask"] = torch.zeros_like(batch["action_mask"])
    batch["logprob"].requires_grad_(True)
    loss, metrics = _build(name)(**batch)
    loss.backward()
    if name == "dpo":
        # DPO's log-ratio sums are 0, so the loss is -logsigmoid(0) = ln 2 (spec §8.5), still finite
        assert loss.item() == pytest.approx(math.log(2.0))
    else:
        assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    assert torch.equal(batch["logprob"].grad, torch.zeros_like(batch["logprob"]))


@pytest.mark.parametrize("name", POLICY_KEYS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_in_masked_positions_cannot_leak(name, poison):
    clean = _batch(torch.float32)
    dirty = {k: v.clone() for k, v in clean.items()}
    pad = ~clean["action_mask"]
    for key in ("logprob", "old_logprob", "ref_logprob", "advantages"):
        dirty[key][pad] = poison
    clean["logprob"].requires_grad_(True)
    dirty["logprob"].requires_grad_(True)
    loss_clean, metrics_clean = _build(name)(**clean)
    loss_dirty, metrics_dirty = _build(name)(**dirty)
    loss_clean.backward()
    loss_dirty.backward()
    assert torch.equal(loss_clean.detach(), loss_dirty.detach())
    assert torch.equal(clean["logprob"].grad, dirty["logprob"].grad)
    for key, value in metrics_clean.items():
        if key == "seq_mask/masked_tokens":  # counts padded positions by definition (spec §1.3)
            continue
        assert metrics_dirty[key] == pytest.approx(value, nan_ok=False), key


@pytest.mark.parametrize("name", POLICY_KEYS)
def test_verl_and_trl_names_give_the_same_result(name):
    batch = _batch(torch.float32)
    loss, metrics = _build(name)(**batch)
    verl = {"log_prob": batch["logprob"], "old_log_probs": batch["old_logprob"], "ref_log_prob": batch["ref_logprob"],
            "response_mask": batch["action_mask"], "advantages": batch["advantages"],
            "expert_mask": batch["expert_mask"], "step": batch["step"], "unrelated_key": "ignored"}
    trl = {"per_token_logps": batch["logprob"], "old_per_token_logps": batch["old_logprob"],
           "ref_per_token_logps": batch["ref_logprob"], "completion_mask": batch["action_mask"],
           "advantages": batch["advantages"], "expert_mask": batch["expert_mask"], "step": batch["step"],
           "prompt_ids": torch.zeros(3)}
    for inputs in (verl, trl):
        other_loss, other_metrics = _build(name)(**inputs)
        assert torch.equal(loss, other_loss)
        assert other_metrics == metrics


def test_conflicting_aliases_are_rejected():
    batch = _batch(torch.float32)
    with pytest.raises(ValueError, match="Ambiguous input 'action_mask'"):
        _build("ppo")(**batch, completion_mask=~batch["action_mask"])


def test_missing_input_is_named():
    batch = _batch(torch.float32)
    del batch["old_logprob"]
    with pytest.raises(ValueError, match="old_logprob"):
        _build("ppo")(**batch)


@pytest.mark.parametrize("name", POLICY_KEYS)
def test_select_keys_cover_the_needed_inputs(name):
    fn = _build(name)
    batch = _batch(torch.float32)
    trl_names = {"old_logprob": "old_per_token_logps", "ref_logprob": "ref_per_token_logps",
                 "action_mask": "completion_mask"}
    inputs = {trl_names.get(k, k): v for k, v in batch.items()}
    needed = {"per_token_logps": inputs["logprob"], **{k: inputs[k] for k in fn.select_keys}}
    loss, _ = fn(**needed)  # works with exactly the advertised keys
    assert torch.equal(loss, fn(**batch)[0])


# Losses whose gradient is the derivative of their value. The others (cispo, sapo, topr, gspo,
# sft_is, sft_phi, mix_chord with φ) multiply log-probs by detached weights on purpose, so finite
# differences of the value cannot match; their per-loss test files check the gradient against the
# spec's formula instead.
TRUE_GRADIENT = {
    "ppo": {}, "sppo": {}, "rec": {}, "opmd": {}, "sft": {}, "dpo": {}, "importance_sampling": {}, "mix": {},
    "mix_chord": {"enable_phi_function": False}, "sapo": {"form": "paper"},
}


@pytest.mark.parametrize("name", list(TRUE_GRADIENT))
def test_policy_loss_gradcheck_float64(name):
    batch = _batch(torch.float64, rows=4, width=5, seed=3)
    overrides = dict(TRUE_GRADIENT[name])
    if "loss_agg_mode" in POLICY_LOSS_FN.get(name).default_args():
        overrides["loss_agg_mode"] = "seq-mean-token-mean"
    fn = _build(name, **overrides)
    others = {k: v for k, v in batch.items() if k != "logprob"}
    logprob = batch["logprob"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **others)[0], (logprob,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_modes_by_hand(mode):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    expected = {"token-mean": 7.0 / 3, "seq-mean-token-sum": (3.0 + 4.0) / 2, "seq-mean-token-mean": (1.5 + 4.0) / 2,
                "seq-mean-token-sum-norm": 7.0 / 3}[mode]
    assert agg_loss(x, m, mode).item() == pytest.approx(expected, rel=1e-6)


def test_agg_loss_float_mask_is_a_weight_and_normalizer():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    w = torch.tensor([[0.5, 1.0], [0.0, 2.0]])
    assert agg_loss(x, w, "token-mean").item() == pytest.approx((0.5 + 2.0 + 8.0) / 3.5)
    assert agg_loss(x, w, "seq-mean-token-sum-norm", normalizer=10).item() == pytest.approx(10.5 / 10)


def test_agg_loss_empty_rows_and_unknown_mode():
    x = torch.ones(2, 3)
    m = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    assert agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx(0.5)  # empty row counts in B
    assert agg_loss(x, torch.zeros_like(m), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(x, m, "sum")


def test_verl_compute_policy_loss_matches_registry_ppo(policy_data):
    d = policy_data
    loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
        old_log_prob=d["old_logprob"], log_prob=d["logprob"], advantages=d["advantages"],
        response_mask=d["action_mask"], cliprange=0.2,
    )
    assert loss.item() == pytest.approx(0.26889559626579285, abs=1e-6)
    assert clipfrac.item() == pytest.approx(0.3541666567325592, abs=1e-6)
    assert ppo_kl.item() == pytest.approx(-0.21663446724414825, abs=1e-6)
    assert clipfrac_lower.item() == pytest.approx(0.0625, abs=1e-6)
    with pytest.raises(ValueError):
        compute_policy_loss(d["old_logprob"], d["logprob"], d["advantages"], d["action_mask"])  # no clip range


def test_verl_kl_penalty_names(kl_data):
    d = kl_data
    lp, ref = d["logprob"], d["ref_logprob"]
    assert torch.allclose(kl_penalty(lp, ref, "kl"), lp - ref)
    assert torch.allclose(kl_penalty(lp, ref, "k1"), lp - ref)
    assert torch.allclose(kl_penalty(lp, ref, "mse"), 0.5 * (lp - ref) ** 2)
    assert torch.allclose(kl_penalty(lp, ref, "abs"), (lp - ref).abs())
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.exp(ref - lp) - 1 - (ref - lp))
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "full")
