"""Bad input: each case fails early with a message naming the row, column or value, or is handled in a documented
way that loses nothing (docs/guarantees.md#bad-input).

Generation batches are made by calling the trainer's `_generate_and_score_completions` seam on `num_generations`
copies of a dataset row (what the sampler hands it), which is what `train()` does at its first step.
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import approx, assert_close

from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    TrinityConfig,
    TrinityTrainer,
)
from trinity_trl.training.checks import RewardFunctionError

G = 4


def _config(tmp_path, cls=TrinityConfig, **overrides):
    return cls(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), **overrides))


def _trainer(tmp_path, model_dir, reward_funcs=length_reward, dataset=None, **overrides):
    return TrinityTrainer(
        model=model_dir,
        reward_funcs=reward_funcs,
        args=_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else tiny_conversational_dataset(8),
    )


def _generate(trainer, dataset=None, row=0):
    trainer.model.train()
    dataset = dataset if dataset is not None else tiny_conversational_dataset(8)
    return trainer._generate_and_score_completions([dict(dataset[row]) for _ in range(G)])


# ---------------------------------------------------------------------------------------------- names and arguments
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"algorithm": "nope"}, r"Unknown algorithm 'nope'; known names: .*grpo"),
        ({"policy_loss": "nope"}, r"Unknown policy loss 'nope'; known names: .*cispo"),
        ({"advantage": "nope"}, r"'nope'.*known names"),
        ({"kl_loss": "nope"}, r"'nope'.*known names"),
        ({"policy_loss": {"clip_range": -0.1}}, r"clip ranges must be >= 0, got low=-0.1"),
        ({"kl_loss": {"kl_coef": -1.0}}, r"kl_coef must be >= 0, got -1.0"),
        ({"policy_loss": {"not_an_arg": 1}}, r"not_an_arg"),
        ({"loss_agg_mode": "bad_mode"}, r"bad_mode"),
        ({"algorithm": "cispo", "epsilon": 0.3}, r"epsilon=0.3 is not used by trinity_trl.*clip_range"),
    ],
)
def test_unknown_names_and_invalid_arguments_fail_at_config_construction(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **overrides)


def test_groups_of_one_are_rejected_by_trl_at_config_construction(tmp_path):
    with pytest.raises(ValueError, match="at least 2 generations"):
        _config(tmp_path, num_generations=1)


# ---------------------------------------------------------------------------------------------------------- datasets
def test_dataset_without_prompt_column_fails_at_construction(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column \(columns: \['answer', 'question'\]\)"):
        _trainer(tmp_path, tiny_model_dir, dataset=Dataset.from_dict({"question": ["a"] * 4, "answer": ["b"] * 4}))
    with pytest.raises(ValueError, match=r"eval_dataset\['small'\] has no 'prompt' column"):
        TrinityTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            args=_config(tmp_path),
            train_dataset=tiny_conversational_dataset(8),
            eval_dataset={"small": Dataset.from_dict({"text": ["a"] * 4})},
        )


@pytest.mark.parametrize("empty", ["", []], ids=["empty_string", "empty_message_list"])
def test_empty_prompts_fail_at_construction_naming_the_rows(tmp_path, tiny_model_dir, empty):
    good = "What is 1+1?" if empty == "" else [{"role": "user", "content": "What is 1+1?"}]
    prompts = [good, empty, good, empty] + [good] * 4
    with pytest.raises(ValueError, match=r"2 row\(s\) with an empty prompt \(rows \[1, 3\]\)"):
        _trainer(tmp_path, tiny_model_dir, dataset=Dataset.from_dict({"prompt": prompts}))


def test_empty_prompt_in_an_iterable_dataset_fails_at_its_batch(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": "What is 1+1?"}]}, {"prompt": []}]
    dataset = IterableDataset.from_generator(lambda: iter(rows * 4))
    trainer = _trainer(tmp_path, tiny_model_dir, dataset=dataset, max_steps=1)
    with pytest.raises(ValueError, match=r"row 0 of this process's batch has an empty prompt: \{'prompt': \[\]\}"):
        trainer._generate_and_score_completions([rows[1]] * G)


def test_expert_dataset_smaller_than_a_batch_cycles_through_every_row(tmp_path, tiny_model_dir):
    """Two demonstrations, four expert rows per batch: each demonstration appears twice per batch (the expert stream
    is one seeded shuffle per pass), training runs, and the stream position counts every row drawn."""
    expert = Dataset.from_list(
        [
            {"messages": [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "It is 3."}]},
            {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]},
        ]
    )
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        expert_dataset=expert,
        args=_config(tmp_path, ChordConfig, expert_batch_size=4, max_steps=2),
        train_dataset=tiny_conversational_dataset(8),
    )
    batch = _generate(trainer)
    expert_rows = batch["completion_ids"][batch["expert_mask"]]
    assert expert_rows.shape[0] == 4
    assert len({tuple(r.tolist()) for r in expert_rows}) == 2
    trainer.train()
    assert trainer._expert_cursor == 4 * 3  # one generation above + two training steps
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


# ---------------------------------------------------------------------------------------------------- reward functions
def test_raising_reward_function_names_the_function_and_the_row(tmp_path, tiny_model_dir):
    def flaky_reward(completions, **kwargs):
        """Raises on the row whose completion is the third of this batch, wherever it appears."""
        if target[0] is None:
            target[0] = completions[2]
        if any(c == target[0] for c in completions):
            raise KeyError("missing field 'score'")
        return [1.0] * len(completions)

    target: list = [None]
    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=[length_reward, flaky_reward])
    with pytest.raises(
        RewardFunctionError,
        match=r"reward function 'flaky_reward' raised KeyError: .*missing field "
        r"'score'.* on row 2 of this process's batch of 4 completions",
    ) as info:
        _generate(trainer)
    assert isinstance(info.value.__cause__, KeyError)


def test_reward_function_failing_only_on_the_whole_batch_is_named(tmp_path, tiny_model_dir):
    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("judge service unavailable")
        return [1.0]

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=batch_only)
    with pytest.raises(
        RewardFunctionError,
        match=r"'batch_only' raised RuntimeError: judge service unavailable on "
        r"this process's batch of 4 completions \(no single row",
    ):
        _generate(trainer)


def test_async_reward_function_failure_is_named(tmp_path, tiny_model_dir):
    async def async_reward(completions, **kwargs):
        if target[0] is None:
            target[0] = completions[1]
        return [1.0 / (c != target[0]) for c in completions]  # the row holding the batch's second completion fails

    target: list = [None]

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=async_reward)
    with pytest.raises(RewardFunctionError, match=r"'async_reward' raised ZeroDivisionError.*on row 1 of"):
        _generate(trainer)


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        (
            None,
            TypeError,
            r"'bad_reward' returned None \(NoneType\); it must return a list with one reward per completion",
        ),
        (0.5, TypeError, r"'bad_reward' returned 0.5 \(float\); it must return a list"),
        (
            ["1.0", 1.0, 1.0, 1.0],
            TypeError,
            r"'bad_reward' returned '1.0' \(str\) for row 0; a reward must be a number",
        ),
        ([1.0, [2.0], 1.0, 1.0], TypeError, r"returned \[2.0\] \(list\) for row 1"),
        ([1.0, 2.0], ValueError, r"'bad_reward' returned 2 rewards for 4 completions; it must return one per"),
    ],
    ids=["none", "scalar", "string", "nested", "wrong_length"],
)
def test_malformed_reward_results_are_named(tmp_path, tiny_model_dir, result, error, match):
    def bad_reward(completions, **kwargs):
        return result

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=bad_reward)
    with pytest.raises(error, match=match):
        _generate(trainer)


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), float("-inf")], ids=["none", "nan", "inf", "-inf"])
@pytest.mark.parametrize("algorithm", ["grpo", "reinforceplusplus"])
def test_unscorable_rewards_get_zero_advantage_no_loss_and_are_counted(tmp_path, tiny_model_dir, value, algorithm):
    """A row whose reward is None/NaN/±inf is excluded from its group's statistics, gets advantage 0 and an empty loss
    mask, and is counted in `unscorable_count`; the other rows are normalised among themselves."""

    def reward(completions, **kwargs):
        return [value if i == 1 else float(i) for i in range(len(completions))]

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=reward, algorithm=algorithm)
    batch = _generate(trainer)
    advantages = batch["advantages"] if batch["advantages"].dim() == 1 else batch["advantages"][:, 0]
    assert advantages[1].item() == 0.0 and batch["completion_mask"][1].sum() == 0
    assert torch.isfinite(batch["advantages"]).all()
    assert trainer._metrics["train"]["unscorable_count"] == [1.0]
    if algorithm == "grpo":
        scored = torch.tensor([0.0, 2.0, 3.0])
        # z-scores over the 3 scored rows (|z| < 2)
        assert_close(advantages[[0, 2, 3]], (scored - scored.mean()) / (scored.std() + 1e-6), terms=3, scale=2.0)


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), float("-inf")], ids=["none", "nan", "inf", "-inf"])
def test_nan_from_one_of_two_reward_functions_keeps_the_other_score(tmp_path, tiny_model_dir, value):
    """As in TRL, the weighted sum skips a function that did not score a row (None); NaN and +-inf are the same as None
    (issue 46 item 6: one rule for bad rewards): the row stays trained with the other function's score."""

    def sometimes(completions, **kwargs):
        return [value] + [0.0] * (len(completions) - 1)

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=[length_reward, sometimes])
    batch = _generate(trainer)
    assert trainer._metrics["train"]["unscorable_count"] == [0.0]
    assert batch["completion_mask"][0].sum() > 0


