"""`trinity_trl/trainers/step_grpo.py`: StepGRPOTrainer, the multi-step rollout through TRL, step bookkeeping, step-wise
advantages, shared-prefix rows, training. The rollout alone: tests/rollouts/test_multi_step.py; the environments:
tests/rollouts/test_envs.py."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import TINY_LOGP_SCALE, TINY_MODEL_TERMS, length_reward, lora_config, recording, tiny_grpo_kwargs
from tolerance import approx, assert_close

from trinity_trl.algorithms import ADVANTAGE_FN, EID, Experience
from trinity_trl.rollouts import (
    Environment,
    NumberGuessEnv,
    Run,
    Step,
    StepResult,
    environment_reward,
    number_guess_dataset,
)
from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer


class ScriptedEnv(Environment):
    """Ends after ``length`` turns (from the row) with reward ``reward``; earlier steps reward 9.0,
    which step-wise GRPO must ignore."""

    def reset(self, length, reward, **row):
        self.length, self.reward, self.turn = int(length), float(reward), 0
        return f"Play {length} turns."

    def step(self, action):
        self.turn += 1
        if self.turn >= self.length:
            return StepResult("Done.", reward=self.reward, done=True)
        return StepResult(f"Turn {self.turn} done, go on.", reward=9.0)


def scripted_tasks(lengths_and_rewards):
    return Dataset.from_dict(
        {"length": [length for length, _ in lengths_and_rewards], "reward": [r for _, r in lengths_and_rewards]}
    )


class Recording(recording(StepGRPOTrainer)):
    """Also keeps the per-step advantages `_step_batch` was given (the last call's)."""

    def _step_batch(self, output, runs, advantages):
        self.step_advantages = advantages
        return super()._step_batch(output, runs, advantages)


def runs_of(trainer, call: int = -1):
    """The runs of one generation batch: the rollout returns them in each row's `run` field."""
    return [row["run"] for row in trainer.recorded.rows[call]]


def loss_inputs(trainer) -> list[dict]:
    return [call.inputs for call in trainer.recorded.loss_calls]


def make(tmp_path, model_dir, tasks, env=ScriptedEnv, cls=Recording, peft=False, **config):
    kwargs = tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1, shuffle_dataset=False)
    kwargs.update(config)
    return cls(
        model=model_dir,
        args=StepGRPOConfig(**kwargs),
        train_dataset=tasks,
        environment_factory=env,
        peft_config=lora_config() if peft else None,
    )


def test_every_step_is_one_row_with_its_runs_advantage(tmp_path, tiny_model_dir):
    # RepeatSampler repeats a task num_generations (4) times: 4 runs of 3 steps, all rewarded 1.0
    tasks = scripted_tasks([(3, 1.0)] * 8)
    trainer = make(tmp_path, tiny_model_dir, tasks, max_env_steps=5, shared_prefix=False)
    trainer.train()
    batch = trainer.recorded.batches[0]
    assert batch["sample_count"].sum() == 4 * 3  # 4 runs x 3 steps
    # all runs have reward 1.0: zero std, so every advantage is 0
    assert torch.all(batch["advantages"] == 0)


