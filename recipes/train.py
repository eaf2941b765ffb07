"""Train any of the 19 algorithm presets: the trainer follows from ``--algorithm``.

    trinity-trl train --config train_cpu --algorithm reinforceplusplus
    trinity-trl train --algorithm rloo --max_steps 50 --output_dir outputs/rloo
    trinity-trl train --config sft_cpu                     # SFT on the task's worked solutions
    trinity-trl train --config dpo_cpu                     # DPO on the bundled preference pairs

Presets and the trainer they run: ``mix``, ``mix_chord`` -> the chord recipe (ChordTrainer); ``ppo`` -> the ppo
recipe (PPOTrainer); ``multi_step_grpo`` -> the step_grpo recipe (an environment instead of a dataset); ``sft``
-> TrinitySFTTrainer on the demonstrations; ``dpo`` -> TrinityDPOTrainer on preference pairs (bundled task: a
worked solution against a wrong answer; other datasets need ``prompt``/``chosen``/``rejected``);
``on_policy_distill`` -> TrinityTrainer with ``--teacher_model_name_or_path``; every other preset ->
TrinityTrainer. Options: those below and every field of the preset's config class.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass, field

from trinity_trl.algorithms import ADVANTAGE_FN, ALGORITHM_TYPE
from trinity_trl.recipes.common import (
    RecipeArguments,
    UsageError,
    check_models,
    check_output_dir,
    choose_trainer,
    concise_progress,
    evaluation_metric,
    load_task,
    parse,
    peft_config,
    read_config,
    reward_functions,
    run_as_script,
    save_outputs,
    train_and_evaluate,
)


@dataclass
class TrainArguments(RecipeArguments):
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Teacher model (id or path, or 'bundled') for the on_policy_distill preset."}
    )


def algorithm_from(argv: list[str]) -> str:
    """The preset named by ``--algorithm`` on the command line, else in the ``--config`` YAML, else 'grpo'."""
    from trinity_trl.recipes import config_path

    algorithm, config = None, None
    for i, token in enumerate(argv):
        for flag in ("--algorithm", "--config"):
            value = (
                argv[i + 1]
                if token == flag and i + 1 < len(argv)
                else (token.split("=", 1)[1] if token.startswith(flag + "=") else None)
            )
            if value is not None and flag == "--algorithm":
                algorithm = value
            elif value is not None:
                config = value
    if algorithm is None and config is not None:
        algorithm = read_config(config_path(config)).get("algorithm")
    algorithm = algorithm or "grpo"
    if algorithm not in ALGORITHM_TYPE.names():
        close = difflib.get_close_matches(str(algorithm), ALGORITHM_TYPE.names(), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(f"unknown algorithm {algorithm!r}{hint}; presets: {', '.join(sorted(ALGORITHM_TYPE.names()))}")
    return algorithm


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    # 1. the preset decides the recipe (and so the trainer and its config class)
    preset = ALGORITHM_TYPE.get(algorithm_from(argv))
    if preset.recipe != "train":  # MIX / CHORD (demonstrations), PPO (critic), multi_step_grpo (an environment)
        return importlib.import_module(f"trinity_trl.recipes.{preset.recipe}").main(argv)
    from trinity_trl import trainers

    trainer_class = choose_trainer(argv, getattr(trainers, preset.trainer), "train")  # --asynchronous: the twin
    config_class = trainer_class.config_class
    # (--algorithm is a field of TrinityConfig; the SFT/DPO configs have no choice to make)
    args, training_args = parse((TrainArguments, config_class), argv, "train", __doc__, ignore=("algorithm",))
    check_output_dir(args, training_args)
    check_models(args, training_args)  # model ids and paths: one line now, before any data or model loads
    # 2. data: RL prompts, held-out problems, and demonstrations or preference pairs for sft / dpo
    task = load_task(
        args, seed=training_args.seed, with_expert=preset.schema == "sft", rewarded=preset.schema not in ("sft", "dpo")
    )
    # the reward functions train the RL presets; for sft / dpo they only score the held-out evaluation (if asked)
    scored = preset.schema not in ("sft", "dpo") or (args.eval_accuracy and evaluation_metric(args) == "reward")
    rewards = reward_functions(args.reward_funcs, task) if scored else None
    kwargs = {}
    if preset.schema == "sft":
        kwargs["train_dataset"] = task.expert
    elif preset.schema == "dpo":
        kwargs["train_dataset"] = _preference_pairs(args, task, training_args.seed)
    else:
        kwargs.update(train_dataset=task.train, reward_funcs=rewards)
        if args.teacher_model_name_or_path is not None:
            if not ADVANTAGE_FN.get(training_args.resolved_algorithm().advantage.name).needs_teacher_logprobs:
                raise UsageError("teacher_model_name_or_path is only used by the on_policy_distill advantage")
            kwargs["teacher_model"] = args.teacher_model_name_or_path
    # 3. model and trainer
    trainer = trainer_class(model=args.model_name_or_path, args=training_args, peft_config=peft_config(args), **kwargs)
    concise_progress(trainer)
    # 4. train, evaluating greedy completions of the held-out rows before and after (eval_metric)
    summary = train_and_evaluate(trainer, args, task.test, training_args.resume_from_checkpoint, rewards=rewards)
    # 5. save the adapter (or model), tokenizer, card, training log and plot; push when asked
    save_outputs(trainer, args, summary)
    return trainer


def _preference_pairs(args: TrainArguments, task, seed: int):
    """The bundled task's pairs (a worked solution against a wrong answer), or the dataset's own columns."""
    if args.dataset_name == "arithmetic":
        from trinity_trl.data.arithmetic import arithmetic_preference_dataset

        return arithmetic_preference_dataset(args.num_expert_rows or 256, seed=seed + 2)
    missing = {"prompt", "chosen", "rejected"} - set(task.train.column_names)
    if missing:
        raise UsageError(
            f"the dpo preset needs 'prompt', 'chosen' and 'rejected' columns; {args.dataset_name} lacks "
            f"{sorted(missing)}"
        )
    return task.train


if __name__ == "__main__":
    run_as_script(main)
