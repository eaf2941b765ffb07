"""TRL's private surface: every name of TRL the package uses beyond what TRL exports, in one list (`SURFACE`).

A port to another TRL release (1.17 made vLLM's importance sampling unbiased, 1.18 made ``AsyncGRPOTrainer`` stable and
removed ``trl.experimental.async_grpo``'s submodules: docs/trl-versions.md) starts from this list. What the package
actually uses is derived from its source (`used_surface`), and the test fails when the two differ, naming the
difference; a second test checks each listed name exists in the installed TRL. Four kinds:

* ``import``: a name imported from a TRL module that ``trl``, ``trl.models`` and ``trl.experimental.async_grpo`` do not
  export (or a whole non-public module). Only the seams modules may import one (`SEAMS`).
* ``patch``: an attribute of a TRL module the package rebinds (TRL calls it by that name, and offers no other way).
* ``override``: a method of a TRL trainer or collator (or of transformers' ``Trainer`` below it) that a class of ours
  redefines, by the class that defines it.
* ``attribute``: a private attribute (``_name``) of TRL's objects the package reads or writes.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "trinity_trl").rglob("*.py")), *sorted((ROOT / "recipes").glob("*.py"))]
#: the only modules that may import TRL's non-public names
SEAMS = {
    "trinity_trl/training/grpo_seams.py",
    "trinity_trl/asynchronous/async_grpo_seams.py",
    "trinity_trl/chat_template_seams.py",
}
#: the packages whose exports are TRL's public names
PUBLIC_PACKAGES = ("trl", "trl.models", "trl.experimental.async_grpo")

GRPO_TRAINER = "trl.trainer.grpo_trainer.GRPOTrainer"
ASYNC_TRAINER = "trl.experimental.async_grpo.async_grpo_trainer.AsyncGRPOTrainer"
TRAINER = "transformers.trainer.Trainer"

#: (kind, where, name) -> what we use it for
SURFACE: dict[tuple[str, str, str], str] = {
    # ---------------------------------------------------------------- imports (training/grpo_seams.py)
    ("import", "trl.trainer.utils", "pad"): "padding rows as TRL pads them (CHORD's expert rows, step rows)",
    ("import", "trl.trainer.utils", "add_fused_lm_head"): "the fused LM head on models TRL did not load",
    ("import", "trl.trainer.utils", "create_model_from_path"): "loading a model as TRL loads the policy",
    ("import", "trl.trainer.utils", "disable_dropout_in_model"): "PPO's critic, as TRL treats the policy",
    ("import", "trl.trainer.utils", "get_callable_name"): "reward function names as TRL logs them",
    ("import", "trl.trainer.utils", "is_async_callable"): "calling async reward functions as TRL does",
    ("import", "trl.trainer.utils", "use_adapter"): "the reference as the policy with its adapter disabled",
    ("import", "trl.trainer.grpo_trainer", "*"): "the module whose shuffle_sequence_dict whole_groups rebinds",
    # ---------------------------------------------------------------- imports (asynchronous/async_grpo_seams.py)
    ("import", "trl.experimental.async_grpo.async_grpo_trainer", "*"): "the module whose names the seams rebind",
    ("import", "trl.experimental.async_grpo.async_grpo_trainer", "DataCollatorForRollout"): "subclassed collator",
    ("import", "trl.experimental.async_grpo.async_rollout_worker", "RolloutSample"): "a sample on TRL's queue",
    ("import", "trl.import_utils", "TRLExperimentalWarning"): "silencing TRL's experimental-import warning",
    # ---------------------------------------------------------------- imports (chat_template_seams.py)
    ("import", "trl.chat_template_utils", "*"): "the tool-calling chat templates TRL stores",
    ("import", "trl.chat_template_utils", "parse_response"): "reading a sampled turn as TRL's tool loop does",
    # ---------------------------------------------------------------- patches (a TRL module's name rebound)
    ("patch", "trl.trainer.grpo_trainer", "shuffle_sequence_dict"): "the shuffle patch: whole groups per micro-batch",
    ("patch", "trl.experimental.async_grpo.async_grpo_trainer", "DataCollatorForRollout"): "the collator swap",
    ("patch", "trl.experimental.async_grpo.async_grpo_trainer", "get_peak_flops_per_device"): "CPU-safe MFU probe",
    # ---------------------------------------------------------------- overrides: TRL's GRPOTrainer
    ("override", GRPO_TRAINER, "_compute_loss"): "our loss (TrinityLossMixin) with TRL's log-prob helper",
    ("override", GRPO_TRAINER, "_generate_and_score_completions"): "advantages, extra rows, KL in the reward",
    ("override", GRPO_TRAINER, "_generate_single_turn"): "one prefill per group, compiled decoding; rollouts call it",
    ("override", GRPO_TRAINER, "_get_per_token_logps_and_entropies"): "prefix packing's forward",
    ("override", GRPO_TRAINER, "_load_optimizer_and_scheduler"): "our checkpoint extras loaded on resume",
    ("override", GRPO_TRAINER, "_name"): "the algorithm's name on the model card",
    ("override", GRPO_TRAINER, "_prepare_inputs"): "whole groups, the token budget",
    ("override", GRPO_TRAINER, "_save_checkpoint"): "complete checkpoints (our state files)",
    ("override", GRPO_TRAINER, "_tag_names"): "the model card's tags",
    ("override", GRPO_TRAINER, "log"): "our metrics pooled before TRL averages them",
    # ---------------------------------------------------------------- overrides: TRL's AsyncGRPOTrainer
    ("override", ASYNC_TRAINER, "_name"): "the algorithm's name on the model card",
    ("override", ASYNC_TRAINER, "_save_checkpoint"): "complete checkpoints (our state files)",
    ("override", ASYNC_TRAINER, "_sync_weight"): "policy versions recorded at each of TRL's weight syncs",
    ("override", ASYNC_TRAINER, "_tag_names"): "the model card's tags",
    ("override", ASYNC_TRAINER, "compute_loss"): "our loss on TRL's packed rows",
    ("override", ASYNC_TRAINER, "get_train_dataloader"): "the collator swap and the loader without read-ahead",
    ("override", ASYNC_TRAINER, "log"): "our metrics pooled",
    # ---------------------------------------------------------------- overrides: TRL's SFT and DPO trainers
    ("override", "trl.trainer.sft_trainer.SFTTrainer", "_name"): "the algorithm's name on the model card",
    ("override", "trl.trainer.sft_trainer.SFTTrainer", "_save_checkpoint"): "complete checkpoints",
    ("override", "trl.trainer.sft_trainer.SFTTrainer", "_tag_names"): "the model card's tags",
    ("override", "trl.trainer.sft_trainer.SFTTrainer", "compute_loss"): "the SFT-type policy losses",
    ("override", "trl.trainer.dpo_trainer.DPOTrainer", "_save_checkpoint"): "complete checkpoints",
    ("override", "trl.trainer.dpo_trainer.DPOTrainer", "_tag_names"): "the model card's tags",
    ("override", "trl.trainer.dpo_trainer.DPOTrainer", "compute_loss"): "the DPO-type policy losses",
    ("override", "trl.trainer.dpo_trainer.DPOTrainer", "loss_is_scaled_for_ga"): "transformers divides by GA",
    ("override", "trl.trainer.base_trainer._BaseTrainer", "loss_is_scaled_for_ga"): "transformers divides by GA",
    ("override", "trl.trainer.base_trainer._BaseTrainer", "create_model_card"): "our model card",
    # ---------------------------------------------------------------- overrides: TRL's collator
    ("override", "trl.experimental.async_grpo.async_grpo_trainer.DataCollatorForRollout", "torch_call"): "fields",
    # ---------------------------------------------------------------- overrides: transformers' Trainer below TRL's
    ("override", TRAINER, "_load_best_model"): "PPO's critic loaded with the best policy",
    ("override", TRAINER, "_load_optimizer_and_scheduler"): "our checkpoint extras loaded on resume (async)",
    ("override", TRAINER, "_save"): "the bundled model's Hub id in a saved adapter",
    ("override", TRAINER, "evaluate"): "trackio reopened after train()",
    ("override", TRAINER, "get_batch_samples"): "an optimizer step's totals; steps with nothing to train (async)",
    ("override", TRAINER, "push_to_hub"): "an unreachable Hub in one line",
    ("override", TRAINER, "save_model"): "the model card beside the saved model",
    ("override", TRAINER, "train"): "checkpoint checks; the asynchronous trainers' end-of-run note",
    # ---------------------------------------------------------------- private attributes of TRL's objects
    ("attribute", "trl", "_buffered_inputs"): "GRPOTrainer's buffered generation batch (checkpointed mid-batch)",
    ("attribute", "trl", "_calculate_rewards"): "GRPOTrainer's reward pass, called for extra rows (Scoring)",
    ("attribute", "trl", "_groups_before_resume"): "AsyncGRPOTrainer's epoch count on resume",
    ("attribute", "trl", "_is_vlm"): "GRPOTrainer's vision-language flag (PPO refuses it)",
    ("attribute", "trl", "_iter_named_params"): "TRL's vLLM weight iterator (the CPU colocate sync)",
    ("attribute", "trl", "_logs"): "GRPOTrainer's completions table (our advantages in it)",
    ("attribute", "trl", "_metrics"): "TRL's metric lists, per mode",
    ("attribute", "trl", "_paper"): "the paper on TRL's model card",
    ("attribute", "trl", "_rollout_dataset"): "AsyncGRPOTrainer's queue dataset, released after train()",
    ("attribute", "trl", "_step_forward_s"): "AsyncGRPOTrainer's throughput accounting (account_step)",
    ("attribute", "trl", "_step_forward_tokens"): "AsyncGRPOTrainer's throughput accounting",
    ("attribute", "trl", "_step_samples"): "AsyncGRPOTrainer's throughput accounting",
    ("attribute", "trl", "_step_seq_len_weighted"): "AsyncGRPOTrainer's throughput accounting",
    ("attribute", "trl", "_step_trained_tokens"): "AsyncGRPOTrainer's throughput accounting",
    ("attribute", "trl", "_tokenize_prompts"): "GRPOTrainer's prompt tokenization (CHORD, the rollouts)",
    ("attribute", "trl", "_tokenizer"): "GRPOTrainer's tokenizer (of a processor)",
}


# ------------------------------------------------------------------------------------------------ derivation
def _public_names() -> set[str]:
    names: set[str] = set()
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        structure = getattr(module, "_import_structure", None)
        names |= {n for values in structure.values() for n in values} if structure else set(vars(module))
    return {n for n in names if not n.startswith("__")}


def _parsed():
    for path in SOURCES:
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _imports_and_patches() -> tuple[set[tuple[str, str, str]], set[str]]:
    """``import`` and ``patch`` entries of the package's source, and the files that import a non-public name."""
    public = _public_names()
    found, importers = set(), set()
    for where, tree in _parsed():
        aliases: dict[str, str] = {}  # local name -> TRL module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trl" and node.level == 0:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    if importlib.util.find_spec(node.module) and _is_module(submodule):
                        aliases[alias.asname or alias.name] = submodule
                        if submodule not in PUBLIC_PACKAGES:
                            found.add(("import", submodule, "*"))
                            importers.add(where)
                    elif alias.name not in public:
                        found.add(("import", node.module, alias.name))
                        importers.add(where)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "trl" and alias.name not in PUBLIC_PACKAGES:
                        aliases[alias.asname or alias.name] = alias.name
                        found.add(("import", alias.name, "*"))
                        importers.add(where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):  # trl_module.name = ...
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and _dotted(target.value) in aliases:
                        found.add(("patch", aliases[_dotted(target.value)], target.attr))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "temporarily" and node.args:
                module = aliases.get(_dotted(node.args[0]))
                if module is not None:  # temporarily(trl_module, name=...)
                    found |= {("patch", module, keyword.arg) for keyword in node.keywords}
    return found, importers


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _overrides() -> set[tuple[str, str, str]]:
    """``override`` entries: for each class of ours below a TRL class (the trainers, the collator), each method (or
    class attribute, as ``_tag_names``) one of our classes in its MRO defines that a TRL class, or transformers'
    ``Trainer`` and ``TrainingArguments``, defines below it."""
    import trinity_trl.trainers as trainers
    from trinity_trl.asynchronous.async_grpo_seams import _collator_class

    classes = [getattr(trainers, name) for name in trainers.__all__] + [_collator_class()]
    found = set()
    from transformers import TrainingArguments

    for cls in classes:
        mro = cls.__mro__
        if issubclass(cls, TrainingArguments):  # a config: its fields are TRL's public options
            continue
        foreign = [c for c in mro if c.__module__.split(".")[0] in ("trl", "transformers")]
        if not foreign:
            continue
        for ours in (c for c in mro if c.__module__.split(".")[0] == "trinity_trl"):
            for name in vars(ours):
                if name.startswith("__") and name.endswith("__"):
                    continue
                owner = next((c for c in foreign if name in vars(c)), None)
                if owner is not None:
                    found.add(("override", f"{owner.__module__}.{owner.__qualname__}", name))
    return found


