"""The set-up the learning studies share: LoRA, training arguments, validation problems, timed generation.

These are the helpers of the first learning benchmark (CHORD-mu against SFT then GRPO over 3 seeds), which was
retired in 0.2.0: the pre-registered ``learning_study.py`` asks its question now, and its results stay in
``results/learning.*`` and ``results/learning_runs.jsonl`` as records. ``learning_study.py`` (and the studies written
like it) build their runs with these; ``args`` is any object with the fields each reads (``lora_r``, ``device``,
``bf16``, ``val_rows``, ``prompt_style``).
"""

from __future__ import annotations

import time


def lora_config(args):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", task_type="CAUSAL_LM")


def common_config(args, seed: int, output_dir: str, steps: int, lr: float) -> dict:
    return {
        "output_dir": output_dir,
        "use_cpu": args.device == "cpu",
        "bf16": args.bf16,
        "activation_checkpointing": False,
        "max_steps": steps,
        "learning_rate": lr,
        "lr_scheduler_type": "constant",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def validation_set(args, data: dict):
    """``args.val_rows`` training-split problems that are neither RL prompts nor demonstrations, the templates
    taking turns (for choosing the learning rate; the held-out split is never used for it)."""
    from datasets import Dataset

    from trinity_trl.data.arithmetic import TEMPLATES, make_problems

    def text(prompt) -> str:
        return prompt[-1]["content"]

    used = {text(p) for p in data["train"]["prompt"]} | {text(p) for p in data["expert"]["prompt"]}
    pool = make_problems("train", 4 * args.val_rows + 40, 2, prompt_style=args.prompt_style)
    by_kind = {k: [r for r in pool if r["kind"] == k and text(r["prompt"]) not in used] for k in TEMPLATES}
    rows = [by_kind[k][i] for i in range(4 * args.val_rows) for k in TEMPLATES if i < len(by_kind[k])]
    if len(rows) < args.val_rows:
        raise ValueError(f"only {len(rows)} validation problems apart from the training rows")
    return Dataset.from_list(rows[: args.val_rows])


def timed_generation(trainer, seconds: list[float]) -> None:
    """Add the CPU seconds of each of ``trainer``'s rollout generations (TRL's single-turn generation) to
    ``seconds[0]`` (the trainer's own method, wrapped on this instance only)."""
    generate = trainer._generate_single_turn

    def timed(*a, **kw):
        cpu = time.process_time()
        try:
            return generate(*a, **kw)
        finally:
            seconds[0] += time.process_time() - cpu

    trainer._generate_single_turn = timed
