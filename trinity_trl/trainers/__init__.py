"""TRL trainers for Trinity-RFT algorithms."""

from .chord import ChordConfig, ChordTrainer
from .cispo import CISPOConfig, CISPOTrainer
from .config import TrinityConfig
from .dpo import TrinityDPOConfig, TrinityDPOTrainer
from .sapo import SAPOConfig, SAPOTrainer
from .sft import TrinitySFTConfig, TrinitySFTTrainer
from .step_grpo import StepGRPOConfig, StepGRPOTrainer
from .trinity import TrinityTrainer

__all__ = [
    "CISPOConfig",
    "CISPOTrainer",
    "ChordConfig",
    "ChordTrainer",
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
