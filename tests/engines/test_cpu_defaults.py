"""Sane defaults where the run happens (`trainers/common.py` `apply_cpu_defaults`).

TRL turns bf16 and activation checkpointing on by default, and transformers refuses bf16 on a machine without a GPU
unless `use_cpu=True` ("Your setup doesn't support bf16/gpu"). Every trinity_trl config built on a CPU machine
without `use_cpu`, `bf16`/`fp16` or `activation_checkpointing` must build, train in float32 without checkpointing,
and say so once; explicit choices stay; with an accelerator TRL's defaults stay.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset

import trinity_trl.trainers.common as common
from trinity_trl.trainers import (
    ChordConfig,
    CISPOConfig,
    PPOConfig,
    SAPOConfig,
    StepGRPOConfig,
    TrinityConfig,
    TrinityDPOConfig,
    TrinitySFTConfig,
    TrinityTrainer,
)

CONFIGS = (
    TrinityConfig,
    ChordConfig,
    CISPOConfig,
    SAPOConfig,
    StepGRPOConfig,
    PPOConfig,
    TrinitySFTConfig,
    TrinityDPOConfig,
)
ANNOUNCEMENT = "No GPU or other accelerator: training in float32"

pytestmark = pytest.mark.skipif(common.accelerator_available(), reason="these tests are about a machine without GPU")


@pytest.fixture
def announcements(monkeypatch, caplog):
    monkeypatch.setattr(common, "_CPU_DEFAULTS_ANNOUNCED", False)
    caplog.set_level(logging.WARNING, logger="trinity_trl")
    return lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith(ANNOUNCEMENT)]


@pytest.mark.parametrize("config_class", CONFIGS)
def test_a_config_built_on_a_cpu_without_use_cpu_or_bf16_is_float32(tmp_path, config_class, announcements):
    config = config_class(output_dir=str(tmp_path), report_to="none")  # TRL's defaults would raise here
    assert config.bf16 is False and not config.fp16
    assert config.activation_checkpointing is False
    assert not config.use_cpu
    assert announcements() == [
        f"{ANNOUNCEMENT} (bf16=True to override), without activation checkpointing "
        "(activation_checkpointing=True to override)."
    ]


def test_said_once_per_process(tmp_path, announcements):
    for config_class in CONFIGS:
        config_class(output_dir=str(tmp_path), report_to="none")
    assert len(announcements()) == 1


def test_explicit_choices_stay(tmp_path, announcements):
    config = TrinityConfig(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=True, activation_checkpointing=True
    )
    assert config.bf16 is True and config.activation_checkpointing is True
    assert announcements() == []
    # bf16 without use_cpu on a machine without GPU: transformers' own refusal, which names the fix
    with pytest.raises(ValueError, match="doesn't support bf16/gpu.*use_cpu"):
        TrinityConfig(output_dir=str(tmp_path), report_to="none", bf16=True)


def test_with_an_accelerator_trl_defaults_stay(monkeypatch):
    monkeypatch.setattr(common, "accelerator_available", lambda: True)
    config = SimpleNamespace(
        use_cpu=False,
        bf16=None,
        fp16=False,
        activation_checkpointing=None,
        gradient_checkpointing=True,
        activation_checkpointing_kwargs=None,
        gradient_checkpointing_kwargs=None,
    )
    common.apply_cpu_defaults(config)
    assert config.bf16 is None  # TRL's __post_init__ turns it on
    assert config.activation_checkpointing is True


def test_the_trainer_built_from_such_a_config_trains_in_float32(tmp_path, tiny_model_dir):
    args = TrinityConfig(
        output_dir=str(tmp_path),
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset(4)
    )
    assert trainer.accelerator.mixed_precision == "no"
    assert trainer.model.dtype == torch.float32
    assert not trainer.model.is_gradient_checkpointing
