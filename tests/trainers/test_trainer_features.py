"""TrinityTrainer features: on-policy distillation, KL reward penalty, model card, save/push, tokenizer."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from helpers import length_reward, save_tiny_model, tiny_conversational_dataset, tiny_grpo_kwargs
from peft import LoraConfig

from trinity_trl.algorithms import KL_FN
from trinity_trl.trainers import ChordConfig, ChordTrainer, TrinityConfig, TrinityTrainer
from trinity_trl.trainers.checkpoint import TRAINER_STATE_FILE

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


class Recording(TrinityTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.batches.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})
        return out


def make(tmp_path, model_dir, cls=Recording, peft=False, **config):
    return cls(model=model_dir, reward_funcs=length_reward,
               args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), **config)),
               train_dataset=tiny_conversational_dataset(), peft_config=LORA if peft else None)


def test_on_policy_distillation_advantages_are_teacher_minus_student_logps(tmp_path, tiny_model_dir):
    teacher_dir = save_tiny_model(tmp_path / "teacher", seed=7)
    trainer = Recording(model=tiny_model_dir, reward_funcs=length_reward, teacher_model=teacher_dir,
                        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), algorithm="on_policy_distill")),
                        train_dataset=tiny_conversational_dataset())
    trainer.train()
    batch = trainer.batches[0]
    mask = batch["completion_mask"].bool()
    teacher = trainer._forward_logps(trainer.teacher_model, batch)
    expected = (teacher - batch["old_per_token_logps"])[mask]
    assert torch.allclose(batch["advantages"][mask], expected, atol=1e-5)
    assert torch.all(batch["advantages"][~mask] == 0)
    assert "kl/mean" in trainer.state.log_history[0]


def test_on_policy_distillation_needs_a_teacher(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="teacher_model"):
        make(tmp_path, tiny_model_dir, algorithm="on_policy_distill")


def test_kl_reward_penalty_with_adaptive_coefficient(tmp_path, tiny_model_dir):
    args = {"kl_coef": 0.05, "adaptive": True, "target_kl": 1e-6, "horizon": 10}
    trainer = make(tmp_path, tiny_model_dir, algorithm="rloo", kl_penalty_fn="k1", kl_penalty_fn_args=args, max_steps=3)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "critic/kl_coef" in h]
    coefs = [h["critic/kl_coef"] for h in logs]
    kls = [h["critic/kl"] for h in logs]
    # step 1: policy == reference, KL 0 < target: β shrinks by 20%·n/horizon (n = 4 rows); later KL > target: it grows
    assert kls[0] == 0.0 and kls[1] > 1e-6 and kls[2] > 1e-6
    step = 0.2 * 4 / 10
    assert coefs == pytest.approx([0.05, 0.05 * (1 - step), 0.05 * (1 - step) * (1 + step)])
    assert trainer.components.kl_penalty.kl_coef == pytest.approx(coefs[-1] * (1 + step))
    # the penalised token rewards reach the advantages: recompute with the library on the recorded batch
    batch = trainer.batches[-1]
    fn = KL_FN.get("k1")(kl_coef=logs[-1]["critic/kl_coef"])
    kl = fn.calculate_kl(batch["old_per_token_logps"], batch["ref_per_token_logps"])
    assert torch.isfinite(kl[batch["completion_mask"].bool()]).all()


def test_importance_sampling_ratio_scales_advantages(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir)
    logps = torch.zeros(2, 3)
    inputs = {"advantages": torch.tensor([1.0, -2.0]), "importance_sampling_ratio": torch.tensor([[0.5], [2.0]])}
    scaled = trainer._loss_inputs(inputs, logps, torch.ones(2, 3))["advantages"]
    assert scaled.tolist() == [[0.5], [-4.0]]


def test_save_model_writes_adapter_and_algorithm_card(tmp_path, tiny_model_dir):
    expert = Dataset.from_list([{"messages": [{"role": "user", "content": "What is 1+1?"},
                                              {"role": "assistant", "content": "2"}]}])
    trainer = ChordTrainer(model=tiny_model_dir, reward_funcs=length_reward, expert_dataset=expert, peft_config=LORA,
                           args=ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), max_steps=1,
                                                               mu_peak=0.4, mu_decay_steps=10)),
                           train_dataset=tiny_conversational_dataset())
    trainer.train()
    target = tmp_path / "saved"
    trainer.save_model(str(target))
    files = set(os.listdir(target))
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= files
    card = (target / "README.md").read_text()
    assert "## Algorithm: CHORD" in card
    assert "arXiv:2508.11408" in card or "2508.11408" in card
    assert '"mu_peak": 0.4' in card and "mix_chord" in card
    assert "trained with CHORD" in card.lower() or "CHORD" in card


def test_push_to_hub_uploads_adapter_and_card(tmp_path, tiny_model_dir, monkeypatch):
    import transformers.trainer as hf_trainer

    uploaded = {}

    class FakeApi:
        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploaded["repo_id"] = repo_id
            uploaded["files"] = set(os.listdir(folder_path))
            uploaded["card"] = open(os.path.join(folder_path, "README.md"), encoding="utf-8").read()

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    trainer = make(tmp_path, tiny_model_dir, cls=TrinityTrainer, peft=True, algorithm="cispo", max_steps=1)
    trainer.train()
    trainer.hub_model_id = "someone/tiny-cispo"
    trainer.push_to_hub()
    assert uploaded["repo_id"] == "someone/tiny-cispo"
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= uploaded["files"]
    assert "## Algorithm: CISPO" in uploaded["card"]
    assert "MiniMax-M1" in uploaded["card"] and "clip_range_high" in uploaded["card"]


def test_model_name_loads_trl_processor_with_hf_tokenizer_corrections(tmp_path, tiny_model_dir, monkeypatch):
    import trinity_trl.tokenizer as tokenizer_module

    calls = []
    original = tokenizer_module.correct_tokenizer

    def spy(tokenizer, name, **kwargs):
        calls.append(name)
        return original(tokenizer, name, **kwargs)

    monkeypatch.setattr(tokenizer_module, "correct_tokenizer", spy)
    trainer = make(tmp_path, tiny_model_dir, cls=TrinityTrainer, max_steps=1)
    assert calls == [tiny_model_dir]
    assert trainer.processing_class.pad_token is not None
    assert trainer.processing_class.padding_side == "left" and trainer.processing_class.truncation_side == "left"


def test_resume_restores_the_adaptive_kl_coefficient(tmp_path, tiny_model_dir):
    def run(**extra):
        args = {"kl_coef": 0.1, "adaptive": True, "target_kl": 1e-6, "horizon": 10}
        return make(tmp_path, tiny_model_dir, cls=TrinityTrainer, algorithm="reinforceplusplus", kl_penalty_fn="k2",
                    kl_penalty_fn_args=args, max_steps=3, save_strategy="steps", save_steps=1, **extra)

    straight = run()
    straight.train()
    resumed = run()
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.components.kl_penalty.kl_coef == pytest.approx(straight.components.kl_penalty.kl_coef, rel=1e-9)
    assert (tmp_path / "out" / "checkpoint-2" / TRAINER_STATE_FILE).is_file()


def test_evaluation_does_not_move_the_kl_controller(tmp_path, tiny_model_dir):
    trainer = TrinityTrainer(model=tiny_model_dir, reward_funcs=length_reward,
                             args=TrinityConfig(**tiny_grpo_kwargs(
                                 output_dir=str(tmp_path / "out"), algorithm="reinforceplusplus", kl_penalty_fn="k2",
                                 kl_penalty_fn_args={"kl_coef": 0.1, "adaptive": True, "target_kl": 1.0, "horizon": 10},
                                 per_device_eval_batch_size=4)),
                             train_dataset=tiny_conversational_dataset(), eval_dataset=tiny_conversational_dataset(8))
    trainer.evaluate()
    assert trainer.components.kl_penalty.kl_coef == 0.1


def test_truncated_rows_keep_their_reward_in_the_rloo_baseline(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, cls=TrinityTrainer, algorithm="rloo")
    mask = torch.ones(4, 3, dtype=torch.long)
    mask[2] = 0  # truncated completion masked by mask_truncated_completions
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    advantages = trainer.advantage_estimator(rewards, mask, slice(0, 4), 4, 0, True,
                                             trainer._advantage_sources({"completion_mask": mask}, [])).advantages
    # leave-one-out baseline of row 0 over the other three rewards (2, 3, 4), as TRL keeps them
    assert advantages[0, 0].item() == pytest.approx(1.0 - 3.0)
    assert torch.all(advantages[2] == 0)


def test_completions_table_shows_our_advantages(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, algorithm="rloo", log_completions=True, max_steps=1)
    trainer.train()
    batch = trainer.batches[0]
    mask = batch["completion_mask"]
    expected = ((batch["advantages"] * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    assert list(trainer._logs["advantages"])[-4:] == pytest.approx(expected)


def test_named_trainers_require_their_config(tmp_path, tiny_model_dir):
    from trinity_trl.trainers import CISPOTrainer

    with pytest.raises(TypeError, match="CISPOConfig"):
        CISPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=tiny_conversational_dataset(),
                     args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))))


def test_mix_entropy_needs_expert_rows(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="entropy_loss_fn 'mix'"):
        make(tmp_path, tiny_model_dir, entropy_loss_fn="mix")


def test_sync_ref_model_without_a_reference_is_rejected_in_our_terms(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="sync_ref_model=True updates the reference model"):
        make(tmp_path, tiny_model_dir, algorithm="asymre", sync_ref_model=True)
    trainer = make(tmp_path, tiny_model_dir, cls=TrinityTrainer, sync_ref_model=True, ref_model_sync_steps=1, max_steps=2)
    trainer.train()  # grpo has a k2 KL loss, so TRL keeps and syncs a reference model
    assert trainer.ref_model is not None
