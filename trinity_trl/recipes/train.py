"""Train any of the algorithm presets: the trainer follows from ``--algorithm``.

    trinity-trl train --config recipes/configs/train_cpu.yaml --algorithm reinforceplusplus
    trinity-trl train --algorithm rloo --max_steps 50 --output_dir outputs/rloo
    trinity-trl train --algorithm sft --num_expert_rows 512      # SFT on the task's worked solutions
    trinity-trl train --algorithm dpo                            # DPO on the bundled preference pairs

Presets and the trainer they run:

- ``mix``, ``mix_chord``: `ChordTrainer` (expert demonstrations from the task's solutions)
- ``sft``: `TrinitySFTTrainer` on the demonstrations
- ``dpo``: `TrinityDPOTrainer` on preference pairs (bundled task: a worked solution against a wrong answer;
  other datasets need ``prompt``/``chosen``/``rejected`` columns)
- ``ppo``: `PPOTrainer` (policy and value model)
- ``multi_step_grpo``: the `step_grpo` recipe (an environment instead of a dataset)
- ``on_policy_distill``: `TrinityTrainer` with ``--teacher_model_name_or_path``
- every other preset: `TrinityTrainer`

Options: `RecipeArguments`, ``--teacher_model_name_or_path``, and every field of the preset's config class.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from ..algorithms import ALGORITHM_TYPE
from .common import RecipeArguments, load_task, parse, peft_config, resolve_model, rl_recipe, run


@dataclass
class TrainArguments(RecipeArguments):
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Teacher model (id or path) for the on_policy_distill preset."}
    )


def algorithm_from(argv: list[str]) -> str:
    """The preset named by ``--algorithm`` on the command line, else in the ``--config`` YAML, else 'grpo'."""
    algorithm, config = None, None
    for i, token in enumerate(argv):
        for flag in ("--algorithm", "--config"):
            value = None
            if token == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif token.startswith(flag + "="):
                value = token.split("=", 1)[1]
            if value is not None:
                if flag == "--algorithm":
                    algorithm = value
                else:
                    config = value
    if algorithm is None and config is not None:
        import yaml

        with open(config, encoding="utf-8") as f:
            algorithm = (yaml.safe_load(f) or {}).get("algorithm")
    algorithm = algorithm or "grpo"
    if algorithm not in ALGORITHM_TYPE.names():
        raise ValueError(f"unknown algorithm {algorithm!r}; presets: {sorted(ALGORITHM_TYPE.names())}")
    return algorithm


def _sft(argv):
    from ..trainers import TrinitySFTConfig, TrinitySFTTrainer

    script_args, training_args = parse((TrainArguments, TrinitySFTConfig), argv, ignore=("algorithm",))
    task = load_task(script_args, seed=training_args.seed, with_expert=True)
    if task.expert is None:
        raise ValueError(f"the sft preset needs demonstrations: {script_args.dataset_name} has no reference solutions")
    trainer = TrinitySFTTrainer(model=resolve_model(script_args.model_name_or_path), args=training_args,
                                train_dataset=task.expert, peft_config=peft_config(script_args))
    return run(trainer, script_args, task)


def _dpo(argv):
    from ..trainers import TrinityDPOConfig, TrinityDPOTrainer

    script_args, training_args = parse((TrainArguments, TrinityDPOConfig), argv, ignore=("algorithm",))
    task = load_task(script_args, seed=training_args.seed)
    if script_args.dataset_name == "arithmetic":
        from ..data.arithmetic import arithmetic_preference_dataset

        pairs = arithmetic_preference_dataset(script_args.num_expert_rows or 256, seed=training_args.seed + 2)
    else:
        pairs = task.train
        missing = {"prompt", "chosen", "rejected"} - set(pairs.column_names)
        if missing:
            raise ValueError(f"the dpo preset needs 'prompt', 'chosen' and 'rejected' columns; "
                             f"{script_args.dataset_name} lacks {sorted(missing)}")
    trainer = TrinityDPOTrainer(model=resolve_model(script_args.model_name_or_path), args=training_args,
                                train_dataset=pairs, peft_config=peft_config(script_args))
    return run(trainer, script_args, task)


def _teacher(script_args: TrainArguments, training_args) -> dict:
    teacher = script_args.teacher_model_name_or_path
    if teacher is not None and training_args.resolved_algorithm().advantage_fn != "on_policy_distill":
        raise ValueError("teacher_model_name_or_path is only used by the on_policy_distill advantage")
    return {"teacher_model": resolve_model(teacher) if teacher else None}


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    algorithm = algorithm_from(argv)
    if algorithm in ("mix", "mix_chord"):
        from . import chord

        return chord.main(argv)
    if algorithm == "multi_step_grpo":
        from . import step_grpo

        return step_grpo.main(argv)
    if algorithm == "sft":
        return _sft(argv)
    if algorithm == "dpo":
        return _dpo(argv)
    if algorithm == "ppo":
        from ..trainers import PPOConfig, PPOTrainer

        return rl_recipe(PPOConfig, PPOTrainer, argv)
    from ..trainers import TrinityConfig, TrinityTrainer

    return rl_recipe(TrinityConfig, TrinityTrainer, argv, script_class=TrainArguments, extra_kwargs=_teacher)

if __name__ == "__main__":
    main()
