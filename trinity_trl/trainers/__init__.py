"""TRL trainers for Trinity-RFT algorithms."""

from .chord import ChordConfig, ChordTrainer
from .cispo import CISPOConfig, CISPOTrainer
from .config import TrinityConfig
from .sapo import SAPOConfig, SAPOTrainer
from .trinity import TrinityTrainer

__all__ = [
    "ChordConfig",
    "ChordTrainer","CISPOConfig", "CISPOTrainer", "SAPOConfig", "SAPOTrainer", "TrinityConfig", "TrinityTrainer"]
