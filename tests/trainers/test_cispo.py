"""`trinity_trl/trainers/cispo_trainer.py`: CISPOConfig's fields reach the cispo loss, and CISPOTrainer is a
TrinityTrainer with that config. Its loss and gradients against TRL's `loss_type="cispo"`: test_trl_parity.py."""

from __future__ import annotations

import pytest
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.trainers import CISPOConfig, CISPOTrainer, TrinityTrainer

# TrainingArguments warns about TRL's own default `gradient_checkpointing=True` on every config built here
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


def _config(tmp_path, cls, **kwargs):
    return cls(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def test_cispo_config_fields_land_in_policy_loss_args(tmp_path):
    config = _config(
        tmp_path,
        CISPOConfig,
        policy_loss={
            "clip_range_low": 0.5,
            "clip_range_high": 0.4,
            "enable_mask_clip": True,
            "mask_clip_range_low": 0.9,
            "mask_clip_range_high": 0.5,
        },
    )
    args = config.resolved_algorithm().policy_loss.args
    assert {
        k: args[k]
        for k in (
            "clip_range_low",
            "clip_range_high",
            "enable_mask_clip",
            "mask_clip_range_low",
            "mask_clip_range_high",
        )
    } == {
        "clip_range_low": 0.5,
        "clip_range_high": 0.4,
        "enable_mask_clip": True,
        "mask_clip_range_low": 0.9,
        "mask_clip_range_high": 0.5,
    }
    resolved = _config(tmp_path, CISPOConfig).resolved_algorithm()
    assert resolved.algorithm == "cispo" and resolved.policy_loss.name == "cispo"
    assert resolved.kl_loss.name == "none"  # TRL's beta=0.0: no KL unless named (issue 43)
    assert _config(tmp_path, CISPOConfig, kl_loss="k2").resolved_algorithm().kl_loss.args["kl_coef"] == 0.001
    # one door: the loss's argument (the flat field of 0.1 is gone)
    given = _config(tmp_path, CISPOConfig, policy_loss={"clip_range_high": 5.0})
    assert given.resolved_algorithm().policy_loss.args["clip_range_high"] == 5.0
    with pytest.raises(TypeError, match="clip_range_high was removed"):
        _config(tmp_path, CISPOConfig, clip_range_high=0.6)
    with pytest.raises(ValueError, match="cispo"):
        _config(tmp_path, CISPOConfig, algorithm="grpo")


def test_cispo_trainer_trains_the_cispo_loss(tmp_path, tiny_model_dir):
    trainer = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        args=CISPOConfig(
            **tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1, policy_loss={"clip_range_high": 0.5})
        ),
    )
    assert isinstance(trainer, TrinityTrainer) and trainer._name == "CISPO"
    assert trainer.components.policy_loss.clip_range_high == 0.5
    trainer.train()
    assert "actor/cispo_loss" in trainer.state.log_history[0]
