"""Contract tests that run over every registered component (issue: public contract)."""

from __future__ import annotations

import math

import pytest
import torch

from trinity_trl.algorithms import ADVANTAGE_FN, ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN

from .support import BATCH_ADV_KEYS, GROUP_ADV_KEYS, POLICY_KEYS


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
        # DPO's log-ratio sums are 0, so the loss is -logsigmoid(0) = ln 2 (docs/algorithms/policy-losses.md#dpo), still
        # finite
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
        if key == "seq_mask/masked_tokens":  # counts padded positions by definition
            # (docs/algorithms/policy-losses.md#sequence-masking)
            continue
        assert metrics_dirty[key] == pytest.approx(value, nan_ok=False), key


@pytest.mark.parametrize("name", POLICY_KEYS)
def test_verl_and_trl_names_give_the_same_result(name):
    batch = _batch(torch.float32)
    loss, metrics = _build(name)(**batch)
    verl = {
        "log_prob": batch["logprob"],
        "old_log_probs": batch["old_logprob"],
        "ref_log_prob": batch["ref_logprob"],
        "response_mask": batch["action_mask"],
        "advantages": batch["advantages"],
        "expert_mask": batch["expert_mask"],
        "step": batch["step"],
        "unrelated_key": "ignored",
    }
    trl = {
        "per_token_logps": batch["logprob"],
        "old_per_token_logps": batch["old_logprob"],
        "ref_per_token_logps": batch["ref_logprob"],
        "completion_mask": batch["action_mask"],
        "advantages": batch["advantages"],
        "expert_mask": batch["expert_mask"],
        "step": batch["step"],
        "prompt_ids": torch.zeros(3),
    }
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
    trl_names = {
        "old_logprob": "old_per_token_logps",
        "ref_logprob": "ref_per_token_logps",
        "action_mask": "completion_mask",
    }
    inputs = {trl_names.get(k, k): v for k, v in batch.items()}
    needed = {"per_token_logps": inputs["logprob"], **{k: inputs[k] for k in fn.select_keys}}
    loss, _ = fn(**needed)  # works with exactly the advertised keys
    assert torch.equal(loss, fn(**batch)[0])


# Losses whose gradient is the derivative of their value. The others (cispo, sapo, topr, gspo,
# sft_is, sft_phi, mix_chord with φ) multiply log-probs by detached weights on purpose, so finite
# differences of the value cannot match; their per-loss test files check the gradient against the
# documented formula instead.
TRUE_GRADIENT = {
    "ppo": {},
    "sppo": {},
    "rec": {},
    "opmd": {},
    "sft": {},
    "dpo": {},
    "importance_sampling": {},
    "mix": {},
    "mix_chord": {"enable_phi_function": False},
    "sapo": {"form": "paper"},
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
