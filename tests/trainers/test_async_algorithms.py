"""AsyncCISPOTrainer, AsyncSAPOTrainer, AsyncChordTrainer and AsyncStepGRPOTrainer: their configs are their
synchronous twins' (the same defaults and checks), and they train; CHORD mixes demonstrations in at its share with μ
scheduled in optimizer steps; step-wise GRPO trains multi-step runs of reset/step environments and refuses what its
worker cannot play. The slow tests train CISPO, SAPO, GSPO, CHORD-μ, CHORD-φ and step-wise GRPO asynchronously on the
bundled model (CISPO, CHORD-μ and step-wise GRPO for 2 steps, the others for 1)."""

from __future__ import annotations

import pytest
from async_helpers import tiny_async_kwargs
from datasets import Dataset
from helpers import length_reward, lora_config, tiny_conversational_dataset

from trinity_trl.algorithms.policy_loss.chord import mu_schedule_function
from trinity_trl.rollouts import Environment, StepResult
from trinity_trl.trainers import (
    AsyncChordConfig,
    AsyncChordTrainer,
    AsyncCISPOConfig,
    AsyncCISPOTrainer,
    AsyncSAPOConfig,
    AsyncSAPOTrainer,
    AsyncStepGRPOConfig,
    AsyncStepGRPOTrainer,
    AsyncTrinityConfig,
    AsyncTrinityTrainer,
    ChordConfig,
    CISPOConfig,
    SAPOConfig,
    StepGRPOConfig,
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
        (
            AsyncStepGRPOConfig,
            StepGRPOConfig,
            {"enable_step_norm": True, "std_threshold": 0.1, "policy_loss": "cispo", "kl_loss": "k3"},
        ),
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
    with pytest.raises(ValueError, match="AsyncStepGRPOConfig needs a step-wise advantage function"):
        AsyncStepGRPOConfig(output_dir=str(tmp_path), use_cpu=True, advantage="grpo")
    with pytest.raises(ValueError, match="history must be one of"):
        AsyncStepGRPOConfig(output_dir=str(tmp_path), use_cpu=True, history="text")


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
        assert entry["actor/expert/sft_loss"] > 0  # demonstrations reached the (plain: CHORD-μ) SFT part
    assert trainer._expert_cursor >= 4 * 2 - 1


def test_chord_needs_demonstrations(tmp_path, tiny_model_dir, tiny_dataset):
    with pytest.raises(ValueError, match="needs an expert_dataset"):
        AsyncChordTrainer(
            tiny_model_dir, length_reward, AsyncChordConfig(**tiny_async_kwargs(output_dir=str(tmp_path))), tiny_dataset
        )


# --------------------------------------------------------------------------------------------- step-wise GRPO
class Countdown(Environment):
    """A task of ``turns`` turns; the last one is rewarded by its length (so runs of a task differ)."""

    def reset(self, turns: int, **row) -> str:
        self.left = int(turns)
        return f"{self.left} turns"

    def step(self, action: str) -> StepResult:
        self.left -= 1
        if self.left:
            return StepResult(f"{self.left} to go", reward=0.0)
        return StepResult(None, reward=float(len(action) % 4), done=True)


class OwnData(Countdown):
    """The environment owns the data: ``reset()`` takes no task and gives the first observation."""

    def reset(self, **row) -> str:
        return super().reset(turns=2)


def countdown_tasks(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "count down"}]] * n, "turns": [1, 2, 3] * 2 + [2, 2]}
    )


@pytest.mark.parametrize("own_data", [False, True], ids=["tasks", "environment-owns-the-data"])
def test_step_wise_grpo_trains_multi_step_runs_asynchronously(own_data, tmp_path, tiny_model_dir):
    """Each step of a run is a sample: an optimizer step of 4 samples holds the steps of runs of 1-3 turns; the runs'
    turns and the environment's reward are logged. With ``train_dataset=None`` the environment's ``reset()`` supplies
    every task and ``max_steps`` the length."""
    args = AsyncStepGRPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path), max_env_steps=3))
    if own_data:
        trainer = AsyncStepGRPOTrainer(tiny_model_dir, None, args, None, environment_factory=OwnData)
    else:
        trainer = AsyncStepGRPOTrainer(tiny_model_dir, None, args, countdown_tasks(), environment_factory=Countdown)
    trainer.train()
    assert trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "actor/loss" in entry]
    assert len(logged) == 2 and all(entry["batch/samples_per_step"] == 4 for entry in logged)
    turns = [
        entry["multi_step/steps_per_run"] for entry in trainer.state.log_history if "multi_step/steps_per_run" in entry
    ]
    assert turns and all(1.0 <= t <= 3.0 for t in turns)
    if own_data:
        assert set(turns) == {2.0}
    else:
        assert any(t > 1.0 for t in turns)
    assert any("rewards/environment_reward" in entry for entry in trainer.state.log_history)


