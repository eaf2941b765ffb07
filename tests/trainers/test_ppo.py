"""`PPOTrainer`: the `ppo` preset with a value model (critic), GAE and the clipped value loss."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    TINY_MODEL_TERMS,
    length_reward,
    lora_config,
    recording,
    tiny_conversational_dataset,
    tiny_grpo_kwargs,
    trained_weights_atol,
)
from launching import scaled_timeout
from peft import PeftModel
from tolerance import assert_close
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    TrainerCallback,
)

from trinity_trl.algorithms import ADVANTAGE_FN, KL_FN, clipped_value_loss
from trinity_trl.algorithms.advantage import scalar_rewards_to_token_level
from trinity_trl.trainers import PPOConfig, PPOTrainer, TrinityConfig
from trinity_trl.trainers.ppo_trainer import CRITIC_DIR, CRITIC_OPTIMIZER_FILE

LORA = lora_config()
DIST_SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "ppo_equivalence.py"

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


def make(tmp_path, model_dir, cls=None, peft=False, callbacks=None, **config):
    config = {"value_learning_rate": 1e-3, **config}
    return (cls or recording(PPOTrainer))(
        model=model_dir,
        reward_funcs=length_reward,
        peft_config=LORA if peft else None,
        callbacks=callbacks,
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), **config)),
        train_dataset=tiny_conversational_dataset(),
    )


def unwrapped_critic(trainer):
    return trainer.accelerator.unwrap_model(trainer.critic)


def snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


# ---------------------------------------------------------------------------------------------------------------------
# configuration


def test_config_defaults_and_gae_arguments(tmp_path):
    config = PPOConfig(output_dir=str(tmp_path), use_cpu=True, gamma=0.9, lam=0.8)
    resolved = config.resolved_algorithm()
    assert (resolved.algorithm, resolved.policy_loss.name, resolved.advantage.name) == ("ppo", "ppo", "ppo")
    assert resolved.use_critic and resolved.kl_loss.name == "none" and resolved.kl_penalty.name == "none"
    assert resolved.advantage.args == {"gamma": 0.9, "lam": 0.8}
    assert resolved.build_advantage_fn().lam == 0.8
    assert (config.cliprange_value, config.critic_warmup_steps, config.save_value_model) == (0.5, 0, False)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "grpo"}, "'ppo' preset"),
        ({"advantage": "reinforceplusplus"}, "advantage must be 'ppo'"),
        ({"advantage": {"gamma": 0.5}}, "gamma"),  # clashes with the gamma field (1.0)
        ({"gamma": 1.5}, "gamma"),
        ({"cliprange_value": 0.0}, "cliprange_value"),
        ({"critic_warmup_steps": -1}, "critic_warmup_steps"),
        ({"value_learning_rate": -1e-5}, "value_learning_rate"),
        ({"fp16": True}, "fp16"),
    ],
)
def test_config_rejects(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def test_trainer_needs_a_ppo_config_and_one_critic(tmp_path, tiny_model_dir):
    with pytest.raises(TypeError, match="PPOConfig"):
        PPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
        )
    with pytest.raises(ValueError, match="value_model"):
        PPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            value_model=tiny_model_dir,
            args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), value_model_name_or_path=tiny_model_dir)),
        )


# ---------------------------------------------------------------------------------------------------------------------
# the critic


def test_values_are_scored_on_response_tokens_only(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir)
    critic = unwrapped_critic(trainer)
    pad = trainer.processing_class.pad_token_id
    batch = {  # left-padded prompts, right-padded completions
        "prompt_ids": torch.tensor([[pad, pad, 11, 12], [21, 22, 23, 24]]),
        "prompt_mask": torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        "completion_ids": torch.tensor([[31, 32, 33], [41, pad, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
    }
    with torch.no_grad():
        values = trainer._critic_values(critic, batch)
        full = critic(
            input_ids=torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
        ).logits[..., 0]
    assert values.shape == (2, 3) and values.dtype == torch.float32
    # V[b, t] is the critic's output at the position before completion token t (prompt width 4)
    # the same forward in another layout (the critic's own call vs ours): the tiny model's chain of additions
    assert_close(values[0], full[0, 3:6], terms=TINY_MODEL_TERMS, scale=full.abs().max())
    assert_close(values[1, :1], full[1, 3:4], terms=TINY_MODEL_TERMS, scale=full.abs().max())
    assert torch.all(values[1, 1:] == 0)  # padding positions are not scored
    assert torch.all(values[batch["completion_mask"].bool()] != 0)

    # prompt padding tokens are masked out; a completion token does not see itself, only the ones before it
    other = dict(batch, prompt_ids=batch["prompt_ids"].clone(), completion_ids=batch["completion_ids"].clone())
    other["prompt_ids"][0, :2] = 7
    other["completion_ids"][0, 1] = 99
    with torch.no_grad():
        moved = trainer._critic_values(critic, other)
    assert_close(moved[0, :2], values[0, :2], terms=TINY_MODEL_TERMS, scale=full.abs().max())
    assert not torch.allclose(moved[0, 2], values[0, 2])


def test_gae_in_the_trainer_equals_the_library_with_kl_in_reward(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, gamma=0.9, lam=0.8, kl_penalty={"name": "k1", "kl_coef": 0.5})
    trainer.train()
    assert len(trainer.recorded.batches) == 2
    kl_coefs = [h["critic/kl_coef"] for h in trainer.state.log_history if "critic/kl_coef" in h]
    for step, batch in enumerate(trainer.recorded.batches):
        mask = batch["completion_mask"]
        kl = KL_FN.get("k1")().calculate_kl(batch["old_per_token_logps"], batch["ref_per_token_logps"]) * mask
        if step == 1:  # the policy moved away from the reference: the penalty is not zero
            assert kl.abs().sum() > 1e-4
        rewards = trainer.recorded.reward_calls[step].rewards[:, 0]  # one reward function, weight 1
        rewards = scalar_rewards_to_token_level(rewards, mask) - kl_coefs[step] * kl
        expected, _ = ADVANTAGE_FN.get("ppo")(gamma=0.9, lam=0.8)(
            {"token_level_rewards": rewards, "values": batch["old_values"], "response_mask": mask}
        )
        # GAE's backward recursion over the row's tokens, on the same inputs; rewards, values and KL set the scale
        tol = {"terms": mask.shape[1], "scale": rewards.abs().max() + batch["old_values"].abs().max()}
        assert_close(batch["advantages"], expected["advantages"], **tol)
        assert_close(batch["returns"], expected["returns"], **tol)
        # the old values are the critic's (non-zero on the response, zero elsewhere)
        assert torch.all((batch["old_values"] != 0) == mask.bool())


def fixed_batch(trainer) -> dict[str, torch.Tensor]:
    """Two rows: a left-padded prompt with a full completion, and a full prompt with a padded completion."""
    pad = trainer.processing_class.pad_token_id
    return {
        "prompt_ids": torch.tensor([[pad, 11, 12], [21, 22, 23]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
        "completion_ids": torch.tensor([[31, 32, 33, 34], [41, 42, pad, pad]]),
        "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }


def test_value_loss_decreases_on_a_fixed_batch(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir, value_learning_rate=3e-3, cliprange_value=0.2)
    batch = fixed_batch(trainer)
    returns = torch.tensor([[1.0, 1.5, 2.0, 2.5], [-1.0, -0.5, 0.0, 0.0]])
    losses = []
    for _ in range(12):
        with torch.no_grad():  # PPO epochs: the clip is around each round's old values
            old_values = trainer._critic_values(unwrapped_critic(trainer), batch)
        loss, _ = clipped_value_loss(
            trainer._critic_values(trainer.critic, batch),
            old_values,
            returns,
            batch["completion_mask"],
            cliprange_value=0.2,
        )
        loss.backward()
        trainer._critic_optimizer_step()
        losses.append(loss.item())
    assert max(losses[-4:]) < 0.2 * losses[0], losses


def test_non_finite_returns_or_old_values_never_reach_the_critic_gradient(tmp_path, tiny_model_dir):
    trainer = make(tmp_path, tiny_model_dir)
    batch = fixed_batch(trainer)
    with torch.no_grad():
        batch["old_values"] = trainer._critic_values(unwrapped_critic(trainer), batch)
    batch["old_values"][1, 3] = float("inf")  # padding
    batch["returns"] = torch.tensor([[1.0, float("nan"), 2.0, 2.5], [-1.0, -0.5, float("nan"), float("nan")]])
    trainer._metrics["train"].clear()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() otherwise
    loss = trainer._value_loss(batch, "train")
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in unwrapped_critic(trainer).parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert trainer._metrics["train"]["guards/nonfinite_values"] == [1.0]  # the one trained NaN return
    assert trainer._metrics["train"]["guards/nonfinite_value_loss"] == [0.0]


# ---------------------------------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_two_steps_train_the_policy_and_the_critic(tmp_path, tiny_model_dir, peft):
    trainer = make(tmp_path, tiny_model_dir, peft=peft)
    critic = unwrapped_critic(trainer)
    policy_before, critic_before = snapshot(trainer.model), snapshot(critic)
    trainer.train()
    assert trainer.state.global_step == 2
    policy_moved, critic_moved = (
        changed(policy_before, snapshot(trainer.model)),
        changed(critic_before, snapshot(critic)),
    )
    assert policy_moved and critic_moved
    assert any("score" in k for k in critic_moved)  # the value head is trained
    if peft:
        assert isinstance(critic, PeftModel) and isinstance(trainer.model, PeftModel)
        trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n or "score" in n for n in trainable)
        assert all("lora_" in k or "score" in k for k in critic_moved)  # the critic's base stays frozen
    assert int(next(iter(trainer.critic_optimizer.state.values()))["step"]) == 2
    logs = [h for h in trainer.state.log_history if "critic/vf_loss" in h]
    assert len(logs) == 2
    for key in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/values/mean",
        "critic/returns/mean",
        "critic/vf_explained_var",
        "critic/grad_norm",
        "critic/lr",
        "actor/pg_loss",
    ):
        assert all(math.isfinite(h[key]) for h in logs), key


class CriticGrads(TrainerCallback):
    """The critic's accumulated gradient just before the optimizers step."""

    def __init__(self):
        self.trainer, self.grads = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(torch.cat([p.grad.reshape(-1).clone() for p in unwrapped_critic(self.trainer).parameters()]))


