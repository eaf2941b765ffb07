"""TRL trainers for Trinity-RFT algorithms."""

from .cispo import CISPOConfig, CISPOTrainer
from .config import TrinityConfig
from .sapo import SAPOConfig, SAPOTrainer
from .trinity import TrinityTrainer

__all__ = ["CISPOConfig", "CISPOTrainer", "SAPOConfig", "SAPOTrainer", "TrinityConfig", "TrinityTrainer"]
