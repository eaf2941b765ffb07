"""REC, MIX and CHORD policy losses: spec §14.1 numbers, gradients, masks, empty subsets, bad args."""

from __future__ import annotations

import math

import pytest
import torch

from trinity_trl.algorithms import POLICY_LOSS_FN, mu_schedule_function

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


def check(result, loss, metrics):
    value, got = result
    assert value.item() == pytest.approx(loss, abs=1e-6)
    for name, expected in metrics.items():
        assert got[name] == pytest.approx(expected, abs=1e-6), name


def as_double(data):
    return {k: v.double() if v.is_floating_point() else v for k, v in data.items()}


# ---------------------------------------------------------------- REC


@pytest.mark.parametrize(
    "overrides, loss, clipfrac",
    [
        (dict(clip_mode="none"), -0.019179895520210266, 0.0),
        (dict(clip_mode="one-side"), 0.05164290592074394, 0.3541666567325592),
        (dict(clip_mode="two-side"), 0.0011463171103969216, 0.625),
        (dict(clip_mode="ring"), 0.025809258222579956, 0.5625),
        (dict(clip_mode="gspo-one-side"), -0.01192514505237341, 0.3333333432674408),
        (dict(clip_mode="one-side", weight="importance_sampling"), 0.12062031775712967, None),
        (dict(clip_mode="gspo-one-side", weight="gspo_importance_sampling"), -0.0010820552706718445, None),
        (dict(weight="advantage", temp=0.5), -0.025423159822821617, None),
        (dict(regularizer="k2", regularizer_coef=0.1), 0.037831660360097885, None),
        (dict(regularizer="forward-kl", regularizer_coef=0.1), -0.02674008347094059, None),
    ],
)
def test_rec_reference_values(policy_data, overrides, loss, clipfrac):
    metrics = {"pg_loss": loss} if clipfrac is None else {"pg_loss": loss, "pg_clipfrac": clipfrac}
    check(build("rec", **overrides)(**policy_data), loss, metrics)


def test_rec_default_args_differ_from_constructor():
    cls = POLICY_LOSS_FN.get("rec")
    assert (cls().epsilon_low_prime, cls().epsilon_high_prime) == (0.4, 0.4)
    assert (cls.default_args()["epsilon_low_prime"], cls.default_args()["epsilon_high_prime"]) == (0.6, 2)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(clip_mode="two-side", regularizer="k2", regularizer_coef=0.3),
        dict(clip_mode="ring", weight="advantage", temp=0.7),
        dict(clip_mode="gspo-one-side", regularizer="forward-kl", regularizer_coef=0.2),
        dict(clip_mode="one-side", loss_agg_mode="seq-mean-token-sum"),
    ],
)
def test_rec_gradcheck(policy_data, overrides):
    data = as_double(policy_data)
    fn = build("rec", **overrides)
    logprob = data.pop("logprob").requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,))


def test_rec_detached_weights_scale_the_reinforce_gradient(policy_data):
    """IS weights and the fix_opd correction are data: the gradient is −A'·in·m/N, not d(A'·ℓ)."""
    data = dict(policy_data)
    logprob = data.pop("logprob").requires_grad_(True)
    mask = data["action_mask"].float()
    ratio = torch.exp(logprob.detach() - data["old_logprob"])
    adv = data["advantages"]
    build("rec", weight="importance_sampling", fix_opd_advantage=True)(logprob=logprob, **data)[0].backward()
    expected = -(adv * ratio + data["old_logprob"] - logprob.detach()) * mask / mask.sum()
    torch.testing.assert_close(logprob.grad, expected)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(epsilon_low=0.0),
        dict(epsilon_low=1.5),
        dict(epsilon_high=0.0),
        dict(epsilon_low_prime=0.0),
        dict(epsilon_low_prime=1.1),
        dict(epsilon_high_prime=-1.0),
        dict(clip_mode="both"),
        dict(weight="is"),
        dict(regularizer="kl"),
        dict(regularizer_coef=-0.1),
        dict(temp=0.0),
        dict(loss_agg_mode="mean"),
        dict(weight="gspo_importance_sampling", clip_mode="one-side"),
    ],
)
def test_rec_rejects_bad_args(overrides):
    with pytest.raises(ValueError):
        build("rec", **overrides)


