"""Recipes: one file per trainer plus the general preset runner, each ``main(argv) -> trainer``.

Run them with the ``trinity-trl`` command (``trinity-trl chord --config chord_cpu``), as scripts from a
checkout (``python recipes/chord.py --config recipes/configs/chord_cpu.yaml``) or as modules of the installed
package (``python -m trinity_trl.recipes.chord``). Each reads top to bottom: parse, data, model and trainer,
train, evaluate, save and push. The example configs are ``recipes/configs/*.yaml``, shipped with the package.
"""

from __future__ import annotations

import difflib
import os

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

# command -> (module, one-line description)
RECIPES = {
    "chord": ("chord", "CHORD: RL + scheduled SFT on expert demonstrations (ChordTrainer)"),
    "cispo": ("cispo", "CISPO: clipped importance-sampling weights (CISPOTrainer)"),
    "sapo": ("sapo", "SAPO: soft adaptive gating of the ratio (SAPOTrainer)"),
    "step_grpo": ("step_grpo", "step-wise GRPO for multi-turn agents in an environment (StepGRPOTrainer)"),
    "ppo": ("ppo", "PPO with a value model and GAE (PPOTrainer)"),
    "train": ("train", "any of the 19 algorithm presets, chosen with --algorithm"),
}


def bundled_configs() -> list[str]:
    """Names of the example configs shipped with the package (``chord_cpu``, ``chord_gpu``, ...)."""
    return sorted(name[:-5] for name in os.listdir(CONFIG_DIR) if name.endswith(".yaml"))


def config_path(name: str) -> str:
    """A config path as given, or the bundled config of that name (with or without ``.yaml``)."""
    from .common import UsageError

    if os.path.exists(name):
        return name
    candidate = os.path.join(CONFIG_DIR, name if name.endswith(".yaml") else f"{name}.yaml")
    if os.path.exists(candidate):
        return candidate
    close = difflib.get_close_matches(name.removesuffix(".yaml"), bundled_configs(), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(f"config {name!r} is neither a file nor a bundled config{hint}; `trinity-trl configs` lists them")


def config_summary(name: str) -> dict[str, str]:
    """``{recipe, model, task, steps, measured, purpose}`` of a bundled config: from its ``# recipe:``,
    ``# purpose:`` and ``# measured:`` header lines (``measured``: what a run of the config as shipped did to its
    held-out metric, recorded in ``benchmarks/results/configs_learning.md``, or ``smoke: <why>`` for a config that
    only shows the mechanics run) and its ``model_name_or_path``, ``dataset_name`` (or ``environment``) and
    ``max_steps`` keys."""
    import yaml

    with open(config_path(name), encoding="utf-8") as f:
        text = f.read()
    header = {}
    for line in text.splitlines():
        if line.startswith("# ") and ":" in line:
            key, _, value = line[2:].partition(":")
            if key in ("recipe", "purpose", "measured"):
                header[key] = value.strip()
    values = yaml.safe_load(text) or {}
    task = values.get("environment") or values.get("dataset_name", "arithmetic")
    return {
        "recipe": header.get("recipe", "?"),
        "model": str(values.get("model_name_or_path", "bundled")),
        "task": str(task),
        "steps": str(values.get("max_steps", "?")),
        "measured": header.get("measured", "-"),
        "purpose": header.get("purpose", ""),
    }
