"""TRL trainers for Trinity-RFT algorithms: the classes a user constructs, and their configs.

One base, `TrinityTrainer` (TRL's ``GRPOTrainer`` running any preset), owns TRL's seams; the algorithm
trainers (`ChordTrainer`, `CISPOTrainer`, `SAPOTrainer`, `StepGRPOTrainer`,
`PPOTrainer`) are small subclasses with a config of the right defaults and the one behaviour that is
theirs, and `TrinitySFTTrainer` / `TrinityDPOTrainer` run the SFT and DPO presets on TRL's own
trainers. What they share lives beside them: `trinity_trl.training` (advantages, loss plan, scoring,
metrics, engines, card), `trinity_trl.packing` (prefix-packed forwards) and
`trinity_trl.checkpointing`. Tests: ``tests/trainers/``.
"""

import warnings

# TRL 1.16's own generation helpers (trl/models/utils.py) call transformers' deprecated
# `is_gradient_checkpointing` / `gradient_checkpointing_enable|disable` aliases on every generation; users
# cannot act on these FutureWarnings, so they are silenced here (only these three messages).
for _alias in ("is_gradient_checkpointing", "gradient_checkpointing_enable", "gradient_checkpointing_disable"):
    warnings.filterwarnings("ignore", message=rf"`{_alias}` is deprecated", category=FutureWarning)

from .chord import ChordConfig, ChordTrainer
from .cispo import CISPOConfig, CISPOTrainer
from .config import TrinityConfig
from .dpo import TrinityDPOConfig, TrinityDPOTrainer
from .ppo import PPOConfig, PPOTrainer
from .sapo import SAPOConfig, SAPOTrainer
from .sft import TrinitySFTConfig, TrinitySFTTrainer
from .step_grpo import StepGRPOConfig, StepGRPOTrainer
from .trinity import TrinityTrainer

__all__ = [
    "CISPOConfig",
    "CISPOTrainer",
    "ChordConfig",
    "ChordTrainer",
    "PPOConfig",
    "PPOTrainer",
    "SAPOConfig",
    "SAPOTrainer",
    "StepGRPOConfig",
    "StepGRPOTrainer",
    "TrinityConfig",
    "TrinityDPOConfig",
    "TrinityDPOTrainer",
    "TrinitySFTConfig",
    "TrinitySFTTrainer",
    "TrinityTrainer",
]