def test_all_rewards_equal_give_zero_advantages_and_a_finite_step(tmp_path, tiny_model_dir):
    trainer = _trainer(
        tmp_path, tiny_model_dir, reward_funcs=lambda completions, **kw: [1.0] * len(completions), max_steps=1
    )
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["frac_reward_zero_std"] == 1.0 and log["actor/pg_loss"] == 0.0
    assert math.isfinite(log["loss"]) and math.isfinite(log["grad_norm"])


def test_group_with_one_scored_member_follows_the_singleton_rule(tmp_path, tiny_model_dir):
    """docs/algorithms/advantages.md#grpo: a group of one uses mean 0 and std 1, so the lone scored row's advantage is
    its reward (the others are unscorable: advantage 0, no loss); with `std_threshold` the singleton group is skipped
    instead and counted in `filtered_count`."""

    def lone(completions, **kwargs):
        return [None, None, 0.75, None]

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=lone)
    batch = _generate(trainer)
    assert batch["advantages"].tolist() == approx([0.0, 0.0, 0.75 / (1 + 1e-6), 0.0], terms=4)  # a group of 4
    assert batch["completion_mask"].sum(1).tolist()[2] > 0 and trainer._metrics["train"]["unscorable_count"] == [3.0]

    trainer = _trainer(tmp_path, tiny_model_dir, reward_funcs=lone, advantage={"std_threshold": 0.0})
    batch = _generate(trainer)
    assert batch["advantages"].abs().sum() == 0 and batch["completion_mask"].sum() == 0
    assert trainer._metrics["train"]["filtered_count"] == [1.0]