def test_gradient_accumulation_equals_one_large_micro_batch(tmp_path, tiny_model_dir):
    """Same 4 rollouts: 2 micro-batches of 2 (gradient_accumulation_steps=2) or 1 of 4. With global token
    normalisation the accumulated critic gradient is the same, and the critic steps once per optimizer step."""
    grads = {}
    for name, config in {
        "ga2": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        "ga1": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
    }.items():
        recorder = CriticGrads()
        trainer = make(
            tmp_path / name,
            tiny_model_dir,
            callbacks=[recorder],
            max_steps=1,
            loss_normalization="global",
            max_grad_norm=0.0,
            **config,
        )
        recorder.trainer = trainer
        trainer.train()
        assert int(next(iter(trainer.critic_optimizer.state.values()))["step"]) == 1
        assert trainer.recorded.batches[0]["completion_ids"].shape[0] == 4
        grads[name] = (recorder.grads[0], trainer.recorded.batches[0]["completion_ids"])
    assert torch.equal(grads["ga2"][1], grads["ga1"][1])  # the same rollouts
    assert grads["ga1"][0].norm() > 1e-3
    assert_close(grads["ga2"][0], grads["ga1"][0], terms=TINY_MODEL_TERMS)  # 2 micro-batches summed vs 1


def test_critic_warmup_leaves_the_policy_unchanged(tmp_path, tiny_model_dir):
    class Snapshots(TrainerCallback):
        def __init__(self):
            self.trainer, self.policy, self.critic = None, [], []

        def on_step_end(self, args, state, control, **kwargs):
            self.policy.append(snapshot(self.trainer.model))
            self.critic.append(snapshot(unwrapped_critic(self.trainer)))

    recorder = Snapshots()
    trainer = make(tmp_path, tiny_model_dir, callbacks=[recorder], max_steps=3, critic_warmup_steps=2)
    recorder.trainer = trainer
    initial_policy, initial_critic = snapshot(trainer.model), snapshot(unwrapped_critic(trainer))
    trainer.train()
    assert not changed(initial_policy, recorder.policy[0]) and not changed(initial_policy, recorder.policy[1])
    assert changed(initial_policy, recorder.policy[2])  # step 3 trains the policy
    assert changed(initial_critic, recorder.critic[0]) and changed(recorder.critic[0], recorder.critic[1])
    logs = [h for h in trainer.state.log_history if "critic/vf_loss" in h]
    assert ["actor/pg_loss" in h for h in logs] == [False, False, True]


