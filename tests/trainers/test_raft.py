"""RAFT in TrinityTrainer (issue 13 item 7): a policy loss that reads no advantages (the `raft` preset's SFT loss)
trains on the best-rewarded completion(s) of each group; the other rows carry no gradient."""

from __future__ import annotations

import torch
from helpers import tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.trainers import TrinityConfig, TrinityTrainer
from trinity_trl.training.grpo_seams import captured_return

G = 4


def ranked_reward(completions, **kwargs):
    """Rewards 0, 1, 3, 3 within every group of 4 (two tied winners), whatever the text."""
    return [(0.0, 1.0, 3.0, 3.0)[i % G] for i in range(len(completions))]


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_raft_keeps_the_best_of_each_group_and_the_others_carry_no_gradient(tmp_path, tiny_model_dir):
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=ranked_reward,
        train_dataset=tiny_conversational_dataset(),
        args=TrinityConfig(
            **tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="raft", per_device_train_batch_size=8)
        ),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; _compute_loss divides by it
    torch.manual_seed(0)
    rows = [dict(tiny_conversational_dataset()[i]) for i in (0, 1) for _ in range(G)]
    with captured_return(trainer, "_calculate_rewards") as rewards:
        batch = trainer._generate_and_score_completions(rows)
    assert rewards.value[:, 0].tolist() == [0.0, 1.0, 3.0, 3.0] * 2
    kept = batch["completion_mask"].sum(1) > 0
    assert kept.tolist() == [False, False, True, True] * 2  # the tied best two of each group
    assert torch.all(batch["advantages"] == 0)
    assert trainer._metrics["train"]["raft/kept_fraction"][-1] == 0.5

    loss, grads = loss_and_grads(trainer, batch)
    assert loss != 0 and any(g.abs().sum() > 0 for g in grads.values())
    # rewrite the completions of the rows that were not kept: neither the loss nor any gradient moves
    changed = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    vocab = trainer.model.config.vocab_size
    changed["completion_ids"][~kept] = (changed["completion_ids"][~kept] + 7) % vocab
    loss_changed, grads_changed = loss_and_grads(trainer, changed)
    # exact: the kept rows run the same kernels on the same inputs, the rewritten rows are masked out of every sum
    torch.testing.assert_close(loss_changed, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads_changed[name], grads[name], rtol=0, atol=0, msg=name)
    # the same rewrite of a kept row does move the loss (the check above can fail)
    moved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
    moved["completion_ids"][kept] = (moved["completion_ids"][kept] + 7) % vocab
    assert loss_and_grads(trainer, moved)[0] != loss