def test_rec_error_names_allowed_values():
    with pytest.raises(ValueError, match="ring"):
        build("rec", clip_mode="bad")


# ---------------------------------------------------------------- MIX


MIX_CASES = [
    (
        {},
        0.6298247575759888,
        {
            "usual/pg_clipfrac": 0.7777777910232544,
            "usual/pg_clipfrac_lower": 0.2222222238779068,
            "usual/ppo_kl": -1.0737695693969727,
            "usual/pg_loss": 0.6921210885047913,
            "expert/sft_loss": 0.06915830634534359,
        },
    ),
    (DYN, 0.16264307498931885, {"usual/pg_loss": 0.17303027212619781, "expert/sft_loss": 0.06915830634534359}),
    (
        {**DYN, "use_dynamic_bsz": False},
        0.8132153749465942,
        {"usual/pg_loss": 0.8651513606309891, "expert/sft_loss": 0.34579153172671795},
    ),
]


@pytest.mark.parametrize("overrides, loss, metrics", MIX_CASES)
def test_mix_reference_values(policy_data, overrides, loss, metrics):
    check(build("mix", **overrides)(**policy_data), loss, {**metrics, "loss": loss})


def test_mix_derived_values_and_inner_modes():
    fn = build("mix", **DYN)
    assert (fn.experience_per_gpu, fn.gradient_accumulation) == (80, 80)
    assert (fn.train_batch_size_usual, fn.train_batch_size_expert) == (64, 16)
    assert fn.grpo_loss_fn.loss_agg_mode == fn.sft_loss_fn.loss_agg_mode == "token-mean"
    fn = build("mix", loss_agg_mode="seq-mean-token-sum", sft_loss_agg_mode="seq-mean-token-mean")
    assert fn.grpo_loss_fn.loss_agg_mode == "seq-mean-token-sum"
    assert fn.sft_loss_fn.loss_agg_mode == "seq-mean-token-mean"
    assert fn.grpo_loss_fn.clip_ratio_c == 3.0 and not fn.grpo_loss_fn.enable_sequence_masking


def test_mix_select_keys_and_sequence_advantages(policy_data):
    assert build("mix").select_keys == ["old_per_token_logps", "completion_mask", "advantages", "expert_mask"]
    data = dict(policy_data)
    per_row = data["advantages"][:, 0].clone()
    data["advantages"] = per_row
    expanded = dict(policy_data, advantages=per_row[:, None].expand(5, 20))
    assert build("mix")(**data)[0].item() == build("mix")(**expanded)[0].item()


def test_mix_gradcheck(policy_data):
    data = as_double(policy_data)
    fn = build("mix", **DYN)
    logprob = data.pop("logprob").requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, **data)[0], (logprob,))