def test_runs_of_different_lengths_and_padding_rows(tmp_path, tiny_model_dir):
    # two tasks x two runs (num_generations=2) whose runs last 1, 3 and 2, 1 turns: 7 step rows, which
    # steps_per_generation=2 cannot split evenly. The runs of one task come from one repeated row, so
    # the environment draws lengths and rewards from shared iterators.
    tasks = Dataset.from_dict({"length": [1, 3, 2, 1], "reward": [1.0, 0.0, 0.5, 0.2]})
    lengths = iter([1, 3, 2, 1])
    rewards = iter([1.0, 0.0, 0.5, 0.2])

    class CountingEnv(Environment):
        def reset(self, **row):
            self.length, self.reward, self.turn = next(lengths), next(rewards), 0
            return "Go."

        def step(self, action):
            self.turn += 1
            if self.turn >= self.length:
                return StepResult("Done.", reward=self.reward, done=True)
            return StepResult("Again.", reward=9.0)

    trainer = make(
        tmp_path,
        tiny_model_dir,
        tasks.select([0, 2]),
        env=CountingEnv,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_env_steps=5,
        shared_prefix=False,
    )
    trainer.train()
    batch = trainer.recorded.batches[0]
    run_log = [(len(run.steps), run.reward) for run in runs_of(trainer, 0)]
    assert run_log == [(1, 1.0), (3, 0.0), (2, 0.5), (1, 0.2)]
    assert int(batch["sample_count"].sum()) == 7
    assert batch["sample_count"].shape[0] == 8  # padded to a multiple of steps_per_generation (2)
    # expected advantages from the library on the same runs (non-last rewards 9.0 ignored)
    fn = ADVANTAGE_FN.get("step_wise_grpo")(**ADVANTAGE_FN.get("step_wise_grpo").default_args())
    exps = [
        Experience(
            eid=EID(batch=0, task=i // 2, run=i % 2, step=s),
            tokens=torch.zeros(1, dtype=torch.long),
            prompt_length=0,
            reward=r,
        )
        for i, (n, r) in enumerate(run_log)
        for s in range(n)
    ]
    expected = [float(e.advantages[0]) for e in fn(exps)[0]]
    # z-scores over a group's runs (at most 8), each step row a copy of its run's; |z| < 3 sets the scale
    assert batch["advantages"][batch["sample_count"].bool(), 0].tolist() == approx(expected, terms=8, scale=3.0)
    # every step row is trained exactly once across the micro-batches, padding rows never
    seen = torch.cat([rows["sample_count"] for rows in loss_inputs(trainer)])
    assert int(seen.sum()) == 7 and seen.numel() == 8
    trained_advantages = torch.cat(
        [rows["advantages"][rows["sample_count"].bool(), 0] for rows in loss_inputs(trainer)]
    )
    assert sorted(trained_advantages.tolist()) == approx(sorted(expected), terms=8, scale=3.0)
    # padding rows attend to one pad token but train none (loss mask = completion_mask * tool_mask)
    padding = torch.cat(
        [(rows["completion_mask"] * rows["tool_mask"])[~rows["sample_count"].bool()] for rows in loss_inputs(trainer)]
    )
    assert padding.sum() == 0


def test_step_prompts_extend_the_previous_turn(tmp_path, tiny_model_dir):
    tasks = scripted_tasks([(3, 1.0)] * 4)
    trainer = make(tmp_path, tiny_model_dir, tasks, max_env_steps=5)
    trainer.train()
    run = runs_of(trainer)[0]
    eos = trainer._tokenizer.eos_token_id
    for previous, step in zip(run.steps, run.steps[1:]):
        history = previous.prompt_ids + previous.completion_ids
        if previous.completion_ids[-1] != eos:
            history = history + [eos]
        assert step.prompt_ids[: len(history)] == history
        assert "Turn" in trainer.processing_class.decode(step.prompt_ids[len(history) :])
    assert all(r.prefix_preserving for r in runs_of(trainer))


def test_max_env_steps_bounds_runs(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, scripted_tasks([(10, 1.0)] * 4), max_env_steps=2)
    trainer.train()
    assert [len(r.steps) for r in runs_of(trainer)] == [2, 2, 2, 2]
    assert all(r.reward == 9.0 for r in runs_of(trainer))  # cut off: the last step's reward counts
    trainer.save_model(str(tmp_path / "saved"))  # the card names the environment the runs were played in
    assert "| environment | `ScriptedEnv` |" in (tmp_path / "saved" / "README.md").read_text()


def test_lora_and_extra_reward_functions(tmp_path, tiny_model_dir):
    trainer = make(
        tmp_path, tiny_model_dir, number_guess_dataset(8), env=NumberGuessEnv, peft=True, max_steps=2, max_env_steps=2
    )
    trainer.train()
    assert "multi_step/steps_per_run" in trainer.state.log_history[0]
    extra = StepGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=number_guess_dataset(8),
        environment_factory=NumberGuessEnv,
        args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "x"), max_steps=1)),
    )
    assert [f.__name__ for f in extra.reward_funcs] == ["environment_reward", "length_reward"]


@pytest.mark.parametrize(
    "config, match",
    [
        ({"max_env_steps": 0}, "max_env_steps"),
        ({"history": "text"}, "history"),
        ({"std_cal_level": "global"}, "std_cal_level"),
        ({"advantage": "grpo"}, "step_wise_grpo"),
    ],
)
def test_bad_configs(config, match):
    with pytest.raises(ValueError, match=match):
        StepGRPOConfig(**tiny_grpo_kwargs(output_dir="unused", **config))


