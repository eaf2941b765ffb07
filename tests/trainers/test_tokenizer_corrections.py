"""Every trainer given a model *name* loads its tokenizer with `hf_tokenizer`'s corrections (issue 13 item 11):
here a Gemma-2 checkpoint, whose turns end with `<end_of_turn>` although its config names `<eos>`."""

from __future__ import annotations

import pytest
from datasets import Dataset
from helpers import build_tiny_model, build_tiny_tokenizer, length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from tokenizers import AddedToken

from trinity_trl.trainers import (
    TrinityConfig,
    TrinityDPOConfig,
    TrinityDPOTrainer,
    TrinitySFTConfig,
    TrinitySFTTrainer,
    TrinityTrainer,
)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """A tiny model saved in a folder named like a Gemma-2 chat checkpoint, with an `<end_of_turn>` token."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([AddedToken("<end_of_turn>", special=True)])
    path = tmp_path_factory.mktemp("models") / "tiny-gemma-2-it"
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def common(tmp_path):
    return {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", "max_steps": 1}


def test_rl_trainer_corrects_the_gemma2_eos(tmp_path, gemma2_dir):
    with pytest.warns(UserWarning, match="end_of_turn"):
        trainer = TrinityTrainer(
            model=gemma2_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
        )
    assert trainer.processing_class.eos_token == "<end_of_turn>"


def test_sft_trainer_corrects_the_gemma2_eos(tmp_path, gemma2_dir):
    data = Dataset.from_dict({"prompt": ["What is 1+1?"], "completion": [" 2"]})
    with pytest.warns(UserWarning, match="end_of_turn"):
        trainer = TrinitySFTTrainer(model=gemma2_dir, args=TrinitySFTConfig(**common(tmp_path)), train_dataset=data)
    assert trainer.processing_class.eos_token == "<end_of_turn>"


def test_dpo_trainer_corrects_the_gemma2_eos(tmp_path, gemma2_dir):
    data = Dataset.from_dict({"prompt": ["What is 1+1?"], "chosen": [" 2"], "rejected": [" 3"]})
    with pytest.warns(UserWarning, match="end_of_turn"):
        trainer = TrinityDPOTrainer(model=gemma2_dir, args=TrinityDPOConfig(**common(tmp_path)), train_dataset=data)
    assert trainer.processing_class.eos_token == "<end_of_turn>"