def test_evaluation_scores_the_critic_without_training_it(tmp_path, tiny_model_dir):
    trainer = PPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        eval_dataset=tiny_conversational_dataset(8),
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), per_device_eval_batch_size=4)),
    )
    before = snapshot(unwrapped_critic(trainer))
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_critic/vf_loss"]) and metrics["eval_critic/vf_loss"] > 0
    assert "eval_critic/vf_explained_var" in metrics
    assert not changed(before, snapshot(unwrapped_critic(trainer))) and not trainer.critic_optimizer.state


def test_resume_restores_the_critic_and_its_optimizer(tmp_path, tiny_model_dir):
    def run():
        return make(tmp_path, tiny_model_dir, cls=PPOTrainer, max_steps=3, save_strategy="steps", save_steps=1)

    straight = run()
    straight.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / CRITIC_DIR).is_dir() and (checkpoint / CRITIC_OPTIMIZER_FILE).is_file()
    resumed = run()
    fresh_critic = snapshot(unwrapped_critic(resumed))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    final = snapshot(unwrapped_critic(resumed))
    assert changed(fresh_critic, final)
    atol = trained_weights_atol(steps=3, lr=1e-3)  # both runs: 3 Adam steps at most at 1e-3
    for key, value in snapshot(unwrapped_critic(straight)).items():
        torch.testing.assert_close(final[key], value, atol=atol, rtol=0, msg=lambda m, key=key: f"critic {key}: {m}")
    for key, value in snapshot(straight.model).items():
        torch.testing.assert_close(snapshot(resumed.model)[key], value, atol=atol, rtol=0)
    straight_state, resumed_state = straight.critic_optimizer.state_dict(), resumed.critic_optimizer.state_dict()
    assert straight_state["param_groups"] == resumed_state["param_groups"]
    for index, state in straight_state["state"].items():
        assert int(resumed_state["state"][index]["step"]) == int(state["step"]) == 3
        for name in ("exp_avg", "exp_avg_sq"):
            # moving averages of the gradients (of their squares): the gradients' tolerance, twice for a square
            assert_close(resumed_state["state"][index][name], state[name], terms=TINY_MODEL_TERMS, ulps=16)


