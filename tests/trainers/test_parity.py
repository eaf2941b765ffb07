"""Numerical parity of the trainers' losses, gradients and advantages.

* CISPO and SAPO trainers against TRL's own `GRPOTrainer(loss_type="cispo" | "sapo")`: same batch, same weights,
  same advantages, so the same loss and the same gradient of every parameter.
* Every experience preset TrinityTrainer runs: its `_compute_loss` equals `policy loss - entropy term + KL term`
  recomputed with `trinity_trl.algorithms` components on the tensors the trainer used (value and gradient), and it
  trains for 2 steps, with and without LoRA.
* Advantages (grpo, rloo) recomputed from the gathered rewards; gradient accumulation and `num_iterations`.

Batches are made by calling the trainer's `_generate_and_score_completions` seam directly on `num_generations`
copies of a dataset row (what the sampler would hand it), then optionally made harder: ragged completion masks (the
random model never emits EOS, so every row is full otherwise), an off-policy `old_per_token_logps` (ratios far from 1,
so clips and gates are exercised) and a perturbed `ref_per_token_logps` (a non-zero KL).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import length_reward, tiny_grpo_kwargs
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trinity_trl.algorithms import ADVANTAGE_FN, EID, Experience
from trinity_trl.algorithms.advantage import scalar_rewards_to_token_level
from trinity_trl.trainers.trl_seams import captured_return
from trinity_trl.trainers import (
    CISPOConfig,
    CISPOTrainer,
    SAPOConfig,
    SAPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


G = 4  # num_generations = per_device_train_batch_size: one micro-batch is one generation batch of one prompt
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6

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


def position_reward(completions, **kwargs):
    """Reward = row index in the reward call: every group has a non-zero reward spread."""
    return [float(i % G) for i in range(len(completions))]


def _args(path, cls, **overrides):
    settings = {"steps_per_generation": 1, "gradient_accumulation_steps": 1}
    settings.update(overrides)
    return cls(**tiny_grpo_kwargs(output_dir=str(path), **settings))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _detached(batch: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _generate(trainer, dataset, prompts=(0,), seed=0) -> dict:
    """One generation batch: `G` completions of each dataset row in `prompts`, scored, with advantages. The rewards
    TRL gathered (`(N, n_funcs)`, NaN where unscored) are kept in `trainer.rewards_per_func`."""
    trainer.model.train()
    torch.manual_seed(seed)
    rows = [dict(dataset[i]) for i in prompts for _ in range(G)]
    with captured_return(trainer, "_calculate_rewards") as rewards:
        batch = _detached(trainer._generate_and_score_completions(rows))
    trainer.rewards_per_func = rewards.value
    return batch


@torch.no_grad()
def _policy_logps(trainer, batch) -> torch.Tensor:
    """Log-probs of the batch's completions under the trainer's current policy (TRL's helper, no recording)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
        trainer,
        trainer.model,
        input_ids,
        attention_mask,
        batch["completion_ids"].size(1),
    )
    return logps


def _harden(
    trainer,
    batch,
    *,
    ragged=True,
    old_noise=0.3,
    ref_noise=0.2,
    empty_row=False,
    lengths=None,
) -> dict:
    """Ragged masks, an off-policy behaviour policy and (where present) a different reference."""
    batch = _detached(batch)
    width = batch["completion_mask"].shape[1]
    if ragged:
        lengths = torch.tensor(lengths if lengths is not None else [width, width - 2, 3, 0 if empty_row else 1])
        ragged_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(batch["completion_mask"].dtype)
        batch["completion_mask"] = batch["completion_mask"] * ragged_mask
        batch["num_items_in_batch"] = batch["completion_mask"].sum()
        if "global_loss_tokens" in batch:  # TrinityConfig(loss_normalization="global"): the same count
            batch["global_loss_tokens"] = batch["completion_mask"].sum().float()
    generator = torch.Generator().manual_seed(1)
    logps = _policy_logps(trainer, batch)
    if old_noise:
        batch["old_per_token_logps"] = logps + old_noise * torch.randn(logps.shape, generator=generator)
    if ref_noise and "ref_per_token_logps" in batch:
        batch["ref_per_token_logps"] = logps + ref_noise * torch.randn(logps.shape, generator=generator)
    return batch


