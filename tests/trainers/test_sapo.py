"""`trinity_trl/trainers/sapo_trainer.py`: SAPOConfig's defaults and fields reach the sapo loss, and SAPOTrainer is a
TrinityTrainer with that config. Its loss and gradients against TRL's `loss_type="sapo"`: test_trl_parity.py."""

from __future__ import annotations

import pytest
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.trainers import SAPOConfig, SAPOTrainer, TrinityTrainer

# TrainingArguments warns about TRL's own default `gradient_checkpointing=True` on every config built here
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


def _config(tmp_path, cls, **kwargs):
    return cls(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def test_sapo_config(tmp_path):
    resolved = _config(tmp_path, SAPOConfig).resolved_algorithm()
    assert resolved.policy_loss.name == "sapo"
    assert resolved.policy_loss.args["form"] == "paper"
    assert resolved.loss_agg_mode == "seq-mean-token-mean"
    assert resolved.build_policy_loss().loss_agg_mode == "seq-mean-token-mean"
    assert resolved.kl_loss.name == "none" and not resolved.needs_reference
    custom = _config(
        tmp_path,
        SAPOConfig,
        sapo_temperature_pos=0.8,
        sapo_temperature_neg=1.5,
        policy_loss={"form": "trinity"},
    )
    args = custom.resolved_algorithm().policy_loss.args
    assert (args["tau_pos"], args["tau_neg"], args["form"]) == (0.8, 1.5, "trinity")
    with pytest.raises(ValueError, match="form"):
        _config(tmp_path, SAPOConfig, policy_loss={"form": "bad"})
    # one door: the loss's own argument, no clash with a trainer field
    given = _config(tmp_path, SAPOConfig, policy_loss={"form": "trinity"}).resolved_algorithm()
    assert given.policy_loss.args["form"] == "trinity"
    with pytest.raises(
        TypeError, match=r"SAPOConfig: sapo_form was removed in trinity_trl 0.2; write policy_loss=\{'form'"
    ):
        _config(tmp_path, SAPOConfig, sapo_form="paper")  # the spelling of 0.1
    with pytest.raises(ValueError, match="sapo"):
        _config(tmp_path, SAPOConfig, algorithm="grpo")


def test_sapo_config_replace_mode_keeps_its_aggregation(tmp_path):
    resolved = _config(tmp_path, SAPOConfig, component_args_mode="replace").resolved_algorithm()
    assert resolved.build_policy_loss().loss_agg_mode == "seq-mean-token-mean"


def test_sapo_trainer_trains_the_sapo_loss(tmp_path, tiny_model_dir):
    trainer = SAPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        args=SAPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), max_steps=1, sapo_temperature_neg=1.5)),
    )
    assert isinstance(trainer, TrinityTrainer) and trainer._name == "SAPO"
    assert trainer.components.policy_loss.tau_neg == 1.5
    assert trainer.ref_model is None  # no KL loss in the SAPO paper: no reference model
    trainer.train()
    assert "actor/sapo_loss" in trainer.state.log_history[0]
