"""CISPO: REINFORCE weighted by a clipped, detached importance ratio (MiniMax-M1).

    trinity-trl cispo --config recipes/configs/cispo_cpu.yaml

Options: every field of `CISPOConfig` (TRL's `GRPOConfig` plus the CISPO fields) and of `RecipeArguments`.
"""

from __future__ import annotations

from ..trainers import CISPOConfig, CISPOTrainer
from .common import rl_recipe


def main(argv: list[str] | None = None) -> CISPOTrainer:
    return rl_recipe(CISPOConfig, CISPOTrainer, argv)


if __name__ == "__main__":
    main()
