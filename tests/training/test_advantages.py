"""`trinity_trl/training/advantages.py`: weighted rewards, RAFT's best-of-group, group operators on the gathered
rewards, and the estimator's batch path (KL penalty, unscored rows, whitening), on tensors; then the same on a
trainer's real batches (the rewards TRL gathered, teacher log-probs, the adaptive KL coefficient).

Expected values are computed by hand from the formulas, or by the library's advantage functions on a layout the
estimator does not use (experiences built here, the scored rows alone).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    TINY_LOGP_SCALE,
    TINY_MODEL_TERMS,
    generate_batch,
    length_reward,
    recording,
    save_tiny_model,
    tiny_conversational_dataset,
    tiny_grpo_kwargs,
)
from tolerance import approx, assert_close

from trinity_trl.algorithms import ADVANTAGE_FN, EID, KL_FN, POLICY_LOSS_FN, Experience
from trinity_trl.algorithms.advantage import scalar_rewards_to_token_level
from trinity_trl.trainers import TrinityConfig, TrinityTrainer
from trinity_trl.training.advantages import (
    AdvantageEstimator,
    AdvantageSources,
    best_of_group,
    group_advantages,
    weighted_rewards,
)

NAN = float("nan")


# ----------------------------------------------------------------------------------------------- weighted_rewards
def test_weighted_rewards_sum_every_scored_function():
    per_func = torch.tensor([[1.0, 2.0], [NAN, 4.0], [3.0, NAN], [NAN, NAN]])
    rewards = weighted_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert rewards[:3].tolist() == [2.0, 2.0, 3.0]  # a function that did not score adds nothing
    assert math.isnan(rewards[3].item())  # no function scored: unscored


def test_weighted_rewards_read_inf_as_not_scored():
    # issue 46 item 6: +-inf (e.g. from a reward model, which no wrapper checks) is "not scored", as NaN is
    inf = float("inf")
    per_func = torch.tensor([[inf, 4.0], [-inf, NAN], [1.0, -inf]])
    rewards = weighted_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert rewards[0].item() == 2.0 and math.isnan(rewards[1].item()) and rewards[2].item() == 1.0


# --------------------------------------------------------------------------------------------------- best_of_group
def test_best_of_group_keeps_each_groups_best():
    rewards = torch.tensor([0.1, 0.9, 0.3, 0.2, 5.0, -1.0, 4.0, 4.5])
    assert best_of_group(rewards, 4).tolist() == [False, True, False, False, True, False, False, False]


def test_best_of_group_keeps_every_tie():
    rewards = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert best_of_group(rewards, 4).tolist() == [False, True, True, False]


def test_best_of_group_keeps_nothing_of_an_all_equal_group():
    rewards = torch.tensor([2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 0.0])
    assert best_of_group(rewards, 4).tolist() == [False] * 4 + [False, True, False, False]


def test_best_of_group_never_keeps_an_unscored_completion():
    rewards = torch.tensor([NAN, 1.0, 0.0, NAN, NAN, NAN, NAN, NAN])
    assert best_of_group(rewards, 4).tolist() == [False, True, False, False] + [False] * 4


def test_best_of_group_judges_the_spread_of_scored_rewards_only():
    """'in groups whose rewards are not all equal': a group whose scored rewards are all equal keeps nothing, as the
    same group without its unscored completion does (unscored completions are left out of group statistics
    everywhere else, e.g. group_advantages)."""
    with_unscored = best_of_group(torch.tensor([NAN, 5.0, 5.0, 5.0]), 4)
    without = best_of_group(torch.tensor([5.0, 5.0, 5.0]), 3)
    assert without.tolist() == [False] * 3
    assert with_unscored.tolist() == [False] * 4


# ------------------------------------------------------------------------------------------------ group_advantages
def library_group_advantages(rewards: list[float], group_size: int, **args) -> dict[int, float]:
    """The library's GRPO on experiences built here (tokens and all), keyed by row; unscored rows left out."""
    experiences = [
        Experience(
            eid=EID(task=row // group_size, run=row % group_size),
            tokens=torch.zeros(2, dtype=torch.long),
            prompt_length=1,
            reward=value,
        )
        for row, value in enumerate(rewards)
        if math.isfinite(value)
    ]
    out, _ = ADVANTAGE_FN.get("grpo")(**args)(experiences)
    return {exp.eid.task * group_size + exp.eid.run: float(exp.advantages[0]) for exp in out}


def test_group_advantages_equal_the_library_and_the_formula():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0])
    advantages, kept, _, metrics = group_advantages(ADVANTAGE_FN.get("grpo")(), rewards, 4, batch_index=3)
    expected = library_group_advantages(rewards.tolist(), 4)
    # z-scores: a mean and a std over a group of 4 rewards, in another order; |z| < 2 sets the scale
    assert advantages.tolist() == approx([expected[row] for row in range(8)], terms=4, scale=2.0)
    grouped = rewards.view(2, 4)
    by_hand = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    assert_close(advantages, by_hand.flatten(), terms=4, scale=2.0)
    assert kept.all()
    assert metrics["group_advantages/reward_mean/max"] == approx(3.0, terms=4)  # a mean of 4 rewards
    assert metrics["filtered_count"] == 0.0


