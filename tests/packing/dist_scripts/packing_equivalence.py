"""Packed vs padded layout under DDP: run by `tests/packing/test_forward.py` with
`python -m torch.distributed.run --standalone --nproc_per_node 2 packing_equivalence.py MODEL_DIR OUT_DIR`.

Each rank generates its own batch (2 prompts x 4 completions), then computes the loss and backward of that batch
twice through the DDP-wrapped model, `prefix_packing` on and off; DDP all-reduces the gradients in each backward.
It writes `<OUT_DIR>/<case>_rank<R>.pt` with `{"packed"|"padded": {"loss", "grads"}, "forwarded_token_ratio"}` for
the cases `trinity` (full fine-tuning, k2 KL, entropy bonus), `lora` and `ppo` (policy and critic gradients).
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/packing/
warnings.filterwarnings("ignore", category=FutureWarning)

import torch
from helpers import length_reward, tiny_grpo_kwargs
from test_forward import LORA, conversational_dataset, generation_batch, loss_and_grads

from trinity_trl.trainers import PPOConfig, PPOTrainer, TrinityConfig, TrinityTrainer


def main(model_dir: str, out_dir: str) -> None:
    for case in ("trinity", "lora", "ppo"):
        kwargs = tiny_grpo_kwargs(
            output_dir=os.path.join(out_dir, case),
            per_device_train_batch_size=8,
            kl_loss={"name": "k2", "kl_coef": 0.5},
            entropy_loss={"entropy_coef": 0.05},
        )
        if case == "ppo":
            trainer = PPOTrainer(
                model=model_dir,
                reward_funcs=length_reward,
                args=PPOConfig(**kwargs),
                train_dataset=conversational_dataset(),
            )
        else:
            trainer = TrinityTrainer(
                model=model_dir,
                reward_funcs=length_reward,
                args=TrinityConfig(**kwargs),
                train_dataset=conversational_dataset(),
                peft_config=copy.deepcopy(LORA) if case == "lora" else None,
            )
        # the Trainer wraps the model in DDP when training starts (trainer.model stays unwrapped); do it now
        trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
        rank = trainer.accelerator.process_index
        torch.manual_seed(rank)
        batch = generation_batch(trainer)
        ratio = trainer._metrics["train"]["packing/forwarded_token_ratio"]
        result = {}
        for name, packing in (("packed", True), ("padded", False)):
            loss, grads = loss_and_grads(trainer, batch, packing)
            result[name] = {"loss": loss, "grads": grads}
        result["forwarded_token_ratio"] = min(ratio) if ratio else 1.0
        torch.save(result, os.path.join(out_dir, f"{case}_rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
