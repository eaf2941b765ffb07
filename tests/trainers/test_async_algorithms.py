"""AsyncCISPOTrainer, AsyncSAPOTrainer and AsyncChordTrainer: their configs are their synchronous twins' (the same
defaults and checks), and they train; CHORD mixes demonstrations in at its share with μ scheduled in optimizer steps.
The slow test trains CISPO, SAPO, GSPO, CHORD-μ and CHORD-φ for 2 asynchronous steps each on the bundled model."""

from __future__ import annotations

import pytest
from async_helpers import tiny_async_kwargs
from datasets import Dataset
from helpers import length_reward, lora_config, tiny_conversational_dataset

from trinity_trl.algorithms.policy_loss.chord import mu_schedule_function
from trinity_trl.trainers import (
    AsyncChordConfig,
    AsyncChordTrainer,
    AsyncCISPOConfig,
    AsyncCISPOTrainer,
    AsyncSAPOConfig,
    AsyncSAPOTrainer,
    AsyncTrinityConfig,
    AsyncTrinityTrainer,
    ChordConfig,
    CISPOConfig,
    SAPOConfig,
)

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


def expert_dataset(n: int = 16) -> Dataset:
    rows = tiny_conversational_dataset(n)
    return Dataset.from_dict(
        {"prompt": rows["prompt"], "completion": [[{"role": "assistant", "content": a}] for a in rows["answer"]]}
    )


@pytest.mark.parametrize(
    "ours, theirs, options",
    [
        (AsyncCISPOConfig, CISPOConfig, {"policy_loss": {"clip_range_high": 5.0}}),
        (AsyncSAPOConfig, SAPOConfig, {"sapo_temperature_neg": 1.2}),
        (AsyncChordConfig, ChordConfig, {"mu_decay_steps": 10, "mu_peak": 0.9, "enable_phi_function": False}),
    ],
)
def test_the_same_options_resolve_to_the_same_algorithm(ours, theirs, options, tmp_path):
    """A config moved from a synchronous trainer to its asynchronous twin builds the same components (CHORD's
    per-sample weights aside: the asynchronous trainer takes them from each optimizer step)."""
    sync = theirs(output_dir=str(tmp_path), use_cpu=True, **options).resolved_algorithm()
    asynchronous = ours(output_dir=str(tmp_path), use_cpu=True, **options).resolved_algorithm()
    assert asynchronous == sync


def test_the_twins_refuse_what_theirs_refuse(tmp_path):
    with pytest.raises(ValueError, match="AsyncCISPOConfig needs the 'cispo' policy loss"):
        AsyncCISPOConfig(output_dir=str(tmp_path), use_cpu=True, policy_loss="ppo")
    with pytest.raises(ValueError, match="AsyncSAPOConfig needs the 'sapo' policy loss"):
        AsyncSAPOConfig(output_dir=str(tmp_path), use_cpu=True, policy_loss="ppo")
    with pytest.raises(ValueError, match="expert_data_ratio must be in"):
        AsyncChordConfig(output_dir=str(tmp_path), use_cpu=True, expert_data_ratio=1.0)
    with pytest.raises(ValueError, match="derives from its own batch geometry"):
        AsyncChordConfig(output_dir=str(tmp_path), use_cpu=True, policy_loss={"usual_sample_weight": 2.0})


@pytest.mark.parametrize(
    "trainer_class, config_class", [(AsyncCISPOTrainer, AsyncCISPOConfig), (AsyncSAPOTrainer, AsyncSAPOConfig)]
)
def test_cispo_and_sapo_train(trainer_class, config_class, tmp_path, tiny_model_dir, tiny_dataset):
    trainer = trainer_class(
        tiny_model_dir, length_reward, config_class(**tiny_async_kwargs(output_dir=str(tmp_path))), tiny_dataset
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert sum("actor/loss" in entry for entry in trainer.state.log_history) == 2


def test_chord_mixes_demonstrations_in_at_its_share_with_mu_in_optimizer_steps(tmp_path, tiny_model_dir, tiny_dataset):
    """A micro-batch holds per_device_train_batch_size rollouts and expert_batch_size demonstrations (within one,
    as the stream mixes them in at that share), the loss
    sees them as expert rows, and μ at step k is the schedule's value at optimizer step k (counted from 1, as
    ChordTrainer stamps it)."""
    schedule = {"mu_warmup_steps": 1, "mu_decay_steps": 2, "mu_peak": 0.9, "mu_valley": 0.05}
    args = AsyncChordConfig(
        **tiny_async_kwargs(
            output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=6, expert_batch_size=2, **schedule
        )
    )
    assert args.expert_share() == 0.25
    trainer = AsyncChordTrainer(tiny_model_dir, length_reward, args, tiny_dataset, expert_dataset=expert_dataset())
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "actor/mu" in entry]
    assert len(logged) == 4
    for step, entry in enumerate(logged, start=1):
        assert entry["actor/mu"] == pytest.approx(
            mu_schedule_function(step, schedule["mu_warmup_steps"], schedule["mu_decay_steps"], 0.9, 0.05)
        )
        assert abs(entry["chord/expert_share"] - 0.25) <= 1 / 8  # 6 rollouts + 2 demonstrations (within one)
        assert entry["batch/samples_per_step"] == 8
        assert entry["actor/expert/sft_phi_loss"] > 0  # demonstrations reached the SFT part
    assert trainer._expert_cursor >= 4 * 2 - 1


def test_chord_needs_demonstrations(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="needs an expert_dataset"):
        AsyncChordTrainer(
            tiny_model_dir, length_reward, AsyncChordConfig(**tiny_async_kwargs(output_dir=str(tmp_path))), tiny_dataset
        )


# --------------------------------------------------------------------------------------------- the bundled model
BUNDLED_CASES = {
    "cispo": (AsyncCISPOTrainer, AsyncCISPOConfig, {}),
    "sapo": (AsyncSAPOTrainer, AsyncSAPOConfig, {}),
    "gspo": (AsyncTrinityTrainer, AsyncTrinityConfig, {"algorithm": "gspo"}),
    "chord-mu": (
        AsyncChordTrainer,
        AsyncChordConfig,
        {"enable_phi_function": False, "mu_decay_steps": 2, "mu_peak": 0.9, "mu_valley": 0.05},
    ),
    "chord-phi": (AsyncChordTrainer, AsyncChordConfig, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BUNDLED_CASES))
def test_each_algorithm_trains_two_asynchronous_steps_on_the_bundled_model(case, tmp_path):
    """The bundled SmolLM2-135M-Instruct on the bundled arithmetic task, LoRA (the KL terms' reference is the policy
    without its adapter): 2 optimizer steps of 2 groups of 2 completions, with the worker generating alongside."""
    from trinity_trl.data.arithmetic import arithmetic_reward
    from trinity_trl.recipes.common import RecipeArguments, load_task

    task = load_task(RecipeArguments(num_train_rows=8, num_eval_rows=1, num_expert_rows=8), seed=0, with_expert=True)
    trainer_class, config_class, options = BUNDLED_CASES[case]
    args = config_class(
        **tiny_async_kwargs(
            output_dir=str(tmp_path),
            max_completion_length=16,
            per_device_train_batch_size=4,
            num_generations=2,
            **options,
        )
    )
    extra = {"expert_dataset": task.expert} if trainer_class is AsyncChordTrainer else {}
    trainer = trainer_class("bundled", arithmetic_reward, args, task.train, peft_config=lora_config(8), **extra)
    trainer.train()
    assert trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "actor/loss" in entry]
    assert len(logged) == 2 and all(entry["guards/nonfinite_loss"] == 0 for entry in logged)
