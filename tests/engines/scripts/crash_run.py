"""Train a few steps, optionally killing this process with SIGKILL at a chosen point; resume from the last complete
checkpoint. Run by `tests/engines/test_crash_resume.py` as a plain `python` subprocess (one process).

Cases:
  ppo    PPOTrainer with an adaptive k2 KL penalty (state: critic weights and optimizer, KL controller),
         checkpoint every step, `save_total_limit=1`
  chord  ChordTrainer, `num_iterations=2` (state: expert cursor, and the buffered generation batch of a checkpoint
         taken in the middle of a generation batch), checkpoint every step

Kill points (the process kills itself with SIGKILL: no exception handler, no atexit, no flush):
  --kill_in_step S        during optimizer step S, after its backward and before the optimizer step
  --kill_in_checkpoint S  while writing checkpoint-S: after transformers/TRL wrote their files and, for PPO, after our
                          trainer state and the critic's weights, before the critic's optimizer state and the
                          completion marker

Without a kill point the run ends normally and writes `--result`: the final trained weights (policy, and critic),
with `torch.save`, plus the logged losses.

Usage: crash_run.py MODEL_DIR OUTPUT_DIR CASE --steps N [--kill_in_step S | --kill_in_checkpoint S] [--resume]
       [--result FILE]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import torch  # noqa: E402
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def build(case: str, model_dir: str, out: str, steps: int):
    from datasets import Dataset

    from trinity_trl.trainers import ChordConfig, ChordTrainer, PPOConfig, PPOTrainer

    common = tiny_grpo_kwargs(
        output_dir=out, max_steps=steps, save_strategy="steps", save_steps=1, learning_rate=1e-2, disable_tqdm=True
    )
    data = {"reward_funcs": length_reward, "train_dataset": tiny_conversational_dataset(16)}
    if case == "ppo":
        args = PPOConfig(
            value_learning_rate=1e-2,
            save_total_limit=1,
            kl_penalty={"name": "k2", "kl_coef": 0.1, "adaptive": True, "target_kl": 1e-6, "horizon": 10},
            **common,
        )
        return PPOTrainer(model=model_dir, args=args, **data)
    if case == "chord":
        expert = Dataset.from_list(
            [
                {
                    "messages": [
                        {"role": "user", "content": f"What is {a}+{b}?"},
                        {"role": "assistant", "content": f"It is {a + b}."},
                    ]
                }
                for a, b in [(1, 2), (3, 4), (5, 6)]
            ]
        )
        args = ChordConfig(expert_batch_size=2, num_iterations=2, **common)
        return ChordTrainer(model=model_dir, args=args, expert_dataset=expert, **data)
    raise ValueError(case)


class KillInStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:  # the gradients of step S are in, its optimizer step is next
            die()


def kill_in_checkpoint(trainer, step: int) -> None:
    """SIGKILL while checkpoint-``step`` is being written (see the module docstring)."""
    if hasattr(trainer, "_critic"):
        save = trainer._critic.save

        def dying_save(folder):
            if trainer.state.global_step == step:
                die()
            save(folder)

        trainer._critic.save = dying_save
    else:
        extras = trainer._save_checkpoint_extras

        def dying_extras(folder):
            if trainer.state.global_step == step:
                die()
            extras(folder)

        trainer._save_checkpoint_extras = dying_extras


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("case", choices=("ppo", "chord"))
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--kill_in_step", type=int)
    parser.add_argument("--kill_in_checkpoint", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--result")
    options = parser.parse_args()
    torch.set_num_threads(1)
    trainer = build(options.case, options.model_dir, options.output_dir, options.steps)
    if options.kill_in_step:
        trainer.add_callback(KillInStep(options.kill_in_step))
    if options.kill_in_checkpoint:
        kill_in_checkpoint(trainer, options.kill_in_checkpoint)
    trainer.train(resume_from_checkpoint=True if options.resume else None)
    if options.result:
        model = trainer.accelerator.unwrap_model(trainer.model)
        result = {
            "policy": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            "logs": [h for h in trainer.state.log_history if "loss" in h],
        }
        if hasattr(trainer, "critic_state_dict"):
            result["critic"] = {k: v.detach().clone() for k, v in trainer.critic_state_dict().items()}
        torch.save(result, options.result)


if __name__ == "__main__":
    main()
