"""`trinity_trl/trainers/trinity.py`: what `TrinityTrainer` itself does around TRL's seams.

* `_compute_loss` of every experience preset equals `policy loss - entropy term + KL term` recomputed with freshly
  built library components on the tensors the trainer used (value and gradient; grpo also written out by hand), and
  every preset trains 2 steps, with and without LoRA;
* gradient accumulation and `num_iterations` through Trainer's own loop;
* vLLM importance weights reach a loss linear in the advantage through the advantages; the completions table shows
  our advantages;
* the reference model exists iff a KL term needs it (TRL's `beta` raised only while TRL decides), with LoRA the
  adapter-disabled policy.

Advantages: test_advantages.py; the loss aggregation: test_loss.py; parity with TRL's own losses: test_trl_parity.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    TINY_MODEL_TERMS,
    generate_batch,
    harden_batch,
    length_reward,
    lora_config,
    recording,
    tiny_grpo_kwargs,
)
from tolerance import approx, assert_close
from transformers import TrainerCallback

from trinity_trl.algorithms import resolve_algorithm_config
from trinity_trl.trainers import TrinityConfig, TrinityTrainer
from trinity_trl.training.loss import LossBatch

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

G = 4  # num_generations = per_device_train_batch_size: one micro-batch is one generation batch of one prompt

EXPERIENCE_PRESETS = (
    "grpo",
    "reinforceplusplus",
    "rloo",
    "opmd",
    "asymre",
    "topr",
    "cispo",
    "gspo",
    "sapo",
    "raft",
    "sppo",
    "rec",
    "multi_step_grpo",
)
# the metric each policy loss logs for its own value (prefixed "actor/")
POLICY_LOSS_METRIC = {
    "ppo": "pg_loss",
    "gspo": "pg_loss",
    "sppo": "pg_loss",
    "rec": "pg_loss",
    "opmd": "opmd_loss",
    "topr": "topr_loss",
    "cispo": "cispo_loss",
    "sapo": "sapo_loss",
    "sft": "sft_loss",
}


def _args(path, cls, **overrides):
    settings = {"steps_per_generation": 1, "gradient_accumulation_steps": 1}
    settings.update(overrides)
    return cls(**tiny_grpo_kwargs(output_dir=str(path), **settings))


def _trainer(tmp_path, model_dir, dataset, cls=TrinityTrainer, config_cls=TrinityConfig, **kwargs):
    init = {k: kwargs.pop(k) for k in ("teacher_model", "peft_config") if k in kwargs}
    args = config_cls(**tiny_grpo_kwargs(output_dir=str(tmp_path), **kwargs))
    return cls(
        model=model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=dataset,
        **init,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Every experience preset: the trainer's loss is the composition of the library's components


def _expected_loss(trainer, inputs, logps, entropies):
    """policy_loss − entropy_term + kl_term, from freshly built components of `trainer.algorithm`."""
    algorithm = trainer.algorithm
    mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    old = inputs.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    ref = inputs.get("ref_per_token_logps")
    agg = algorithm.loss_agg_mode
    loss, _ = algorithm.build_policy_loss().evaluate(
        logprob=logps,
        old_logprob=old,
        action_mask=mask,
        advantages=inputs["advantages"],
        ref_logprob=ref,
    )
    if algorithm.entropy_loss.name != "none":
        entropy_term, _ = algorithm.build_entropy_loss()(entropy=entropies, action_mask=mask, loss_agg_mode=agg)
        loss = loss - entropy_term
    if algorithm.kl_loss.name != "none":
        kl_term, _ = algorithm.build_kl_loss().calculate_kl_loss(logps, ref, mask, agg, old_logprob=old)
        loss = loss + kl_term
    return loss


def _grpo_by_hand(inputs, logps, entropies, kl_coef, entropy_coef):
    """The grpo preset written out: dual-clip PPO (ε=0.2, c=3) + k2 KL − entropy, all token-mean."""
    mask = inputs["completion_mask"].to(logps.dtype)
    adv = inputs["advantages"].unsqueeze(1)
    ratio = torch.exp(torch.clamp(logps - inputs["old_per_token_logps"], -20, 20))
    clipped = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
    token = torch.where(adv < 0, torch.minimum(clipped, -adv * 3.0), clipped)

    def mean(x):
        return (x * mask).sum() / mask.sum()

    kl = 0.5 * (logps - inputs["ref_per_token_logps"]) ** 2
    return mean(token) + kl_coef * mean(kl) - entropy_coef * mean(entropies)


@pytest.mark.parametrize("preset", EXPERIENCE_PRESETS)
def test_preset_loss_is_the_composition_of_its_components(tmp_path, tiny_model_dir, tiny_dataset, preset):
    kl_coef, entropy_coef = (
        0.05,
        0.01,
    )  # larger than the presets' so both terms show in the loss
    # the preset's own KL loss (Trinity-RFT's), named: a trainer config adds none unless named (issue 43)
    trinity_kl = resolve_algorithm_config(preset).kl_loss.name
    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path,
            TrinityConfig,
            algorithm=preset,
            kl_loss={"name": trinity_kl, "kl_coef": kl_coef} if trinity_kl != "none" else None,
            entropy_loss={"entropy_coef": entropy_coef},
        ),
    )
    assert (trainer.ref_model is not None) == trainer.algorithm.needs_reference
    batch = generate_batch(trainer, tiny_dataset)
    assert ("ref_per_token_logps" in batch) == trainer.algorithm.needs_reference
    batch = harden_batch(trainer, batch)

    ga = 2  # pretend to accumulate: the returned loss is divided by it
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ga
    trainer.recorded.logps_calls.clear()
    loss = trainer._compute_loss(trainer.model, dict(batch))
    (forward,) = trainer.recorded.logps_calls  # one forward pass, through TRL's helper
    assert trainer.recorded.loss_calls[-1].forward is forward
    logps, entropies, _aux = forward.result
    assert (entropies is not None) == (trainer.algorithm.entropy_loss.name != "none")

    expected = _expected_loss(trainer, batch, logps, entropies)
    assert torch.isfinite(expected)
    # the same per-token terms summed in another order over the batch's tokens; GRPO's advantages cancel, so the sum
    # is compared at the terms' magnitude: an advantage plus a log-prob (the KL and entropy terms are of that size)
    terms = batch["completion_mask"].numel()
    scale = batch["advantages"].abs().max() + logps.detach().abs().max()
    assert_close(loss * ga, expected, terms=terms, scale=scale)
    assert trainer._metrics["train"]["actor/loss"][-1] == approx(loss.item(), scale=scale)  # the same value, logged

    # same gradient w.r.t. the log-probs (and entropies) the loss was built from
    wrt = [t for t in (logps, entropies) if t is not None and t.requires_grad]
    got = torch.autograd.grad(loss * ga, wrt, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(expected, wrt, retain_graph=True, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        g = torch.zeros_like(wrt[0]) if g is None else g
        w = torch.zeros_like(wrt[0]) if w is None else w
        assert_close(g, w)  # one token's derivative: a product and a division apart

    if preset == "grpo":  # and, independently of the library, the formula itself
        by_hand = _grpo_by_hand(batch, logps, entropies, kl_coef, entropy_coef)
        assert_close(loss * ga, by_hand, terms=terms, scale=scale)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("preset", EXPERIENCE_PRESETS)
def test_preset_trains_two_steps(tmp_path, tiny_model_dir, tiny_dataset, preset, lora):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path, TrinityConfig, algorithm=preset, max_steps=2),
        peft_config=lora_config() if lora else None,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    if lora:
        assert before and all("lora_" in n for n in before)
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    assert len(logs) == 2
    metric = f"actor/{POLICY_LOSS_METRIC[trainer.algorithm.policy_loss.name]}"
    for entry in logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry[metric]), entry
        # the logged loss is the metric summed over one step's micro-batches (at most 8 of them)
        assert entry["actor/loss"] == approx(entry["loss"], terms=8)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before), "no trainable parameter moved"


# ---------------------------------------------------------------------------------------------------------------------
# Gradient accumulation and num_iterations, through Trainer's own loop


class GradientCapture(TrainerCallback):
    """Copies the accumulated gradients just before the optimizer step (after clipping, which is off here)."""

    def __init__(self):
        self.trainer = None
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(
            {n: p.grad.detach().clone() for n, p in self.trainer.model.named_parameters() if p.requires_grad}
        )


def test_gradient_accumulation_averages_the_micro_batch_losses(tmp_path, tiny_model_dir, tiny_dataset):
    capture = GradientCapture()
    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        callbacks=[capture],
        args=_args(
            tmp_path / "ga",
            TrinityConfig,
            algorithm="grpo",
            gradient_accumulation_steps=2,
            steps_per_generation=2,
            max_steps=1,
            max_grad_norm=0.0,
            prefix_packing_token_budget=0,  # a loss per micro-batch (merged: tests/training/test_token_budget.py)
        ),
    )
    capture.trainer = trainer
    trainer.train()
    assert len(trainer.recorded.loss_calls) == 2 and len(capture.grads) == 1
    micro_batches = [call.inputs for call in trainer.recorded.loss_calls]
    assert all(mb["completion_ids"].shape[0] == G for mb in micro_batches)

    # the same initial weights, no accumulation: mean of the two unscaled micro-batch losses
    fresh = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "fresh", TrinityConfig, algorithm="grpo"),
    )
    fresh.model.train()
    fresh.current_gradient_accumulation_steps = 1
    fresh.model.zero_grad(set_to_none=True)
    losses = [fresh._compute_loss(fresh.model, dict(mb)) for mb in micro_batches]
    for call, unscaled in zip(trainer.recorded.loss_calls, losses, strict=True):
        assert_close(call.loss * 2, unscaled.detach(), terms=TINY_MODEL_TERMS)  # two forwards of the same weights
    (sum(losses) / 2).backward()
    (accumulated,) = capture.grads
    for name, param in fresh.model.named_parameters():
        assert_close(accumulated[name], param.grad, terms=TINY_MODEL_TERMS, msg=name)
    assert any(g.abs().max() > 1e-6 for g in accumulated.values())


def test_num_iterations_reuses_the_generation_with_old_logps(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = recording(TrinityTrainer)(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path, TrinityConfig, algorithm="grpo", num_iterations=2, max_steps=2),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    first, second = (call.inputs for call in trainer.recorded.loss_calls)
    assert "old_per_token_logps" in first and "old_per_token_logps" in second
    assert torch.equal(first["completion_ids"], second["completion_ids"])  # the second iteration reuses the batch
    # the old log-probs of the reused batch are the buffered ones, not recomputed: a copy, bit for bit
    assert torch.equal(first["old_per_token_logps"], second["old_per_token_logps"])
    kls = [entry["actor/ppo_kl"] for entry in trainer.state.log_history if "actor/ppo_kl" in entry]
    assert len(kls) == 2
    assert abs(kls[0]) < 1e-5  # first iteration: the policy is the behaviour policy
    assert abs(kls[1]) > 1e-6  # second: one optimizer step later, the ratio is no longer 1


# ---------------------------------------------------------------------------------------------------------------------
# vLLM importance weights and the completions table


def test_importance_sampling_ratio_scales_advantages(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = _trainer(tmp_path, tiny_model_dir, tiny_dataset)
    logps = torch.zeros(2, 3)
    batch = LossBatch(
        mask=torch.ones(2, 3),
        advantages=torch.tensor([1.0, -2.0]),
        importance_sampling_ratio=torch.tensor([[0.5], [2.0]]),
    )
    scaled = trainer._loss_inputs(batch, logps, batch.mask)["advantages"]
    assert scaled.tolist() == [[0.5], [-4.0]]


def test_completions_table_shows_our_advantages(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        tiny_dataset,
        cls=recording(TrinityTrainer),
        algorithm="rloo",
        log_completions=True,
        max_steps=1,
    )
    trainer.train()
    batch = trainer.recorded.batches[0]
    mask = batch["completion_mask"]
    expected = ((batch["advantages"] * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist()
    assert list(trainer._logs["advantages"])[-4:] == approx(expected, terms=mask.shape[1])  # a row mean


# ---------------------------------------------------------------------------------------------------------------------
# beta and the reference model


def test_reference_model_iff_kl_term(tmp_path, tiny_model_dir, tiny_dataset):
    with_kl = _trainer(tmp_path / "kl", tiny_model_dir, tiny_dataset, algorithm="grpo", kl_loss="k2")
    assert with_kl.args.beta == 0.0  # restored after TRL's __init__
    assert with_kl.algorithm.needs_reference
    assert with_kl.ref_model is not None

    for name, kl in (("none", "none"), ("unset", None)):  # unset: TRL's beta=0.0, no KL (issue 43)
        no_kl = _trainer(tmp_path / name, tiny_model_dir, tiny_dataset, algorithm="grpo", kl_loss=kl)
        assert no_kl.args.beta == 0.0
        assert not no_kl.algorithm.needs_reference
        assert no_kl.ref_model is None

    no_ref_preset = _trainer(tmp_path / "asymre", tiny_model_dir, tiny_dataset, algorithm="asymre")
    assert no_ref_preset.ref_model is None


def test_ref_logps_reach_the_loss_iff_kl_term(tmp_path, tiny_model_dir, tiny_dataset):
    with_kl = _trainer(
        tmp_path / "kl",
        tiny_model_dir,
        tiny_dataset,
        cls=recording(TrinityTrainer),
        max_steps=1,
        kl_loss="k2",
    )
    with_kl.train()
    assert with_kl.args.beta == 0.0
    (inputs,) = (call.inputs for call in with_kl.recorded.loss_calls)
    assert inputs["ref_per_token_logps"].shape == inputs["completion_ids"].shape

    no_kl = _trainer(
        tmp_path / "none",
        tiny_model_dir,
        tiny_dataset,
        cls=recording(TrinityTrainer),
        max_steps=1,
        kl_loss="none",
    )
    no_kl.train()
    (inputs,) = (call.inputs for call in no_kl.recorded.loss_calls)
    assert "ref_per_token_logps" not in inputs


def test_sync_ref_model_is_honoured_with_a_kl_term(tmp_path, tiny_model_dir, tiny_dataset):
    from trl.trainer.callbacks import SyncRefModelCallback

    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        tiny_dataset,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        kl_loss="k2",
    )
    assert trainer.ref_model is not None
    assert any(isinstance(cb, SyncRefModelCallback) for cb in trainer.callback_handler.callbacks)
    # without a KL term there is no reference to sync; the error speaks our terms, not TRL's beta
    with pytest.raises(ValueError, match="set kl_loss or kl_penalty"):
        _trainer(
            tmp_path,
            tiny_model_dir,
            tiny_dataset,
            sync_ref_model=True,
            kl_loss="none",
        )


def test_lora_reference_is_the_base_model(tmp_path, tiny_model_dir, tiny_dataset):
    peft_config = lora_config()
    trainer = _trainer(
        tmp_path,
        tiny_model_dir,
        tiny_dataset,
        cls=recording(TrinityTrainer),
        max_steps=2,
        peft_config=peft_config,
        kl_loss="k2",
    )
    assert trainer.args.beta == 0.0
    assert trainer.ref_model is None  # the adapter-disabled policy is the reference
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(trainer.recorded.loss_calls) == 2
    for inputs in (call.inputs for call in trainer.recorded.loss_calls):
        ref = inputs["ref_per_token_logps"]
        assert ref.shape == inputs["completion_ids"].shape and torch.isfinite(ref).all()
    kl_losses = [entry["actor/kl_loss"] for entry in trainer.state.log_history if "actor/kl_loss" in entry]
    assert len(kl_losses) == 2 and all(math.isfinite(v) for v in kl_losses)
