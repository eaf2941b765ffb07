"""M2PO policy loss (docs/algorithms/policy-losses.md#m2po): the reference case of
docs/algorithms/reference-values.md#m2po (value, gradient, metrics), ties, the trust region, an all-masked batch, the
straight-through clamp, the whole-step mask against the mask of each micro-batch, the paper's loop, bad arguments."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms import ALGORITHM_TYPE, POLICY_LOSS_FN, resolve_algorithm_config
from trinity_trl.algorithms.policy_loss import second_moment_keep

from ..support import MEAN_EPSILON, build


def _call(log_ratio, advantages, mask=None, dtype=torch.float64, **overrides):
    """The loss, its gradient with respect to the current log-probs and the metrics, the behaviour log-probs 0."""
    log_ratio = torch.tensor([log_ratio], dtype=dtype) if not isinstance(log_ratio, torch.Tensor) else log_ratio
    logprob = log_ratio.clone().requires_grad_(True)
    advantages = torch.as_tensor([advantages] if not isinstance(advantages, torch.Tensor) else advantages, dtype=dtype)
    mask = torch.ones_like(log_ratio, dtype=torch.bool) if mask is None else torch.as_tensor(mask)
    inputs = {"old_logprob": torch.zeros_like(log_ratio), "action_mask": mask, "advantages": advantages}
    step_mask = overrides.pop("step_mask", None)
    if step_mask is not None:
        inputs["step_mask"] = step_mask
    loss, metrics = build("m2po", **overrides)(logprob=logprob, **inputs)
    (grad,) = torch.autograd.grad(loss, logprob)
    return loss.detach(), grad, metrics


# ------------------------------------------------------------------------------------------------ the reference case
def test_reference_case_value_gradient_and_metrics():
    """Advantages [+1, +1, +1, -1], log-ratios [0.1, 0.3, 0.5, -0.2], all trained, threshold 0.04: every token is in
    the trust region, M2 [0.01, 0.09, 0.25, 0.04] has mean 0.0975; sorted, the running means 0.01, 0.025, 0.0467,
    0.0975 keep two tokens (0.1 and -0.2) and mask 0.3 and 0.5. The loss divides by all 4 tokens."""
    loss, grad, metrics = _call([0.1, 0.3, 0.5, -0.2], [1.0, 1.0, 1.0, -1.0])
    expected = (-math.exp(0.1) + math.exp(-0.2)) / 4
    assert loss.item() == approx(expected, dtype=torch.float64, terms=4, known_rtol=MEAN_EPSILON)
    assert loss.item() == pytest.approx(-0.071610, abs=1e-6)  # as the reference prints it
    assert_close(
        grad,
        torch.tensor([[-math.exp(0.1) / 4, 0.0, 0.0, math.exp(-0.2) / 4]], dtype=torch.float64),
        known_rtol=MEAN_EPSILON,
    )
    printed = torch.tensor([[-0.276293, 0.0, 0.0, 0.204683]], dtype=torch.float64)
    assert (grad - printed).abs().max() <= 0.5e-6  # the reference's six decimals
    assert metrics["pg_loss"] == loss.item()
    assert metrics["m2po/m2_before"] == approx(0.0975, terms=4)  # float32 second moments
    assert metrics["m2po/m2_after"] == approx(0.025, terms=2)
    assert metrics["m2po/masked_fraction"] == approx(0.5, known_rtol=MEAN_EPSILON)
    assert metrics["m2po/trust_region_fraction"] == approx(1.0, known_rtol=MEAN_EPSILON)


def test_reference_case_under_trinitys_input_name():
    """Trinity-RFT's name of the mask input (``m2po_mask``) is this loss's ``step_mask``."""
    keep = torch.tensor([[True, False, False, True]])
    ours = _call([0.1, 0.3, 0.5, -0.2], [1.0, 1.0, 1.0, -1.0], step_mask=keep)
    logprob = torch.tensor([[0.1, 0.3, 0.5, -0.2]], dtype=torch.float64)
    trinity, _ = build("m2po")(
        log_prob=logprob,
        old_log_probs=torch.zeros_like(logprob),
        response_mask=torch.ones(1, 4, dtype=torch.bool),
        advantages=torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float64),
        m2po_mask=keep,
    )
    assert trinity.item() == ours[0].item()


# ------------------------------------------------------------------------------------------------ the mask
def test_ties_keep_the_earlier_token_and_a_running_mean_equal_to_the_threshold():
    """Three tokens share the largest M2 (0.25; 0.5 and 0.25 are exact in binary): sorted stably, the first of them
    in the order joins the token of M2 0.0625, whose running mean (0.0625 + 0.25) / 2 = 0.15625 equals the threshold
    and is kept (at most the threshold); the two later ones are masked."""
    keep = second_moment_keep(
        torch.tensor([0.5, 0.25, 0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0, 1.0]), threshold=0.15625
    )
    assert keep.tolist() == [True, True, False, False]
    # the same tokens in another order: again the earliest of the equal ones is kept
    keep = second_moment_keep(
        torch.tensor([0.25, 0.5, 0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0, 1.0]), threshold=0.15625
    )
    assert keep.tolist() == [True, True, False, False]
    # just below the running mean: only the smallest stays
    keep = second_moment_keep(
        torch.tensor([0.5, 0.25, 0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0, 1.0]), threshold=0.15624
    )
    assert keep.tolist() == [False, True, False, False]


def test_only_the_trust_region_is_masked():
    """Where PPO's clip could not act (advantage and log-ratio of opposite signs, or either 0) a token is kept
    whatever its M2; the trust region is what is masked."""
    log_ratio = torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0, 0.0, 0.1])
    advantages = torch.tensor([-1.0, 1.0, 0.0, -1.0, 1.0, 1.0, 1.0])
    keep = second_moment_keep(log_ratio, advantages, threshold=0.04)
    assert keep.tolist() == [True, True, True, False, False, True, True]


def test_nothing_is_masked_when_the_mean_is_within_the_threshold():
    keep = second_moment_keep(torch.tensor([0.1, 0.15, -0.19]), torch.tensor([1.0, 1.0, -1.0]), threshold=0.04)
    assert keep.all()
    loss, grad, metrics = _call([0.1, 0.15, -0.19], [1.0, 1.0, -1.0])
    assert metrics["m2po/masked_fraction"] == 0.0
    expected = (
        -torch.tensor([[1.0, 1.0, -1.0]]) * torch.exp(torch.tensor([[0.1, 0.15, -0.19]], dtype=torch.float64)) / 3
    )
    assert_close(grad, expected, known_rtol=MEAN_EPSILON)


def paper_loop(log_ratio: torch.Tensor, advantages: torch.Tensor, threshold: float) -> torch.Tensor:
    """The paper's procedure, written independently: while the trust region's mean M2 exceeds the threshold, drop
    its largest M2 (of equal ones, the latest in the order)."""
    m2 = log_ratio.float().square().double()
    trust = ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))
    active = [i for i in range(len(log_ratio)) if trust[i]]
    keep = torch.ones(len(log_ratio), dtype=torch.bool)
    while active and sum(m2[i] for i in active) / len(active) > threshold:
        largest = max(m2[i] for i in active)
        drop = [i for i in active if m2[i] == largest][-1]
        keep[drop] = False
        active.remove(drop)
    return keep


@pytest.mark.parametrize("seed", range(6))
def test_the_sorted_prefix_is_the_papers_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    log_ratio = 0.6 * torch.randn(200, generator=generator)
    log_ratio[::7] = log_ratio[3]  # ties across the cut
    advantages = torch.randn(200, generator=generator).sign() * (torch.rand(200, generator=generator) > 0.1)
    for threshold in (0.0, 0.01, 0.04, 0.2, 10.0):
        keep = second_moment_keep(log_ratio, advantages, threshold)
        assert torch.equal(keep, paper_loop(log_ratio, advantages, threshold)), threshold


# ------------------------------------------------------------------------------------------------ edge cases
def test_an_all_masked_batch_gives_zero_loss_and_gradient():
    """No trained token: 0 and a zero gradient, finite metrics. Every trained token masked (each M2 above the
    threshold, all in the trust region): the loss is 0 over 4 tokens, the gradient 0."""
    loss, grad, metrics = _call([0.1, 0.3], [1.0, -1.0], mask=[[False, False]])
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["m2po/masked_fraction"] == 0.0
    loss, grad, metrics = _call([0.5, 0.6, -0.5, -0.7], [1.0, 2.0, -1.0, -3.0])
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert metrics["m2po/masked_fraction"] == approx(1.0, known_rtol=MEAN_EPSILON)
    assert metrics["m2po/m2_after"] == 0.0


def test_masked_tokens_count_in_the_denominator():
    """One token kept of three trained: the loss is its term over 3, not over 1."""
    loss, _, _ = _call([0.5, 0.01, 0.6], [1.0, 1.0, 1.0], m2_threshold=0.001)
    assert loss.item() == approx(-math.exp(0.01) / 3, dtype=torch.float64, terms=3, known_rtol=MEAN_EPSILON)


def test_the_clamp_is_straight_through():
    """A log-ratio of 25 is clamped to 20 in the value, and its gradient is still -A * exp(20) (not 0)."""
    loss, grad, _ = _call([25.0, 0.0], [-1.0, 1.0], step_mask=torch.ones(1, 2))
    assert loss.item() == approx((math.exp(20.0) - 1.0) / 2, dtype=torch.float64, terms=2, known_rtol=MEAN_EPSILON)
    assert_close(grad, torch.tensor([[math.exp(20.0) / 2, -0.5]], dtype=torch.float64), known_rtol=MEAN_EPSILON)


# ------------------------------------------------------------------------------------------------ the whole step
def _micro_batches():
    """Two micro-batches of one step: the first's trust-region tokens have small M2, the second's large ones."""
    first = torch.tensor([[0.05, 0.1, -0.08, 0.02]], dtype=torch.float64)
    second = torch.tensor([[0.3, 0.25, -0.35, 0.4]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    return [first, second], advantages


def test_the_mask_of_the_whole_step_is_not_the_mask_of_each_micro_batch():
    """Chosen over the step, the first micro-batch's small second moments let the second keep two of its tokens;
    chosen per micro-batch, the second keeps none. Given its part of the step's mask (``step_mask``), each micro-batch
    trains exactly the tokens of the whole step: the two losses, each divided by the step's 8 tokens, add up to the
    loss of the step in one call; per micro-batch they do not."""
    (first, second), advantages = _micro_batches()
    fn = build("m2po")
    step = fn.step_mask(torch.cat([first, second], 1).flatten(), advantages.repeat(1, 2).flatten()).view(2, 4)
    alone = [fn.step_mask(part.flatten(), advantages.flatten()) for part in (first, second)]
    assert step[0].all() and step[1].tolist() == [True, True, False, False]
    assert not alone[1].any()  # the other algorithm: every M2 of the second is above 0.04
    whole, _, _ = _call(torch.cat([first, second], 1), advantages.repeat(1, 2))
    parts = [_call(part, advantages, step_mask=step[i : i + 1])[0] * 4 / 8 for i, part in enumerate((first, second))]
    assert sum(parts).item() == approx(whole.item(), dtype=torch.float64, terms=8, known_rtol=MEAN_EPSILON)
    per_micro_batch = [_call(part, advantages)[0] * 4 / 8 for part in (first, second)]
    assert abs(sum(per_micro_batch).item() - whole.item()) > 0.05


# ------------------------------------------------------------------------------------------------ arguments, preset
BAD_ARGS = [
    (
        {"loss_agg_mode": "seq-mean-token-mean"},
        r"^m2po: loss_agg_mode must be 'token-mean' .*got 'seq-mean-token-mean'$",
    ),
    ({"loss_agg_mode": "sum"}, "allowed: token-mean"),
    ({"m2_threshold": -0.01}, r"^m2po: m2_threshold must be a finite number >= 0, got -0.01$"),
    ({"m2_threshold": float("nan")}, "m2_threshold must be a finite number"),
    ({"log_ratio_clip": 0.0}, r"^m2po: log_ratio_clip must be a finite number > 0, got 0.0$"),
    ({"log_ratio_clip": float("inf")}, "log_ratio_clip must be a finite number"),
]


@pytest.mark.parametrize("overrides, message", BAD_ARGS)
def test_bad_arguments_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message):
        build("m2po", **overrides)


def test_a_step_mask_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"step_mask has shape \(1, 3\), the tokens \(1, 4\)"):
        _call([0.1, 0.3, 0.5, -0.2], [1.0, 1.0, 1.0, -1.0], step_mask=torch.ones(1, 3))


def test_the_preset_is_trinity_rfts_and_the_loss_declares_its_step_mask():
    """Trinity-RFT's ``m2po`` algorithm type: 8 samples a prompt, GRPO advantages, no KL term or penalty, no entropy
    term, no reference model; the global ``loss_agg_mode`` reaches the loss (and only token-mean is taken)."""
    preset = ALGORITHM_TYPE.get("m2po")
    assert not preset.use_reference and preset.paper == "arXiv:2510.01161"
    resolved = resolve_algorithm_config("m2po")
    assert (resolved.repeat_times, resolved.advantage.name, resolved.policy_loss.name) == (8, "grpo", "m2po")
    assert (resolved.kl_loss.name, resolved.kl_penalty.name, resolved.entropy_loss.name) == ("none", "none", "none")
    assert resolved.policy_loss.args == {"m2_threshold": 0.04, "loss_agg_mode": "token-mean", "log_ratio_clip": 20.0}
    assert not resolved.needs_reference
    loss = POLICY_LOSS_FN.get("m2po")()
    assert loss.needs_step_mask and loss.linear_in_advantage and not loss.sequence_level
    assert not any(POLICY_LOSS_FN.get(name).needs_step_mask for name in POLICY_LOSS_FN.names() if name != "m2po")
    with pytest.raises(ValueError, match="loss_agg_mode must be 'token-mean'"):
        resolve_algorithm_config("m2po", loss_agg_mode="seq-mean-token-sum").build_policy_loss()