def test_group_advantages_leave_unscored_rows_out_of_the_statistics():
    rewards = torch.tensor([0.0, NAN, 2.0, 3.0])
    advantages, kept, _, _ = group_advantages(ADVANTAGE_FN.get("grpo")(), rewards, 4, batch_index=0)
    scored = torch.tensor([0.0, 2.0, 3.0])
    expected = (scored - scored.mean()) / (scored.std() + 1e-6)
    assert kept.tolist() == [True, False, True, True]
    assert advantages[1].item() == 0.0
    assert_close(advantages[[0, 2, 3]], expected, terms=3, scale=2.0)  # z-scores over the 3 scored rows


def test_group_advantages_mark_filtered_groups_as_not_kept():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 2.0, 3.0])
    advantages, kept, _, metrics = group_advantages(ADVANTAGE_FN.get("grpo")(std_threshold=0.0), rewards, 4, 0)
    assert kept.tolist() == [False] * 4 + [True] * 4
    assert advantages[:4].tolist() == [0.0] * 4
    assert metrics["filtered_count"] == 4.0


# ---------------------------------------------------------------------------------------------------- estimator
def identity_gather(tensor):
    return tensor


def identity_pad(tensor, dim=1, pad_index=0):
    return tensor


def estimator(advantage_fn, policy_loss="ppo", kl_penalty="none", **kl_args):
    policy = POLICY_LOSS_FN.get(policy_loss)(**({"clip_range": 0.2} if policy_loss == "ppo" else {}))
    return AdvantageEstimator(advantage_fn, policy, KL_FN.get(kl_penalty)(**kl_args), identity_gather, identity_pad)


def unavailable(name):
    def source():
        raise AssertionError(f"{name} was computed although nothing needs it")

    return source


def sources(behaviour=None, reference=None) -> AdvantageSources:
    return AdvantageSources(
        behaviour_logps=(lambda: behaviour) if behaviour is not None else unavailable("behaviour log-probs"),
        reference_logps=(lambda: reference) if reference is not None else unavailable("reference log-probs"),
        teacher_logps=unavailable("teacher log-probs"),
        values=unavailable("critic values"),
    )


def test_estimator_raft_path_keeps_the_local_best_rows():
    rewards = torch.tensor([0.1, 0.9, 0.3, NAN, 1.0, 1.0, 1.0, 1.0])  # every process's rows
    mask = torch.ones(4, 3)
    result = estimator(None, policy_loss="sft")(rewards, mask, slice(0, 4), 4, 0, True, sources())
    assert result.advantages.tolist() == [0.0] * 4
    assert result.loss_rows.tolist() == [False, True, False, False]
    assert result.metrics == {"unscorable_count": 1.0, "raft/kept_fraction": 1 / 8}
    second_process = estimator(None, policy_loss="sft")(rewards, mask, slice(4, 8), 4, 0, True, sources())
    assert second_process.loss_rows.tolist() == [False] * 4  # an all-equal group


