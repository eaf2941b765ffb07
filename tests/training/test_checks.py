"""`trinity_trl/training/checks.py`: `check_components` (every rejection, asked from component properties, on small
fakes), the loss guards on tensors, and the construction errors as a trainer raises them.

Bad datasets, reward functions, rollouts and context lengths on real trainers: tests/reliability/test_bad_input.py;
the guards in training runs: tests/reliability/test_guards.py.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from trl import GRPOConfig

from trinity_trl.algorithms.component import Component
from trinity_trl.trainers import ChordConfig, ChordTrainer, TrinityConfig, TrinityTrainer
from trinity_trl.training.checks import (
    RewardFunctionError,
    check_completion_room,
    check_components,
    checked_reward_func,
    guard_loss_mask,
    hub_errors_in_one_line,
)
from trinity_trl.training.loss import LossBatch


# ------------------------------------------------------------------------------------ fakes of what is asked
class PlainTrainer:
    """A trainer class as check_components sees it: three class flags."""

    supports_expert_rows = False
    has_critic = False
    requires_prompt = True


class ExpertTrainer(PlainTrainer):
    supports_expert_rows = True


class CriticTrainer(PlainTrainer):
    has_critic = True


@dataclass
class FakeAlgorithm:
    algorithm: str = "custom"
    schema: str = "experience"
    use_critic: bool = False
    compute_advantage_in_trainer: bool = False
    needs_reference: bool = True
    policy_loss: Component = field(default_factory=lambda: Component("my_loss"))
    advantage: Component = field(default_factory=lambda: Component("my_advantage"))
    kl_penalty: Component = field(default_factory=lambda: Component("none"))
    entropy_loss: Component = field(default_factory=lambda: Component("default"))


@dataclass
class FakeAdvantage:
    needs_teacher_logprobs: bool = False
    needs_reward_baselines: bool = False
    needs_values: bool = False
    in_trainer: bool = False
    needs_logprobs: bool = False
    refills_filtered_groups: bool = False
    needs_step_states: bool = False

    def compute_in_trainer(self) -> bool:
        return self.in_trainer


def fake_policy_loss(**declared: bool) -> SimpleNamespace:
    """A stand-in policy loss declaring what the checks read: a per-token loss linear in the advantage, reading
    advantages, with no expert rows and no step mask, unless ``declared`` says otherwise."""
    needs = dict(
        pairwise=False, needs_expert_rows=False, linear_in_advantage=True, reads_advantages=True, needs_step_mask=False
    )
    return SimpleNamespace(**{**needs, **declared})


@dataclass
class FakeComponents:
    policy_loss: Any = field(default_factory=fake_policy_loss)
    kl_penalty: Any = field(default_factory=lambda: SimpleNamespace(enabled=False))
    entropy_loss: Any = field(default_factory=lambda: SimpleNamespace(needs_expert_mask=False))
    advantage_fn: Any = field(default_factory=FakeAdvantage)


def fake_args(**overrides) -> SimpleNamespace:
    return SimpleNamespace(
        **{
            "use_vllm": False,
            "vllm_importance_sampling_correction": True,
            "sync_ref_model": False,
            "per_device_train_batch_size": 8,
            "steps_per_generation": 1,
            "num_generations": 4,
            **overrides,
        }
    )


def check(
    trainer_cls=PlainTrainer, algorithm=None, components=None, args=None, teacher=None, rollout_func=None
) -> None:
    check_components(
        trainer_cls,
        algorithm or FakeAlgorithm(),
        components or FakeComponents(),
        args or fake_args(),
        teacher,
        rollout_func,
    )


def test_a_complete_setup_passes():
    check()


def test_a_critic_algorithm_needs_a_critic_trainer():
    with pytest.raises(ValueError, match=r"algorithm 'custom' needs a value model \(critic\) and GAE: use PPOTrainer"):
        check(algorithm=FakeAlgorithm(use_critic=True))
    check(CriticTrainer, algorithm=FakeAlgorithm(use_critic=True))


@pytest.mark.parametrize(("schema", "trainer"), [("sft", "TrinitySFTTrainer"), ("dpo", "TrinityDPOTrainer")])
def test_offline_data_points_to_its_trainer(schema, trainer):
    with pytest.raises(ValueError, match=rf"trains on '{schema}' data, not on rollouts; use {trainer} instead"):
        check(algorithm=FakeAlgorithm(schema=schema))


def test_expert_rows_need_a_trainer_that_adds_them():
    components = FakeComponents(policy_loss=fake_policy_loss(needs_expert_rows=True))
    with pytest.raises(ValueError, match=r"policy loss 'my_loss' needs expert rows; use ChordTrainer"):
        check(components=components)
    check(ExpertTrainer, components=components)


def test_a_pairwise_loss_is_refused_by_the_rollout_trainers():
    """DPO's loss compares chosen/rejected pairs: a rollout trainer once failed at its first step (no aggregation to
    replace); it is refused at construction."""
    components = FakeComponents(policy_loss=fake_policy_loss(pairwise=True, reads_advantages=False))
    with pytest.raises(ValueError, match=r"policy loss 'my_loss' compares chosen/rejected pairs.*TrinityDPOTrainer"):
        check(components=components)


def test_a_kl_penalty_needs_trainer_side_advantages():
    components = FakeComponents(kl_penalty=SimpleNamespace(enabled=True))
    with pytest.raises(
        ValueError,
        match=r"kl_penalty='k1' subtracts a KL from token rewards before trainer-side "
        r"advantages, but algorithm 'custom' computes advantages on experience "
        r"groups",
    ):
        check(algorithm=FakeAlgorithm(kl_penalty=Component("k1")), components=components)
    check(algorithm=FakeAlgorithm(kl_penalty=Component("k1"), compute_advantage_in_trainer=True), components=components)


def test_an_entropy_of_expert_rows_needs_expert_rows():
    components = FakeComponents(entropy_loss=SimpleNamespace(needs_expert_mask=True))
    with pytest.raises(
        ValueError,
        match=r"entropy_loss 'mix' needs expert rows; use ChordTrainer, or "
        r"entropy_loss='default'",
    ):
        check(algorithm=FakeAlgorithm(entropy_loss=Component("mix")), components=components)
    check(ExpertTrainer, algorithm=FakeAlgorithm(entropy_loss=Component("mix")), components=components)


def test_vllm_importance_sampling_needs_a_loss_linear_in_the_advantage():
    components = FakeComponents(policy_loss=fake_policy_loss(linear_in_advantage=False))
    with pytest.raises(
        ValueError,
        match=r"policy loss 'my_loss' with these arguments is not linear in the advantage.*"
        r"set vllm_importance_sampling_correction=False",
    ):
        check(components=components, args=fake_args(use_vllm=True))
    check(components=components, args=fake_args(use_vllm=True, vllm_importance_sampling_correction=False))
    check(components=components, args=fake_args(use_vllm=False))  # no vLLM: no importance weight


def test_sync_ref_model_needs_a_reference():
    with pytest.raises(
        ValueError,
        match=r"sync_ref_model=True updates the reference model, but this algorithm uses "
        r"none \(no KL loss or penalty\)",
    ):
        check(algorithm=FakeAlgorithm(needs_reference=False), args=fake_args(sync_ref_model=True))
    check(algorithm=FakeAlgorithm(needs_reference=True), args=fake_args(sync_ref_model=True))


def test_a_teacher_advantage_needs_a_teacher():
    components = FakeComponents(advantage_fn=FakeAdvantage(needs_teacher_logprobs=True, in_trainer=True))
    with pytest.raises(
        ValueError,
        match=r"advantage 'my_advantage' needs a teacher_model \(a model or a path\), "
        r"or a rollout_func that returns 'teacher_logprobs'",
    ):
        check(components=components)
    check(components=components, teacher="path/to/teacher")
    check(components=components, rollout_func=lambda prompts, trainer: {})  # teacher log-probs come with the rollout


def test_reward_baselines_need_whole_groups_on_each_process():
    """ReMax's greedy baseline is generated per group on the process that holds the group."""
    components = FakeComponents(advantage_fn=FakeAdvantage(needs_reward_baselines=True, in_trainer=True))
    with pytest.raises(ValueError, match=r"advantage 'my_advantage' scores one greedy completion per prompt group"):
        check(components=components, args=fake_args(per_device_train_batch_size=2))
    check(components=components, args=fake_args(per_device_train_batch_size=2, steps_per_generation=2))


