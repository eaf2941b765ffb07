"""`trinity_trl/trainers/sft_trainer.py`: `TrinitySFTTrainer`, the `sft` preset (and the `sft_*` losses) on TRL's own
`SFTTrainer`.

Losses are checked against an independent computation: log-probs from a plain forward of the same weights
(`logits → log_softmax → gather` at the shifted labels, tests/helpers.py `plain_token_logps`), fed to the library
losses; the `sft` and `sft_is` losses also against TRL's own `SFTTrainer` NLL and DFT.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields

import pytest
import torch
from helpers import (
    TINY_MODEL_TERMS,
    assert_grads_close,
    first_batch,
    lora_config,
    parameter_grads,
    plain_token_logps,
    recording,
    tiny_sft_dpo_kwargs,
)
from tolerance import approx
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, TrainingArguments
from trl import SFTConfig, SFTTrainer

from trinity_trl.algorithms import POLICY_LOSS_FN, agg_loss
from trinity_trl.trainers.sft_trainer import REPLACED_SFT_FIELDS, TrinitySFTConfig, TrinitySFTTrainer

ROWS = [(a, b) for a in range(1, 5) for b in range(1, 5)]  # 16 rows


def prompt_completion_dataset():
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {a}+{b}?"}] for a, b in ROWS],
            # different lengths, so micro-batches have different token counts
            "completion": [
                [{"role": "assistant", "content": "The answer is " + " so" * (a % 3) + f" {a + b}."}] for a, b in ROWS
            ],
        }
    )


def messages_dataset():
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": f"What is {a}*{b}?"}, {"role": "assistant", "content": f"It is {a * b}."}]
                for a, b in ROWS
            ]
        }
    )


class GradientGrab(TrainerCallback):
    """Keeps the accumulated gradients just before the optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = parameter_grads(model)


