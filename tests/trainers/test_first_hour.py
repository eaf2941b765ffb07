"""What a new user meets first (issue 14): CPU-safe defaults, `model="bundled"` wherever a model id works, and model
cards that say what was trained and load what was saved."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from peft import LoraConfig

from trinity_trl.data import model as bundled
from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    PPOConfig,
    PPOTrainer,
    TrinityConfig,
    TrinityDPOConfig,
    TrinityDPOTrainer,
    TrinitySFTConfig,
    TrinitySFTTrainer,
    TrinityTrainer,
    machine,
)

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


# ------------------------------------------------------------------------------------------- CPU defaults
@pytest.mark.parametrize("config_class", [TrinityConfig, TrinitySFTConfig, TrinityDPOConfig, PPOConfig])
def test_without_an_accelerator_configs_train_in_float32_without_checkpointing(
    tmp_path, config_class, caplog, monkeypatch
):
    """TRL's defaults (bf16, gradient checkpointing) are emulated on a CPU; without `use_cpu` or an explicit
    precision a config built here must neither fail ("doesn't support bf16/gpu") nor pick them; the trainer says so
    when it starts (tests/engines/test_cpu_defaults.py), building a config says nothing."""
    with caplog.at_level(logging.WARNING, logger="trinity_trl"):
        config = config_class(output_dir=str(tmp_path))
        assert not [r for r in caplog.records if "No GPU or other accelerator" in r.getMessage()]
        machine.start_on_this_machine(config)
    assert config.bf16 is False and config.activation_checkpointing is False
    said = [r.getMessage() for r in caplog.records if "No GPU or other accelerator" in r.getMessage()]
    assert len(said) == 1 and "float32" in said[0]


def test_explicit_precision_and_checkpointing_are_kept(tmp_path):
    config = TrinityConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True, activation_checkpointing=True)
    assert config.bf16 is True and config.activation_checkpointing is True


def test_with_an_accelerator_trl_defaults_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "accelerator_available", lambda: True)
    config = TrinityConfig.__new__(TrinityConfig)  # apply_cpu_defaults alone: no CUDA here for the full config
    config.use_cpu, config.bf16, config.fp16 = False, None, False
    config.activation_checkpointing, config.gradient_checkpointing = None, True
    config.activation_checkpointing_kwargs, config.gradient_checkpointing_kwargs = None, None
    machine.apply_cpu_defaults(config)
    assert config.bf16 is None  # TRL turns it on
    assert config.activation_checkpointing is True  # TRL's default, under the new name (no deprecation warning)


# ----------------------------------------------------------------------------------- model="bundled"
@pytest.fixture
def bundled_is_tiny(monkeypatch, tiny_model_dir):
    """`bundled` resolves to the tiny model here (the real 135M model is exercised by the slow tests)."""
    monkeypatch.setattr(bundled, "bundled_model_dir", lambda cache_dir=None: tiny_model_dir)
    return tiny_model_dir


def test_bundled_works_in_the_rl_trainers_and_as_teacher(tmp_path, bundled_is_tiny):
    trainer = TrinityTrainer(
        model="bundled",
        reward_funcs=length_reward,
        teacher_model="bundled",
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="on_policy_distill")),
    )
    assert trainer.model.config._name_or_path == bundled_is_tiny
    assert trainer.teacher_model is not None


def test_bundled_works_for_chord_and_as_the_ppo_value_model(tmp_path, bundled_is_tiny):
    expert = Dataset.from_dict({"prompt": ["What is 1+1?"] * 4, "completion": [" 2"] * 4})
    ChordTrainer(
        model="bundled",
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        expert_dataset=expert,
        args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "c"))),
    )
    ppo = PPOTrainer(
        model="bundled",
        value_model="bundled",
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "p"))),
    )
    assert ppo.accelerator.unwrap_model(ppo.critic).config._name_or_path == bundled_is_tiny


def test_bundled_works_in_the_sft_and_dpo_trainers(tmp_path, bundled_is_tiny):
    common_args = {"use_cpu": True, "report_to": "none", "max_steps": 1}
    TrinitySFTTrainer(
        model="bundled",
        args=TrinitySFTConfig(output_dir=str(tmp_path / "s"), **common_args),
        train_dataset=Dataset.from_dict({"prompt": ["What is 1+1?"], "completion": [" 2"]}),
    )
    TrinityDPOTrainer(
        model="bundled",
        args=TrinityDPOConfig(output_dir=str(tmp_path / "d"), **common_args),
        train_dataset=Dataset.from_dict({"prompt": ["1+1?"], "chosen": [" 2"], "rejected": [" 3"]}),
    )


# ------------------------------------------------------------------------------------------ model cards
def card_of(trainer, folder) -> str:
    trainer.save_model(str(folder))
    return (folder / "README.md").read_text()


def test_card_names_the_bundled_model_by_its_hub_id_and_loads_the_adapter_with_peft(tmp_path, tiny_model_dir):
    (tmp_path / "cache").mkdir()
    bundled_dir = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    shutil.copytree(tiny_model_dir, bundled_dir)
    (bundled_dir / bundled._MARKER).write_text("{}")  # what bundled_model_dir() writes after a conversion
    trainer = TrinityTrainer(
        model=str(bundled_dir),
        reward_funcs=length_reward,
        peft_config=LORA,
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1)),
    )
    trainer.train()
    card = card_of(trainer, tmp_path / "out")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" in card
    assert str(bundled_dir) not in card and "licence" not in card and "license: apache-2.0" in card
    assert "library_name: peft" in card and "AutoPeftModelForCausalLM.from_pretrained" in card
    assert "dequantized" in card and "not equal" in card  # trained on the Q4_1 file's weights, and says so
    # the adapter names the public model, not this machine's cache folder (issue 35): it loads anywhere
    adapter_config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # another machine: the cache folder is gone and the public id resolves from a Hub cache (offline)
    elsewhere = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    (elsewhere / "refs").mkdir(parents=True)
    (elsewhere / "refs" / "main").write_text("0" * 40)
    shutil.move(str(bundled_dir), elsewhere / "snapshots" / ("0" * 40))
    assert not bundled_dir.exists()
    # the quick start's loader, run as written, gives the trained adapter
    load_from = card.split('AutoPeftModelForCausalLM.from_pretrained("')[1].split('")')[0]
    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(load_from, cache_dir=str(tmp_path / "hub"))
    trained, pulled = trainer.accelerator.unwrap_model(trainer.model).state_dict(), loaded.state_dict()
    assert trained.keys() == pulled.keys() and all(torch.equal(trained[k], pulled[k]) for k in trained)


def test_card_lists_the_training_set_up(tmp_path, tiny_model_dir):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        peft_config=LORA,
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), learning_rate=3e-4)),
    )
    trainer.set_model_card_dataset("my/dataset")
    card = card_of(trainer, tmp_path / "saved")
    for row in (
        "| dataset | `my/dataset` |",
        "| learning rate | 0.0003 (linear) |",
        "| max steps | 2 |",
        "| batch per device | 4 |",
        "| generations per prompt | 4 |",
        "| max completion length | 8 |",
        "| LoRA | r 4, alpha 8, modules q_proj, v_proj |",
        "| precision | float32 |",
    ):
        assert row in card, row
    assert 'from_pretrained("' + str(tmp_path / "saved") + '")' in card  # not pushed: the folder it was saved to


def test_card_describes_chord_mu_or_phi_as_configured(tmp_path, tiny_model_dir):
    expert = Dataset.from_dict({"prompt": ["What is 1+1?"] * 4, "completion": [" 2"] * 4})

    def card(**config):
        trainer = ChordTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            expert_dataset=expert,
            train_dataset=tiny_conversational_dataset(),
            args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), **config)),
        )
        return card_of(trainer, tmp_path / "card")

    mu = card(enable_phi_function=False, mu_peak=0.9, mu_valley=0.05, mu_decay_steps=20)
    assert "Variant: CHORD-μ (plain SFT term); μ starts at 0.9 and decays (cosine) to 0.05 over 20 steps." in mu
    assert "| demonstrations | 4 rows given as `expert_dataset` |" in mu  # the card names its demonstrations
    default = card()  # ChordConfig()'s default: CHORD-μ over the run (max_steps)
    assert "Variant: CHORD-μ (plain SFT term); μ starts at 0.9 and decays (cosine) to 0.05 over 2 steps." in default
    phi = card(enable_phi_function=True, mu_peak=0.1, mu_valley=0.1, mu_decay_steps=0)  # the default before 0.2.0
    assert "Variant: CHORD-φ" in phi and "constant μ = 0.1" in phi


def test_a_dpo_card_lists_only_the_components_dpo_uses(tmp_path, tiny_model_dir):
    trainer = TrinityDPOTrainer(
        model=tiny_model_dir,
        train_dataset=Dataset.from_dict({"prompt": ["1+1?"], "chosen": [" 2"], "rejected": [" 3"]}),
        args=TrinityDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1),
    )
    card = card_of(trainer, tmp_path / "card")
    assert "| policy_loss | `dpo` |" in card and "| kl_loss | `k2` |" in card
    assert "advantage_fn" not in card and "kl_penalty_fn" not in card