@pytest.mark.parametrize("key", ["mix", "mix_chord"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("all_expert", [False, True])
def test_empty_subset_guard(policy_data, key, mode, all_expert):
    data = dict(policy_data, expert_mask=torch.full((5,), all_expert), step=[3] * 5)
    logprob = data.pop("logprob").requires_grad_(True)
    fn = build(key, loss_agg_mode=mode)
    loss, metrics = fn(logprob=logprob, **data)
    absent, present = ("usual/", "expert/") if all_expert else ("expert/", "usual/")
    assert not any(k.startswith(absent) for k in metrics)
    assert any(k.startswith(present) for k in metrics)
    mu = 0.1
    inner = fn.sft_loss_fn if all_expert else fn.grpo_loss_fn
    inner_loss = inner(logprob=logprob.detach(), **{k: v for k, v in data.items() if k != "expert_mask"})[0]
    expected = (mu if all_expert else 1 - mu) * 5 * inner_loss.item()
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    assert torch.isfinite(logprob.grad).all()


def test_expert_mask_must_have_one_entry_per_row(policy_data):
    with pytest.raises(ValueError, match="expert_mask"):
        build("mix")(**dict(policy_data, expert_mask=torch.tensor([True, False])))
    with pytest.raises(ValueError, match="expert_mask"):
        build("mix_chord")(**dict(policy_data, expert_mask=[True] * 6, step=[0] * 5))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(clip_range=None),
        dict(loss_agg_mode="mean"),
        dict(sft_loss_agg_mode="mean"),
        dict(grpo_loss_agg_mode="mean"),
        dict(mu=1.5),
        dict(ngpus_trainer=0),
        dict(train_batch_size_usual=2, ngpus_trainer=4),
        dict(train_batch_size_expert=0),
        dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4),
        dict(use_dynamic_bsz=True, ppo_mini_batch_size=2, ngpus_trainer=4, train_batch_size_usual=4, train_batch_size_expert=4),
    ],
)
def test_mix_rejects_bad_args(overrides):
    with pytest.raises(ValueError):
        build("mix", **overrides)


# ---------------------------------------------------------------- CHORD


def test_mu_schedule_boundaries():
    assert mu_schedule_function(10, 10, 20, 0.7, 0.1) == 0.7
    assert mu_schedule_function(30, 10, 20, 0.7, 0.1) == 0.1
    assert mu_schedule_function(99, 10, 20, 0.7, 0.1) == 0.1
    assert mu_schedule_function(0, 0, 0, 0.7, 0.1) == 0.1
    assert mu_schedule_function(5, 0, 0, 0.7, 0.1) == 0.1
    assert mu_schedule_function(0, 10, 20, 0.7, 0.1) == 0.0
    assert mu_schedule_function(4, 10, 20, 0.7, 0.1) == pytest.approx(0.28, abs=1e-12)
    assert mu_schedule_function(20, 10, 20, 0.7, 0.1) == pytest.approx(0.4, abs=1e-12)
    assert mu_schedule_function(10, 10, 0, 0.7, 0.1) == 0.1


CHORD_CASES = [
    ({}, 0, 0.7818535566329956, {"expert/sft_phi_loss": 1.5894461274147034, "mu": 0.1}),
    *[
        (SCHEDULE, step, loss, {"mu": mu})
        for step, loss, mu in [
            (0, 0.6921210885047913, 0.0),
            (100, 0.9164523482322693, 0.25),
            (200, 1.1407835483551025, 0.5),
            (300, 1.0777066946029663, 0.42970562748477137),
            (400, 0.9254255294799805, 0.26),
            (600, 0.710067629814148, 0.02),
            (700, 0.710067629814148, 0.02),
        ]
    ],
    (
        dict(enable_phi_function=False, mu_warmup_steps=0, mu_decay_steps=200, mu_peak=0.9, mu_valley=0.05),
        50,
        0.20900075137615204,
        {"mu": 0.7755203820042827, "expert/sft_loss": 0.06915830634534359},
    ),
    (DYN, 0, 0.3146718442440033, {"usual/pg_loss": 0.17303027212619781, "expert/sft_phi_loss": 1.5894461274147034}),
]


@pytest.mark.parametrize("overrides, step, loss, metrics", CHORD_CASES)
def test_chord_reference_values(policy_data, overrides, step, loss, metrics):
    check(build("mix_chord", **overrides)(**policy_data, step=torch.full((5,), step)), loss, {**metrics, "loss": loss})


def test_chord_step_as_list_and_keys(policy_data):
    fn = build("mix_chord", **SCHEDULE)
    assert fn(**policy_data, step=[300] * 5)[1]["mu"] == pytest.approx(0.42970562748477137, abs=1e-12)
    assert fn.select_keys == ["old_per_token_logps", "completion_mask", "advantages", "expert_mask", "step"]
    assert type(build("mix_chord").sft_loss_fn) is POLICY_LOSS_FN.get("sft_phi")
    assert type(build("mix_chord", enable_phi_function=False).sft_loss_fn) is POLICY_LOSS_FN.get("sft")


