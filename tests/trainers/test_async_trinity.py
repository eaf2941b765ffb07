"""AsyncTrinityTrainer: the asynchronous trainers' loss is the synchronous trainers' loss.

On a fixed batch, TRL's packed micro-batch through `AsyncTrinityTrainer.compute_loss` (tree attention on our kernel,
the per-sample layout, the shared `TrinityLossMixin`) gives the same loss and the same gradient of every parameter as
`TrinityTrainer._compute_loss` on TRL's padded rows, in float64 on a CPU, for each component and normalisation below.
Also here: the config (fields honoured or refused in one line) and what the trainer refuses.
"""

from __future__ import annotations

import pytest
import torch
from async_helpers import packed_batch, rollout_sample, save_float64_model, tiny_async_kwargs
from datasets import Dataset
from helpers import TINY_MODEL_TERMS, length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from tolerance import assert_close
from trl import GRPOTrainer
from trl.trainer.utils import pad

from trinity_trl.asynchronous.trl_seams import POLICY_VERSION_KEY
from trinity_trl.trainers import (
    AsyncChordConfig,
    AsyncChordTrainer,
    AsyncSAPOConfig,
    AsyncSAPOTrainer,
    AsyncTrinityConfig,
    AsyncTrinityTrainer,
    ChordConfig,
    ChordTrainer,
    SAPOConfig,
    SAPOTrainer,
    TrinityConfig,
    TrinityTrainer,
)

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

F64 = {"model_init_kwargs": {"dtype": "auto"}}  # the synchronous trainers load the float64 checkpoint as it is


@pytest.fixture(scope="module")
def float64_model_dir(tmp_path_factory):
    from helpers import build_tiny_tokenizer

    return save_float64_model(tmp_path_factory.mktemp("tiny_qwen2_f64"), build_tiny_tokenizer())


def expert_dataset(n: int = 8) -> Dataset:
    rows = tiny_conversational_dataset(n)
    return Dataset.from_dict(
        {"prompt": rows["prompt"], "completion": [[{"role": "assistant", "content": a}] for a in rows["answer"]]}
    )


# ------------------------------------------------------------------------------------------- the fixed batch
# four completions of two prompts; the first two share their first two tokens (the tree forks inside a completion);
# every completion is trained from its first token and the widest one is whole, so the padded rows' width is the
# widest sample (the one layout difference: docs/asynchronous.md#what-differs)
COMPLETIONS = [[17, 23, 40, 41, 42, 43], [17, 23, 50, 51], [60, 61, 62, 63, 64, 65], [70, 71, 72]]
PROMPTS = [0, 0, 1, 1]
ADVANTAGES = [1.0, -0.5, 0.3, -0.8]


def _prompt_ids(tokenizer) -> list[list[int]]:
    rows = tiny_conversational_dataset(2)
    return [
        tokenizer(tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True))["input_ids"]
        for p in rows["prompt"]
    ]


def _perturb(model, seed: int = 3) -> None:
    """Move the policy off the checkpoint (the reference), the same way in both trainers."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


def _padded_inputs(tokenizer, old_logps: list[list[float]], expert: list[bool] | None = None) -> dict:
    prompts = _prompt_ids(tokenizer)
    prompt_rows = [torch.tensor(prompts[p]) for p in PROMPTS]
    completion_rows = [torch.tensor(c) for c in COMPLETIONS]
    inputs = {
        "prompt_ids": pad(prompt_rows, padding_value=tokenizer.pad_token_id, padding_side="left"),
        "prompt_mask": pad([torch.ones_like(r) for r in prompt_rows], padding_value=0, padding_side="left"),
        "completion_ids": pad(completion_rows, padding_value=tokenizer.pad_token_id, padding_side="right"),
        "completion_mask": pad([torch.ones_like(r) for r in completion_rows], padding_value=0, padding_side="right"),
        "old_per_token_logps": pad(
            [torch.tensor(lp, dtype=torch.float64) for lp in old_logps], padding_value=0.0, padding_side="right"
        ),
        "advantages": torch.tensor(ADVANTAGES, dtype=torch.float32),
    }
    if expert is not None:
        inputs["expert_mask"] = torch.tensor(expert)
        inputs["advantages"] = inputs["advantages"].masked_fill(inputs["expert_mask"], 0.0)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    inputs["global_loss_tokens"] = inputs["completion_mask"].sum().float()
    inputs["global_loss_rows"] = torch.tensor(4.0)
    return inputs


def _packed_inputs(tokenizer, old_logps, expert: list[bool] | None = None) -> dict:
    prompts = _prompt_ids(tokenizer)
    samples = []
    for i, completion in enumerate(COMPLETIONS):
        is_expert = expert is not None and expert[i]
        metrics = {"chord/expert_share": 1.0} if is_expert else {POLICY_VERSION_KEY: 0.0}
        samples.append(
            rollout_sample(
                prompts[PROMPTS[i]],
                completion,
                [0.0] * len(completion) if is_expert else old_logps[i],
                0.0 if is_expert else ADVANTAGES[i],
                group_id=PROMPTS[i],
                metrics=metrics,
            )
        )
    return packed_batch(samples, tokenizer.pad_token_id)


def _old_logps(trainer, tokenizer) -> list[list[float]]:
    """Behaviour log-probs off the current policy (ratios far from 1), rounded to float32 as TRL's queue carries
    them."""
    inputs = _padded_inputs(tokenizer, [[0.0] * len(c) for c in COMPLETIONS])
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer,
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].shape[1],
        )
    generator = torch.Generator().manual_seed(1)
    noisy = logps + 0.3 * torch.randn(logps.shape, generator=generator, dtype=logps.dtype)
    return [noisy[i, : len(c)].float().tolist() for i, c in enumerate(COMPLETIONS)]


def _grads(model) -> dict:
    return {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _sync_loss(trainer, inputs):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    if "ref_per_token_logps" not in inputs and trainer.algorithm.needs_reference:
        with torch.no_grad():
            inputs["ref_per_token_logps"], _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer,
                trainer.ref_model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
                inputs["completion_ids"].shape[1],
            )
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    return loss.detach(), _grads(trainer.model)


def _async_loss(trainer, batch):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss.detach(), _grads(trainer.model)


def _assert_same(sync, asynchronous):
    """The model computes in float64, but TRL's fused LM head (both trainers') accumulates log-probs in float32 and
    TRL's queue carries behaviour log-probs and advantages in float32: float32's tolerance for the tiny model's sums."""
    (loss_s, grads_s), (loss_a, grads_a) = sync, asynchronous
    assert_close(loss_a.double(), loss_s.double(), terms=TINY_MODEL_TERMS, dtype=torch.float32)
    assert grads_s.keys() == grads_a.keys() and grads_s
    for name in grads_s:
        assert_close(grads_a[name], grads_s[name], terms=TINY_MODEL_TERMS, dtype=torch.float32, msg=name)
    assert any(g.abs().max() > 1e-6 for g in grads_s.values()), "all-zero gradients prove nothing"


