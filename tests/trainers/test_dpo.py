"""`trinity_trl/trainers/dpo_trainer.py`: `TrinityDPOTrainer`, the `dpo` preset on TRL's own `DPOTrainer`.

Losses are checked against an independent computation: log-probs from a plain forward of the same weights
(`logits → log_softmax → gather` at the shifted labels, tests/helpers.py `plain_token_logps`), fed to the library
loss; the DPO loss also against TRL's sigmoid loss and the per-pair formula of docs/algorithms/policy-losses.md#dpo.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    TINY_LOGP_SCALE,
    TINY_MODEL_TERMS,
    assert_grads_close,
    first_batch,
    lora_config,
    parameter_grads,
    plain_token_logps,
    recording,
    save_tiny_model,
    tiny_sft_dpo_kwargs,
)
from tolerance import approx, assert_close, tolerance
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments
from trl import DPOConfig, DPOTrainer

from trinity_trl.algorithms import POLICY_LOSS_FN, agg_loss
from trinity_trl.trainers.dpo_trainer import REPLACED_DPO_FIELDS, TrinityDPOConfig, TrinityDPOTrainer

ROWS = [(a, b) for a in range(1, 5) for b in range(1, 5)]  # 16 rows


def preference_dataset():
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [f"What is {a}+{b}?" for a, b in ROWS],
            "chosen": [f" The answer is {a + b}." for a, b in ROWS],
            "rejected": [" I think it is" + " more" * (b % 3) + f" {a * b + 1}" for a, b in ROWS],
        }
    )


@pytest.fixture(scope="module")
def ref_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A second tiny model with other weights, so policy and reference differ from the first step."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_ref"), tokenizer=tokenizer, seed=1)


def dpo_trainer(
    model_dir, tmp_path, ref_model=None, trainer_cls=TrinityDPOTrainer, peft_config=None, callbacks=None, **config
):
    args = TrinityDPOConfig(**tiny_sft_dpo_kwargs(tmp_path, **config))
    return trainer_cls(
        model=model_dir,
        ref_model=ref_model,
        args=args,
        train_dataset=preference_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=peft_config,
        callbacks=callbacks,
    )


def plain_dpo_inputs(policy, reference, inputs):
    """Per-token policy and reference log-probs ``(2B, T-1)``, entropies and the completion mask, computed
    independently of TRL's fused head."""
    labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    logps, entropy, mask = plain_token_logps(policy, inputs["input_ids"], inputs["attention_mask"], labels)
    with torch.no_grad():
        ref_logps, _, _ = plain_token_logps(reference, inputs["input_ids"], inputs["attention_mask"], labels)
    return logps, ref_logps, entropy, mask


def test_dpo_pair_losses_equal_library_dpo_on_summed_logprobs(tiny_model_dir, ref_model_dir, tmp_path):
    beta, smoothing = 0.5, 0.1
    trainer = dpo_trainer(
        tiny_model_dir,
        tmp_path,
        ref_model=AutoModelForCausalLM.from_pretrained(ref_model_dir),
        beta=beta,
        label_smoothing=smoothing,
    )
    inputs = first_batch(trainer)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(ref_model_dir)
    logps, ref_logps, _, mask = plain_dpo_inputs(policy, reference, inputs)
    losses, _ = trainer.pair_losses(logps, ref_logps, mask)

    library = POLICY_LOSS_FN.get("dpo")(beta=beta, label_smoothing=smoothing)
    sums, ref_sums = (logps * mask).sum(1), (ref_logps * mask).sum(1)
    n_pairs = len(sums) // 2
    assert losses.shape == (n_pairs,) == (4,)
    for i in range(n_pairs):
        rows = [i, n_pairs + i]  # TRL's layout: chosen rows, then rejected rows
        expected, _ = library(
            logprob=sums[rows].unsqueeze(1), ref_logprob=ref_sums[rows].unsqueeze(1), action_mask=torch.ones(2, 1)
        )
        h = (sums[i] - ref_sums[i]) - (sums[n_pairs + i] - ref_sums[n_pairs + i])
        formula = -(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)
        # the margin h subtracts sums of a row's log-probs (cancelling), and the loss's slope in h is at most beta
        tol = {"terms": mask.shape[1], "scale": beta * sums.abs().max()}
        assert_close(losses[i], expected.reshape(()), **tol)
        assert_close(losses[i], formula, **tol)
    assert len({round(x, 4) for x in losses.tolist()}) > 1  # the pairs really differ

    # summed (precomputed) reference log-probs give the same pair losses
    summed, _ = trainer.pair_losses(logps, ref_sums.unsqueeze(1), mask)
    assert_close(summed, losses, terms=mask.shape[1], scale=beta * sums.abs().max())