@pytest.mark.parametrize("ours_loss, trl_loss", [("sft", "nll"), ("sft_is", "dft")])
def test_sft_loss_and_gradients_equal_trl(tiny_model_dir, tmp_path, ours_loss, trl_loss):
    """`sft` is TRL's NLL and `sft_is` TRL's DFT: same value and same gradients on the same batch."""
    dataset = prompt_completion_dataset()
    kwargs = tiny_sft_dpo_kwargs(tmp_path)
    ours = TrinitySFTTrainer(
        model=tiny_model_dir,
        args=TrinitySFTConfig(**kwargs, policy_loss=ours_loss),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    theirs = SFTTrainer(
        model=tiny_model_dir,
        args=SFTConfig(**kwargs, loss_type=trl_loss),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    inputs = first_batch(ours)
    assert (inputs["labels"] == -100).any() and (inputs["labels"] != -100).any()  # completion-only labels
    num_items = (inputs["labels"][:, 1:] != -100).sum()

    loss_ours = ours.compute_loss(ours.model, dict(inputs), num_items_in_batch=num_items)
    loss_ours.backward()
    loss_theirs = theirs.compute_loss(theirs.model, dict(inputs), num_items_in_batch=num_items)
    loss_theirs.backward()

    # two forwards of the same weights (TRL's and ours), each a token mean of positive -log-probs (no cancellation)
    assert loss_ours.item() == approx(loss_theirs.item(), terms=TINY_MODEL_TERMS)
    assert_grads_close(parameter_grads(ours.model), parameter_grads(theirs.model))
    # our token-mean does not depend on num_items_in_batch (Trinity aggregates per micro-batch)
    with torch.no_grad():
        again = ours.compute_loss(ours.model, dict(inputs), num_items_in_batch=None).item()
        assert again == approx(loss_ours.item(), terms=TINY_MODEL_TERMS)  # a second forward (no_grad)


@pytest.mark.parametrize(
    "loss_fn, loss_args, agg",
    [
        ("sft_is", None, "token-mean"),
        ("sft_phi", None, "token-mean"),
        ("sft_phi", {"cutoff_prob": 0.002}, "token-mean"),  # p ≈ 1/512 on a random model: the cutoff binds for some
        ("sft", None, "seq-mean-token-mean"),
    ],
)
def test_sft_losses_equal_library_on_the_same_logprobs(tiny_model_dir, tmp_path, loss_fn, loss_args, agg):
    args = TrinitySFTConfig(
        **tiny_sft_dpo_kwargs(tmp_path), policy_loss={"name": loss_fn, **(loss_args or {})}, loss_agg_mode=agg
    )
    trainer = TrinitySFTTrainer(
        model=tiny_model_dir,
        args=args,
        train_dataset=prompt_completion_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    inputs = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, dict(inputs))
    loss.backward()

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    logps, _, mask = plain_token_logps(reference, inputs["input_ids"], inputs["attention_mask"], inputs["labels"])
    library = POLICY_LOSS_FN.get(loss_fn)(**trainer.algorithm.policy_loss.args)
    expected, _ = library(logprob=logps, action_mask=mask)
    expected.backward()

    assert trainer.algorithm.policy_loss.args["loss_agg_mode"] == agg
    assert loss.item() == approx(expected.item(), terms=TINY_MODEL_TERMS)  # two forwards, a mean of -log-probs
    assert_grads_close(parameter_grads(trainer.model), parameter_grads(reference))


def test_sft_gradient_accumulation_divides_once(tiny_model_dir, tmp_path):
    """GA = 2: the accumulated gradient is the mean of the two micro-batches' token-means, and the logged loss is
    their mean; neither is divided twice (÷4) nor not at all (×2)."""
    grab = GradientGrab()
    args = TrinitySFTConfig(
        **tiny_sft_dpo_kwargs(
            tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, max_grad_norm=0.0
        )
    )
    trainer = recording(TrinitySFTTrainer)(
        model=tiny_model_dir,
        args=args,
        train_dataset=prompt_completion_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        callbacks=[grab],
    )
    trainer.train()
    calls = trainer.recorded.loss_calls
    assert len(calls) == 2

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    micro_losses, token_counts = [], []
    for batch in (call.inputs for call in calls):
        logps, _, mask = plain_token_logps(reference, batch["input_ids"], batch["attention_mask"], batch["labels"])
        micro_losses.append(agg_loss(-logps, mask, "token-mean"))
        token_counts.append(int(mask.sum()))
    expected = sum(micro_losses) / 2
    expected.backward()

    assert_grads_close(grab.grads, parameter_grads(reference))
    assert trainer.state.log_history[0]["loss"] == approx(expected.item(), terms=TINY_MODEL_TERMS)
    for call, micro in zip(calls, micro_losses):  # compute_loss itself returns the undivided loss
        assert call.loss.item() == approx(micro.item(), terms=TINY_MODEL_TERMS)
    if token_counts[0] != token_counts[1]:  # Trinity's token-mean differs from TRL's window-wide token mean here
        window_mean = sum(-loss * n for loss, n in zip(micro_losses, token_counts)) / -sum(token_counts)
        assert abs(window_mean.item() - expected.item()) > 1e-6


@pytest.mark.parametrize("dataset_format", ["messages", "prompt_completion"])
@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_sft_trains_two_steps(tiny_model_dir, tmp_path, dataset_format, use_lora):
    dataset = messages_dataset() if dataset_format == "messages" else prompt_completion_dataset()
    peft_config = lora_config() if use_lora else None
    args = TrinitySFTConfig(**tiny_sft_dpo_kwargs(tmp_path), policy_loss="sft_phi")
    trainer = TrinitySFTTrainer(
        model=tiny_model_dir,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log in logs:
        assert math.isfinite(log["loss"]) and log["loss"] > 0
        # GA = 1: the same loss, the metric averaged over the step's micro-batch (sum of at most 8 values)
        assert log["loss"] == approx(log["actor/sft_phi_loss"], terms=8)
        assert {"entropy", "mean_token_accuracy", "num_tokens"} <= log.keys()  # TRL's metrics are kept
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed
    if use_lora:
        assert all("lora_" in n for n in changed)


def test_sft_evaluates_and_model_card_names_the_algorithm(tiny_model_dir, tmp_path):
    args = TrinitySFTConfig(**tiny_sft_dpo_kwargs(tmp_path, max_steps=1), policy_loss="sft_phi")
    trainer = TrinitySFTTrainer(
        model=tiny_model_dir,
        args=args,
        train_dataset=messages_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    trainer.train()
    metrics = trainer.evaluate(eval_dataset=messages_dataset().select(range(4)))
    # Trainer's eval loss and our metric: two means of the 4 rows' losses
    assert metrics["eval_loss"] == approx(metrics["eval_actor/sft_phi_loss"], terms=4)
    trainer.save_model()
    with open(os.path.join(tmp_path, "README.md"), encoding="utf-8") as file:
        card = file.read()
    assert "## Algorithm: SFT" in card
    assert "TrinitySFTTrainer" in card and "`sft_phi`" in card and "cutoff_prob" in card
    assert "trinity_trl" in card


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"loss_type": "dft"}, "loss_type='dft'.*sft_is"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"policy_loss": "ppo"}, "policy_loss must be a loss that reads only the trained tokens' log-probs"),
        ({"loss_agg_mode": "token-sum"}, "loss_agg_mode"),
        ({"policy_loss": "{not json"}, "policy_loss is not a JSON object"),
        ({"policy_loss": {"name": "sft_phi", "cutoff_prob": 0.0}}, "cutoff_prob"),
        ({"packing": True, "loss_agg_mode": "seq-mean-token-mean"}, "packing=True"),
        ({"padding_free": True, "loss_agg_mode": "seq-mean-token-sum"}, "padding_free=True"),
    ],
)
def test_sft_config_rejects_conflicting_options(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        TrinitySFTConfig(**tiny_sft_dpo_kwargs(tmp_path), **overrides)


def test_sft_trainer_rejects_compute_loss_func_and_converts_trl_sft_config(tiny_model_dir, tmp_path):
    dataset = prompt_completion_dataset()
    with pytest.raises(ValueError, match="compute_loss_func"):
        TrinitySFTTrainer(
            model=tiny_model_dir,
            args=TrinitySFTConfig(**tiny_sft_dpo_kwargs(tmp_path)),
            train_dataset=dataset,
            compute_loss_func=lambda *a, **k: 0.0,
        )
    plain = TrinitySFTTrainer(
        model=tiny_model_dir, args=SFTConfig(**tiny_sft_dpo_kwargs(tmp_path)), train_dataset=dataset
    )
    assert type(plain.args) is TrinitySFTConfig and plain.args.max_length == 64  # TRL's SFTConfig, converted


def test_sft_args_merge_over_default_args(tmp_path):
    args = TrinitySFTConfig(
        **tiny_sft_dpo_kwargs(tmp_path),
        policy_loss='{"name": "sft_phi", "cutoff_prob": 0.9, "loss_agg_mode": "seq-mean-token-sum"}',
    )
    resolved = args.resolved_algorithm()
    # the global loss_agg_mode wins over the loss's own key (docs/algorithms/presets.md#resolution step 4)
    assert resolved.policy_loss.args == {"cutoff_prob": 0.9, "loss_agg_mode": "token-mean"}
    assert resolved.algorithm == "sft" and resolved.kl_loss.name == "none" and resolved.entropy_loss.name == "none"


# ------------------------------------------------------------------------------- every option has an owner
def _trl_fields(config_cls) -> set[str]:
    return {f.name for f in fields(config_cls)} - {f.name for f in fields(TrainingArguments)}


# TRL options this trainer leaves to TRL (data preparation, model loading, ...)
HONOURED_SFT = {
    "activation_offloading",
    "assistant_only_loss",
    "chat_template_path",
    "completion_only_loss",
    "dataset_kwargs",
    "dataset_num_proc",
    "dataset_text_field",
    "eos_token",
    "eval_packing",
    "max_length",
    "model_init_kwargs",
    "packing",
    "packing_strategy",
    "pad_to_multiple_of",
    "pad_token",
    "padding_free",
    "router_aux_loss_coef",
    "shuffle_dataset",
    "truncation_mode",
    "trust_remote_code",
}


def test_every_trl_sft_option_is_honoured_or_rejected():
    """A TRL upgrade that adds an SFT option fails here until it is classified."""
    assert _trl_fields(SFTConfig) == HONOURED_SFT | (REPLACED_SFT_FIELDS.keys() - {"label_smoothing_factor"})
    assert "label_smoothing_factor" in {f.name for f in fields(TrainingArguments)}