def test_critic_values_need_a_critic_trainer():
    components = FakeComponents(advantage_fn=FakeAdvantage(needs_values=True, in_trainer=True))
    with pytest.raises(ValueError, match=r"advantage 'my_advantage' \(GAE\) needs critic values.*PPOTrainer"):
        check(components=components)
    check(CriticTrainer, components=components)


def test_group_operators_needing_behaviour_logps_or_refilling_groups_are_accepted():
    """GRPO's rank_penalty and duplicate_experiences run in the trainers (tests/trainers/test_group_options.py)."""
    check(components=FakeComponents(advantage_fn=FakeAdvantage(needs_logprobs=True)))
    check(components=FakeComponents(advantage_fn=FakeAdvantage(refills_filtered_groups=True)))


@pytest.mark.parametrize(
    "advantage",
    [
        FakeAdvantage(needs_teacher_logprobs=True, in_trainer=True),
        FakeAdvantage(needs_reward_baselines=True),
        FakeAdvantage(needs_values=True),
        FakeAdvantage(needs_logprobs=True),
        FakeAdvantage(refills_filtered_groups=True),
    ],
)
def test_advantage_needs_are_not_checked_when_no_advantage_is_read(advantage):
    """A loss that reads no advantages (RAFT's SFT loss) never runs the advantage function."""
    policy = fake_policy_loss(linear_in_advantage=False, reads_advantages=False)
    check(components=FakeComponents(policy_loss=policy, advantage_fn=advantage))
    check(components=FakeComponents(advantage_fn=None))  # a preset without an advantage function