async def two_call_agent(client, row):
    """Two calls through the OpenAI client, the second continuing the first; scored by its answer's length."""
    messages = [{"role": "user", "content": f"task {row['task']}"}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content or "") % 3)


def test_an_agent_trains_asynchronously_each_call_a_step(tmp_path, tiny_model_dir):
    """``agent=``: the worker serves its copy of the policy on the endpoint; every call of a run is a sample (2 per
    run here), trained on the ids it sampled: a run's second call extends its first call's prompt and completion."""
    from trinity_trl.asynchronous.multi_step_worker import MultiStepWorker

    tasks = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 4, "task": list(range(4))})
    args = AsyncStepGRPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path), max_env_steps=2, agent_timeout=60.0))
    trainer = AsyncStepGRPOTrainer(tiny_model_dir, None, args, tasks, agent=two_call_agent)
    worker = trainer.rollout_worker
    assert isinstance(worker, MultiStepWorker)
    queued = []
    rollout_groups = worker.rollout_groups

    def recording(positions):
        groups = rollout_groups(positions)
        queued.extend(samples for samples, _ in groups)
        return groups

    worker.rollout_groups = recording
    trainer.train()
    assert queued
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "agent/calls_per_run" in entry]
    assert logs and all(entry["agent/calls_per_run"] == 2.0 for entry in logs)
    assert all(entry["agent/errors_total"] == 0 for entry in logs)
    for samples in queued:
        assert len(samples) == 2 * 4  # 4 runs x 2 calls
        for first, second in zip(samples[0::2], samples[1::2]):
            assert second.input_ids.tolist()[: len(first.input_ids)] == first.input_ids.tolist()
            assert first.completion_mask.sum() > 0 and second.completion_mask.sum() > 0


def test_an_agent_working_longer_than_the_heartbeat_limit_is_not_a_stall(tmp_path, tiny_model_dir):
    """An agent's own time is bounded by agent_timeout, not by TRL's heartbeat_stale_after_s: an agent that thinks for
    7 s before its calls trains under a 1 s heartbeat limit (TRL checks the worker's health every 5 s it waits)."""
    import asyncio

    async def slow_agent(client, row):
        await asyncio.sleep(7.0)
        return await two_call_agent(client, row)

    tasks = Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 2, "task": [0, 1]})
    args = AsyncStepGRPOConfig(
        **tiny_async_kwargs(
            output_dir=str(tmp_path),
            max_steps=1,
            max_env_steps=2,
            num_generations=2,
            per_device_train_batch_size=2,
            heartbeat_stale_after_s=1.0,
        )
    )
    trainer = AsyncStepGRPOTrainer(tiny_model_dir, None, args, tasks, agent=slow_agent)
    trainer.train()
    assert trainer.state.global_step == 1


def test_agent_options_need_an_agent_asynchronously_too(tmp_path, tiny_model_dir):
    args = AsyncStepGRPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path), agent_on_failure="drop"))
    with pytest.raises(ValueError, match="agent_on_failure set, but there is no agent="):
        AsyncStepGRPOTrainer(tiny_model_dir, None, args, countdown_tasks(), environment_factory=Countdown)
    with pytest.raises(ValueError, match="agent_timeout must be > 0"):
        AsyncStepGRPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path), agent_timeout=0.0))


