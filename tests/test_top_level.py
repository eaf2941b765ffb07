"""TRL's import surface (issue 35): every public trainer and config is importable from ``trinity_trl`` as TRL's are
from ``trl``, loaded on first access so that ``import trinity_trl`` stays light; and a trainer given a keyword
argument another trainer owns (``expert_dataset`` to TrinityTrainer) names that trainer in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from datasets import Dataset
from helpers import length_reward, tiny_grpo_kwargs
from launching import scaled_timeout

import trinity_trl
from trinity_trl import trainers


def test_every_public_trainer_and_config_is_at_the_top_level():
    from trinity_trl import ChordConfig, ChordTrainer, CISPOTrainer, TrinityTrainer  # noqa: F401 - the TRL spelling

    assert set(trainers.__all__) <= set(trinity_trl.__all__) <= set(dir(trinity_trl))
    for name in trainers.__all__:
        assert getattr(trinity_trl, name) is getattr(trainers, name)
    with pytest.raises(AttributeError, match="has no attribute 'ChordTrainr'"):
        trinity_trl.ChordTrainr  # noqa: B018


def test_import_trinity_trl_imports_no_trainer_torch_or_trl():
    """Checked in a fresh interpreter: this test session has imported all of them already."""
    code = (
        "import sys, trinity_trl\n"
        "heavy = ['torch', 'trl', 'transformers', 'datasets', 'trinity_trl.trainers']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from trinity_trl import ChordTrainer\n"
        "print(ChordTrainer.__module__, 'trl' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=scaled_timeout(120)
    ).stdout.splitlines()
    assert out == ["[]", "trinity_trl.trainers.chord True"]


@pytest.mark.parametrize(
    ("trainer", "argument", "owner"),
    [
        ("TrinityTrainer", "expert_dataset", "ChordTrainer"),
        ("CISPOTrainer", "expert_dataset", "ChordTrainer"),
        ("TrinityTrainer", "agent", "StepGRPOTrainer"),
        ("SAPOTrainer", "value_model", "PPOTrainer"),
    ],
)
def test_an_argument_another_trainer_owns_names_that_trainer(trainer, argument, owner, tmp_path, tiny_model_dir):
    data = Dataset.from_dict({"prompt": ["What is 1+1?"], "completion": [" 2"]})
    config = getattr(trinity_trl, trainer.replace("Trainer", "Config"))
    with pytest.raises(TypeError, match=rf"^{trainer} does not take {argument} \(.*\); use {owner} with a "):
        getattr(trinity_trl, trainer)(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            args=config(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
            train_dataset=data,
            **{argument: data},
        )