def test_dpo_loss_equals_trl_sigmoid_plus_kl_and_entropy(tiny_model_dir, ref_model_dir, tmp_path):
    kl_coef, entropy_coef = 0.5, 0.01
    trainer = dpo_trainer(
        tiny_model_dir,
        tmp_path,
        ref_model=AutoModelForCausalLM.from_pretrained(ref_model_dir),
        beta=0.3,
        kl_loss={"kl_coef": kl_coef},
        entropy_loss={"entropy_coef": entropy_coef},
    )
    inputs = first_batch(trainer)
    with torch.no_grad():
        trl_sigmoid = DPOTrainer.compute_loss(trainer, trainer.model, dict(inputs)).item()  # TRL's own loss
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(ref_model_dir)
    logps, ref_logps, entropy, mask = plain_dpo_inputs(policy, reference, inputs)
    pair_losses, _ = trainer.pair_losses(logps, ref_logps, mask)
    kl = agg_loss(0.5 * (logps - ref_logps) ** 2, mask, "token-mean")
    expected = pair_losses.mean() + kl_coef * kl - entropy_coef * agg_loss(entropy, mask, "token-mean")
    expected.backward()

    # TRL's forward and ours (another batch layout) of the same weights; the margins cancel sums of log-probs
    scale = 0.3 * (logps * mask).sum(1).abs().max()  # beta times the largest summed log-prob
    assert pair_losses.mean().item() == approx(trl_sigmoid, terms=TINY_MODEL_TERMS, scale=scale)  # TRL's sigmoid loss
    assert loss.item() == approx(
        expected.item(), terms=TINY_MODEL_TERMS, scale=scale + kl_coef * kl + entropy_coef * 6.25
    )
    assert kl.item() > 1e-3  # the KL term is really exercised
    assert_grads_close(parameter_grads(trainer.model), parameter_grads(policy))


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_dpo_trains_two_steps(tiny_model_dir, tmp_path, use_lora):
    peft_config = lora_config() if use_lora else None
    trainer = dpo_trainer(tiny_model_dir, tmp_path, peft_config=peft_config)
    assert (trainer.ref_model is None) == use_lora  # LoRA: the reference is the model with its adapter disabled
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    # policy = reference at step 0, KL = 0: the margins cancel sums of up to 64 log-probs, with TRL's beta 0.1
    assert logs[0]["loss"] == approx(math.log(2), terms=TINY_MODEL_TERMS, scale=0.1 * 64 * TINY_LOGP_SCALE)
    # k2 = 0.5 (δ logp)² with δ a log-prob's rounding error at most
    logp_error = tolerance(torch.float32, terms=TINY_MODEL_TERMS, scale=TINY_LOGP_SCALE)["atol"]
    assert 0.0 <= logs[0]["actor/kl_loss"] <= 0.5 * logp_error**2
    assert logs[1]["actor/kl_loss"] > 0  # the policy has moved away from the reference
    for log in logs:
        assert log["actor/kl_coef"] == 0.001  # the preset's k2 KL
        assert {"rewards/chosen", "rewards/margins", "logps/chosen", "entropy"} <= log.keys()  # TRL's metrics
        # same beta in both, over the same summed log-probs (TRL's metric is averaged over the processes' rows)
        assert log["rewards/chosen"] == approx(log["actor/chosen_reward"], terms=64, scale=0.1 * 64 * TINY_LOGP_SCALE)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed
    if use_lora:
        assert all("lora_" in n for n in changed)