def _loss_and_grads(trainer, inputs, ga=1):
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = ga  # set by Trainer's loop; _compute_loss divides by it
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, dict(inputs))
    loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same(result_a, result_b, scale=1.0):
    (loss_a, grads_a), (loss_b, grads_b) = result_a, result_b
    torch.testing.assert_close(loss_a * scale, loss_b, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(
            grads_a[name] * scale,
            grads_b[name],
            rtol=LOSS_RTOL,
            atol=LOSS_ATOL,
            msg=name,
        )
    assert any(g.abs().max() > 1e-6 for g in grads_a.values()), "all-zero gradients prove nothing"


def _ratio(trainer, batch):
    return torch.exp(_policy_logps(trainer, batch) - batch["old_per_token_logps"])[batch["completion_mask"].bool()]


# ---------------------------------------------------------------------------------------------------------------------
# a. CISPO against TRL's loss_type="cispo"


@pytest.fixture
def cispo_pair(tmp_path, tiny_model_dir, tiny_dataset):
    ours = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", CISPOConfig, kl_loss_fn="none"),
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
    batch = _generate(ours, tiny_dataset)
    assert batch["advantages"].abs().sum() > 0
    if variant == "ragged_off_policy":
        batch = _harden(ours, batch, empty_row=True)
        ratio = _ratio(ours, batch)
        assert (ratio > 1.28).any() and (ratio < 1.0).any()  # the cap is exercised
    _assert_same(_loss_and_grads(ours, batch), _loss_and_grads(theirs, batch))


def test_cispo_differs_from_trl_default_epsilon_high(tmp_path, tiny_model_dir, tiny_dataset):
    """TRL's cap is absolute and defaults to epsilon=0.2: on-policy (ratio 1) every weight becomes 0.2 instead of 1,
    so TRL's loss and gradients are exactly 0.2 times ours (the warning in CISPOConfig's docstring)."""
    ours = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", CISPOConfig, kl_loss_fn="none"),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "trl", GRPOConfig, loss_type="cispo", beta=0.0),
    )
    assert theirs.epsilon_high == pytest.approx(0.2)
    batch = _generate(ours, tiny_dataset)
    ours_result, theirs_result = (
        _loss_and_grads(ours, batch),
        _loss_and_grads(theirs, batch),
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
    batch = _generate(ours, tiny_dataset)
    advantages = batch["advantages"]
    assert (advantages > 0).any() and (advantages < 0).any()  # both temperatures are used
    if variant == "ragged_off_policy":
        batch = _harden(ours, batch, empty_row=True)
    _assert_same(_loss_and_grads(ours, batch), _loss_and_grads(theirs, batch))


def test_sapo_trinity_form_differs_from_trl(tmp_path, tiny_model_dir, tiny_dataset):
    ours = SAPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "ours", SAPOConfig, sapo_form="trinity"),
    )
    theirs = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path / "trl", GRPOConfig, loss_type="sapo"),
    )
    batch = _generate(ours, tiny_dataset)
    (loss_ours, grads_ours), (loss_trl, grads_trl) = (
        _loss_and_grads(ours, batch),
        _loss_and_grads(theirs, batch),
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
            kl_loss_fn="none",
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
    batch = _generate(ours, tiny_dataset, prompts=(0, 1))
    width = batch["completion_ids"].shape[1]
    batch = _harden(ours, batch, lengths=[2, 1, 3, 1, width, width, width - 1, width])
    micro_batches = split_tensor_dict(batch, 2)
    counts = [int(mb["completion_mask"].sum()) for mb in micro_batches]
    assert counts[0] != counts[1]  # where per-micro-batch token means would differ from TRL
    for micro_batch in micro_batches:
        _assert_same(
            _loss_and_grads(ours, micro_batch, ga=2),
            _loss_and_grads(theirs, micro_batch, ga=2),
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
            _args(tmp_path / "ours", CISPOConfig, kl_loss_fn="none"),
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
    batch = _harden(ours, _generate(ours, tiny_dataset))
    width = batch["completion_ids"].shape[1]
    generator = torch.Generator().manual_seed(2)
    shape = (G, width) if is_level == "token" else (G, 1)
    batch["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=generator)
    _assert_same(_loss_and_grads(ours, batch), _loss_and_grads(theirs, batch))


# ---------------------------------------------------------------------------------------------------------------------
# c. Every experience preset: the trainer's loss is the composition of the library's components


class RecordingTrinityTrainer(TrinityTrainer):
    """Records the tensors `_compute_loss` gets from TRL's log-prob helper (with their graph)."""

    def __init__(self, *args, **kwargs):
        self.logps_calls: list[tuple] = []
        self.loss_inputs: list[dict] = []
        super().__init__(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        self.logps_calls.append(result)
        return result

    def _compute_loss(self, model, inputs):
        self.loss_inputs.append(_detached(inputs))
        loss = super()._compute_loss(model, inputs)
        self.loss_inputs[-1]["_loss"] = loss.detach().clone()
        return loss


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
    if algorithm.entropy_loss_fn != "none":
        entropy_term, _ = algorithm.build_entropy_loss()(entropy=entropies, action_mask=mask, loss_agg_mode=agg)
        loss = loss - entropy_term
    if algorithm.kl_loss_fn != "none":
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
    trainer = RecordingTrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path,
            TrinityConfig,
            algorithm=preset,
            kl_loss_fn_args={"kl_coef": kl_coef},
            entropy_loss_fn_args={"entropy_coef": entropy_coef},
        ),
    )
    assert (trainer.ref_model is not None) == trainer.algorithm.needs_reference
    batch = _generate(trainer, tiny_dataset)
    assert ("ref_per_token_logps" in batch) == trainer.algorithm.needs_reference
    batch = _harden(trainer, batch)

    ga = 2  # pretend to accumulate: the returned loss is divided by it
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = ga
    trainer.logps_calls.clear()
    loss = trainer._compute_loss(trainer.model, dict(batch))
    ((logps, entropies, _aux),) = trainer.logps_calls
    assert (entropies is not None) == (trainer.algorithm.entropy_loss_fn != "none")

    expected = _expected_loss(trainer, batch, logps, entropies)
    assert torch.isfinite(expected)
    torch.testing.assert_close(loss * ga, expected, rtol=1e-6, atol=1e-6)
    assert trainer._metrics["train"]["actor/loss"][-1] == pytest.approx(loss.item(), rel=1e-6, abs=1e-9)

    # same gradient w.r.t. the log-probs (and entropies) the loss was built from
    wrt = [t for t in (logps, entropies) if t is not None and t.requires_grad]
    got = torch.autograd.grad(loss * ga, wrt, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(expected, wrt, retain_graph=True, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        g = torch.zeros_like(wrt[0]) if g is None else g
        w = torch.zeros_like(wrt[0]) if w is None else w
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)

    if preset == "grpo":  # and, independently of the library, the formula itself
        by_hand = _grpo_by_hand(batch, logps, entropies, kl_coef, entropy_coef)
        torch.testing.assert_close(loss * ga, by_hand, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("preset", EXPERIENCE_PRESETS)
def test_preset_trains_two_steps(tmp_path, tiny_model_dir, tiny_dataset, preset, lora):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path, TrinityConfig, algorithm=preset, max_steps=2),
        peft_config=_lora() if lora else None,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    if lora:
        assert before and all("lora_" in n for n in before)
    trainer.train()
    assert trainer.state.global_step == 2
    logs = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    assert len(logs) == 2
    metric = f"actor/{POLICY_LOSS_METRIC[trainer.algorithm.policy_loss_fn]}"
    for entry in logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry[metric]), entry
        assert entry["actor/loss"] == pytest.approx(entry["loss"], rel=1e-5, abs=1e-9)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before), "no trainable parameter moved"


# ---------------------------------------------------------------------------------------------------------------------
# d. Advantages, recomputed from the rewards TRL gathered


def _group_advantages_by_library(rewards: torch.Tensor, advantage_args: dict) -> torch.Tensor:
    experiences = [
        Experience(
            eid=EID(task=row // G, run=row % G),
            tokens=torch.zeros(1, dtype=torch.long),
            prompt_length=0,
            reward=float(value),
        )
        for row, value in enumerate(rewards.tolist())
    ]
    out, _ = ADVANTAGE_FN.get("grpo")(**advantage_args)(experiences)
    advantages = torch.full((len(experiences),), float("nan"))
    for exp in out:
        advantages[exp.eid.task * G + exp.eid.run] = exp.advantages[0]
    return advantages


def test_grpo_advantages_are_the_library_grpo_of_the_weighted_rewards(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=[length_reward, position_reward],
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path,
            TrinityConfig,
            algorithm="grpo",
            reward_weights=[1.0, 0.5],
            gradient_accumulation_steps=2,
            steps_per_generation=2,
        ),
    )
    batch = _generate(trainer, tiny_dataset, prompts=(0, 1))  # 2 groups of G
    per_func = trainer.rewards_per_func
    assert per_func.shape == (2 * G, 2)
    rewards = per_func[:, 0] + 0.5 * per_func[:, 1]

    expected = _group_advantages_by_library(rewards, trainer.algorithm.advantage_fn_args)
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-6, atol=1e-6)
    grouped = rewards.view(-1, G)
    by_hand = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(batch["advantages"], by_hand.flatten(), rtol=1e-5, atol=1e-6)