def test_resume_restores_a_lora_critic(tmp_path, tiny_model_dir):
    def run():
        return make(
            tmp_path, tiny_model_dir, cls=PPOTrainer, peft=True, max_steps=2, save_strategy="steps", save_steps=1
        )

    straight = run()
    straight.train()
    resumed = run()
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    final, expected = snapshot(unwrapped_critic(resumed)), snapshot(unwrapped_critic(straight))
    assert any("score" in k for k in changed(snapshot(unwrapped_critic(run())), expected))
    atol = trained_weights_atol(steps=2, lr=1e-3)
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, atol=atol, rtol=0, msg=lambda m, key=key: f"critic {key}: {m}")


# ---------------------------------------------------------------------------------------------------------------------
# where the critic comes from, what is saved


def test_critic_from_a_reward_model_path_a_module_or_an_in_memory_policy(tmp_path, tiny_model_dir):
    reward_dir = str(tmp_path / "reward")
    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    with torch.no_grad():
        reward_model.score.weight.fill_(0.25)
    reward_model.save_pretrained(reward_dir)
    by_path = make(tmp_path / "a", tiny_model_dir, value_model_name_or_path=reward_dir)
    assert torch.all(unwrapped_critic(by_path).score.weight == 0.25)  # the reward model's head is reused

    module = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1)
    by_module = PPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        value_model=module,
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "b"))),
        train_dataset=tiny_conversational_dataset(),
    )
    assert unwrapped_critic(by_module) is module

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy_base = snapshot(policy.model)
    from_policy = PPOTrainer(
        model=policy,
        reward_funcs=length_reward,
        train_dataset=tiny_conversational_dataset(),
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "c"), kl_loss="none")),
    )
    critic_base = snapshot(unwrapped_critic(from_policy).model)
    assert critic_base.keys() == policy_base.keys()
    assert all(torch.equal(critic_base[k], policy_base[k]) for k in policy_base)
    with pytest.raises(ValueError, match="PeftModel"):
        from peft import get_peft_model

        PPOTrainer(
            model=get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LORA),
            reward_funcs=length_reward,
            train_dataset=tiny_conversational_dataset(),
            args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "d"))),
        )


