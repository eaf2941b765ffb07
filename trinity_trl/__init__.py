"""trinity_trl: Trinity-RFT algorithms for Hugging Face TRL.

As in TRL (``from trl import GRPOTrainer, GRPOConfig``), every public trainer and config is importable from the top
level: ``from trinity_trl import ChordTrainer, ChordConfig``. They load lazily, on first use, so ``import
trinity_trl`` itself imports neither torch nor TRL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .distributed import end_process_group, ending_process_group
from .notices import quiet_notices
from .tokenizer import hf_tokenizer, tool_chat_template

quiet_notices()  # library notices a user cannot act on (trinity_trl/notices.py says which and why)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "end_process_group",
    "ending_process_group",
    "hf_tokenizer",
    "tool_chat_template",
    "TrinityTrainer",
    "TrinityConfig",
    "ChordTrainer",
    "ChordConfig",
    "CISPOTrainer",
    "CISPOConfig",
    "SAPOTrainer",
    "SAPOConfig",
    "StepGRPOTrainer",
    "StepGRPOConfig",
    "PPOTrainer",
    "PPOConfig",
    "TrinitySFTTrainer",
    "TrinitySFTConfig",
    "TrinityDPOTrainer",
    "TrinityDPOConfig",
    "AsyncTrinityTrainer",
    "AsyncTrinityConfig",
    "AsyncCISPOTrainer",
    "AsyncCISPOConfig",
    "AsyncSAPOTrainer",
    "AsyncSAPOConfig",
    "AsyncChordTrainer",
    "AsyncChordConfig",
    "AsyncStepGRPOTrainer",
    "AsyncStepGRPOConfig",
]

#: public name -> the module it is imported from on first access (PEP 562): every trainer and config, which the
#: trainers package re-exports from its own module (trinity_trl/trainers/chord_trainer.py, ...)
_LAZY: dict[str, str] = {name: "trinity_trl.trainers" for name in __all__ if name not in globals()}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first access
    from .trainers import (
        AsyncChordConfig,
        AsyncChordTrainer,
        AsyncCISPOConfig,
        AsyncCISPOTrainer,
        AsyncSAPOConfig,
        AsyncSAPOTrainer,
        AsyncStepGRPOConfig,
        AsyncStepGRPOTrainer,
        AsyncTrinityConfig,
        AsyncTrinityTrainer,
        ChordConfig,
        ChordTrainer,
        CISPOConfig,
        CISPOTrainer,
        PPOConfig,
        PPOTrainer,
        SAPOConfig,
        SAPOTrainer,
        StepGRPOConfig,
        StepGRPOTrainer,
        TrinityConfig,
        TrinityDPOConfig,
        TrinityDPOTrainer,
        TrinitySFTConfig,
        TrinitySFTTrainer,
        TrinityTrainer,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