def test_unscorable_rows_get_no_advantage_and_no_loss(tmp_path, tiny_model_dir, tiny_dataset):
    def partial_reward(completions, **kwargs):
        return [None if i == 1 else float(i) for i in range(len(completions))]

    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=partial_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path, TrinityConfig, algorithm="grpo"),
    )
    batch = _generate(trainer, tiny_dataset)
    assert math.isnan(trainer.rewards_per_func[1, 0].item())
    assert batch["advantages"][1].item() == 0.0
    assert batch["completion_mask"][1].sum().item() == 0
    scored = torch.tensor([0.0, 2.0, 3.0])  # group statistics over the three scored rows only
    expected = (scored - scored.mean()) / (scored.std() + 1e-6)
    torch.testing.assert_close(batch["advantages"][[0, 2, 3]], expected, rtol=1e-6, atol=1e-6)


def test_rloo_advantages_are_the_library_rloo_of_the_token_level_batch(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=[length_reward, position_reward],
        train_dataset=tiny_dataset,
        args=_args(
            tmp_path,
            TrinityConfig,
            algorithm="rloo",
            gradient_accumulation_steps=2,
            steps_per_generation=2,
        ),
    )
    batch = _generate(trainer, tiny_dataset, prompts=(0, 1))
    rewards = trainer.rewards_per_func.sum(dim=1)
    mask = batch["completion_mask"]
    library_batch = {
        "token_level_rewards": scalar_rewards_to_token_level(rewards, mask),
        "response_mask": mask,
        "uid": torch.arange(2 * G) // G,
    }
    library_batch, _ = ADVANTAGE_FN.get("rloo")()(library_batch)
    assert batch["advantages"].shape == mask.shape
    torch.testing.assert_close(batch["advantages"], library_batch["advantages"], rtol=1e-6, atol=1e-6)
    grouped = rewards.view(-1, G)
    by_hand = (grouped - grouped.mean(1, keepdim=True)) * G / (G - 1)
    torch.testing.assert_close(batch["advantages"], by_hand.flatten().unsqueeze(1) * mask, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# e. Gradient accumulation and num_iterations, through Trainer's own loop


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
    trainer = RecordingTrinityTrainer(
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
        ),
    )
    capture.trainer = trainer
    trainer.train()
    assert len(trainer.loss_inputs) == 2 and len(capture.grads) == 1
    micro_batches = trainer.loss_inputs
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
    inputs = [{k: v for k, v in mb.items() if k != "_loss"} for mb in micro_batches]
    losses = [fresh._compute_loss(fresh.model, dict(mb)) for mb in inputs]
    for scaled, unscaled in zip(micro_batches, losses, strict=True):
        torch.testing.assert_close(scaled["_loss"] * 2, unscaled.detach(), rtol=1e-5, atol=1e-7)
    (sum(losses) / 2).backward()
    (accumulated,) = capture.grads
    for name, param in fresh.model.named_parameters():
        torch.testing.assert_close(accumulated[name], param.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().max() > 1e-6 for g in accumulated.values())


def test_num_iterations_reuses_the_generation_with_old_logps(tmp_path, tiny_model_dir, tiny_dataset):
    trainer = RecordingTrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=_args(tmp_path, TrinityConfig, algorithm="grpo", num_iterations=2, max_steps=2),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    first, second = trainer.loss_inputs
    assert "old_per_token_logps" in first and "old_per_token_logps" in second
    assert torch.equal(first["completion_ids"], second["completion_ids"])  # the second iteration reuses the batch
    torch.testing.assert_close(first["old_per_token_logps"], second["old_per_token_logps"])
    kls = [entry["actor/ppo_kl"] for entry in trainer.state.log_history if "actor/ppo_kl" in entry]
    assert len(kls) == 2
    assert abs(kls[0]) < 1e-5  # first iteration: the policy is the behaviour policy
    assert abs(kls[1]) > 1e-6  # second: one optimizer step later, the ratio is no longer 1