def test_value_peft_config_false_trains_a_full_critic_next_to_a_lora_policy(tmp_path, tiny_model_dir):
    trainer = PPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        peft_config=LORA,
        value_peft_config=False,
        args=PPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path))),
        train_dataset=tiny_conversational_dataset(),
    )
    assert isinstance(trainer.model, PeftModel) and not isinstance(unwrapped_critic(trainer), PeftModel)
    assert all(p.requires_grad for p in unwrapped_critic(trainer).parameters())


@pytest.mark.parametrize("save_value_model", [False, True])
def test_save_model_writes_the_critic_on_request(tmp_path, tiny_model_dir, save_value_model):
    trainer = make(tmp_path, tiny_model_dir, cls=PPOTrainer, peft=True, max_steps=1, save_value_model=save_value_model)
    trainer.train()
    target = tmp_path / "saved"
    trainer.save_model(str(target))
    assert {"adapter_model.safetensors", "README.md"} <= set(os.listdir(target))
    assert "## Algorithm: PPO" in (target / "README.md").read_text()
    assert (target / CRITIC_DIR).is_dir() == save_value_model
    if save_value_model:
        reloaded = PeftModel.from_pretrained(
            AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1), str(target / CRITIC_DIR)
        )
        ids = torch.tensor([[11, 12, 13, 14]])
        with torch.no_grad():
            expected = unwrapped_critic(trainer)(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            got = reloaded(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        # the saved and reloaded critic, the same kernels on the same ids
        assert torch.equal(got, expected)


def test_push_to_hub_uploads_the_critic(tmp_path, tiny_model_dir, monkeypatch):
    import transformers.trainer as hf_trainer

    uploaded = {}

    class FakeApi:
        def upload_folder(self, repo_id, folder_path, **kwargs):
            uploaded["files"] = set(os.listdir(folder_path))
            uploaded["critic"] = set(os.listdir(os.path.join(folder_path, CRITIC_DIR)))

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    trainer = make(tmp_path, tiny_model_dir, cls=PPOTrainer, max_steps=1, save_value_model=True)
    trainer.train()
    trainer.hub_model_id = "someone/tiny-ppo"
    trainer.push_to_hub()
    assert {"model.safetensors", "README.md", CRITIC_DIR} <= uploaded["files"]
    assert {"model.safetensors", "config.json"} <= uploaded["critic"]


# ---------------------------------------------------------------------------------------------------------------------
# two processes


def test_one_vs_two_processes(tmp_path, tiny_model_dir):
    """torchrun with 2 CPU processes vs 1 process on the same global batch (ragged completions, so the ranks'
    padded widths and token counts differ): the same old values, GAE advantages and returns row by row, the same
    (DDP-averaged) critic gradient, and both ranks hold the same critic after the step."""
    sys.path.insert(0, str(DIST_SCRIPT.parent))
    from ppo_equivalence import run

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(DIST_SCRIPT),
            tiny_model_dir,
            str(tmp_path),
        ],
        env=env,
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    one = run(tiny_model_dir, str(tmp_path), world=1, rank=0)  # in this process, while the 2 ranks start up
    try:
        # torchrun --standalone: the OS picks the rendezvous port (localhost:0), so no port can be taken at start-up
        output, _ = proc.communicate(timeout=scaled_timeout(600))
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"2-process torchrun timed out:\n{output[-8000:]}")
    assert proc.returncode == 0, output[-8000:]
    ranks = [torch.load(tmp_path / f"ppo_world2_rank{r}.pt", weights_only=False) for r in range(2)]
    assert [(r["world"], r["rank"]) for r in ranks] == [(2, 0), (2, 1)]
    rows_two = ranks[0]["rows"] + ranks[1]["rows"]
    assert len(one["rows"]) == len(rows_two) == 8
    widths = [max(len(r["completion_ids"]) for r in rank["rows"]) for rank in ranks]
    assert widths[0] < widths[1]
    for i, (a, b) in enumerate(zip(one["rows"], rows_two)):
        assert a["completion_ids"] == b["completion_ids"], i
        for key in ("old_values", "advantages", "returns"):
            # values: the critic's forward in another batch layout; advantages and returns: GAE over them
            assert_close(
                torch.tensor(b[key]),
                torch.tensor(a[key]),
                terms=TINY_MODEL_TERMS,
                scale=max(1.0, max(abs(x) for row in one["rows"] for x in row[key])),
                msg=lambda m, i=i, key=key: f"row {i} {key}: {m}",
            )
    assert torch.equal(ranks[0]["critic_grad"], ranks[1]["critic_grad"])
    assert one["critic_grad"].norm() > 1e-3
    # the all-reduce sums the ranks' gradients, one process all rows: the tiny model's chain in another order
    assert_close(ranks[0]["critic_grad"], one["critic_grad"], terms=TINY_MODEL_TERMS)
    assert_close(ranks[0]["grad"], one["grad"], terms=TINY_MODEL_TERMS)
    for key, value in ranks[0]["critic"].items():
        assert torch.equal(value, ranks[1]["critic"][key]), key