def test_needs_an_environment_factory(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="environment_factory"):
        StepGRPOTrainer(
            model=tiny_model_dir,
            train_dataset=number_guess_dataset(4),
            args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
        )


class VaryingEnv(Environment):
    """Runs of 1 to 3 turns with distinct rewards, drawn from a class-level counter (deterministic)."""

    counter = 0

    def reset(self, **row):
        VaryingEnv.counter += 1
        self.length, self.reward, self.turn = 1 + VaryingEnv.counter % 3, (VaryingEnv.counter * 0.37) % 1.0, 0
        return "Start."

    def step(self, action):
        self.turn += 1
        if self.turn >= self.length:
            return StepResult("End.", reward=self.reward, done=True)
        return StepResult(f"Observation {self.turn}.", reward=0.0)


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_shared_prefix_rows_equal_one_row_per_step(tmp_path, tiny_model_dir, agg):
    VaryingEnv.counter = 0
    trainer = make(
        tmp_path,
        tiny_model_dir,
        number_guess_dataset(8),
        env=VaryingEnv,
        num_generations=4,
        per_device_train_batch_size=8,
        max_env_steps=3,
        loss_agg_mode=agg,
        kl_loss={"name": "k3", "kl_coef": 0.5},
        entropy_loss={"entropy_coef": 0.05},
        learning_rate=0.0,
    )
    trainer.train()
    runs = runs_of(trainer)
    assert {len(r.steps) for r in runs} == {1, 2, 3}
    assert any(a not in (None, 0.0) for scores in trainer.step_advantages for a in scores)
    stub = {"prompt_ids": torch.zeros(1, 1, dtype=torch.long), "num_items_in_batch": torch.tensor(0)}
    trainer.args.shared_prefix = False
    per_step = trainer._step_batch(stub, runs, trainer.step_advantages)
    trainer.args.shared_prefix = True
    shared = trainer._step_batch(stub, runs, trainer.step_advantages)
    assert shared["prompt_ids"].shape[0] == len(runs) < per_step["prompt_ids"].shape[0]
    assert int(shared["sample_count"].sum()) == int(per_step["sample_count"].sum())
    trainer.model.train()
    loss_step, grads_step = _loss_and_grads(trainer, per_step)
    loss_shared, grads_shared = _loss_and_grads(trainer, shared)
    # one row per run (shared prefix) vs one row per step: other attention rows and sums, the tiny model's chain
    scale = per_step["advantages"].abs().max() * TINY_LOGP_SCALE  # advantages times ratios exp(logp - old)
    assert loss_shared.item() == approx(loss_step.item(), terms=TINY_MODEL_TERMS, scale=scale)
    assert grads_step.keys() == grads_shared.keys()
    for name in grads_step:
        assert_close(grads_shared[name], grads_step[name], terms=TINY_MODEL_TERMS, msg=name)


def test_shared_prefix_falls_back_for_sequence_level_losses(tmp_path, tiny_model_dir):
    VaryingEnv.counter = 0
    trainer = make(
        tmp_path, tiny_model_dir, number_guess_dataset(8), env=VaryingEnv, max_env_steps=3, policy_loss="gspo"
    )
    trainer.train()
    batch = trainer.recorded.batches[0]
    assert batch["prompt_ids"].shape[0] == sum(len(r.steps) for r in runs_of(trainer))  # one row per step


class FixedRuns:
    """A user's `trinity_trl.rollouts.Rollout`, written from scratch (no base class): every task row gets the same two
    turns, token ids fixed, prefix-preserving; run ``i`` of a batch is rewarded ``i % 2``."""

    protocol = "fixed"
    environment_names = ["FixedRuns"]
    max_env_steps = 2
    history = "tokens"

    def __init__(self):
        self.metrics: dict[str, float] = {}
        self.started = None

    def trl_arguments(self, given, reward_funcs):
        return given | {"reward_funcs": [environment_reward, *reward_funcs]}

    def start(self, context):
        self.started = context

    def generate(self, inputs, trl_generate):
        return trl_generate(inputs, rollout_func=self.report)

    def report(self, prompts, trainer):
        eos = self.started.generation.eos_token_id
        runs = [
            Run(
                steps=[
                    Step([11, 12], [13, 14, eos], None, 0.0, ""),
                    Step([11, 12, 13, 14, eos, 15], [16, eos], None, float(i % 2), ""),
                ],
                reward=float(i % 2),
                done=True,
            )
            for i in range(len(prompts))
        ]
        last = [run.steps[-1] for run in runs]
        return {
            "prompt_ids": [s.prompt_ids for s in last],
            "completion_ids": [s.completion_ids for s in last],
            "logprobs": None,
            "env_reward": [run.reward for run in runs],
            "run": runs,
        }

    def runs(self, output, inputs, rewards):
        return [row["run"] for row in inputs]