def test_estimator_group_path_gives_each_process_its_slice():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, NAN, 1.0, 4.0])
    fn = ADVANTAGE_FN.get("grpo")()
    whole, kept, _, _ = group_advantages(fn, rewards, 4, 0)
    for local in (slice(0, 4), slice(4, 8)):
        result = estimator(fn)(rewards, torch.ones(4, 2), local, 4, 0, True, sources())
        # each process computes the whole batch's advantages from the gathered rewards: the same kernels and inputs
        assert torch.equal(result.advantages, whole[local])
        assert result.loss_rows.tolist() == kept[local].tolist()
        assert result.returns is None and result.metrics["unscorable_count"] == 1.0


def rloo_by_hand(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out: each row's score minus the mean of the other rows of its group."""
    grouped = scores.view(-1, group_size)
    others = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).flatten()


def test_estimator_batch_path_subtracts_the_kl_penalty_before_the_advantages():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -9.0], [-1.5, -9.0, -9.0], [-0.1, -0.4, -0.7]])
    ref = old - torch.tensor([[0.2, 0.1, 0.4], [0.3, 0.0, 5.0], [0.5, 7.0, 7.0], [0.0, 0.2, 0.1]])
    beta = 0.5
    result = estimator(ADVANTAGE_FN.get("rloo")(), kl_penalty="k1", kl_coef=beta)(
        rewards, mask, slice(0, 4), 4, 0, True, sources(old, ref)
    )
    kl = (old - ref) * mask  # k1 on the trained tokens only
    scores = rewards - beta * kl.sum(1)  # the reward sits on each row's last token; the KL on every token
    expected = rloo_by_hand(scores, 4).unsqueeze(1) * mask
    # leave-one-out over 4 scores, each a reward minus a KL summed over 3 tokens (log-probs up to 9 cancel)
    assert_close(result.advantages, expected, terms=4 * 3, scale=rewards.abs().max() + beta * 9.0)
    assert result.loss_rows.tolist() == [True] * 4
    per_row_kl = (kl.sum(1) / mask.sum(1)).mean().item()
    assert result.metrics["critic/kl"] == approx(per_row_kl, terms=4 * 3, scale=9.0)
    assert result.metrics["critic/kl_coef"] == beta
    assert result.batch["token_level_rewards"].shape == (4, 3)


def test_estimator_batch_path_asks_only_for_the_sources_it_needs():
    mask, rewards = torch.ones(4, 2), torch.tensor([1.0, 2.0, 3.0, 4.0])
    result = estimator(ADVANTAGE_FN.get("rloo")())(
        rewards, mask, slice(0, 4), 4, 0, True, sources()
    )  # every source raises if called
    assert_close(result.advantages, rloo_by_hand(rewards, 4).unsqueeze(1) * mask, terms=4)  # leave-one-out of 4


@pytest.mark.parametrize("training", [True, False])
def test_only_training_moves_the_adaptive_kl_coefficient(training):
    mask = torch.ones(4, 2)
    old = torch.full((4, 2), -1.0)
    ref = old - 0.5  # KL 0.5 per token, far above the target: the controller raises β
    fn = estimator(ADVANTAGE_FN.get("rloo")(), kl_penalty="k1", kl_coef=0.1, adaptive=True, target_kl=0.01, horizon=10)
    result = fn(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask, slice(0, 4), 4, 0, training, sources(old, ref))
    assert result.metrics["critic/kl_coef"] == 0.1  # this batch is penalised with the current β either way
    moved = 0.1 * (1 + 0.2 * 4 / 10)  # error clipped at +0.2, 4 rows, horizon 10
    assert fn.kl_penalty.kl_coef == approx(moved if training else 0.1, dtype=torch.float64, terms=4)