def test_completion_room():
    check_completion_room(511, 512)
    check_completion_room(10_000, None)  # a model without max_position_embeddings
    with pytest.raises(
        ValueError,
        match=r"max_completion_length \(512\) leaves no room for a prompt in the "
        r"model's 512 positions",
    ):
        check_completion_room(512, 512)


# --------------------------------------------------------------------------------------------- loss guards
def test_guard_loss_mask_drops_only_trained_nonfinite_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    logps = torch.full((3, 4), -1.0)
    logps[0, 3] = -torch.inf  # untrained: ignored
    old = torch.full((3, 4), -1.0)
    old[0, 1] = torch.nan
    ref = torch.full((3, 4), -1.0)
    ref[1, 0] = torch.inf
    advantages = torch.tensor([1.0, torch.nan, 2.0])  # row 1: one token left after the ref drop
    batch = LossBatch(mask=mask, advantages=advantages, old_logps=old, ref_logps=ref)
    guarded, metrics = guard_loss_mask(mask, logps, batch, entropies=None)
    assert guarded.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert metrics == {"guards/nonfinite_logps": 2.0, "guards/nonfinite_advantages": 1.0, "guards/empty_mask": 0.0}
    empty = torch.zeros(2, 3)
    _, metrics = guard_loss_mask(empty, torch.zeros(2, 3), LossBatch(mask=empty, advantages=torch.zeros(2)), None)
    assert metrics["guards/empty_mask"] == 1.0


def test_guard_loss_mask_checks_entropies_and_importance_weights():
    mask = torch.ones(2, 3, dtype=torch.long)
    entropies = torch.tensor([[0.5, torch.nan, 0.5], [0.5, 0.5, 0.5]])
    ratio = torch.tensor([[1.0, 1.0, 1.0], [torch.inf, 1.0, 1.0]])  # token-level vLLM importance weights
    batch = LossBatch(mask=mask, advantages=torch.zeros(2), importance_sampling_ratio=ratio)
    guarded, metrics = guard_loss_mask(mask, torch.zeros(2, 3), batch, entropies)
    assert guarded.tolist() == [[1, 0, 1], [0, 1, 1]]
    assert metrics["guards/nonfinite_logps"] == 1.0 and metrics["guards/nonfinite_advantages"] == 1.0


