"""The main job (`make demo` = `trinity-trl demo`, config chord_cpu): its settings are those the README states,
its rollouts come from the templates it names, and its console line, plot and model card show both CHORD terms."""

from __future__ import annotations

import yaml

from trinity_trl.cli import run as cli
from trinity_trl.data.arithmetic import TEMPLATES
from trinity_trl.recipes import config_path
from trinity_trl.recipes.chord import terms_card_section
from trinity_trl.recipes.common import RecipeArguments, load_task
from trinity_trl.recipes.plot import curves

from .test_recipes import RUNS, run_recipe

# what the README's main-job paragraph says of the demo: change both together
README_STATES = {
    "max_steps": 8,
    "per_device_train_batch_size": 8,  # rollouts per step: 2 prompts x 4
    "num_generations": 4,
    "expert_batch_size": 8,
    "rollout_kinds": ["mul", "div"],
    "mu_peak": 0.9,
    "mu_valley": 0.05,
    "mu_warmup_steps": 0,
    "mu_decay_steps": 16,  # twice max_steps: mu ends halfway (0.48)
    "max_completion_length": 40,
    "temperature": 0.8,
    "num_eval_rows": 100,
    "lora_r": 16,
    "learning_rate": 1.0e-3,
    "torch_threads": 1,
    "enable_phi_function": False,
}


def test_demo_config_is_what_the_readme_states():
    with open(config_path("chord_cpu"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    assert {key: config.get(key) for key in README_STATES} == README_STATES
    assert config["algorithm"] == "mix_chord" and config["dataset_name"] == "arithmetic"


def test_demo_rollouts_draw_the_named_templates_and_show_both_terms(tmp_path, tiny_model_dir, capsys):
    config, tiny = RUNS["chord"]
    trainer = cli(
        [
            "chord",
            "--config",
            config,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            *tiny,
            "--eval_accuracy",
            "false",
        ]
    )
    assert set(trainer.train_dataset["kind"]) == {"mul", "div"}  # rollout_kinds of chord_cpu
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("| reward " in line and "| rl " in line and "| sft " in line for line in lines)
    panels = curves(trainer.state.log_history)
    assert {"mean reward", "groups with non-zero advantages (fraction)"} <= set(panels["reward"])
    assert "RL loss" in panels["losses"]
    card = (tmp_path / "README.md").read_text()
    assert "## What each term did" in card and "SFT term" in card and "RL term" in card


def test_rollout_kinds_all_templates_by_default(tmp_path, tiny_model_dir):
    trainer = run_recipe("chord", tiny_model_dir, tmp_path, "--eval_accuracy", "false", "--rollout_kinds", "add")
    assert set(trainer.train_dataset["kind"]) == {"add"}
    default = load_task(RecipeArguments(num_train_rows=64, num_eval_rows=2))  # no rollout_kinds given
    assert set(default.train["kind"]) == set(TEMPLATES)
    # on one's own data it is ignored with one line: tests/recipes/test_common_data.py


def _entry(step, mu, sft, reward, zero_std):
    return {"step": step, "loss": 0.1, "actor/mu": mu, "actor/expert/sft_loss": sft, "reward": reward,
            "frac_reward_zero_std": zero_std}  # fmt: skip


def test_terms_card_section_reports_each_term():
    history = [
        _entry(1, 0.9, 1.2, 0.0, 1.0),
        _entry(2, 0.5, 0.6, 0.25, 0.5),
        _entry(3, 0.05, 0.3, 0.5, 0.0),
        {"step": 3, "train_runtime": 1.0},
    ]
    text = terms_card_section(history)
    assert "weight mu 0.90 -> 0.05; loss 1.200 at step 1 -> 0.300 at step 3" in text
    assert "mean train reward 0.250 (first step 0.000, last 0.500); 2 of 3 steps had a rollout group" in text
    assert terms_card_section([{"step": 1, "loss": 0.1}]) == ""  # not a CHORD log: no section
