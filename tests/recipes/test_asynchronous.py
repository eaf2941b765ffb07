"""``--asynchronous``: a recipe trains with its trainer's asynchronous twin from the same config, in one argument
(docs/asynchronous.md); recipes without a twin refuse it in one line."""

from __future__ import annotations

import json
import os

import pytest

from trinity_trl.cli import run as cli
from trinity_trl.recipes.common import UsageError, asynchronous_requested

# a bundled CPU config made tiny: the tiny model, 2 steps of one group of 4 completions of 8 tokens, 4 held-out rows
TINY = ["--max_steps", "2", "--num_train_rows", "8", "--num_eval_rows", "4", "--eval_max_new_tokens", "8"]
TINY += ["--eval_batch_size", "4", "--max_completion_length", "8", "--per_device_train_batch_size", "4"]
TINY += ["--num_generations", "4", "--lora_r", "4", "--lora_alpha", "8"]


@pytest.mark.parametrize(
    "command, config, extra, trainer",
    [
        ("cispo", "cispo_cpu", [], "AsyncCISPOTrainer"),
        (
            "chord",
            "chord_cpu",
            ["--expert_batch_size", "2", "--num_expert_rows", "8", "--mu_decay_steps", "2"],
            "AsyncChordTrainer",
        ),
        ("train", "train_cpu", ["--algorithm", "opmd"], "AsyncTrinityTrainer"),
    ],
)
def test_a_recipe_trains_asynchronously_with_one_more_argument(
    command, config, extra, trainer, tmp_path, tiny_model_dir
):
    run = cli(
        [
            command,
            "--config",
            config,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            *TINY,
            *extra,
            "--asynchronous",
        ]
    )
    assert type(run).__name__ == trainer and run.state.global_step == 2
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert 0.0 <= log["summary"]["accuracy_after"] <= 1.0  # the trained model generates for the held-out check
    assert any("async/staleness" in entry for entry in log["log_history"])
    assert {"adapter_model.safetensors", "README.md", "training_log.json"} <= set(os.listdir(tmp_path))


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--asynchronous"], True),
        (["--asynchronous", "--max_steps", "2"], True),
        (["--asynchronous", "false"], False),
        (["--asynchronous=true"], True),
        (["--max_steps", "2"], False),
    ],
)
def test_the_flag_is_read_before_parsing(argv, expected):
    assert asynchronous_requested(argv) is expected


def test_the_flag_in_a_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("asynchronous: true\nmax_steps: 2\n")
    assert asynchronous_requested(["--config", str(config)]) is True
    assert asynchronous_requested(["--config", str(config), "--asynchronous", "false"]) is False
    config.write_text("asynchronous: maybe\n")
    with pytest.raises(UsageError, match="asynchronous must be true or false"):
        asynchronous_requested(["--config", str(config)])


def test_the_step_grpo_recipe_trains_asynchronously_with_one_more_argument(tmp_path, tiny_model_dir):
    """The number-guessing config with ``--asynchronous``: AsyncStepGRPOTrainer, each turn a sample."""
    tiny = ["--max_steps", "2", "--num_tasks", "8", "--max_completion_length", "8", "--max_env_steps", "2"]
    tiny += ["--lora_r", "4", "--lora_alpha", "8"]
    argv = ["step_grpo", "--config", "step_grpo_cpu", "--model_name_or_path", tiny_model_dir, *tiny]
    run = cli([*argv, "--output_dir", str(tmp_path), "--asynchronous"])
    assert type(run).__name__ == "AsyncStepGRPOTrainer" and run.state.global_step == 2
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert any("multi_step/steps_per_run" in entry for entry in log["log_history"])
    assert {"adapter_model.safetensors", "README.md", "training_log.json"} <= set(os.listdir(tmp_path))


def test_the_agent_config_trains_asynchronously_and_a_tool_environment_is_refused_in_one_line(tmp_path, tiny_model_dir):
    tiny = ["--max_steps", "1", "--num_tasks", "4", "--max_completion_length", "8", "--max_env_steps", "2"]
    tiny += ["--num_generations", "2", "--per_device_train_batch_size", "2"]
    argv = ["step_grpo", "--model_name_or_path", tiny_model_dir, *tiny, "--asynchronous"]
    run = cli([*argv, "--config", "step_grpo_agent_cpu", "--output_dir", str(tmp_path / "agent")])
    assert type(run).__name__ == "AsyncStepGRPOTrainer" and run.state.global_step == 1
    with pytest.raises(ValueError, match="is a TRL tool environment") as info:
        cli([*argv, "--config", "step_grpo_tools_cpu", "--output_dir", str(tmp_path / "tools")])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("command, config", [("ppo", "ppo_cpu")])
def test_recipes_without_an_asynchronous_twin_refuse_it(command, config, tiny_model_dir):
    with pytest.raises(UsageError, match="has no asynchronous twin") as info:
        cli([command, "--config", config, "--model_name_or_path", tiny_model_dir, "--asynchronous"])
    assert "\n" not in str(info.value)


def test_an_option_only_the_synchronous_trainer_has_is_named(tiny_model_dir, tmp_path):
    """A synchronous option under --asynchronous is one line saying it is one, and what the asynchronous one is (it
    was an unknown option with "did you mean --num_generations?"), on the command line and in a config file."""
    base = ["cispo", "--config", "cispo_cpu", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path)]
    with pytest.raises(UsageError) as info:
        cli([*base, "--asynchronous", "--steps_per_generation", "2"])
    assert str(info.value).startswith(
        "--steps_per_generation is an option of the synchronous trainers, not of the asynchronous one "
        "(--asynchronous): the worker generates one group at a time all along, and how far behind the trained "
        "weights a sample may be is --max_staleness"
    )
    assert "did you mean" not in str(info.value) and "\n" not in str(info.value)
    config = tmp_path / "mine.yaml"
    config.write_text("asynchronous: true\nuse_vllm: true\n")
    with pytest.raises(UsageError, match=r"--use_vllm \(in .*mine.yaml\) is an option of the synchronous trainers.*"
                       "--generation_backend vllm"):  # fmt: skip
        cli(["cispo", "--config", str(config), "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path)])