# ------------------------------------------------------------------------------------ as a trainer raises them
def _trainer(tmp_path, model_dir, dataset, cls=TrinityTrainer, config_cls=TrinityConfig, **kwargs):
    init = {k: kwargs.pop(k) for k in ("teacher_model", "peft_config") if k in kwargs}
    args = config_cls(**tiny_grpo_kwargs(output_dir=str(tmp_path), **kwargs))
    return cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=dataset, **init)


def test_ppo_needs_a_critic(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="critic.*PPOTrainer"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm="ppo")


@pytest.mark.parametrize(("algorithm", "trainer_name"), [("sft", "SFT"), ("dpo", "DPO")])
def test_sft_and_dpo_point_to_their_trainers(tmp_path, tiny_model_dir, tiny_dataset, algorithm, trainer_name):
    with pytest.raises(ValueError, match=rf"{trainer_name}Trainer"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["mix", "mix_chord"])
def test_expert_presets_need_chord_trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm):
    with pytest.raises(ValueError, match="ChordTrainer"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm=algorithm)


def test_kl_penalty_needs_trainer_side_advantages(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="kl_penalty="):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm="grpo", kl_penalty="k1")


def test_on_policy_distill_needs_a_teacher(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="teacher_model"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm="on_policy_distill")


def test_plain_grpo_config_is_converted(tmp_path, tiny_model_dir, tiny_dataset):
    """TRL's own GRPOConfig is converted (issue 27 item 6; tests/trainers/test_config.py covers every trainer)."""
    args = GRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)))
    trainer = TrinityTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_dataset)
    assert type(trainer.args) is TrinityConfig and trainer.args.max_steps == args.max_steps


def test_named_trainers_require_their_config(tmp_path, tiny_model_dir):
    from trinity_trl.trainers import CISPOTrainer

    with pytest.raises(TypeError, match="CISPOConfig"):
        CISPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
        )


def test_mix_entropy_needs_expert_rows(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="entropy_loss 'mix'"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, entropy_loss="mix")
    # ChordTrainer adds expert rows, so the same entropy is accepted there
    expert = tiny_conversational_dataset(4).map(lambda row: {"completion": "It is " + row["answer"]})
    ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        expert_dataset=expert,
        train_dataset=tiny_dataset,
        args=ChordConfig(
            **tiny_grpo_kwargs(output_dir=str(tmp_path / "chord"), entropy_loss="mix", expert_batch_size=2)
        ),
    )


def test_sync_ref_model_without_a_reference_is_rejected_in_our_terms(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="sync_ref_model=True updates the reference model"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, algorithm="asymre", sync_ref_model=True)
    with pytest.raises(ValueError, match="sync_ref_model=True updates the reference model"):
        _trainer(tmp_path, tiny_model_dir, tiny_dataset, sync_ref_model=True)  # grpo without a KL named: none
    trainer = _trainer(
        tmp_path, tiny_model_dir, tiny_dataset, sync_ref_model=True, ref_model_sync_steps=1, max_steps=2, kl_loss="k2"
    )
    trainer.train()  # a k2 KL loss, so TRL keeps and syncs a reference model
    assert trainer.ref_model is not None