CASES = {
    # CISPO preset: GRPO advantages, k2 KL loss against our reference forward, token-mean
    "cispo": {"algorithm": "cispo"},
    # sequence-level ratios (a sample's tokens must stay one row)
    "gspo": {"algorithm": "gspo"},
    "grpo-k3-entropy-seq-mean-token-mean": {
        "algorithm": "grpo",
        "kl_loss": {"name": "k3", "kl_coef": 0.05},
        "entropy_loss": {"entropy_coef": 0.01},
        "loss_agg_mode": "seq-mean-token-mean",
    },
    "grpo-seq-mean-token-sum-norm": {"algorithm": "grpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
    "ppo-global-normalization": {"algorithm": "ppo", "loss_normalization": "global", "advantage": "grpo"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_async_loss_and_gradient_equal_the_synchronous_trainers(case, tmp_path, float64_model_dir, tiny_dataset):
    options = CASES[case]
    if options["algorithm"] == "ppo":  # the critic-free part of PPO's loss: its clip, a group advantage
        options = {**options, "algorithm": "grpo", "policy_loss": "ppo"}
    sync = TrinityTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "s"), prefix_packing=False, **F64, **options)),
        train_dataset=tiny_dataset,
    )
    asynchronous = AsyncTrinityTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=AsyncTrinityConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto", **options)),
        train_dataset=tiny_dataset,
    )
    assert sync.model.dtype == asynchronous.model.dtype == torch.float64
    _perturb(sync.model), _perturb(asynchronous.model)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old)), _async_loss(asynchronous, _packed_inputs(tokenizer, old))
    )


def test_async_sapo_equals_sapo_trainer(tmp_path, float64_model_dir, tiny_dataset):
    sync = SAPOTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=SAPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "s"), prefix_packing=False, **F64)),
        train_dataset=tiny_dataset,
    )
    asynchronous = AsyncSAPOTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=AsyncSAPOConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto")),
        train_dataset=tiny_dataset,
    )
    _perturb(sync.model), _perturb(asynchronous.model)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old)), _async_loss(asynchronous, _packed_inputs(tokenizer, old))
    )


@pytest.mark.parametrize("phi", [True, False], ids=["chord-phi", "chord-mu"])
def test_async_chord_equals_chord_trainer_on_a_mixed_batch(phi, tmp_path, float64_model_dir, tiny_dataset):
    """Three rollouts and one demonstration in one micro-batch: ChordTrainer weighs each of its 3 rollouts 1/3 and its
    demonstration 1/1 (per_device_train_batch_size 3, expert_batch_size 1); AsyncChordTrainer the same from the
    optimizer step's counts."""
    schedule = {
        "mu_warmup_steps": 0,
        "mu_decay_steps": 4,
        "mu_peak": 0.9,
        "mu_valley": 0.05,
        "enable_phi_function": phi,
    }
    sync = ChordTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=ChordConfig(
            **tiny_grpo_kwargs(
                output_dir=str(tmp_path / "s"),
                prefix_packing=False,
                **F64,
                per_device_train_batch_size=3,
                num_generations=3,
                expert_batch_size=1,
                **schedule,
            )
        ),
        train_dataset=tiny_dataset,
        expert_dataset=expert_dataset(),
    )
    asynchronous = AsyncChordTrainer(
        model=float64_model_dir,
        reward_funcs=length_reward,
        args=AsyncChordConfig(**tiny_async_kwargs(output_dir=str(tmp_path / "a"), dtype="auto", **schedule)),
        train_dataset=tiny_dataset,
        expert_dataset=expert_dataset(),
    )
    _perturb(sync.model), _perturb(asynchronous.model)
    tokenizer = sync.processing_class
    old = _old_logps(sync, tokenizer)
    expert = [False, False, False, True]
    _assert_same(
        _sync_loss(sync, _padded_inputs(tokenizer, old, expert)),
        _async_loss(asynchronous, _packed_inputs(tokenizer, old, expert)),
    )