def test_unscored_rows_leave_the_loss_and_the_baseline():
    mask = torch.ones(4, 3)
    rewards = torch.tensor([1.0, NAN, 4.0, 7.0])
    result = estimator(ADVANTAGE_FN.get("rloo")())(rewards, mask, slice(0, 4), 4, 0, True, sources())
    assert result.loss_rows.tolist() == [True, False, True, True]
    assert torch.all(result.advantages[1] == 0)
    # the three scored rows form the group of the leave-one-out baseline
    expected = rloo_by_hand(torch.tensor([1.0, 4.0, 7.0]), 3)
    assert_close(result.advantages[[0, 2, 3]], expected.unsqueeze(1) * mask[[0, 2, 3]], terms=3)  # leave-one-out
    assert result.metrics["unscorable_count"] == 1.0


def test_rows_with_an_empty_mask_keep_their_reward_in_the_baseline():
    mask = torch.ones(4, 3, dtype=torch.long)
    mask[2] = 0  # a truncated completion masked by mask_truncated_completions
    result = estimator(ADVANTAGE_FN.get("rloo")())(
        torch.tensor([1.0, 2.0, 3.0, 4.0]), mask, slice(0, 4), 4, 0, True, sources()
    )
    assert result.advantages[0, 0].item() == approx(1.0 - 3.0, terms=4)  # baseline over 2, 3 and 4
    assert torch.all(result.advantages[2] == 0)
    assert result.loss_rows.tolist() == [True] * 4  # its mask alone keeps it out of the loss


@pytest.mark.parametrize("tokens", [0, 1])
def test_whitening_with_fewer_than_two_tokens_gives_zero_advantages(tokens):
    mask = torch.zeros(4, 3)
    mask[0, :tokens] = 1
    fn = ADVANTAGE_FN.get("reinforceplusplus")()
    assert fn.whitens
    with pytest.raises(ValueError):  # the library itself refuses (MVAR needs two values)
        fn({"token_level_rewards": torch.ones(4, 3), "response_mask": mask})
    result = estimator(fn)(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask, slice(0, 4), 4, 0, True, sources())
    assert torch.equal(result.advantages, torch.zeros(4, 3))
    assert torch.equal(result.returns, torch.zeros(4, 3))


def test_whitening_with_two_tokens_runs():
    mask = torch.zeros(4, 3)
    mask[0, 0] = mask[1, 0] = 1
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0])
    result = estimator(ADVANTAGE_FN.get("reinforceplusplus")())(rewards, mask, slice(0, 4), 4, 0, True, sources())
    # returns 1 and 3 on the two trained tokens, whitened: -1/sqrt(2), +1/sqrt(2)
    # whitening's mean and variance over the 2 tokens; the spec's + 1e-8 under the square root of a variance of 1
    assert result.advantages[:2, 0].tolist() == approx([-(2**-0.5), 2**-0.5], terms=2, known_rtol=1e-8)


# ------------------------------------------------------------------------------------------- on a trainer's batches
G = 4


def position_reward(completions, **kwargs):
    """Reward = row index in the reward call modulo G: every group has a non-zero reward spread."""
    return [float(i % G) for i in range(len(completions))]


def _args(path, **overrides):
    settings = {"steps_per_generation": 1, "gradient_accumulation_steps": 1}
    settings.update(overrides)
    return TrinityConfig(**tiny_grpo_kwargs(output_dir=str(path), **settings))


def make(tmp_path, model_dir, cls=None, reward_funcs=length_reward, **config):
    return (cls or recording(TrinityTrainer))(
        model=model_dir,
        reward_funcs=reward_funcs,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), **config)),
        train_dataset=tiny_conversational_dataset(),
    )


def test_grpo_advantages_are_the_library_grpo_of_the_weighted_rewards(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=[length_reward, position_reward],
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path, algorithm="grpo", reward_weights=[1.0, 0.5], gradient_accumulation_steps=2, steps_per_generation=2
        ),
    )
    batch = generate_batch(trainer, tiny_dataset, prompts=(0, 1))  # 2 groups of G
    per_func = trainer.recorded.reward_calls[-1].rewards
    assert per_func.shape == (2 * G, 2)
    rewards = per_func[:, 0] + 0.5 * per_func[:, 1]

    expected = library_group_advantages(rewards.tolist(), G, **trainer.algorithm.advantage.args)
    # z-scores over a group of G weighted rewards, in another order; |z| < 2 sets the scale
    assert_close(batch["advantages"], torch.tensor([expected[row] for row in range(2 * G)]), terms=G, scale=2.0)
    grouped = rewards.view(-1, G)
    by_hand = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    assert_close(batch["advantages"], by_hand.flatten(), terms=G, scale=2.0)