# ------------------------------------------------------------------------------------------------------ the Hub
def test_hub_errors_in_one_line_turns_only_an_unreachable_hub_into_one_line(monkeypatch):
    """What `trainer.push_to_hub()` runs in (trainers/card.py): a connection error becomes a one-line ValueError
    naming the call and what to do instead; any other error, and success, pass through unchanged."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://hub.invalid")
    with pytest.raises(ValueError, match=r"^upload\(\), but the Hugging Face Hub at http://hub.invalid is unreachable"):
        with hub_errors_in_one_line("upload()", "save it and upload later"):
            raise ConnectionError("connection refused")
    with pytest.raises(KeyError, match="not a Hub problem"):
        with hub_errors_in_one_line("upload()", "save it and upload later"):
            raise KeyError("not a Hub problem")
    with hub_errors_in_one_line("upload()", "save it and upload later"):
        done = True
    assert done
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"^upload\(\), but the Hugging Face Hub is switched off") as err:
        with hub_errors_in_one_line("upload()", "save it and upload later"):
            raise RuntimeError("whatever the client raised offline")
    assert "\n" not in str(err.value) and "save it and upload later" in str(err.value)


def test_a_model_that_cannot_load_now_is_one_error_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch):
    """check_model_source: a missing folder, a folder that is no model, a Hub id offline and not cached (with the
    bundled model's name suggested for a misspelling of its Hub id); "bundled", a model folder and a cached id pass."""
    from huggingface_hub import constants

    import trinity_trl.data.loading as loading
    from trinity_trl.training.checks import check_model_source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(loading, "_ask_hub", lambda *a: pytest.fail("asked the Hub offline"))
    (tmp_path / "notes").mkdir()
    check_model_source("bundled")
    check_model_source(tiny_model_dir)
    for model, message in (
        ("./mdl", r"^model \./mdl: no such model folder \(looked for \S+mdl\)$"),
        ("notes", r"^model 'notes' is a folder without config\.json: not a saved model$"),
        (
            "HuggingFaceTB/SmolLM2-135M-Instuct",
            r"^model 'HuggingFaceTB/SmolLM2-135M-Instuct' is not a local path and not in the Hugging Face cache .* "
            r"HF_HUB_OFFLINE is set, so the Hub is not asked; did you mean HuggingFaceTB/SmolLM2-135M-Instruct\? "
            r"\('bundled' is that model",
        ),
    ):
        with pytest.raises(FileNotFoundError, match=message):
            check_model_source(model)
    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    check_model_source("someone/tiny")  # in the cache: loads offline


def test_a_reward_parameter_no_column_fills_is_refused_naming_both():
    from datasets import Dataset

    from trinity_trl.training.checks import check_reward_columns

    data = Dataset.from_dict({"prompt": ["What is the capital of Kenya?"], "country": ["Kenya"]})

    def capital_reward(completions, answer, **kwargs):
        return [0.0] * len(completions)

    def with_default(completions, answer=None, trainer_state=None, log_metric=None):
        return [0.0] * len(completions)

    def by_country(prompts, completions, completion_ids, country):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"^reward function 'capital_reward' takes 'answer', but data has no such "):
        check_reward_columns([length_reward, capital_reward], data, "data")
    check_reward_columns([with_default, by_country, "owner/reward-model", torch.nn.Linear(1, 1)], data, "data")
    check_reward_columns(capital_reward, None, "data")  # nothing to check against


def test_a_trainer_refuses_such_a_reward_before_it_loads_the_model(tmp_path):
    from datasets import Dataset

    def capital_reward(completions, answer, **kwargs):
        return [0.0] * len(completions)

    data = Dataset.from_dict({"prompt": ["What is the capital of Kenya?"] * 4})
    args = TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"'capital_reward' takes 'answer', but train_dataset has no such column"):
        TrinityTrainer(model=str(tmp_path / "never-loaded"), reward_funcs=capital_reward, train_dataset=data, args=args)


def test_a_checked_reward_function_names_what_raised_and_where_sync_or_async():
    """The checks are written once for both kinds of function: a sync one stays sync and its exception keeps its type
    (even StopIteration, which a coroutine around it would turn into RuntimeError); an async one is awaited."""

    def sync_reward(prompts, completions, **_):
        if "bad" in completions:
            raise StopIteration("no score")
        return [1.0] * len(completions)

    async def async_reward(prompts, completions, **_):
        await asyncio.sleep(0)
        if "bad" in completions:
            raise ValueError("no score")
        return [2.0] * len(completions)

    checked = checked_reward_func(sync_reward, "sync_reward")
    assert not inspect.iscoroutinefunction(checked)
    assert checked(prompts=["p", "q"], completions=["a", "b"]) == [1.0, 1.0]
    with pytest.raises(RewardFunctionError, match=r"'sync_reward' raised StopIteration: no score on row 1 of"):
        checked(prompts=["p", "q"], completions=["a", "bad"])
    checked_async = checked_reward_func(async_reward, "async_reward")
    assert inspect.iscoroutinefunction(checked_async)
    assert asyncio.run(checked_async(prompts=["p"], completions=["a"])) == [2.0]
    with pytest.raises(RewardFunctionError, match=r"'async_reward' raised ValueError: no score on row 1 of"):
        asyncio.run(checked_async(prompts=["p", "q"], completions=["a", "bad"]))
