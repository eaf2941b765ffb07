"""GSPO, CISPO, SAPO, TOPR, sPPO, importance sampling, OPMD, SFT (3 kinds) and DPO policy losses:
spec §14.1 / §15 numbers, metric names, input naming, gradients, NaN safety and bad arguments."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from trinity_trl.algorithms import POLICY_LOSS_FN, phi_function

PPO_KL = -0.21663446724414825
AVG_RATIO = 1.630766749382019
MY_KEYS = ("gspo", "cispo", "sapo", "topr", "sppo", "importance_sampling", "opmd", "sft", "sft_is", "sft_phi", "dpo")


def build(key: str, **overrides):
    cls = POLICY_LOSS_FN.get(key)
    return cls(**{**cls.default_args(), **overrides})


def as_double(data):
    return {k: v.double() if v.is_floating_point() else v for k, v in data.items()}


# ---------------------------------------------------------------- spec §14.1 / §15 numbers

REFERENCE = [
    # (key, overrides, loss, metrics)
    ("gspo", {}, 0.27235108613967896,
     {"pg_clipfrac": 0.375, "ppo_kl": PPO_KL, "ppo_kl_seq": -0.21027061343193054}),
    ("gspo", {"loss_agg_mode": "token-mean"}, 0.2790028154850006, {}),
    ("cispo", {}, -0.015564538538455963, {"unmasked_frac": 1.0, "ppo_kl": PPO_KL}),
    ("cispo", {"enable_mask_clip": True}, 0.04039409011602402, {"unmasked_frac": 0.8125}),
    ("cispo", {"enable_mask_clip": True, "mask_clip_range_low": 0.2, "mask_clip_range_high": 0.2},
     0.05443551763892174, {"unmasked_frac": 0.6458333134651184}),
    ("sapo", {}, -0.05128994956612587,
     {"avg_soft_gate": 2.3191137313842773, "avg_ratio": AVG_RATIO, "pos_adv_frac": 0.3958333432674408,
      "ppo_kl": PPO_KL}),
    ("sapo", {"tau_neg": 2.0}, -0.0716615691781044, {"avg_soft_gate": 1.7199063301086426}),
    # §15.4: the paper / TRL form on the same data
    ("sapo", {"form": "paper", "loss_agg_mode": "seq-mean-token-mean"}, 0.22332315146923065,
     {"avg_soft_gate": 2.3191137313842773, "avg_ratio": AVG_RATIO, "pos_adv_frac": 0.3958333432674408}),
    ("sapo", {"form": "paper"}, 0.24060268700122833, {}),
    ("topr", {}, -0.005364187061786652, {"avg_alpha": 0.9055275917053223, "avg_ratio": AVG_RATIO}),
    ("sppo", {}, 0.01046084240078926, {"pg_clipfrac": 0.5625}),
    ("importance_sampling", {}, 0.1029665470123291, {"ratio/mean": AVG_RATIO, "approx_kl": PPO_KL}),
    ("sft", {}, -0.07560186833143234, {}),
    ("sft", {"loss_agg_mode": "seq-mean-token-sum"}, -0.7257779240608215, {}),
    ("sft", {"loss_agg_mode": "seq-mean-token-mean"}, -0.06965617835521698, {}),
    ("sft", {"loss_agg_mode": "seq-mean-token-sum-norm"}, -0.18144448101520538, {}),
    ("sft_is", {}, -0.46196869015693665, {}),
    ("sft_phi", {}, 0.655408501625061, {}),
    ("sft_phi", {"cutoff_prob": 0.8}, -0.13724572956562042, {}),
    ("opmd", {}, -0.009589947760105133, {}),
    ("opmd", {"tau": 0.5}, -0.01278659701347351, {}),
    # §14.1 has 5 rows: the reference sums the unpaired 5th (chosen) row too
    ("dpo", {"allow_odd_rows": True}, 0.5406752228736877,
     {"chosen_reward": 0.7082431316375732, "rejected_reward": 0.3757950782775879, "accuracy_mean": 1.0}),
    ("dpo", {"allow_odd_rows": True, "beta": 0.2, "label_smoothing": 0.1}, 0.48146069049835205,
     {"chosen_reward": 1.4164862632751465, "rejected_reward": 0.7515901565551758}),
]  # fmt: skip

LOSS_METRIC = {
    "gspo": "pg_loss", "cispo": "cispo_loss", "sapo": "sapo_loss", "topr": "topr_loss", "sppo": "pg_loss",
    "importance_sampling": "pg_loss", "opmd": "opmd_loss", "sft": "sft_loss", "sft_is": "sft_is_loss",
    "sft_phi": "sft_phi_loss", "dpo": "dpo_loss",
}  # fmt: skip

METRIC_NAMES = {
    "gspo": {"pg_clipfrac", "ppo_kl", "pg_loss", "ppo_kl_seq"},
    "cispo": {"cispo_loss", "ppo_kl", "unmasked_frac"},
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


@pytest.mark.parametrize("key, overrides, loss, metrics", REFERENCE)
def test_reference_values(policy_data, key, overrides, loss, metrics):
    value, got = build(key, **overrides)(**policy_data)
    assert value.dim() == 0 and value.requires_grad is False  # §14.1 data holds plain tensors
    assert value.item() == pytest.approx(loss, abs=1e-6)
    assert set(got) == METRIC_NAMES[key]
    assert all(type(v) is float for v in got.values())
    assert got[LOSS_METRIC[key]] == pytest.approx(loss, abs=1e-6)
    for name, expected in metrics.items():
        assert got[name] == pytest.approx(expected, abs=1e-6), name


def test_default_args_match_spec():
    assert POLICY_LOSS_FN.get("gspo").default_args() == {
        "clip_range_low": 0.0003, "clip_range_high": 0.0004, "loss_agg_mode": "seq-mean-token-mean"
    }  # fmt: skip
    assert POLICY_LOSS_FN.get("cispo").default_args() == {
        "clip_range_low": 1.0, "clip_range_high": 0.28, "enable_mask_clip": False,
        "mask_clip_range_low": 1.0, "mask_clip_range_high": 0.28, "loss_agg_mode": "token-mean",
    }  # fmt: skip
    assert POLICY_LOSS_FN.get("sapo").default_args() == {"tau_pos": 1.0, "tau_neg": 1.05, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("topr").default_args() == {"advantage_threshold": 0.0, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("sppo").default_args() == {"epsilon": 0.3, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("opmd").default_args() == {"tau": 1.0, "loss_agg_mode": "token-mean"}
    assert POLICY_LOSS_FN.get("sft_phi").default_args() == {"loss_agg_mode": "token-mean", "cutoff_prob": 1.0}
    assert POLICY_LOSS_FN.get("dpo").default_args() == {"beta": 0.1, "label_smoothing": 0.0}
    for key in ("importance_sampling", "sft", "sft_is"):
        assert POLICY_LOSS_FN.get(key).default_args() == {"loss_agg_mode": "token-mean"}


def test_constructor_defaults_equal_default_args_except_gspo(policy_data):
    four_rows = {k: v[:4] for k, v in policy_data.items()}  # DPO needs whole pairs
    for key in MY_KEYS:
        if key == "gspo":
            continue
        cls = POLICY_LOSS_FN.get(key)
        assert cls()(**four_rows)[0].item() == build(key)(**four_rows)[0].item(), key
    # GSPO's constructor has no clip range at all (spec §2)
    with pytest.raises(ValueError, match="clip range is unresolved"):
        POLICY_LOSS_FN.get("gspo")()
    assert POLICY_LOSS_FN.get("gspo")(clip_range=0.2).clip_range_low == 0.2


def test_gspo_warns_only_for_other_modes(caplog):
    with caplog.at_level(logging.WARNING):
        build("gspo")
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        build("gspo", loss_agg_mode="token-mean")
    assert "token-mean" in caplog.text and "seq-mean-token-mean" in caplog.text


# ---------------------------------------------------------------- inputs and naming


INPUTS = {
    "opmd": ("action_mask", "advantages"),
    "sft": ("action_mask",),
    "sft_is": ("action_mask",),
    "sft_phi": ("action_mask",),
    "dpo": ("ref_logprob", "action_mask"),
}


@pytest.mark.parametrize("key", MY_KEYS)
def test_inputs_and_select_keys(key):
    cls = POLICY_LOSS_FN.get(key)
    expected = INPUTS.get(key, ("old_logprob", "action_mask", "advantages"))
    assert tuple(cls.inputs) == expected
    trl_names = {
        "old_logprob": "old_per_token_logps", "ref_logprob": "ref_per_token_logps", "action_mask": "completion_mask"
    }  # fmt: skip
    verl_names = {"old_logprob": "old_log_probs", "ref_logprob": "ref_log_prob", "action_mask": "response_mask"}
    assert build(key, backend="trl").select_keys == [trl_names.get(k, k) for k in expected]
    assert build(key, backend="verl").select_keys == [verl_names.get(k, k) for k in expected]


@pytest.mark.parametrize("key", MY_KEYS)
def test_verl_and_trl_names_give_the_same_result(policy_data, key):
    fn = build(key, allow_odd_rows=True) if key == "dpo" else build(key)
    d = policy_data
    internal = fn(**d)
    verl = fn(
        log_prob=d["logprob"], old_log_probs=d["old_logprob"], ref_log_prob=d["ref_logprob"],
        response_mask=d["action_mask"], advantages=d["advantages"], unrelated_key=object(),
    )  # fmt: skip
    trl = fn(
        per_token_logps=d["logprob"], old_per_token_logps=d["old_logprob"], ref_per_token_logps=d["ref_logprob"],
        completion_mask=d["action_mask"], advantages=d["advantages"], prompt_ids=torch.zeros(5, 3), num_items=7,
    )  # fmt: skip
    for other in (verl, trl):
        assert other[0].item() == internal[0].item()
        assert other[1] == internal[1]


@pytest.mark.parametrize("key", ["gspo", "cispo", "sapo", "topr", "sppo", "importance_sampling", "opmd"])
def test_sequence_advantages_are_broadcast(policy_data, key):
    seq_adv = torch.linspace(-1.0, 1.0, 5)
    fn = build(key)
    a = fn(**{**policy_data, "advantages": seq_adv})
    b = fn(**{**policy_data, "advantages": seq_adv[:, None].expand(5, 20).clone()})
    assert a[0].item() == pytest.approx(b[0].item(), abs=1e-7)


# ---------------------------------------------------------------- gradients


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


# Losses whose gradient is the true derivative of their value (no stop-gradient inside).
# sft_is / sft_phi weight ℓ by a detached function of ℓ itself, which no finite difference can
# hold fixed: their gradients are checked analytically below.
EXACT_GRADIENT_CASES = [
    ("sapo", {"form": "paper", "loss_agg_mode": "seq-mean-token-mean"}),
    ("sppo", {}),
    ("importance_sampling", {}),
    ("opmd", {"tau": 0.5}),
    ("sft", {"loss_agg_mode": "seq-mean-token-sum-norm"}),
    ("dpo", {"label_smoothing": 0.1}),
]


@pytest.mark.parametrize("key, overrides", EXACT_GRADIENT_CASES)
def test_gradcheck(key, overrides):
    data = small_data()
    fn = build(key, **overrides)
    if key == "sppo":
        _assert_off_edges(torch.exp(data["logprob"] - data["old_logprob"]), [1 / 1.3, 1.3])
    logprob = data.pop("logprob").clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,), eps=1e-6, atol=1e-6)


# Losses that multiply ℓ by a detached weight of the ratio r = exp(ℓ − ℓo). Their gradient is the
# derivative of the loss with that weight held fixed; moving ℓo together with ℓ keeps r, hence the
# weight, fixed, so a finite difference along that path checks exactly the surrogate gradient.
DETACHED_RATIO_WEIGHT_CASES = [
    ("cispo", {}),
    ("cispo", {"enable_mask_clip": True, "mask_clip_range_low": 0.2, "mask_clip_range_high": 0.2}),
    ("sapo", {}),
    ("sapo", {"tau_neg": 2.0, "loss_agg_mode": "seq-mean-token-sum"}),
    ("topr", {"advantage_threshold": 0.2}),
]


@pytest.mark.parametrize("key, overrides", DETACHED_RATIO_WEIGHT_CASES)
def test_gradcheck_with_ratio_weight_held_fixed(key, overrides):
    data = small_data()
    fn = build(key, **overrides)
    log_ratio = data["logprob"] - data.pop("old_logprob")
    logprob = data.pop("logprob").clone().requires_grad_(True)

    def loss(lp):
        return fn(logprob=lp, old_logprob=lp.detach() - log_ratio, **data)[0]

    assert torch.autograd.gradcheck(loss, (logprob,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_gradcheck_with_sequence_advantages(loss_agg_mode):
    """With one advantage per row, the token-form gradient ``s·∇ℓ`` is the true derivative (§15.5)."""
    data = small_data()
    data["advantages"] = torch.tensor([0.7, -0.4, 0.9, -0.8], dtype=torch.float64)
    fn = build("gspo", clip_range_low=0.05, clip_range_high=0.05, loss_agg_mode=loss_agg_mode)
    mask = data["action_mask"]
    seq_ratio = torch.exp(((data["logprob"] - data["old_logprob"]) * mask).sum(-1) / mask.sum(-1))
    _assert_off_edges(seq_ratio, [0.95, 1.05])
    logprob = data.pop("logprob").clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,), eps=1e-6, atol=1e-6)
    (grad,) = torch.autograd.grad(fn(logprob=logprob, **data)[0], logprob)
    assert (grad != 0).any()  # not vacuous: some rows are unclipped


def _grad(fn, data):
    logprob = data["logprob"].clone().requires_grad_(True)
    loss, _ = fn(**{**data, "logprob": logprob})
    (grad,) = torch.autograd.grad(loss, logprob)
    return grad


def test_cispo_gradient_is_clipped_weight_times_reinforce():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    n = mask.sum()
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    for overrides in ({}, {"clip_range_low": 0.2, "clip_range_high": 0.2, "enable_mask_clip": True,
                           "mask_clip_range_low": 0.1, "mask_clip_range_high": 0.1}):  # fmt: skip
        fn = build("cispo", **overrides)
        w = ratio.clamp(1 - fn.clip_range_low, 1 + fn.clip_range_high)
        keep = torch.ones_like(ratio)
        if fn.enable_mask_clip:
            too_high = (ratio > 1 + fn.mask_clip_range_high) & (adv > 0)
            too_low = (ratio < 1 - fn.mask_clip_range_low) & (adv < 0)
            keep = (~(too_high | too_low)).double()
            assert 0 < keep[mask].sum() < mask.sum()  # the mask really drops some tokens here
        torch.testing.assert_close(_grad(fn, data), -adv * w * keep * mask / n)


def test_sapo_trinity_gradient_is_gate_times_reinforce():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    tau = torch.where(adv > 0, 1.0, 1.05).double()
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    torch.testing.assert_close(_grad(build("sapo"), data), -adv * gate * mask / mask.sum())
    # the paper form differentiates through the gate instead
    sig = torch.sigmoid(tau * (ratio - 1))
    paper = -adv * 4 * sig * (1 - sig) * ratio * mask / mask.sum()
    torch.testing.assert_close(_grad(build("sapo", form="paper"), data), paper)


def test_sapo_on_policy_gradient_is_two_over_tau_times_the_paper_form():
    """§15.4: at r = 1 Trinity's gradient is (2/τ)·(−A·∇ℓ) and the paper's is −A·∇ℓ."""
    data = small_data()
    data["old_logprob"] = data["logprob"].clone()
    mask, adv = data["action_mask"], data["advantages"]
    tau = torch.where(adv > 0, 1.0, 1.05).double()
    reinforce = -adv * mask / mask.sum()
    torch.testing.assert_close(_grad(build("sapo", form="paper"), data), reinforce)
    torch.testing.assert_close(_grad(build("sapo"), data), (2 / tau) * reinforce)


def test_sppo_gradient_is_reinforce_in_range_and_zero_outside():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    fn = build("sppo", epsilon=0.2)
    inside = (ratio >= 1 / 1.2) & (ratio <= 1.2)
    assert inside[mask].any() and (~inside[mask]).any()
    expected = torch.where(inside & mask, -adv / mask.sum(), torch.zeros_like(adv))
    torch.testing.assert_close(_grad(fn, data), expected)


def test_sppo_range_is_inclusive():
    eps = 0.25
    logprob = torch.zeros(1, 3, dtype=torch.float64)
    # ratios exactly 1/(1+ε), 1+ε and just outside 1+ε
    old = -torch.log(torch.tensor([[1 / (1 + eps), 1 + eps, 1 + eps + 1e-3]], dtype=torch.float64))
    _, metrics = build("sppo", epsilon=eps)(
        logprob=logprob, old_logprob=old, advantages=torch.ones(1, 3, dtype=torch.float64),
        action_mask=torch.ones(1, 3, dtype=torch.bool),
    )  # fmt: skip
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 3)


def test_sft_phi_gradient_is_zero_above_cutoff():
    data = small_data()
    mask = data["action_mask"]
    cutoff = 0.4
    p = torch.exp(data["logprob"])
    above = p > cutoff
    assert above[mask].any() and (~above[mask]).any()
    expected = torch.where(above | ~mask, torch.zeros_like(p), -phi_function(p) / mask.sum())
    torch.testing.assert_close(_grad(build("sft_phi", cutoff_prob=cutoff), data), expected)


def test_simple_reinforce_gradients():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    n = mask.sum()
    ratio = torch.exp(data["logprob"] - data["old_logprob"])
    p = torch.exp(data["logprob"])
    alpha = torch.where(adv <= 0, ratio.clamp(max=1.0), torch.ones_like(ratio))
    torch.testing.assert_close(_grad(build("topr"), data), -alpha * adv * mask / n)
    torch.testing.assert_close(_grad(build("importance_sampling"), data), -adv * ratio * mask / n)
    torch.testing.assert_close(_grad(build("opmd", tau=0.5), data), -adv * mask / n / 1.5)
    torch.testing.assert_close(_grad(build("sft"), data), -mask.double() / n)
    torch.testing.assert_close(_grad(build("sft_is"), data), -p * mask / n)


def test_gspo_gradient_is_sequence_ratio_per_token():
    data = small_data()
    mask, adv = data["action_mask"], data["advantages"]
    n_row = mask.sum(-1, keepdim=True)
    seq_ratio = torch.exp(((data["logprob"] - data["old_logprob"]) * mask).sum(-1, keepdim=True) / n_row)
    fn = build("gspo", clip_range_low=0.05, clip_range_high=0.05)
    clipped = ((seq_ratio > 1.05) & (adv > 0)) | ((seq_ratio < 0.95) & (adv < 0))
    assert clipped[mask].any() and (~clipped[mask]).any()
    expected = torch.where(clipped | ~mask, torch.zeros_like(adv), -adv * seq_ratio / (n_row * mask.shape[0]))
    torch.testing.assert_close(_grad(fn, data), expected)


def test_dpo_gradient():
    data = small_data()
    mask = data["action_mask"]
    beta = 0.3
    log_ratio = ((data["logprob"] - data["ref_logprob"]) * mask).sum(-1)
    h = log_ratio[0::2].sum() - log_ratio[1::2].sum()
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)[:, None]
    expected = -beta * torch.sigmoid(-beta * h) * sign * mask
    torch.testing.assert_close(_grad(build("dpo", beta=beta), data), expected)


def test_dpo_single_pair_equals_textbook_dpo():
    data = small_data(batch=2)
    beta, ls = 0.2, 0.1
    loss, metrics = build("dpo", beta=beta, label_smoothing=ls)(**data)
    mask = data["action_mask"]
    rewards = beta * ((data["logprob"] - data["ref_logprob"]) * mask).sum(-1)
    margin = rewards[0] - rewards[1]
    expected = -(1 - ls) * torch.nn.functional.logsigmoid(margin) - ls * torch.nn.functional.logsigmoid(-margin)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert metrics["chosen_reward"] == pytest.approx(rewards[0].item(), abs=1e-12)
    assert metrics["accuracy_mean"] == float(margin > 0)


@pytest.mark.parametrize("key", MY_KEYS)
def test_nan_in_padding_leaks_nowhere(key):
    data = small_data()
    pad = ~data["action_mask"]
    for name in ("logprob", "old_logprob", "ref_logprob", "advantages"):
        data[name] = data[name].masked_fill(pad, float("nan"))
    fn = build(key, clip_range_low=0.2, clip_range_high=0.2) if key == "gspo" else build(key)
    logprob = data.pop("logprob").requires_grad_(True)
    loss, metrics = fn(logprob=logprob, **data)
    (grad,) = torch.autograd.grad(loss, logprob)
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    assert torch.isfinite(grad).all() and (grad[pad] == 0).all()


# ---------------------------------------------------------------- bad arguments


BAD_ARGS = [
    ("gspo", {"loss_agg_mode": "mean"}, "Unknown loss_agg_mode 'mean'"),
    ("gspo", {"clip_range_low": None}, "unresolved"),
    ("gspo", {"clip_range_high": -0.1}, "must be >= 0"),
    ("cispo", {"loss_agg_mode": "sum"}, "allowed: token-mean"),
    ("cispo", {"clip_range_low": 1.5}, r"clip_range_low must be in \[0, 1.0\], got 1.5"),
    ("cispo", {"clip_range_high": -0.8}, "clip_range_high must be >= 0, got -0.8"),
    ("cispo", {"mask_clip_range_low": -0.1}, "mask_clip_range_low"),
    ("cispo", {"mask_clip_range_high": -1.0}, "mask_clip_range_high"),
    ("sapo", {"tau_neg": 0.5}, "tau_neg must be >= tau_pos, got tau_neg=0.5 < tau_pos=1.0"),
    ("sapo", {"tau_pos": 0.0}, "must be > 0"),
    ("sapo", {"tau_pos": -2.0, "tau_neg": -1.0}, "must be > 0"),
    ("sapo", {"form": "trl"}, "unknown form 'trl'; allowed: trinity, paper"),
    ("sapo", {"loss_agg_mode": "token-sum"}, "Unknown loss_agg_mode"),
    ("topr", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("sppo", {"epsilon": 0.0}, "epsilon must be > 0, got 0.0"),
    ("sppo", {"epsilon": -0.3}, "epsilon must be > 0"),
    ("importance_sampling", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("opmd", {"tau": -0.5}, "tau must be a finite number >= 0, got -0.5"),
    ("opmd", {"tau": float("nan")}, "tau must be"),
    ("opmd", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("sft", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("sft_is", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("sft_phi", {"cutoff_prob": 0.0}, r"cutoff_prob must be in \(0, 1\], got 0.0"),
    ("sft_phi", {"cutoff_prob": 1.2}, "cutoff_prob must be in"),
    ("sft_phi", {"loss_agg_mode": "x"}, "Unknown loss_agg_mode"),
    ("dpo", {"beta": 0.0}, "beta must be > 0, got 0.0"),
    ("dpo", {"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\), got 0.5"),
    ("dpo", {"label_smoothing": -0.1}, "label_smoothing must be in"),
]


@pytest.mark.parametrize("key, overrides, message", BAD_ARGS)
def test_bad_arguments(key, overrides, message):
    with pytest.raises(ValueError, match=message):
        build(key, **overrides)


@pytest.mark.parametrize("key", MY_KEYS)
def test_unknown_backend(key):
    with pytest.raises(ValueError, match="Unknown backend 'torch'"):
        build(key, backend="torch")


@pytest.mark.parametrize("rows", [0, 1, 3, 5])
def test_dpo_rejects_unpaired_rows(rows):
    data = small_data(batch=max(rows, 1))
    data = {k: v[:rows] for k, v in data.items()}
    with pytest.raises(ValueError, match=f"even number .* of rows.*got {rows}"):
        build("dpo")(**data)
    if rows >= 3:  # the reference behaviour, on request
        build("dpo", allow_odd_rows=True)(**data)
