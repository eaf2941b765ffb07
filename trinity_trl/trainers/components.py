"""The components of a trainer: each config field read into one `Component` value, and the algorithm's
components built once from the resolved algorithm (trainers ask their declared properties)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..algorithms import AlgorithmConfig
from ..algorithms.advantage import AdvantageFn
from ..algorithms.component import Component
from ..algorithms.entropy import EntropyLossFn
from ..algorithms.kl import KLFn
from ..algorithms.policy_loss import PolicyLossFn


def component_fields(config: Any, fields: Iterable[str]) -> None:
    """Read the component fields of ``config`` (``policy_loss``, ...) into `Component` values, in place."""
    owner = type(config).__name__
    for name in fields:
        setattr(config, name, Component.parse(owner, name, getattr(config, name)))


@dataclass
class Components:
    """An algorithm's components, built once from its resolved config (trainers ask their properties)."""

    policy_loss: PolicyLossFn
    kl_loss: KLFn
    kl_penalty: KLFn
    entropy_loss: EntropyLossFn
    advantage_fn: AdvantageFn | None

    @classmethod
    def build(cls, algorithm: AlgorithmConfig, policy_loss_overrides: dict[str, Any] | None = None) -> Components:
        """``policy_loss_overrides``: constructor arguments a trainer sets itself (ChordTrainer's
        batch geometry); the user may not set them too (an error, never silently overwritten)."""
        overrides = policy_loss_overrides or {}
        clash = sorted(set(overrides) & set(algorithm.policy_loss_fn_args))
        if clash:
            raise ValueError(
                f"policy_loss sets {clash}, which the trainer derives from its own batch geometry "
                f"(would be { ({k: overrides[k] for k in clash}) }); remove them"
            )
        return cls(
            policy_loss=algorithm.build_policy_loss(**overrides),
            kl_loss=algorithm.build_kl_loss(),
            kl_penalty=algorithm.build_kl_penalty(),
            entropy_loss=algorithm.build_entropy_loss(),
            advantage_fn=algorithm.build_advantage_fn() if algorithm.uses_advantage else None,
        )
