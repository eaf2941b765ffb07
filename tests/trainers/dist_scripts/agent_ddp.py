"""One optimizer step of ``StepGRPOTrainer(agent=...)`` on this launch's processes; records what each rank played.

Run by `tests/rollouts/test_agent.py` as `python -m torch.distributed.run --standalone --nproc_per_node 2
agent_ddp.py MODEL_DIR OUT_DIR` (CPU + gloo through `use_cpu=True`). Each process serves its own agent runs on its own
endpoint and generates with transformers when its agents ask. Per rank it writes `<out>/agent_rank<R>.pt`:
`world`, `rank`, `prompts` (the row prompts its runs got), `generated` (every `(prompt_ids, completion_ids)` its
generator produced), `steps` (the `(prompt_ids, completion_ids)` of every step of `trainer.agent_runs`), `rows` (each
trained row's prompt + completion ids, unpadded), `global_step`, `loss` and `logs`.

Usage: agent_ddp.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests/ on sys.path for `helpers` (this file is tests/trainers/dist_scripts/agent_ddp.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore", category=FutureWarning)

import math

import torch
from helpers import tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer


async def agent(client, row):
    """Two calls, the second continuing the first with a user turn; a reward that varies with the answer."""
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content or "") % 3)


class Recording(StepGRPOTrainer):
    def _training_batch(self, output, inputs, rewards, mode):
        batch = super()._training_batch(output, inputs, rewards, mode)
        self.rows = [
            p[m.bool()].tolist() + c[cm.bool()].tolist()
            for p, m, c, cm in zip(
                batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
            )
        ]
        return batch


def main(model_dir: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = tiny_grpo_kwargs(
        output_dir=os.path.join(out, "run"),
        max_steps=1,
        num_generations=4,
        per_device_train_batch_size=8 // world,  # 2 prompts x 4 runs in all
        max_completion_length=8,
        temperature=1.0,
        shuffle_dataset=False,
        max_env_steps=2,
    )
    trainer = Recording(
        model=model_dir, args=StepGRPOConfig(**kwargs), train_dataset=tiny_conversational_dataset(4), agent=agent
    )
    generated = []
    generator = trainer.rollout.endpoint.generator
    own = generator.generate

    def generate(prompt_ids):
        completions, logprobs = own(prompt_ids)
        generated.extend((list(p), list(c)) for p, c in zip(prompt_ids, completions))
        return completions, logprobs

    generator.generate = generate
    result = trainer.train()
    runs = trainer.agent_runs  # one step: the only generation
    torch.save(
        {
            "world": trainer.accelerator.num_processes,
            "rank": trainer.accelerator.process_index,
            "prompts": [run.row["prompt"][0]["content"] for run in runs],
            "generated": generated,
            "steps": [(list(p), list(c)) for run in runs for p, c, _ in run.steps],
            "rows": trainer.rows,
            "global_step": trainer.state.global_step,
            "loss": float(result.training_loss),
            "finite": math.isfinite(result.training_loss),
            "logs": {k: v for entry in trainer.state.log_history for k, v in entry.items()},
        },
        os.path.join(out, f"agent_rank{trainer.accelerator.process_index}.pt"),
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
