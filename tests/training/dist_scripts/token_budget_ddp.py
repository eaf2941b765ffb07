"""The token budget under DDP: run by `tests/training/test_token_budget.py` with
`python -m torch.distributed.run --standalone --nproc_per_node 2 token_budget_ddp.py MODEL_DIR OUT_DIR`.

Each rank trains two optimizer steps of 4 micro-batches (its own generation batch) three times:

* `merged`: rank 0 with the default budget (its micro-batches share packed forwards), rank 1 with a budget of one
  token (each micro-batch its own forward): the ranks run different numbers of forwards;
* `declined`: a budget holding the whole step, every merged forward declined by packing, so the 4 members run alone
  in the step's last `training_step`, the first 3 under `no_sync`;
* `off`: no budget.

A DDP communication hook records, for each gradient all-reduce, the micro-batch of the optimizer step it ran in (0 to
3). It writes `<OUT_DIR>/rank<R>.pt`: `{case: {"gradients": [per step {name: grad}], "all_reduce_steps": [...],
"forwards": [...]}}`.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/training/
warnings.filterwarnings("ignore", category=FutureWarning)

import torch
from test_token_budget import DecliningTrainer, RaggedTrainer, merged_forwards, train_gradients
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from transformers import TrainerCallback


class AllReduceSteps(TrainerCallback):
    """Registers a DDP communication hook (once the Trainer has wrapped the model) that records, per all-reduced
    bucket, the micro-batch of the optimizer step it belongs to (TRL's micro-step counter modulo the accumulation)."""

    def __init__(self, trainer):
        self.trainer, self.steps, self.registered = trainer, [], False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.registered:
            return
        ddp = self.trainer.model_wrapped
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)

        def hook(process_group, bucket):
            self.steps.append(self.trainer._step % args.gradient_accumulation_steps)
            return allreduce_hook(process_group, bucket)

        ddp.register_comm_hook(None, hook)
        self.registered = True


def main(model_dir: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for case, budget, trainer_class in (
        ("merged", None if rank == 0 else 1, RaggedTrainer),
        ("declined", 100_000, DecliningTrainer),  # one bin of 4, each member alone in the synchronising step
        ("off", 0, RaggedTrainer),
    ):
        recorders: list[AllReduceSteps] = []

        def setup(trainer, recorders=recorders):
            recorders.append(AllReduceSteps(trainer))
            trainer.add_callback(recorders[-1])

        # every rank its own prompts (TRL's sampler), the same seed (the sampler's shuffle agrees across ranks)
        steps, trainer = train_gradients(model_dir, os.path.join(out_dir, case), budget, trainer_class, setup)
        results[case] = {
            "gradients": steps,
            "all_reduce_steps": recorders[0].steps,
            "forwards": merged_forwards(trainer),
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
