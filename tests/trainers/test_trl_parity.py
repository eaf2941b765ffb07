"""Numerical parity with TRL: the CISPO and SAPO trainers against TRL's own `GRPOTrainer(loss_type="cispo" | "sapo")`
on the same batch and weights give the same loss and the same gradient of every parameter (and differ exactly where
the documented behaviour differs: TRL's absolute CISPO cap, Trinity's SAPO form), also under gradient accumulation
with global normalisation and with vLLM importance-sampling weights; and `TrinityTrainer`'s GRPO against TRL's
defaults (`loss_type="dapo"`), the pair the whole-step benchmark compares.

This promise spans the config, the loss and the trainer, so it has its own file. Batches come from the trainer's
`_generate_and_score_completions` seam, optionally hardened (tests/helpers.py `generate_batch`, `harden_batch`).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TINY_MODEL_TERMS,
    generate_batch,
    harden_batch,
    length_reward,
    loss_and_grads,
    policy_logps,
    tiny_grpo_kwargs,
)
from tolerance import assert_close
from trl import GRPOConfig, GRPOTrainer

from trinity_trl.trainers import CISPOConfig, CISPOTrainer, SAPOConfig, SAPOTrainer, TrinityConfig, TrinityTrainer

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

G = 4  # num_generations = per_device_train_batch_size: one micro-batch is one generation batch of one prompt


def _args(path, cls, **overrides):
    settings = {"steps_per_generation": 1, "gradient_accumulation_steps": 1}
    settings.update(overrides)
    return cls(**tiny_grpo_kwargs(output_dir=str(path), **settings))


def _trainer(trainer_cls, config_cls, path, model, dataset, **config):
    args = _args(path, config_cls, **config)
    return trainer_cls(model=model, reward_funcs=length_reward, train_dataset=dataset, args=args)


def _assert_same(result_a, result_b, scale=1.0):
    (loss_a, grads_a), (loss_b, grads_b) = result_a, result_b
    # TRL's loss and ours sum the same tokens in another order: the tiny model's chain of additions (helpers.py)
    assert_close(loss_a * scale, loss_b, terms=TINY_MODEL_TERMS)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert_close(grads_a[name] * scale, grads_b[name], terms=TINY_MODEL_TERMS, msg=name)
    assert any(g.abs().max() > 1e-6 for g in grads_a.values()), "all-zero gradients prove nothing"


def _ratio(trainer, batch):
    return torch.exp(policy_logps(trainer, batch) - batch["old_per_token_logps"])[batch["completion_mask"].bool()]


# ---------------------------------------------------------------------------------------------------------------------
# a. CISPO against TRL's loss_type="cispo"


@pytest.fixture
def cispo_pair(tmp_path, tiny_model_dir, tiny_dataset):
    ours = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", CISPOConfig, kl_loss="none"),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "trl", GRPOConfig, loss_type="cispo", epsilon_high=1.28, beta=0.0),
    )
    return ours, theirs


@pytest.mark.parametrize("variant", ["on_policy", "ragged_off_policy"])
def test_cispo_matches_trl_cispo(cispo_pair, tiny_dataset, variant):
    ours, theirs = cispo_pair
    assert ours.ref_model is None and theirs.ref_model is None
    batch = generate_batch(ours, tiny_dataset)
    assert batch["advantages"].abs().sum() > 0
    if variant == "ragged_off_policy":
        batch = harden_batch(ours, batch, empty_row=True)
        ratio = _ratio(ours, batch)
        assert (ratio > 1.28).any() and (ratio < 1.0).any()  # the cap is exercised
    _assert_same(loss_and_grads(ours, batch), loss_and_grads(theirs, batch))


def test_cispo_differs_from_trl_default_epsilon_high(tmp_path, tiny_model_dir, tiny_dataset):
    """TRL's cap is absolute and defaults to epsilon=0.2: on-policy (ratio 1) every weight becomes 0.2 instead of 1,
    so TRL's loss and gradients are exactly 0.2 times ours (the warning in CISPOConfig's docstring)."""
    ours = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", CISPOConfig, kl_loss="none"),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "trl", GRPOConfig, loss_type="cispo", beta=0.0),
    )
    assert theirs.epsilon_high == pytest.approx(0.2)
    batch = generate_batch(ours, tiny_dataset)
    ours_result, theirs_result = (
        loss_and_grads(ours, batch),
        loss_and_grads(theirs, batch),
    )
    assert not torch.allclose(ours_result[0], theirs_result[0], rtol=1e-3, atol=0)
    _assert_same(ours_result, theirs_result, scale=0.2)


# ---------------------------------------------------------------------------------------------------------------------
# b. SAPO against TRL's loss_type="sapo"


@pytest.mark.parametrize("temperatures", [{}, {"sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.5}])
@pytest.mark.parametrize("variant", ["on_policy", "ragged_off_policy"])
def test_sapo_matches_trl_sapo(tmp_path, tiny_model_dir, tiny_dataset, temperatures, variant):
    ours = SAPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", SAPOConfig, **temperatures),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "trl", GRPOConfig, loss_type="sapo", **temperatures),
    )
    assert ours.ref_model is None
    if temperatures:
        assert (ours.components.policy_loss.tau_pos, ours.components.policy_loss.tau_neg) == (0.8, 1.5)
    batch = generate_batch(ours, tiny_dataset)
    advantages = batch["advantages"]
    assert (advantages > 0).any() and (advantages < 0).any()  # both temperatures are used
    if variant == "ragged_off_policy":
        batch = harden_batch(ours, batch, empty_row=True)
    _assert_same(loss_and_grads(ours, batch), loss_and_grads(theirs, batch))


def test_sapo_trinity_form_differs_from_trl(tmp_path, tiny_model_dir, tiny_dataset):
    ours = SAPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", SAPOConfig, policy_loss={"form": "trinity"}),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "trl", GRPOConfig, loss_type="sapo"),
    )
    batch = generate_batch(ours, tiny_dataset)
    (loss_ours, grads_ours), (loss_trl, grads_trl) = (
        loss_and_grads(ours, batch),
        loss_and_grads(theirs, batch),
    )
    assert not torch.allclose(loss_ours, loss_trl, rtol=1e-2, atol=0)
    assert any(not torch.allclose(grads_ours[n], grads_trl[n], rtol=1e-2, atol=1e-6) for n in grads_ours)


def test_cispo_global_normalization_matches_trl_cispo_under_accumulation(tmp_path, tiny_model_dir, tiny_dataset):
    """TRL normalises cispo by the token count of the whole accumulation window; `loss_normalization="global"`
    does the same, so micro-batches with different token counts still match TRL one by one."""
    from trl.trainer.utils import split_tensor_dict

    geometry = {"gradient_accumulation_steps": 2, "steps_per_generation": 2}
    ours = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path / "ours",
            CISPOConfig,
            kl_loss="none",
            loss_normalization="global",
            **geometry,
        ),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path / "trl",
            GRPOConfig,
            loss_type="cispo",
            epsilon_high=1.28,
            **geometry,
        ),
    )
    batch = generate_batch(ours, tiny_dataset, prompts=(0, 1))
    width = batch["completion_ids"].shape[1]
    batch = harden_batch(ours, batch, lengths=[2, 1, 3, 1, width, width, width - 1, width])
    micro_batches = split_tensor_dict(batch, 2)
    counts = [int(mb["completion_mask"].sum()) for mb in micro_batches]
    assert counts[0] != counts[1]  # where per-micro-batch token means would differ from TRL
    for micro_batch in micro_batches:
        _assert_same(
            loss_and_grads(ours, micro_batch, ga=2),
            loss_and_grads(theirs, micro_batch, ga=2),
        )


@pytest.mark.parametrize("is_level", ["token", "sequence"])
@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_vllm_importance_sampling_ratio_matches_trl(tmp_path, tiny_model_dir, tiny_dataset, loss, is_level):
    """With vLLM IS correction TRL multiplies each token's loss by `importance_sampling_ratio`; TrinityTrainer scales
    the advantages by it instead. vLLM is not installed, so the ratio is injected into the batch and TRL's trainer
    is told it was produced by vLLM."""
    if loss == "cispo":
        ours_cls, ours_args = (
            CISPOTrainer,
            _args(tmp_path / "ours", CISPOConfig, kl_loss="none"),
        )
        trl_args = _args(tmp_path / "trl", GRPOConfig, loss_type="cispo", epsilon_high=1.28)
    else:
        ours_cls, ours_args = SAPOTrainer, _args(tmp_path / "ours", SAPOConfig)
        trl_args = _args(tmp_path / "trl", GRPOConfig, loss_type="sapo")
    ours = ours_cls(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=ours_args,
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=trl_args,
    )
    theirs.use_vllm = theirs.vllm_importance_sampling_correction = True
    batch = harden_batch(ours, generate_batch(ours, tiny_dataset))
    width = batch["completion_ids"].shape[1]
    generator = torch.Generator().manual_seed(2)
    shape = (G, width) if is_level == "token" else (G, 1)
    batch["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=generator)
    _assert_same(loss_and_grads(ours, batch), loss_and_grads(theirs, batch))


# ---------------------------------------------------------------------------------------------------------------------
# c. GRPO against TRL's defaults (loss_type="dapo"): the `ours` side of benchmarks/whole_step.py


def test_grpo_with_global_normalisation_matches_trls_defaults(tmp_path, tiny_model_dir, tiny_dataset):
    """`TrinityConfig(algorithm="grpo", loss_normalization="global", advantage={"epsilon": 1e-4})` trains what
    `GRPOTrainer` trains at TRL's defaults (`loss_type="dapo"`, `beta=0`, group z-score with 1e-4): the same
    completions and advantages from the same weights and seed, the same loss and gradients on and off policy (the
    dual clip at 3 binds neither batch: it needs a ratio above 3 with a negative advantage)."""
    ours = _trainer(
        TrinityTrainer,
        TrinityConfig,
        tmp_path / "ours",
        tiny_model_dir,
        tiny_dataset,
        algorithm="grpo",
        loss_normalization="global",
        advantage={"epsilon": 1e-4},
    )
    theirs = _trainer(GRPOTrainer, GRPOConfig, tmp_path / "trl", tiny_model_dir, tiny_dataset)
    assert theirs.loss_type == "dapo" and theirs.beta == 0.0 and ours.ref_model is None
    batch, trl_batch = generate_batch(ours, tiny_dataset), generate_batch(theirs, tiny_dataset)
    assert torch.equal(batch["completion_ids"], trl_batch["completion_ids"])  # same weights, seed and sampler
    assert batch["advantages"].abs().sum() > 0
    # a group z-score of 4 rewards: a handful of roundings on each side
    assert_close(batch["advantages"], trl_batch["advantages"], terms=G)
    _assert_same(loss_and_grads(ours, batch), loss_and_grads(theirs, batch))
    hardened = harden_batch(ours, batch)
    _assert_same(loss_and_grads(ours, hardened), loss_and_grads(theirs, hardened))
