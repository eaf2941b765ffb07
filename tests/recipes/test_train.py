"""recipes/train.py: the preset runner picks the recipe and trainer from --algorithm."""

from __future__ import annotations

import pytest

from trinity_trl.cli import run as cli
from trinity_trl.recipes.common import UsageError
from trinity_trl.recipes.train import algorithm_from


def test_preset_runner_picks_the_algorithm_from_argv_or_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("algorithm: rloo\n")
    assert algorithm_from(["--config", str(config)]) == "rloo"
    assert algorithm_from(["--config", str(config), "--algorithm", "opmd"]) == "opmd"
    assert algorithm_from(["--algorithm=topr"]) == "topr"
    assert algorithm_from(["--config", "sft_cpu"]) == "sft"  # a bundled config by name
    assert algorithm_from([]) == "grpo"
    with pytest.raises(UsageError, match="unknown algorithm 'grpoo'"):
        algorithm_from(["--algorithm", "grpoo"])


def test_on_policy_distill_teacher_only_with_that_preset(tmp_path, tiny_model_dir):
    with pytest.raises(UsageError, match="only used by the on_policy_distill"):
        cli(
            [
                "train",
                "--algorithm",
                "grpo",
                "--model_name_or_path",
                tiny_model_dir,
                "--output_dir",
                str(tmp_path),
                "--teacher_model_name_or_path",
                tiny_model_dir,
            ]
        )