def test_step_wise_grpo_refuses_what_its_worker_cannot_play(tmp_path, tiny_model_dir):
    class Adder:  # TRL's tool protocol: reset() and public methods as tools
        def reset(self, **row) -> None:
            return None

        def add(self, a: int, b: int) -> int:
            """Add two numbers.

            Args:
                a: the first.
                b: the second.
            """
            return a + b

    def config(**options):
        return AsyncStepGRPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path), **options))

    with pytest.raises(ValueError, match="needs environment_factory"):
        AsyncStepGRPOTrainer(tiny_model_dir, None, config(), countdown_tasks())
    with pytest.raises(ValueError, match="Adder is a TRL tool environment"):
        AsyncStepGRPOTrainer(tiny_model_dir, None, config(), countdown_tasks(), environment_factory=Adder)

    class NoTasks(Countdown):
        def reset(self) -> str:
            return super().reset(turns=1)

    with pytest.raises(TypeError, match=r"does not accept \['turns'\]"):
        AsyncStepGRPOTrainer(tiny_model_dir, None, config(), countdown_tasks(), environment_factory=NoTasks)
    with pytest.raises(ValueError, match="needs max_steps > 0"):
        AsyncStepGRPOTrainer(tiny_model_dir, None, config(max_steps=-1), None, environment_factory=OwnData)
    with pytest.raises(ValueError, match="generation_backend must be 'transformers'"):
        config(generation_backend="vllm")
    with pytest.raises(ValueError, match="normalises by statistics of the whole batch"):
        AsyncStepGRPOTrainer(
            tiny_model_dir, None, config(std_cal_level="batch"), countdown_tasks(), environment_factory=Countdown
        )
    with pytest.raises(ValueError, match="AsyncTrinityTrainer generates one turn"):
        AsyncTrinityTrainer(
            tiny_model_dir,
            length_reward,
            AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path), algorithm="multi_step_grpo")),
            tiny_conversational_dataset(8),
        )


# --------------------------------------------------------------------------------------------- the bundled model
# (trainer, config, options, optimizer steps). The worker, its weight sync and a step on the updated policy are the
# same for every single-turn algorithm: CISPO trains them for 2 steps on the real model's module names, and CHORD-μ
# for 2 as its μ moves with them (mu_decay_steps=2); SAPO, GSPO and CHORD-φ differ from those only in their loss, which
# one step runs on the real model's log-probs
BUNDLED_CASES = {
    "cispo": (AsyncCISPOTrainer, AsyncCISPOConfig, {}, 2),
    "sapo": (AsyncSAPOTrainer, AsyncSAPOConfig, {}, 1),
    "gspo": (AsyncTrinityTrainer, AsyncTrinityConfig, {"algorithm": "gspo"}, 1),
    "chord-mu": (
        AsyncChordTrainer,
        AsyncChordConfig,
        {"enable_phi_function": False, "mu_decay_steps": 2, "mu_peak": 0.9, "mu_valley": 0.05},
        2,
    ),
    "chord-phi": (AsyncChordTrainer, AsyncChordConfig, {}, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BUNDLED_CASES))
def test_each_algorithm_trains_asynchronously_on_the_bundled_model(case, tmp_path):
    """The bundled SmolLM2-135M-Instruct on the bundled arithmetic task, LoRA (the KL terms' reference is the policy
    without its adapter): optimizer steps (BUNDLED_CASES) of 2 groups of 2 completions, with the worker generating
    alongside."""
    from trinity_trl.data.arithmetic import arithmetic_reward
    from trinity_trl.recipes.common import RecipeArguments, load_task

    task = load_task(RecipeArguments(num_train_rows=8, num_eval_rows=1, num_expert_rows=8), seed=0, with_expert=True)
    trainer_class, config_class, options, steps = BUNDLED_CASES[case]
    args = config_class(
        **tiny_async_kwargs(
            output_dir=str(tmp_path),
            max_completion_length=16,
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=steps,
            **options,
        )
    )
    extra = {"expert_dataset": task.expert} if trainer_class is AsyncChordTrainer else {}
    trainer = trainer_class("bundled", arithmetic_reward, args, task.train, peft_config=lora_config(8), **extra)
    trainer.train()
    assert trainer.state.global_step == steps
    logged = [entry for entry in trainer.state.log_history if "actor/loss" in entry]
    assert len(logged) == steps and all(entry["guards/nonfinite_loss"] == 0 for entry in logged)


@pytest.mark.slow
def test_step_wise_grpo_trains_two_asynchronous_steps_on_the_bundled_model(tmp_path):
    """The bundled model plays the bundled number-guessing game (partial credit, targets 1-20, at most 3 turns) with
    LoRA: 2 optimizer steps of 4 steps each, finite losses."""
    from trinity_trl.rollouts.envs import NumberGuessEnv, number_guess_dataset

    args = AsyncStepGRPOConfig(
        **tiny_async_kwargs(output_dir=str(tmp_path), max_completion_length=16, num_generations=2, max_env_steps=3)
    )
    trainer = AsyncStepGRPOTrainer(
        "bundled",
        None,
        args,
        number_guess_dataset(8, low=1, high=20),
        peft_config=lora_config(8),
        environment_factory=lambda: NumberGuessEnv(partial_credit=True),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    logged = [entry for entry in trainer.state.log_history if "actor/loss" in entry]
    assert len(logged) == 2 and all(entry["guards/nonfinite_loss"] == 0 for entry in logged)
