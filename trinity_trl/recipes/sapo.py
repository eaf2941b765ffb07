"""SAPO: soft, temperature-controlled gating of the importance ratio instead of a hard clip.

    trinity-trl sapo --config recipes/configs/sapo_cpu.yaml

Options: every field of `SAPOConfig` (TRL's `GRPOConfig` plus `sapo_form`) and of `RecipeArguments`.
"""

from __future__ import annotations

from ..trainers import SAPOConfig, SAPOTrainer
from .common import rl_recipe


def main(argv: list[str] | None = None) -> SAPOTrainer:
    return rl_recipe(SAPOConfig, SAPOTrainer, argv)


if __name__ == "__main__":
    main()