# ---------------------------------------------------------------------------------------------------------------------
# the recipe


def test_ppo_cpu_config_keys_are_options():
    import yaml

    from trinity_trl.recipes import config_path
    from trinity_trl.recipes.common import RecipeArguments

    with open(config_path("ppo_cpu")) as f:
        keys = set(yaml.safe_load(f))
    assert {"value_learning_rate", "cliprange_value", "critic_warmup_steps", "save_value_model"} <= keys
    assert keys <= set(RecipeArguments.__dataclass_fields__) | set(PPOConfig.__dataclass_fields__)


def test_recipe_trains_and_saves_policy_and_critic_adapters(tmp_path, tiny_model_dir):
    from trinity_trl.cli import run as cli

    trainer = cli(
        [
            "ppo",
            "--config",
            "ppo_cpu",
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "5",
            "--num_train_rows",
            "8",
            "--eval_accuracy",
            "false",
            "--max_completion_length",
            "8",
            "--per_device_train_batch_size",
            "4",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--plot",
            "false",
        ]
    )
    assert isinstance(trainer, PPOTrainer) and trainer.state.global_step == 5
    assert trainer.args.critic_warmup_steps == 4 and isinstance(unwrapped_critic(trainer), PeftModel)
    assert {"adapter_model.safetensors", "README.md", "training_log.json", CRITIC_DIR} <= set(os.listdir(tmp_path))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / CRITIC_DIR))
    logs = [h for h in trainer.state.log_history if "critic/vf_loss" in h]
    assert ["actor/pg_loss" in h for h in logs] == [False] * 4 + [True]  # 4 critic warm-up steps (ppo_cpu.yaml)