def test_unscorable_rows_get_no_advantage_and_no_loss(tmp_path, tiny_model_dir, tiny_dataset):
    def partial_reward(completions, **kwargs):
        return [None if i == 1 else float(i) for i in range(len(completions))]

    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=partial_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path, algorithm="grpo"),
    )
    batch = generate_batch(trainer, tiny_dataset)
    assert math.isnan(trainer.recorded.reward_calls[-1].rewards[1, 0].item())
    assert batch["advantages"][1].item() == 0.0
    assert batch["completion_mask"][1].sum().item() == 0
    scored = torch.tensor([0.0, 2.0, 3.0])  # group statistics over the three scored rows only
    expected = (scored - scored.mean()) / (scored.std() + 1e-6)
    assert_close(batch["advantages"][[0, 2, 3]], expected, terms=3, scale=2.0)  # z-scores over 3 rows


def test_rloo_advantages_are_the_library_rloo_of_the_token_level_batch(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=[length_reward, position_reward],
        train_dataset=tiny_dataset,
        args=_args(tmp_path, algorithm="rloo", gradient_accumulation_steps=2, steps_per_generation=2),
    )
    batch = generate_batch(trainer, tiny_dataset, prompts=(0, 1))
    rewards = trainer.recorded.reward_calls[-1].rewards.sum(dim=1)
    mask = batch["completion_mask"]
    library_batch = {
        "token_level_rewards": scalar_rewards_to_token_level(rewards, mask),
        "response_mask": mask,
        "uid": torch.arange(2 * G) // G,
    }
    library_batch, _ = ADVANTAGE_FN.get("rloo")()(library_batch)
    assert batch["advantages"].shape == mask.shape
    # leave-one-out over a group of G row rewards (each a sum of 2 reward functions)
    assert_close(batch["advantages"], library_batch["advantages"], terms=2 * G, scale=rewards.abs().max())
    grouped = rewards.view(-1, G)
    by_hand = (grouped - grouped.mean(1, keepdim=True)) * G / (G - 1)
    assert_close(batch["advantages"], by_hand.flatten().unsqueeze(1) * mask, terms=2 * G, scale=rewards.abs().max())


def test_on_policy_distillation_advantages_are_teacher_minus_student_logps(tmp_path, tiny_model_dir):
    teacher_dir = save_tiny_model(tmp_path / "teacher", seed=7)
    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        teacher_model=teacher_dir,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), algorithm="on_policy_distill")),
        train_dataset=tiny_conversational_dataset(),
    )
    trainer.train()
    batch = trainer.recorded.batches[0]
    mask = batch["completion_mask"].bool()
    teacher = trainer.scoring.logps(trainer.teacher_model, batch)
    expected = (teacher - batch["old_per_token_logps"])[mask]
    # the teacher's forward in the trainer and here (another call), minus the same old log-probs
    assert_close(batch["advantages"][mask], expected, terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE)
    assert torch.all(batch["advantages"][~mask] == 0)
    assert "kl/mean" in trainer.state.log_history[0]


