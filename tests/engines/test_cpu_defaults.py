"""Sane defaults where the run happens (`trainers/machine.py`: `apply_cpu_defaults` when a config is built,
`start_on_this_machine` when a trainer starts).

TRL turns bf16 and activation checkpointing on by default, and transformers refuses bf16 on a machine without a GPU
unless `use_cpu=True` ("Your setup doesn't support bf16/gpu"). Every trinity_trl config built on a CPU machine
without `use_cpu`, `bf16`/`fp16` or `activation_checkpointing` must build and train in float32 without
checkpointing; explicit choices stay; with an accelerator TRL's defaults stay. Building a config changes nothing
process-wide (issue 37 item 3): when a trainer starts, torch gets one thread per process on a CPU (torch's default of
one per core collapses on a shared small machine) unless `OMP_NUM_THREADS` or the config's `torch_threads` says
otherwise, and one line says what was chosen.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset

import trinity_trl.trainers.machine as machine
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
THREADS = "with one torch thread per process (torch_threads or OMP_NUM_THREADS to override)"

pytestmark = pytest.mark.skipif(machine.accelerator_available(), reason="these tests are about a machine without GPU")


@pytest.fixture
def announcements(monkeypatch, caplog):
    """The CPU-defaults log lines of the test; OMP_NUM_THREADS unset and torch's thread count restored after."""
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    caplog.set_level(logging.WARNING, logger="trinity_trl")
    yield lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith("No GPU or other accelerator")]
    torch.set_num_threads(threads)


@pytest.mark.parametrize("config_class", CONFIGS)
def test_a_config_built_on_a_cpu_without_use_cpu_or_bf16_is_float32(tmp_path, config_class, announcements):
    torch.set_num_threads(2)
    config = config_class(output_dir=str(tmp_path), report_to="none")  # TRL's defaults would raise here
    assert config.bf16 is False and not config.fp16
    assert config.activation_checkpointing is False
    assert not config.use_cpu
    # building a config changes nothing process-wide: no thread count, no notice (the trainer does both)
    assert torch.get_num_threads() == 2 and announcements() == []
    machine.start_on_this_machine(config)
    assert announcements() == [
        f"{ANNOUNCEMENT} (bf16=True to override), without activation checkpointing "
        f"(activation_checkpointing=True to override), {THREADS}."
    ]
    assert torch.get_num_threads() == 1


def test_explicit_choices_stay(tmp_path, announcements):
    config = TrinityConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=True,
        activation_checkpointing=True,
        torch_threads=2,
    )
    assert config.bf16 is True and config.activation_checkpointing is True
    machine.start_on_this_machine(config)
    assert config.torch_threads == 2 and torch.get_num_threads() == 2
    assert announcements() == []
    # bf16 without use_cpu on a machine without GPU: transformers' own refusal, which names the fix
    with pytest.raises(ValueError, match="doesn't support bf16/gpu.*use_cpu"):
        TrinityConfig(output_dir=str(tmp_path), report_to="none", bf16=True)


def test_one_torch_thread_by_default_an_explicit_count_wins(tmp_path, announcements):
    torch.set_num_threads(2)
    config = CISPOConfig(output_dir=str(tmp_path), report_to="none")
    machine.start_on_this_machine(config)
    assert torch.get_num_threads() == 1 and config.torch_threads is None  # the config keeps what the user gave
    torch.set_num_threads(2)
    machine.start_on_this_machine(CISPOConfig(output_dir=str(tmp_path), report_to="none", torch_threads=0))
    assert torch.get_num_threads() == 2  # 0: torch's own choice, untouched
    machine.start_on_this_machine(TrinitySFTConfig(output_dir=str(tmp_path), report_to="none", torch_threads=3))
    assert torch.get_num_threads() == 3
    assert THREADS in announcements()[0] and not any(THREADS in line for line in announcements()[1:])
    with pytest.raises(ValueError, match="torch_threads must be a whole number >= 0, got -1"):
        TrinityDPOConfig(output_dir=str(tmp_path), report_to="none", torch_threads=-1)


def test_omp_num_threads_wins(tmp_path, announcements, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)  # what torch reads from OMP_NUM_THREADS=2 at start
    machine.start_on_this_machine(TrinityConfig(output_dir=str(tmp_path), report_to="none"))
    assert torch.get_num_threads() == 2
    assert announcements() == [
        f"{ANNOUNCEMENT} (bf16=True to override), without activation checkpointing "
        "(activation_checkpointing=True to override)."
    ]


def test_with_an_accelerator_trl_defaults_stay(monkeypatch):
    monkeypatch.setattr(machine, "accelerator_available", lambda: True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    config = SimpleNamespace(
        use_cpu=False,
        bf16=None,
        fp16=False,
        activation_checkpointing=None,
        gradient_checkpointing=True,
        activation_checkpointing_kwargs=None,
        gradient_checkpointing_kwargs=None,
    )
    machine.apply_cpu_defaults(config)
    assert config.bf16 is None  # TRL's __post_init__ turns it on
    assert config.activation_checkpointing is True
    config.torch_threads = None
    machine.start_on_this_machine(config)
    assert torch.get_num_threads() == threads  # torch's own thread count with an accelerator


def test_the_trainer_built_from_such_a_config_trains_in_float32(tmp_path, tiny_model_dir, announcements):
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
    # the trainer, not the config, set torch's threads and said so
    assert torch.get_num_threads() == 1 and len(announcements()) == 1 and THREADS in announcements()[0]
