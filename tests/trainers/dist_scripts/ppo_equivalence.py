"""One optimizer step of `PPOTrainer` on a fixed global batch; records what each rank saw and did.

Run by `tests/trainers/test_ppo.py` as `python -m torch.distributed.run --standalone --nproc_per_node 2
ppo_equivalence.py MODEL_DIR OUT_DIR` (2 processes); the test calls `run(...)` in-process for the 1-process
reference. The setup is `equivalence.py`'s: 2 prompts x 4 generations = 8 rollouts per step (world 1:
`per_device_train_batch_size=8`, world 2: 4 each), generation replaced by a deterministic `rollout_func` with ragged
completions, so rank 1 has longer completions (a wider padded batch) than rank 0.

`<out>/ppo_world<W>_rank<R>.pt` holds, per rank: `rows` (prompt/completion ids, advantages, returns and old values
of each rollout, unpadded, in this rank's order), `critic_grad` (the critic's gradient just before the optimizer
steps, after DDP's all-reduce), `critic` (its weights after the step) and `grad` (the policy's gradient).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # equivalence.py (it adds tests/ for helpers)

import torch
from equivalence import (
    GLOBAL_ROLLOUTS,
    NUM_GENERATIONS,
    GradRecorder,
    digit_reward,
    make_rollout_func,
)
from helpers import recording, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.trainers import PPOConfig, PPOTrainer


class CriticGradRecorder(GradRecorder):
    """The policy's gradient (``GradRecorder``) and the critic's, just before the optimizers step."""

    def __init__(self):
        super().__init__()
        self.trainer = None
        self.critic_grad = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        super().on_pre_optimizer_step(args, state, control, model=model, **kwargs)
        critic = self.trainer.accelerator.unwrap_model(self.trainer.critic)
        self.critic_grad = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone()
                for p in critic.parameters()
                if p.requires_grad
            ]
        )


def recorded_rows(trainer) -> list[dict]:
    """Every rollout of this rank (tests/helpers.py `recording`), unpadded: ids, advantages, returns, old values."""
    rows = []
    for output in trainer.recorded.batches:
        for i in range(output["prompt_ids"].shape[0]):
            valid = output["completion_mask"][i].bool()
            rows.append(
                {
                    "prompt_ids": output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist(),
                    "completion_ids": output["completion_ids"][i][valid].tolist(),
                    "advantages": output["advantages"][i][valid].tolist(),
                    "returns": output["returns"][i][valid].tolist(),
                    "old_values": output["old_values"][i][valid].tolist(),
                }
            )
    return rows


def run(model_dir: str, out_dir: str, world: int, rank: int) -> dict:
    args = PPOConfig(
        **tiny_grpo_kwargs(
            output_dir=os.path.join(out_dir, f"run_ppo_world{world}"),
            per_device_train_batch_size=GLOBAL_ROLLOUTS // world,
            num_generations=NUM_GENERATIONS,
            max_completion_length=32,
            max_steps=1,
            max_grad_norm=0.0,  # no clipping: compare the raw (DDP-averaged) gradients
            shuffle_dataset=False,
            value_learning_rate=1e-3,
            gamma=0.95,
            lam=0.9,
            # token-mean over processes with different token counts: global normalisation makes 2 processes equal 1
            loss_normalization="global",
        )
    )
    recorder = CriticGradRecorder()
    trainer = recording(PPOTrainer)(
        model=model_dir,
        reward_funcs=[digit_reward],
        args=args,
        train_dataset=tiny_conversational_dataset(4),
        rollout_func=make_rollout_func(True),
        callbacks=[recorder],
    )
    recorder.trainer = trainer
    trainer.train()
    critic = trainer.accelerator.unwrap_model(trainer.critic)
    record = {
        "rows": recorded_rows(trainer),
        "grad": recorder.grad,
        "critic_grad": recorder.critic_grad,
        "critic": {k: v.detach().clone() for k, v in critic.state_dict().items()},
        "world": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
    }
    torch.save(record, os.path.join(out_dir, f"ppo_world{world}_rank{rank}.pt"))
    return record


def main() -> None:
    model_dir, out_dir = sys.argv[1:3]
    torch.set_num_threads(1)
    run(model_dir, out_dir, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # without this, rank 0 aborts at exit with SIGABRT (notes/TRL_1_16.md §7)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