def test_kl_reward_penalty_with_adaptive_coefficient(tmp_path, tiny_model_dir):
    args = {"kl_coef": 0.05, "adaptive": True, "target_kl": 1e-6, "horizon": 10}
    trainer = make(tmp_path, tiny_model_dir, algorithm="rloo", kl_penalty={"name": "k1", **args}, max_steps=3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "critic/kl_coef" in h]
    coefs = [h["critic/kl_coef"] for h in logs]
    kls = [h["critic/kl"] for h in logs]
    # step 1: policy == reference, KL 0 < target: β shrinks by 20%·n/horizon (n = 4 rows); later KL > target: it grows
    # exact at step 1: the policy's and the reference's log-probs come from the same weights through the same kernels
    assert kls[0] == 0.0 and kls[1] > 1e-6 and kls[2] > 1e-6
    step = 0.2 * 4 / 10
    # the controller's products in Python floats (a few roundings each)
    assert coefs == approx([0.05, 0.05 * (1 - step), 0.05 * (1 - step) * (1 + step)], dtype=torch.float64)
    assert trainer.components.kl_penalty.kl_coef == approx(coefs[-1] * (1 + step), dtype=torch.float64)
    # the penalised token rewards reach the advantages: RLOO by hand on the recorded batch's scores minus β·k1
    batch = trainer.recorded.batches[-1]
    mask = batch["completion_mask"]
    kl = KL_FN.get("k1")().calculate_kl(batch["old_per_token_logps"], batch["ref_per_token_logps"]) * mask
    assert kl.abs().sum() > 1e-6
    scores = trainer.recorded.reward_calls[-1].rewards[:, 0] - coefs[-1] * kl.sum(1)
    # leave-one-out of G scores, each a reward minus a KL summed over the row's tokens (log-probs cancel)
    assert_close(
        batch["advantages"],
        rloo_by_hand(scores, G).unsqueeze(1) * mask,
        terms=G * mask.shape[1],
        scale=scores.abs().max() + coefs[-1] * mask.shape[1] * TINY_LOGP_SCALE,
    )


def test_evaluation_does_not_move_the_kl_controller(tmp_path, tiny_model_dir):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / "out"),
                algorithm="reinforceplusplus",
                kl_penalty={"name": "k2", "kl_coef": 0.1, "adaptive": True, "target_kl": 1.0, "horizon": 10},
                per_device_eval_batch_size=4,
            )
        ),
        train_dataset=tiny_conversational_dataset(),
        eval_dataset=tiny_conversational_dataset(8),
    )
    trainer.evaluate()
    assert trainer.components.kl_penalty.kl_coef == 0.1


def test_truncated_rows_keep_their_reward_in_the_rloo_baseline(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, cls=TrinityTrainer, algorithm="rloo")
    mask = torch.ones(4, 3, dtype=torch.long)
    mask[2] = 0  # truncated completion masked by mask_truncated_completions
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    advantages = trainer.advantage_estimator(
        rewards, mask, slice(0, 4), 4, 0, True, trainer._advantage_sources({"completion_mask": mask}, [])
    ).advantages
    # leave-one-out baseline of row 0 over the other three rewards (2, 3, 4), as TRL keeps them
    assert advantages[0, 0].item() == approx(1.0 - 3.0, terms=4)
    assert torch.all(advantages[2] == 0)


def test_group_advantages_draw_from_their_own_generator_not_the_global_one():
    """The refill copies (GRPO's duplicate_experiences) come from a generator of (seed, batch): the same on every
    process and call, and Python's global random state is neither read nor changed."""
    import random

    from trinity_trl.training.advantages import group_advantages

    fn = ADVANTAGE_FN.get("grpo")(std_threshold=0.0, duplicate_experiences=True)
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5, 2.0, 3.0, 0.0, 1.0, 0.2, 1.0, 1.0, 1.0, 1.0])
    random.seed(123)
    state = random.getstate()
    first = group_advantages(fn, rewards, group_size=2, batch_index=3, seed=7)
    assert random.getstate() == state
    random.seed(999)  # another global state: the same draws
    second = group_advantages(fn, rewards, group_size=2, batch_index=3, seed=7)
    assert torch.equal(first[2], second[2]) and torch.equal(first[0], second[0])
    kept_groups = [g for g in range(8) if rewards[2 * g] != rewards[2 * g + 1]]  # 4 kept, 4 filtered
    expected = random.Random(7 * 1_000_003 + 3).choices(range(len(kept_groups)), k=8 - len(kept_groups))
    copied = [int(first[2][i]) // 2 for i in range(len(rewards)) if int(first[2][i]) != i][::2]
    assert copied == [kept_groups[i] for i in expected]
