"""PPO with a value model: GAE advantages from a critic trained next to the policy (Trinity-RFT's `ppo` preset).

    trinity-trl ppo --config recipes/configs/ppo_cpu.yaml

Options: every field of `PPOConfig` (TRL's `GRPOConfig`, the algorithm components, and the critic's
`value_model_name_or_path`, `value_learning_rate`, `cliprange_value`, `critic_warmup_steps`, `gamma`, `lam`,
`save_value_model`) and of `RecipeArguments`. With `use_peft`, the critic gets its own LoRA adapter with the same
settings (its scalar value head is trained in full).
"""

from __future__ import annotations

from ..trainers import PPOConfig, PPOTrainer
from .common import rl_recipe


def main(argv: list[str] | None = None) -> PPOTrainer:
    return rl_recipe(PPOConfig, PPOTrainer, argv)


if __name__ == "__main__":
    main()