# ------------------------------------------------------------------------------------------- context and completions
def test_prompt_longer_than_the_context_fails_at_the_first_batch(tmp_path, tiny_model_dir):
    long_prompt = [{"role": "user", "content": " ".join(["apples"] * 600)}]
    dataset = Dataset.from_dict({"prompt": [long_prompt] * 4})
    trainer = _trainer(tmp_path, tiny_model_dir, dataset=dataset)
    with pytest.raises(
        ValueError,
        match=r"row 0 of this process's generation batch .*: its prompt has \d{3} tokens, "
        r"and \d{3} \+ 8 completion tokens exceed the model's 512 positions",
    ):
        _generate(trainer, dataset)


def test_completion_length_beyond_the_context_fails_at_construction(tmp_path, tiny_model_dir):
    with pytest.raises(
        ValueError, match=r"max_completion_length \(512\) leaves no room for a prompt in the model's 512"
    ):
        _trainer(tmp_path, tiny_model_dir, max_completion_length=512)


def test_expert_prompt_longer_than_the_context_names_the_expert_row(tmp_path, tiny_model_dir):
    long = {
        "messages": [{"role": "user", "content": " ".join(["apples"] * 600)}, {"role": "assistant", "content": "ok"}]
    }
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        expert_dataset=Dataset.from_list([long]),
        args=_config(tmp_path, ChordConfig, expert_batch_size=1),
        train_dataset=tiny_conversational_dataset(8),
    )
    with pytest.raises(ValueError, match=r"expert_dataset row 0: its prompt has \d{3} tokens"):
        _generate(trainer)


def test_rollout_func_with_an_empty_completion_fails_naming_the_row(tmp_path, tiny_model_dir):
    def rollout(prompts, trainer):
        tokenizer = trainer.processing_class
        ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        return {
            "prompt_ids": ids,
            "completion_ids": [[5, tokenizer.eos_token_id], []] + [[7]] * (len(ids) - 2),
            "logprobs": None,
        }

    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=_config(tmp_path),
        train_dataset=tiny_conversational_dataset(8),
        rollout_func=rollout,
    )
    with pytest.raises(ValueError, match=r"rollout_func returned an empty completion for row\(s\) \[1\]"):
        _generate(trainer)
