"""The StepGRPO recipe runs end to end from its YAML config plus command-line overrides."""

from __future__ import annotations

import os
import sys

import pytest

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


@pytest.mark.parametrize("environment", ["number_guess", "calculator"])
def test_step_grpo_recipe_runs_two_steps(tmp_path, tiny_model_dir, environment):
    sys.path.insert(0, RECIPES)
    try:
        import step_grpo
    finally:
        sys.path.remove(RECIPES)
    trainer = step_grpo.main([
        "--config", os.path.join(RECIPES, "configs", "step_grpo_cpu.yaml"),
        "--model_name_or_path", tiny_model_dir, "--environment", environment, "--output_dir", str(tmp_path),
        "--max_steps", "2", "--num_tasks", "8", "--max_completion_length", "8", "--max_env_steps", "2",
    ])
    assert trainer.state.global_step == 2
    assert {"adapter_model.safetensors", "README.md"} <= set(os.listdir(tmp_path))
    assert "multi_step/steps_per_run" in trainer.state.log_history[0]


def test_step_grpo_recipe_rejects_unknown_environment(tmp_path, tiny_model_dir):
    sys.path.insert(0, RECIPES)
    try:
        import step_grpo
    finally:
        sys.path.remove(RECIPES)
    with pytest.raises(ValueError, match="environment must be one of"):
        step_grpo.main(["--config", os.path.join(RECIPES, "configs", "step_grpo_cpu.yaml"),
                        "--model_name_or_path", tiny_model_dir, "--environment", "chess", "--output_dir", str(tmp_path)])
