"""`trinity_trl/trainers/common.py`: the processor a model name loads, the
default output folder, `*_args` fields, fused-head capture and the sequence-sharding refusal. The model card written
by `AlgorithmCardMixin` (`trainers/card.py`): test_model_card.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.trainers import TrinityConfig, TrinityTrainer
from trinity_trl.trainers.common import capture_fused_outputs, default_output_dir, reject_sequence_sharding


# ---------------------------------------------------------------------------------------------- load_processor
def test_model_name_loads_trl_processor_with_hf_tokenizer_corrections(tmp_path, tiny_model_dir, monkeypatch):
    import trinity_trl.tokenizer as tokenizer_module

    calls = []
    original = tokenizer_module.correct_tokenizer

    def spy(tokenizer, name, **kwargs):
        calls.append(name)
        return original(tokenizer, name, **kwargs)

    monkeypatch.setattr(tokenizer_module, "correct_tokenizer", spy)
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1)),
    )
    assert calls == [tiny_model_dir]
    assert trainer.processing_class.pad_token is not None
    assert trainer.processing_class.padding_side == "left" and trainer.processing_class.truncation_side == "left"


def test_a_given_processor_is_used_as_it_is(tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch):
    import trinity_trl.tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "correct_tokenizer", lambda *a, **k: pytest.fail("processor was reloaded"))
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        processing_class=tiny_tokenizer,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"))),
    )
    assert trainer.processing_class is tiny_tokenizer


# ------------------------------------------------------------------------------------------ default_output_dir
def test_default_output_dir():
    assert default_output_dir("HuggingFaceTB/SmolLM2-135M-Instruct/", "ChordConfig") == (
        "SmolLM2-135M-Instruct-ChordConfig"
    )
    model = SimpleNamespace(config=SimpleNamespace(_name_or_path="/models/tiny"))
    assert default_output_dir(model, "TrinityConfig") == "tiny-TrinityConfig"
    assert default_output_dir(SimpleNamespace(config=SimpleNamespace(_name_or_path="")), "X") == "model-X"


# ---------------------------------------------------------------------------------------- capture_fused_outputs
class Head(torch.nn.Module):
    def forward(self, x, fused_lm_head=False):
        return {"log_probs": x * 2} if fused_lm_head else x


class Wrapper(torch.nn.Module):
    """A DDP/PEFT-like wrapper: calling it calls the wrapped module with the same keywords."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, fused_lm_head=False):
        return self.inner(x, fused_lm_head=fused_lm_head)


def test_capture_fused_outputs_records_each_outermost_fused_call_once():
    head = Head()
    wrapper = Wrapper(head)
    with capture_fused_outputs([wrapper, head, head, None]) as calls:
        wrapper(torch.ones(1), fused_lm_head=True)  # runs the hooks of both: recorded once
        head(torch.full((1,), 3.0), fused_lm_head=True)
        head(torch.ones(1))  # not fused: not recorded
    assert [c["log_probs"].item() for c in calls] == [2.0, 6.0]
    head(torch.ones(1), fused_lm_head=True)  # hooks removed afterwards
    assert len(calls) == 2 and not head._forward_hooks and not head._forward_pre_hooks


# ------------------------------------------------------------------------------------- reject_sequence_sharding
@pytest.mark.parametrize("flag", ["cp_enabled", "sp_enabled"])
def test_sequence_sharding_is_rejected(flag):
    trainer = SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=SimpleNamespace(**{flag: True})))
    with pytest.raises(
        ValueError,
        match=rf"TrinitySFTTrainer does not support context or sequence parallelism "
        rf"\({flag}\)",
    ):
        reject_sequence_sharding(trainer, "TrinitySFTTrainer")


def test_no_parallelism_config_is_accepted():
    reject_sequence_sharding(SimpleNamespace(accelerator=SimpleNamespace(parallelism_config=None)), "X")
    reject_sequence_sharding(
        SimpleNamespace(
            accelerator=SimpleNamespace(parallelism_config=SimpleNamespace(cp_enabled=False, sp_enabled=False))
        ),
        "X",
    )