@pytest.mark.parametrize("step", [[1, 1, 2, 1, 1], [1] * 4, torch.ones(5, 1, dtype=torch.int32), 3])
def test_chord_rejects_bad_step(policy_data, step):
    with pytest.raises(ValueError, match="step"):
        build("mix_chord")(**policy_data, step=step)


def test_chord_needs_step(policy_data):
    with pytest.raises(ValueError, match="step"):
        build("mix_chord")(**policy_data)


@pytest.mark.parametrize(
    "overrides", [dict(mu_peak=1.5), dict(mu_valley=-0.1), dict(mu_warmup_steps=-1), dict(clip_range=None)]
)
def test_chord_rejects_bad_args(overrides):
    with pytest.raises(ValueError):
        build("mix_chord", **overrides)


def test_chord_gradcheck(policy_data):
    # φ off: φ's detached weight would make the finite-difference gradient differ on purpose
    data = as_double(policy_data)
    fn = build("mix_chord", enable_phi_function=False, **SCHEDULE)
    logprob = data.pop("logprob").requires_grad_(True)
    assert torch.autograd.gradcheck(lambda lp: fn(logprob=lp, step=[300] * 5, **data)[0], (logprob,))


def test_chord_phi_gradient_on_expert_rows(policy_data):
    data = dict(policy_data)
    logprob = data.pop("logprob").requires_grad_(True)
    build("mix_chord")(logprob=logprob, step=[0] * 5, **data)[0].backward()
    expert, mask = data["expert_mask"], data["action_mask"].float()
    p = torch.exp(logprob.detach())
    # μ · n_e·w_e · (−φ(p)·m / Σ m over expert rows)
    expected = 0.1 * 3 * (-p * (1 - p) * mask)[expert] / mask[expert].sum()
    torch.testing.assert_close(logprob.grad[expert], expected)


# ---------------------------------------------------------------- masks and NaN safety


CASES = [
    ("rec", dict(clip_mode="ring", weight="truncated_importance_sampling", regularizer="k2", regularizer_coef=0.1), {}),
    ("rec", dict(clip_mode="gspo-one-side", weight="gspo_importance_sampling", fix_opd_advantage=True), {}),
    ("mix", {}, {}),
    ("mix_chord", SCHEDULE, {"step": [300] * 5}),
]


@pytest.mark.parametrize("key, overrides, extra", CASES)
def test_nan_in_masked_positions_is_ignored(policy_data, key, overrides, extra):
    fn = build(key, **overrides)
    pad = ~policy_data["action_mask"]

    def run(data):
        data = dict(data, **extra)
        logprob = data.pop("logprob").clone().requires_grad_(True)
        loss, metrics = fn(logprob=logprob, **data)
        loss.backward()
        return loss, metrics, logprob.grad

    dirty = dict(policy_data)
    for name, bad in (("logprob", math.nan), ("old_logprob", math.inf), ("advantages", math.nan)):
        dirty[name] = policy_data[name].masked_fill(pad, bad)
    clean_loss, clean_metrics, clean_grad = run(policy_data)
    loss, metrics, grad = run(dirty)
    assert loss.item() == pytest.approx(clean_loss.item(), abs=1e-7)
    assert metrics == pytest.approx(clean_metrics, abs=1e-7)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad, clean_grad)


@pytest.mark.parametrize("key, overrides, extra", CASES)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_all_zero_mask_gives_zero(policy_data, key, overrides, extra, mode):
    data = dict(policy_data, action_mask=torch.zeros(5, 20, dtype=torch.bool), **extra)
    loss, metrics = build(key, **{**overrides, "loss_agg_mode": mode})(**data)
    assert loss.item() == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
