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


@pytest.fixture(scope="module")
def fresh_imports() -> list[str]:
    """What a fresh interpreter holds after ``import trinity_trl``, then after importing the trainers, the rollouts
    and packing: checked in a fresh interpreter because this test session has imported all of them already. One
    interpreter serves both tests below (each import of TRL costs seconds): the first lines are printed before any
    trainer is imported, so each test reads the state it checks."""
    code = (
        "import sys, trinity_trl\n"
        "heavy = ['torch', 'trl', 'transformers', 'datasets', 'trinity_trl.trainers']\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from trinity_trl import ChordTrainer\n"
        "print(ChordTrainer.__module__, 'trl' in sys.modules)\n"
        "from trinity_trl import StepGRPOTrainer, TrinityTrainer\n"
        "import trinity_trl.rollouts, trinity_trl.packing\n"
        "typed = ['trinity_trl.rollouts.' + m for m in ('body', 'chat_request', 'responses_request', "
        "'messages_request', 'wire')]\n"
        "print(sorted(m for m in typed + ['fastapi', 'anthropic'] if m in sys.modules))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=scaled_timeout(180)
    ).stdout.splitlines()


def test_import_trinity_trl_imports_no_trainer_torch_or_trl(fresh_imports):
    assert fresh_imports[:2] == ["[]", "trinity_trl.trainers.chord_trainer True"]


def test_importing_every_trainer_imports_no_agent_request_model(fresh_imports):
    """The typed request models need pydantic (the ``agents`` extra's, through FastAPI): they are imported when an
    endpoint serves, not with the trainers (the lent GPU machine, for one, has no pydantic)."""
    assert fresh_imports[2:] == ["[]"]


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


def test_a_plain_grpo_config_with_use_cpu_trains_on_a_cpu_and_converts_silently(tmp_path, tiny_model_dir, recwarn):
    """What the README tells a TRL user on a CPU: TRL's own GRPOConfig refuses its bf16 default without a GPU unless
    `use_cpu=True`; given that, the conversion sets the rest a CPU needs (float32, no activation checkpointing) and
    warns about nothing (TRL's GRPOConfig prints transformers' `gradient_checkpointing is deprecated` itself)."""
    from helpers import tiny_conversational_dataset
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_steps=1, max_completion_length=8, report_to="none")
    recwarn.clear()
    trainer = trinity_trl.CISPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )
    assert [str(w.message) for w in recwarn if "checkpointing" in str(w.message)] == []
    assert isinstance(trainer.args, trinity_trl.CISPOConfig) and not trainer.args.bf16
    assert not trainer.args.activation_checkpointing and trainer.args.use_cpu
    trainer.train()
    assert trainer.state.global_step == 1