def test_a_rollout_of_ones_own_plugs_into_the_trainer(tmp_path, tiny_model_dir):
    # issue 37 item 4: the trainer asks the Rollout for whole runs and lays them out, whatever the protocol's name;
    # 4 runs (2 tasks x num_generations 2), each one row of both turns (shared prefix), rewards 0, 1 per task
    rollout = FixedRuns()
    trainer = Recording(
        model=tiny_model_dir,
        args=StepGRPOConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / "out"),
                max_steps=1,
                shuffle_dataset=False,
                num_generations=2,
                per_device_train_batch_size=4,
                max_env_steps=2,
            )
        ),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Go."}]] * 2}),
        rollout=rollout,
    )
    assert trainer.environment_protocol == "fixed" and rollout.started.tokenizer is trainer.processing_class
    trainer.train()
    eos = trainer._tokenizer.eos_token_id
    batch = trainer.recorded.batches[0]
    assert batch["sample_count"].tolist() == [2, 2, 2, 2]
    for r in range(4):
        mask = batch["completion_mask"][r].bool()
        assert batch["completion_ids"][r][mask].tolist() == [13, 14, eos, 15, 16, eos]
        assert batch["segment_ids"][r][mask].tolist() == [0, 0, 0, -1, 1, 1]
    # step-wise GRPO of rewards (0, 1) per task: -z, +z for both turns of each run
    fn = ADVANTAGE_FN.get("step_wise_grpo")(**ADVANTAGE_FN.get("step_wise_grpo").default_args())
    exps = [
        Experience(eid=EID(batch=0, task=i // 2, run=i % 2, step=s), tokens=torch.zeros(1), reward=float(i % 2))
        for i in range(4)
        for s in range(2)
    ]
    expected = {(e.eid.task, e.eid.run): float(e.advantages[0]) for e in fn(exps)[0]}
    assert expected[(0, 0)] < 0 < expected[(0, 1)]
    trained = batch["advantages"][batch["segment_ids"] >= 0].view(4, 5)  # 5 trained tokens per row
    for i in range(4):
        assert trained[i].tolist() == approx([expected[(i // 2, i % 2)]] * 5, terms=2)
    trainer.save_model(str(tmp_path / "saved"))
    assert "| environment | `FixedRuns` |" in (tmp_path / "saved" / "README.md").read_text()


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"runs": None}, TypeError, "FixedRuns lacks runs"),
        ({"max_env_steps": 3}, ValueError, "max_env_steps=3 turns per run but the config says max_env_steps=2"),
        ({"history": "messages"}, ValueError, "history by 'messages' but the config says history='tokens'"),
    ],
)
def test_a_rollout_that_does_not_fit_is_refused_at_construction(tmp_path, tiny_model_dir, change, error, match):
    rollout = FixedRuns()
    for name, value in change.items():
        setattr(rollout, name, value)
    with pytest.raises(error, match=match):
        StepGRPOTrainer(
            model=tiny_model_dir,
            args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_env_steps=2)),
            train_dataset=number_guess_dataset(2),
            rollout=rollout,
        )
    with pytest.raises(ValueError, match="rollout= plays its own runs"):
        StepGRPOTrainer(
            model=tiny_model_dir,
            args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_env_steps=2)),
            train_dataset=number_guess_dataset(2),
            rollout=FixedRuns(),
            environment_factory=NumberGuessEnv,
        )


# ---------------------------------------------------------------------------------------------------------------------
# GiGPO (docs/trainers/step-grpo.md#gigpo): the trainer records each step's state and feeds it to the advantage


