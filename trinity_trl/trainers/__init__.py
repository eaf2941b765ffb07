"""The trainer classes a user constructs, and their configs: TRL trainer subclasses that own TRL's seams.

``trainers/`` versus ``training/``: a class here is what you construct and what TRL calls by method name;
`trinity_trl.training` is the machinery those methods hand their work to (advantages, the loss plan, scoring,
metrics, checks, engines, the card's content), one concern per module, tested without a trainer and importing none.
So a new trainer goes here, and what happens inside its seams goes there.

One base, `TrinityTrainer` (TRL's ``GRPOTrainer`` running any preset), owns TRL's seams; the algorithm
trainers (`ChordTrainer`, `CISPOTrainer`, `SAPOTrainer`, `StepGRPOTrainer`,
`PPOTrainer`) are small subclasses with a config of the right defaults and the one behaviour that is
theirs, and `TrinitySFTTrainer` / `TrinityDPOTrainer` run the SFT and DPO presets on TRL's own
trainers. `AsyncTrinityTrainer` (and `AsyncCISPOTrainer`, `AsyncSAPOTrainer`, `AsyncChordTrainer`,
`AsyncStepGRPOTrainer`) run the same algorithms on TRL's asynchronous trainer (`async_trinity`, `async_algorithms`;
the loss after the forward is `trinity_loss`, shared with `TrinityTrainer`; they import TRL's experimental module on
first access). Beside the
trainer classes: `components` (the algorithm's components, built once), `machine` (where the run happens: CPU
defaults, threads, the start checks), `card` (the model card's seams), `common` (TRL plumbing) and `spellings` (the
removed spellings); `trinity_trl.asynchronous` is what the asynchronous trainers compose. Other rooms they compose:
`trinity_trl.packing` (prefix-packed forwards),
`trinity_trl.rollouts` (multi-step runs) and `trinity_trl.checkpointing`. Tests: ``tests/trainers/``.
"""

import warnings

# TRL 1.16's own generation helpers (trl/models/utils.py) call transformers' deprecated
# `is_gradient_checkpointing` / `gradient_checkpointing_enable|disable` aliases on every generation; users
# cannot act on these FutureWarnings, so they are silenced here (only these three messages).
for _alias in ("is_gradient_checkpointing", "gradient_checkpointing_enable", "gradient_checkpointing_disable"):
    warnings.filterwarnings("ignore", message=rf"`{_alias}` is deprecated", category=FutureWarning)

import importlib
from typing import Any

from .chord_trainer import ChordConfig, ChordTrainer
from .cispo_trainer import CISPOConfig, CISPOTrainer
from .config import TrinityConfig
from .dpo_trainer import TrinityDPOConfig, TrinityDPOTrainer
from .ppo_trainer import PPOConfig, PPOTrainer
from .sapo_trainer import SAPOConfig, SAPOTrainer
from .sft_trainer import TrinitySFTConfig, TrinitySFTTrainer
from .step_grpo import StepGRPOConfig, StepGRPOTrainer
from .trinity import TrinityTrainer

#: the asynchronous trainers (TRL's experimental AsyncGRPOTrainer), imported on first access (PEP 562)
_ASYNC: dict[str, str] = {
    "AsyncTrinityConfig": "async_config",
    "AsyncTrinityTrainer": "async_trinity",
    "AsyncCISPOConfig": "async_algorithms",
    "AsyncCISPOTrainer": "async_algorithms",
    "AsyncSAPOConfig": "async_algorithms",
    "AsyncSAPOTrainer": "async_algorithms",
    "AsyncChordConfig": "async_algorithms",
    "AsyncChordTrainer": "async_algorithms",
    "AsyncStepGRPOConfig": "async_algorithms",
    "AsyncStepGRPOTrainer": "async_algorithms",
}


def __getattr__(name: str) -> Any:
    module = _ASYNC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    *_ASYNC,
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
