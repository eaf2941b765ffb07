"""TRL trainers for Trinity-RFT algorithms."""

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