@functools.cache
def _trl_private_names() -> frozenset[str]:
    """Private names TRL's own source binds: ``self._x = ...`` targets, methods and class attributes."""
    import trl

    names: set[str] = set()
    pattern = re.compile(r"self\.(_[a-z]\w*)\s*(?::[^=\n]*)?=(?!=)|^\s*(?:def\s+)?(_[a-z]\w*)\s*(?::[^=\n]*)?[=(]")
    for path in pathlib.Path(trl.__file__).parent.rglob("*.py"):
        for line in path.read_text(encoding="utf-8").splitlines():
            for match in pattern.finditer(line):
                names.add(match.group(1) or match.group(2))
    return frozenset(names)


#: private names TRL binds that the package also uses, but not on TRL's objects: whose they are
NOT_TRL = {
    "_forward": "trinity_trl.training.token_budget's own attribute",
    "_trainer": "trinity_trl.training.trl_generation's own attribute",
    "_initialized": "transformers' TrackioCallback (grpo_seams.reopen_trackio_run)",
}


def _private_attributes(overridden: set[str]) -> set[tuple[str, str, str]]:
    """``attribute`` entries: ``x._name`` in the package's source (read or written) where TRL binds ``_name`` on its
    objects, less the methods we override (``override`` entries) and `NOT_TRL`."""
    used: set[str] = set()
    ours: set[str] = set()  # functions and classes the package defines (its own helpers, whatever TRL names)
    for _, tree in _parsed():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                used.add(node.attr)
    names = (used & _trl_private_names()) - overridden - ours - set(NOT_TRL)
    return {("attribute", "trl", name) for name in names}