def test_dpo_gradient_accumulation_divides_once(tiny_model_dir, tmp_path):
    """GA = 2: the logged loss is the mean of the two micro-batch losses (each divided once by Trainer)."""
    args = TrinityDPOConfig(
        **tiny_sft_dpo_kwargs(
            tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, learning_rate=0.0
        )
    )
    trainer = recording(TrinityDPOTrainer)(
        model=tiny_model_dir,
        args=args,
        train_dataset=preference_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    trainer.train()
    assert len(trainer.recorded.loss_calls) == 2
    micro = [call.loss.item() for call in trainer.recorded.loss_calls]
    assert trainer.state.log_history[0]["loss"] == approx(sum(micro) / 2, terms=2)  # the mean of the 2 losses


def test_dpo_precomputed_reference_without_kl(tiny_model_dir, tmp_path):
    trainer = dpo_trainer(tiny_model_dir, tmp_path, precompute_ref_log_probs=True, kl_loss={"kl_coef": 0.0})
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and "actor/kl_loss" not in logs[0]
    assert logs[0]["loss"] == approx(math.log(2), terms=TINY_MODEL_TERMS, scale=0.1 * 64 * TINY_LOGP_SCALE)


def test_dpo_evaluates_and_model_card_names_the_algorithm(tiny_model_dir, tmp_path):
    trainer = dpo_trainer(tiny_model_dir, tmp_path, max_steps=1)
    trainer.train()
    metrics = trainer.evaluate(eval_dataset=preference_dataset().select(range(4)))
    assert {"eval_loss", "eval_actor/dpo_loss", "eval_actor/kl_loss", "eval_rewards/margins"} <= metrics.keys()
    trainer.save_model()
    with open(os.path.join(tmp_path, "README.md"), encoding="utf-8") as file:
        card = file.read()
    assert "## Algorithm: DPO" in card and "2305.18290" in card
    assert "| kl_loss | `k2` |" in card and "TrinityDPOTrainer" in card


def test_dpo_beta_and_label_smoothing_map_both_ways(tmp_path):
    from_fields = TrinityDPOConfig(**tiny_sft_dpo_kwargs(tmp_path), beta=0.2, label_smoothing=0.1)
    assert from_fields.resolved_algorithm().policy_loss.args == {"beta": 0.2, "label_smoothing": 0.1}
    from_args = TrinityDPOConfig(**tiny_sft_dpo_kwargs(tmp_path), policy_loss='{"beta": 0.3, "label_smoothing": 0.2}')
    assert (from_args.beta, from_args.label_smoothing) == (0.3, 0.2)  # TRL's metrics use the same beta
    resolved = TrinityDPOConfig(**tiny_sft_dpo_kwargs(tmp_path)).resolved_algorithm()
    assert resolved.kl_loss.name == "k2" and resolved.kl_loss.args["kl_coef"] == 0.001
    assert resolved.entropy_loss.name == "default" and resolved.entropy_loss.args == {"entropy_coef": 0.0}


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"loss_type": ["hinge"]}, "loss_type"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, "loss_type"),
        ({"ld_alpha": 0.5}, "ld_alpha"),
        ({"f_divergence_type": "js_divergence"}, "f_divergence_type"),
        ({"use_weighting": True}, "use_weighting"),
        ({"discopop_tau": 0.1}, "discopop_tau"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"kl_loss": "none"}, "kl_loss='none'.*kl_coef"),
        ({"kl_loss": "k9"}, "k9"),
        ({"entropy_loss": "mix"}, "entropy_loss must not read expert rows"),
        ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True.*per-token KL"),
        ({"beta": 0.2, "policy_loss": {"beta": 0.3}}, "beta=0.2 conflicts"),
        ({"label_smoothing": 0.6}, "label_smoothing"),
        ({"policy_loss": {"beta": -1.0}}, "beta must be > 0"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
    ],
)
def test_dpo_config_rejects_bad_options(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        TrinityDPOConfig(**tiny_sft_dpo_kwargs(tmp_path), **overrides)


# ------------------------------------------------------------------------------- every option has an owner
def _trl_fields(config_cls) -> set[str]:
    return {f.name for f in fields(config_cls)} - {f.name for f in fields(TrainingArguments)}


# TRL options this trainer leaves to TRL (data preparation, model loading, reference handling, ...)
HONOURED_DPO = {
    "activation_offloading",
    "dataset_num_proc",
    "disable_dropout",
    "max_length",
    "model_init_kwargs",
    "pad_to_multiple_of",
    "pad_token",
    "padding_free",
    "precompute_ref_batch_size",
    "precompute_ref_log_probs",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "router_aux_loss_coef",
    "sync_ref_model",
    "truncation_mode",
    "trust_remote_code",
    "beta",
    "label_smoothing",  # beta / label_smoothing become the dpo loss's arguments
}


def test_every_trl_dpo_option_is_honoured_or_rejected():
    """A TRL upgrade that adds a DPO option fails here until it is classified."""
    assert _trl_fields(DPOConfig) == HONOURED_DPO | (REPLACED_DPO_FIELDS.keys() - {"label_smoothing_factor"})
    assert "label_smoothing_factor" in {f.name for f in fields(TrainingArguments)}