class AnchorEnv(Environment):
    """Run i (in the order the environments are built) walks the states ``PATHS[i]`` (each an observation) and ends
    with reward ``FINAL[i]``: docs/algorithms/advantages.md#gigpo's reference runs A, B, C, plus D that ends at once.
    The reset observation, s0, is every run's first state."""

    PATHS = [["s1"], ["s2"], ["s1", "s3"], []]
    FINAL = [1.0, 0.0, 0.5, 0.5]
    built = 0

    def reset(self, **row):
        self.index, self.turn = AnchorEnv.built % 4, 0
        AnchorEnv.built += 1
        return "s0"

    def step(self, action):
        path = self.PATHS[self.index]
        self.turn += 1
        if self.turn > len(path):
            return StepResult("Done.", reward=self.FINAL[self.index], done=True)
        return StepResult(path[self.turn - 1], reward=9.0)  # a decoy: GiGPO reads the last step's reward


def test_gigpo_trains_each_step_with_its_anchor_state_advantage(tmp_path, tiny_model_dir):
    AnchorEnv.built = 0
    trainer = make(tmp_path, tiny_model_dir, Dataset.from_dict({"task": [0] * 4}), env=AnchorEnv, algorithm="gigpo")
    assert trainer.components.advantage_fn.needs_step_states and trainer.algorithm.advantage.name == "gigpo"
    trainer.train()
    runs = runs_of(trainer)
    assert [len(run.steps) for run in runs] == [2, 2, 3, 1]
    # the state each step acted from: the reset observation, then the previous step's observation
    assert [[s.state_key for s in run.steps] for run in runs][2] == [
        "observation:s0",
        "observation:s1",
        "observation:s3",
    ]
    # the reference values (omega 1, gamma 1, F none), each divided by 1 + epsilon; D, alone after s0, gets 0
    expected = [[1.0, 0.75], [-1.0, -0.5], [0.0, -0.25, 0.0], [0.0]]
    for got, want in zip(trainer.step_advantages, expected):
        assert got == [approx(v / (1 + 1e-6), terms=16, scale=2.0) for v in want]
    trained = torch.cat([rows["advantages"][rows["sample_count"].bool()] for rows in loss_inputs(trainer)])
    assert sorted(set(trained[trained != 0].tolist())) == approx(sorted({v for r in expected for v in r} - {0.0}))
    logged = trainer.state.log_history[0]
    assert logged["gigpo/anchor_hit_ratio"] == 0.5  # A's and C's second steps act from s1; B's s2 and C's s3 alone
    assert logged["gigpo/later_steps"] == 4.0


class DeclaringEnv(Environment):
    """Two turns, each declaring an immediate reward of 0.25 beside a running score of 0.25 per turn."""

    def reset(self, **row):
        self.turn = 0
        return "Go."

    def step(self, action):
        self.turn += 1
        return StepResult("Again.", reward=0.25 * self.turn, done=self.turn == 2, info={"step_reward": 0.25})


def test_gigpo_sums_declared_step_rewards_and_refuses_reward_functions_they_would_hide(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, Dataset.from_dict({"task": [0] * 4}), env=DeclaringEnv, algorithm="gigpo")
    trainer.train()
    assert [[s.step_reward for s in run.steps] for run in runs_of(trainer)] == [[0.25, 0.25]] * 4
    assert trainer.step_advantages == [[0.0, 0.0]] * 4  # equal returns
    with_reward_functions = StepGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=Dataset.from_dict({"task": [0] * 4}),
        environment_factory=DeclaringEnv,
        args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "x"), max_steps=1, algorithm="gigpo")),
    )
    with pytest.raises(ValueError, match=r"declares info\['step_reward'\].*\['environment_reward', 'length_reward'\]"):
        with_reward_functions.train()


def test_gigpo_is_refused_where_no_step_states_are_recorded_and_with_step_wise_grpo_options(tmp_path, tiny_model_dir):
    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    with pytest.raises(ValueError, match="advantage 'gigpo' compares the steps of multi-step runs.*StepGRPOTrainer"):
        TrinityTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c", "d"]}),
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="gigpo")),
        )
    with pytest.raises(ValueError, match="std_threshold=0.0 is an option of the step_wise_grpo advantage; 'gigpo'"):
        StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="gigpo", std_threshold=0.0))
    # the preset brings gigpo; advantage= brings it under another preset, and its arguments pass through
    config = StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), advantage={"name": "gigpo", "omega": 0.0}))
    assert config.resolved_algorithm().advantage.args == {
        "omega": 0.0,
        "gamma": 1.0,
        "fnorm": "none",
        "epsilon": 1e-6,
    }
