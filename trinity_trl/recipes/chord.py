"""CHORD: on-policy RL mixed with SFT on expert demonstrations, weighted by a scheduled μ.

    trinity-trl chord --config recipes/configs/chord_cpu.yaml
    trinity-trl chord --config recipes/configs/chord_gpu.yaml --mu_decay_steps 300

Options: every field of `ChordConfig` (TRL's `GRPOConfig` plus the CHORD fields) and of `RecipeArguments`.
Demonstrations are the task's worked solutions (bundled arithmetic, or GSM8K's reference answers).
"""

from __future__ import annotations

from ..trainers import ChordConfig, ChordTrainer
from .common import rl_recipe


def main(argv: list[str] | None = None) -> ChordTrainer:
    return rl_recipe(ChordConfig, ChordTrainer, argv, with_expert=True)


if __name__ == "__main__":
    main()
