"""The components of a trainer: each config field read into one `Component` value, and the algorithm's
components built once, from the resolved algorithm's `Component` values, and handed to the trainer
(trainers ask their declared properties).

A config builds its components when it checks itself, so that a bad argument fails when the config is built, and
keeps them for the trainer that takes them (`ComponentsBuiltOnce.take_components`): each component is built once,
from the very `Component` the user wrote, with the arguments resolution filled in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..algorithms import AlgorithmConfig
from ..algorithms.advantage import AdvantageFn
from ..algorithms.component import Component
from ..algorithms.entropy import EntropyLossFn
from ..algorithms.kl import KLFn
from ..algorithms.policy_loss import PolicyLossFn


class TrainerCapabilities:
    """What a trainer class adds to the components it runs, checked against what they need
    (`trinity_trl.training.checks.check_components`): the flags of both trainer families (`TrinityTrainer`,
    `AsyncTrinityTrainer`), each set by the subclass that has the capability."""

    #: mixes expert (demonstration) rows into its batches (ChordTrainer, AsyncChordTrainer)
    supports_expert_rows: ClassVar[bool] = False
    #: trains a value model that provides critic values (PPOTrainer)
    has_critic: ClassVar[bool] = False
    #: plays multi-step runs and records each step's state (StepGRPOTrainer, AsyncStepGRPOTrainer): what a step-wise
    #: advantage (GiGPO's) reads
    plays_runs: ClassVar[bool] = False


def component_fields(config: Any, fields: Iterable[str]) -> None:
    """Read the component fields of ``config`` (``policy_loss``, ...) into `Component` values, in place."""
    owner = type(config).__name__
    for name in fields:
        setattr(config, name, Component.parse(owner, name, getattr(config, name)))


@dataclass
class Components:
    """An algorithm's components, built once from its resolved config (trainers ask their properties), and what they
    were built from (``algorithm`` and ``trainer_arguments``)."""

    policy_loss: PolicyLossFn
    kl_loss: KLFn
    kl_penalty: KLFn
    entropy_loss: EntropyLossFn
    advantage_fn: AdvantageFn | None
    algorithm: AlgorithmConfig
    trainer_arguments: Mapping[str, Any]

    @classmethod
    def build(cls, algorithm: AlgorithmConfig, trainer_arguments: Mapping[str, Any] | None = None) -> Components:
        """Each component of ``algorithm`` built from its `Component`. ``trainer_arguments``: constructor arguments
        of the policy loss that the trainer's config derives from its own batch geometry (ChordConfig's sample
        weights); the user may not set them too (an error, never silently overwritten)."""
        trainer_arguments = dict(trainer_arguments or {})
        clash = sorted(set(trainer_arguments) & set(algorithm.policy_loss.args))
        if clash:
            raise ValueError(
                f"policy_loss sets {clash}, which the trainer derives from its own batch geometry "
                f"(would be { ({k: trainer_arguments[k] for k in clash}) }); remove them"
            )
        return cls(
            policy_loss=algorithm.build_policy_loss(**trainer_arguments),
            kl_loss=algorithm.build_kl_loss(),
            kl_penalty=algorithm.build_kl_penalty(),
            entropy_loss=algorithm.build_entropy_loss(),
            advantage_fn=algorithm.build_advantage_fn() if algorithm.uses_advantage else None,
            algorithm=algorithm,
            trainer_arguments=trainer_arguments,
        )

    def built_from(self, algorithm: AlgorithmConfig, trainer_arguments: Mapping[str, Any]) -> bool:
        """Whether these components are the ones ``algorithm`` and ``trainer_arguments`` build."""
        return self.algorithm == algorithm and dict(self.trainer_arguments) == dict(trainer_arguments)


class ComponentsBuiltOnce:
    """Mixin of the trainer configs: the config builds its components when it checks itself (`check_components`, in
    ``__post_init__``), so a bad argument fails there, and hands them to the first trainer built from it
    (`take_components`), so each component is built once. A config changed since it was checked, or used by a second
    trainer, builds them anew: a trainer never shares a stateful component (an adaptive KL coefficient) with
    another, nor gets components that do not match its config. The built components are not part of the config's
    pickled state (transformers saves ``training_args.bin``)."""

    def resolved_algorithm(self) -> AlgorithmConfig:
        raise NotImplementedError

    def derived_policy_loss_arguments(self) -> dict[str, Any]:
        """Constructor arguments of the policy loss that the config derives from its own batch geometry
        (ChordConfig: the per-sample weights); none by default."""
        return {}

    def check_components(self) -> Components:
        """Resolve and build the components now, so a bad name, argument or value fails when the config is built;
        kept for the trainer (`take_components`) and returned."""
        self._built_components = Components.build(self.resolved_algorithm(), self.derived_policy_loss_arguments())
        return self._built_components

    def take_components(self) -> Components:
        """The components built when the config was checked, for the trainer that takes them (once); built anew if
        already taken or if the config resolves differently now."""
        built, self._built_components = getattr(self, "_built_components", None), None
        algorithm, trainer_arguments = self.resolved_algorithm(), self.derived_policy_loss_arguments()
        if built is not None and built.built_from(algorithm, trainer_arguments):
            return built
        return Components.build(algorithm, trainer_arguments)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_built_components", None)
        return state
