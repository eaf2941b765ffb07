"""Recipe scripts: one per trainer plus the general preset runner, each ``main(argv) -> trainer``.

Run them with the ``trinity-trl`` command (``trinity-trl chord --config chord_cpu``), as modules
(``python -m trinity_trl.recipes.chord ...``) or through the thin scripts in the repository's
``recipes/`` folder. Example configs ship in ``trinity_trl/recipes/configs/``.
"""

from __future__ import annotations

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
    if os.path.exists(name):
        return name
    candidate = os.path.join(CONFIG_DIR, name if name.endswith(".yaml") else f"{name}.yaml")
    if os.path.exists(candidate):
        return candidate
    raise FileNotFoundError(f"config {name!r} is neither a file nor a bundled config ({', '.join(bundled_configs())})")