def used_surface() -> tuple[set[tuple[str, str, str]], set[str]]:
    imports, importers = _imports_and_patches()
    overrides = _overrides()
    return imports | overrides | _private_attributes({name for _, _, name in overrides}), importers


# ------------------------------------------------------------------------------------------------ tests
def test_the_listed_surface_is_what_the_package_uses():
    """The list and the source agree: a private name of TRL used anywhere in the package and not listed (or listed
    and no longer used) fails here, named."""
    used, _ = used_surface()
    unlisted, gone = sorted(used - set(SURFACE)), sorted(set(SURFACE) - used)
    assert not unlisted and not gone, f"used but not in SURFACE: {unlisted}; in SURFACE but not used: {gone}"


def test_only_the_seams_modules_import_trls_non_public_names():
    _, importers = used_surface()
    assert importers <= SEAMS, f"non-public TRL imports outside the seams modules: {sorted(importers - SEAMS)}"


@pytest.mark.parametrize("entry", sorted(SURFACE), ids=lambda e: "-".join(e))
def test_every_listed_name_exists_in_the_installed_trl(entry):
    kind, where, name = entry
    if kind == "attribute":
        assert name in _trl_private_names(), f"TRL binds no {name}"
        return
    if kind == "override":
        module, _, cls = where.rpartition(".")
        assert name in vars(getattr(importlib.import_module(module), cls)), f"{where} defines no {name}"
        return
    module = importlib.import_module(where)
    assert name == "*" or hasattr(module, name), f"{where} has no {name}"
