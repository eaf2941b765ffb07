"""`trinity_trl/rollouts/environment_registry.py`: a new environment from a file outside the package (issue 37,
"Done means"), registered with `register_environment` and trained through Python, YAML (``import:`` beside the YAML
file) and the command line (``--import``, ``--environment``)."""

from __future__ import annotations

import textwrap

import pytest
from helpers import tiny_grpo_kwargs

from trinity_trl.algorithms.registry import import_components
from trinity_trl.rollouts import ENVIRONMENTS, register_environment

PLUGIN = textwrap.dedent(
    '''
    """A user's environment: count down from the task's number, two turns."""
    from datasets import Dataset

    from trinity_trl.rollouts import Environment, StepResult, register_environment


    def countdown_tasks(num_tasks, seed=0):
        return Dataset.from_dict({"start": [10 + (seed + i) % 7 for i in range(num_tasks)]})


    @register_environment("countdown", dataset=countdown_tasks)
    class Countdown(Environment):
        def reset(self, start, **row):
            self.start, self.turn = start, 0
            return f"Count down from {start}, one number per turn."

        def step(self, action):
            self.turn += 1
            expected = str(self.start - self.turn)
            if self.turn == 2:
                return StepResult("Done.", reward=float(expected in action), done=True)
            return StepResult(f"Next after {expected}?", reward=0.0)
    '''
)


@pytest.fixture
def env_plugin(tmp_path):
    """The user's file, outside the package; its environment is unregistered afterwards."""
    path = tmp_path / "user_env.py"
    path.write_text(PLUGIN)
    yield path
    if "countdown" in ENVIRONMENTS:
        ENVIRONMENTS.unregister("countdown")


def two_turn_runs(trainer) -> bool:
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    return logs["multi_step/steps_per_run"] == 2.0 and trainer.model_card.environment == "Countdown"


def test_an_environment_from_a_file_through_python(tmp_path, tiny_model_dir, env_plugin):
    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    import_components(str(env_plugin))
    named = ENVIRONMENTS.get("countdown")
    assert named.factory.__name__ == "Countdown" and not named.agent
    trainer = StepGRPOTrainer(
        model=tiny_model_dir,
        args=StepGRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1, max_env_steps=3)),
        **named.trainer_arguments(4, seed=0),
    )
    trainer.train()
    assert two_turn_runs(trainer)


RECIPE_YAML = (
    "max_env_steps: 3\nnum_tasks: 4\nmax_steps: 1\nmax_completion_length: 8\nper_device_train_batch_size: 4\n"
    "num_generations: 4\nlora_r: 4\nlora_alpha: 8\nlogging_steps: 1\nplot: false\nreport_to: none\n"
    "save_strategy: 'no'\nuse_cpu: true\nbf16: false\nactivation_checkpointing: false\n"
)


def test_an_environment_from_a_file_through_yaml_and_the_command_line(tmp_path, tiny_model_dir, env_plugin):
    from trinity_trl.cli import run

    common = f"model_name_or_path: {tiny_model_dir}\n" + RECIPE_YAML
    config = tmp_path / "run.yaml"
    config.write_text(f"import: user_env.py\nenvironment: countdown\noutput_dir: {tmp_path / 'yaml'}\n" + common)
    assert two_turn_runs(run(["step_grpo", "--config", str(config)]))
    ENVIRONMENTS.unregister("countdown")  # the command line imports the file again, elsewhere
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "user_env.py").write_text(env_plugin.read_text())
    config = tmp_path / "plain.yaml"
    config.write_text(f"output_dir: {tmp_path / 'cli'}\n" + common)
    argv = ["step_grpo", "--config", str(config), "--import", str(moved / "user_env.py"), "--environment", "countdown"]
    assert two_turn_runs(run(argv))


def test_an_unknown_or_taken_name_is_one_line(tmp_path):
    from trinity_trl.cli import run
    from trinity_trl.recipes.common import UsageError

    with pytest.raises(UsageError, match=r"environment must be one of \[.*'number_guess'.*\].*got 'nowhere'"):
        run(["step_grpo", "--environment", "nowhere", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="environment 'number_guess' is already registered"):
        register_environment("number_guess")(object)
    with pytest.raises(TypeError, match="dataset must be a function"):
        register_environment("other", dataset=[1, 2])
