"""The algorithm presets (Trinity-RFT's 19, `m2po` and `gigpo`) and configuration resolution
(docs/algorithms/presets.md).

A preset is a class with flags (``use_critic``, ``use_reference``, ``compute_advantage_in_trainer``,
``can_balance_batch``, ``use_rollout``), a data ``schema`` and ``default_config()``: the components
it sets, each a `Component`. `resolve_algorithm_config` fills in everything else as Trinity does and
returns an `AlgorithmConfig` whose components are `Component` values with every argument resolved: the
value a user wrote (``policy_loss={"name": "cispo", "clip_range_high": 5.0}``) is the value a component is
built from, once, by `build_component`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .advantage import ADVANTAGE_FN
from .component import Component, argument_types, check_arguments, rename_trl_arguments
from .entropy import ENTROPY_LOSS_FN
from .kl import KL_FN
from .masked import check_loss_agg_mode
from .policy_loss import POLICY_LOSS_FN
from .policy_loss.base import check_aggregation_contract
from .registry import Registry

# docs/algorithms/presets.md#resolution step 1: used for every setting neither the user nor the preset makes
GLOBAL_DEFAULTS: dict[str, Any] = {
    "sample_strategy": "warmup",
    "policy_loss": "ppo",
    "advantage": "ppo",
    "kl_penalty": "none",
    "kl_loss": "k2",
    "entropy_loss": "default",
}
#: the aggregation of every term when neither the user nor the preset chooses one
DEFAULT_LOSS_AGG_MODE = "token-mean"

#: what a component keyword of `resolve_algorithm_config` takes: a `Component`, a name, a YAML-style mapping
#: (``{"name": "cispo", "clip_range_high": 5.0}``) or ``None`` (the preset's)
ComponentValue = Component | str | Mapping[str, Any] | None

# component field -> registry it names
COMPONENTS: dict[str, Registry] = {
    "policy_loss": POLICY_LOSS_FN,
    "advantage": ADVANTAGE_FN,
    "kl_penalty": KL_FN,
    "kl_loss": KL_FN,
    "entropy_loss": ENTROPY_LOSS_FN,
}

SCHEMAS = ("sft", "dpo", "experience")


class ConstantMeta(type):
    """Metaclass of the presets: a preset's flags are constants. Once a preset class is set up (the
    ``_preset`` decorator freezes it), assigning or deleting one of its attributes raises
    ``AttributeError``, so no code can change, say, ``use_critic`` of every later run of a preset."""

    def __setattr__(cls, name: str, value: Any) -> None:
        if cls.__dict__.get("_frozen", False):
            raise AttributeError(f"{cls.__name__}.{name} is a constant of the preset and cannot be reassigned")
        super().__setattr__(name, value)

    def __delattr__(cls, name: str) -> None:
        if cls.__dict__.get("_frozen", False):
            raise AttributeError(f"{cls.__name__}.{name} is a constant of the preset and cannot be deleted")
        super().__delattr__(name)

    def freeze(cls) -> None:
        type.__setattr__(cls, "_frozen", True)


class AlgorithmType(metaclass=ConstantMeta):
    """A preset. Class attributes only (constants, see `ConstantMeta`); ``ALGORITHM_TYPE.get(name)``
    returns the class."""

    name: ClassVar[str]
    use_critic: ClassVar[bool] = False
    use_reference: ClassVar[bool] = True
    compute_advantage_in_trainer: ClassVar[bool] = False
    can_balance_batch: ClassVar[bool] = True
    use_rollout: ClassVar[bool] = False
    schema: ClassVar[str] = "experience"
    # presets whose advantage function never runs (no advantage needed)
    uses_advantage: ClassVar[bool] = True
    paper: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # what a model card calls the preset, and the paper's title (only where the reference is unambiguous)
    display_name: ClassVar[str] = ""
    paper_title: ClassVar[str | None] = None
    # which ``trinity-trl`` recipe runs the preset and which trainer class (of ``trinity_trl.trainers``) it uses
    recipe: ClassVar[str] = "train"
    trainer: ClassVar[str] = "TrinityTrainer"

    @classmethod
    def default_config(cls) -> dict[str, Any]:
        """The settings this preset makes (docs/algorithms/presets.md#preset-table), a fresh dict: ``repeat_times``,
        ``sample_strategy`` and each component it sets as a `Component` (``{"advantage": Component("grpo")}``);
        components it does not set come from `GLOBAL_DEFAULTS`."""
        return {}

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """Preset-specific adjustments applied during resolution (in place), after each component's name is
        chosen (``config["kl_loss"]`` is a `Component`) and before its arguments are."""


AlgorithmType.freeze()  # the defaults every preset inherits are constants too

ALGORITHM_TYPE: Registry[type[AlgorithmType]] = Registry("algorithm")


def _preset(
    key: str,
    *,
    description: str,
    display_name: str,
    paper: str = "",
    paper_title: str | None = None,
    repeat_times: int | None = 2,
    sample_strategy: str = "default",
    **settings: Any,
):
    """Declare a preset from its table row (docs/algorithms/presets.md#preset-table)."""

    unknown = sorted(set(settings) - set(COMPONENTS))
    if unknown:
        raise TypeError(f"preset {key!r} sets {unknown}; a preset sets components ({', '.join(COMPONENTS)})")

    def decorator(cls: type[AlgorithmType]) -> type[AlgorithmType]:
        def default_config(_cls) -> dict[str, Any]:
            config: dict[str, Any] = {} if repeat_times is None else {"repeat_times": repeat_times}
            config["sample_strategy"] = sample_strategy
            for name, value in settings.items():  # a fresh Component each call: nobody can change the preset's
                config[name] = Component.parse(key, name, value).copy()
            return config

        cls.default_config = classmethod(default_config)  # type: ignore[method-assign]
        cls.description = description
        cls.paper = paper
        cls.display_name = display_name
        cls.paper_title = paper_title
        ALGORITHM_TYPE.register(key)(cls)
        cls.freeze()
        return cls

    return decorator


_RL = {"kl_penalty": "none", "kl_loss": "k2", "entropy_loss": "default"}
_NO_KL = {"kl_penalty": "none", "kl_loss": "none", "entropy_loss": "none"}


@_preset(
    "sft",
    display_name="SFT",
    description="Supervised fine-tuning on demonstrations",
    repeat_times=None,
    policy_loss="sft",
    kl_loss="none",
    entropy_loss="none",
)
class SFTAlgorithm(AlgorithmType):
    trainer = "TrinitySFTTrainer"
    use_reference = False
    schema = "sft"
    uses_advantage = False


@_preset(
    "ppo",
    display_name="PPO",
    paper_title="Proximal Policy Optimization Algorithms",
    description="PPO with a value model and GAE",
    paper="arXiv:1707.06347",
    repeat_times=1,
    policy_loss="ppo",
    advantage="ppo",
    **_RL,
)
class PPOAlgorithm(AlgorithmType):
    recipe = "ppo"
    trainer = "PPOTrainer"
    use_critic = True
    compute_advantage_in_trainer = True


@_preset(
    "grpo",
    display_name="GRPO",
    paper_title="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
    description="GRPO: PPO-clip with group-normalised rewards",
    paper="arXiv:2402.03300",
    policy_loss="ppo",
    advantage="grpo",
    **_RL,
)
class GRPOAlgorithm(AlgorithmType):
    pass


@_preset(
    "reinforceplusplus",
    display_name="REINFORCE++",
    paper_title="REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    description="REINFORCE++: discounted returns, batch-whitened",
    paper="arXiv:2501.03262",
    policy_loss="ppo",
    advantage="reinforceplusplus",
    **_RL,
)
class ReinforcePlusPlusAlgorithm(AlgorithmType):
    compute_advantage_in_trainer = True


@_preset(
    "rloo",
    display_name="RLOO",
    paper_title=("Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs"),
    description="RLOO: leave-one-out baseline",
    paper="arXiv:2402.14740",
    policy_loss="ppo",
    advantage="rloo",
    **_RL,
)
class RLOOAlgorithm(AlgorithmType):
    compute_advantage_in_trainer = True


@_preset(
    "opmd",
    display_name="OPMD",
    paper_title=(
        "Trinity-RFT: A General-Purpose and Unified Framework for Reinforcement Fine-Tuning of Large Language Models"
    ),
    description="Online policy mirror descent",
    paper="arXiv:2505.17826",
    policy_loss="opmd",
    advantage="opmd",
    **_RL,
)
class OPMDAlgorithm(AlgorithmType):
    pass


@_preset(
    "asymre",
    display_name="AsymRE",
    description="Asymmetric REINFORCE (shifted group baseline)",
    paper="arXiv:2506.20520",
    policy_loss="opmd",
    advantage="asymre",
    **_NO_KL,
)
class AsymREAlgorithm(AlgorithmType):
    use_reference = False


@_preset(
    "dpo",
    display_name="DPO",
    paper_title="Direct Preference Optimization: Your Language Model is Secretly a Reward Model",
    description="Direct preference optimisation",
    paper="arXiv:2305.18290",
    policy_loss="dpo",
    kl_loss="k2",
    entropy_loss="default",
)
class DPOAlgorithm(AlgorithmType):
    trainer = "TrinityDPOTrainer"
    can_balance_batch = False  # chosen/rejected rows must stay adjacent
    schema = "dpo"
    uses_advantage = False

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        config["repeat_times"] = 2
        if config["kl_loss"].name == "none":
            config["kl_loss"] = Component("k2", **config["kl_loss"].args)


@_preset(
    "topr",
    display_name="TOPR",
    description="Tapered off-policy REINFORCE",
    paper="arXiv:2503.14286",
    policy_loss="topr",
    advantage="reinforce",
    **_RL,
)
class TOPRAlgorithm(AlgorithmType):
    pass


@_preset(
    "cispo",
    display_name="CISPO",
    paper_title="MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    description="CISPO: clipped IS-weight policy optimisation (MiniMax-M1)",
    paper="arXiv:2506.13585",
    policy_loss="cispo",
    advantage="grpo",
    **_RL,
)
class CISPOAlgorithm(AlgorithmType):
    pass


@_preset(
    "gspo",
    display_name="GSPO",
    paper_title="Group Sequence Policy Optimization",
    description="GSPO: sequence-level importance ratio",
    paper="arXiv:2507.18071",
    policy_loss="gspo",
    advantage="grpo",
    **_RL,
)
class GSPOAlgorithm(AlgorithmType):
    pass


@_preset(
    "sapo",
    display_name="SAPO",
    paper_title="Soft Adaptive Policy Optimization",
    description="SAPO: soft adaptive gate instead of a hard clip",
    paper="arXiv:2511.20347",
    policy_loss="sapo",
    advantage="grpo",
    **_RL,
)
class SAPOAlgorithm(AlgorithmType):
    pass


@_preset(
    "mix",
    display_name="MIX",
    paper_title=(
        "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised "
        "Fine-Tuning and Reinforcement Learning via Dynamic Weighting"
    ),
    description="MIX: on-policy RL plus expert SFT with a fixed weight",
    paper="arXiv:2508.11408",
    repeat_times=8,
    sample_strategy="mix",
    policy_loss="mix",
    advantage="grpo",
    entropy_loss="mix",
)
class MIXAlgorithm(AlgorithmType):
    recipe = "chord"
    trainer = "ChordTrainer"
    use_rollout = True


@_preset(
    "mix_chord",
    display_name="CHORD",
    paper_title=(
        "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised "
        "Fine-Tuning and Reinforcement Learning via Dynamic Weighting"
    ),
    description=(
        "CHORD: on-policy RL plus expert SFT (plain for CHORD-μ, φ-weighted for CHORD-φ) with a scheduled weight μ"
    ),
    paper="arXiv:2508.11408",
    repeat_times=8,
    sample_strategy="mix",
    policy_loss="mix_chord",
    advantage="grpo",
    entropy_loss="mix",
)
class MIXCHORDAlgorithm(AlgorithmType):
    recipe = "chord"
    trainer = "ChordTrainer"
    use_rollout = True


@_preset(
    "raft",
    display_name="RAFT",
    paper_title="RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment",
    description="RAFT: SFT on the best (rewarded) samples",
    paper="arXiv:2304.06767",
    repeat_times=None,
    policy_loss="sft",
    kl_loss="none",
    entropy_loss="none",
)
class RAFTAlgorithm(AlgorithmType):
    use_reference = False
    uses_advantage = False


@_preset(
    "sppo",
    display_name="sPPO",
    description="sPPO: log-ratio policy gradient inside a trust region",
    paper="arXiv:2108.05828",
    policy_loss="sppo",
    advantage="opmd",
    **_NO_KL,
)
class sPPOAlgorithm(AlgorithmType):  # noqa: N801 (Trinity's name)
    use_reference = False


@_preset(
    "rec",
    display_name="REC",
    description="REC: group-relative REINFORCE with optional clipping",
    paper="arXiv:2509.24203",
    policy_loss="rec",
    advantage="rec",
    **_RL,
)
class RECAlgorithm(AlgorithmType):
    pass


@_preset(
    "multi_step_grpo",
    display_name="Step-wise GRPO",
    description="Step-wise GRPO for multi-step agents (run reward broadcast to every step)",
    paper="rLLM (github.com/rllm-org/rllm)",
    repeat_times=8,
    policy_loss="ppo",
    advantage="step_wise_grpo",
    **_RL,
)
class MultiStepGRPOAlgorithm(AlgorithmType):
    recipe = "step_grpo"
    trainer = "StepGRPOTrainer"
    pass


@_preset(
    "gigpo",
    display_name="GiGPO",
    paper_title="Group-in-Group Policy Optimization for LLM Agent Training",
    description="GiGPO for multi-step agents: the run's group-relative advantage plus an anchor-state step advantage",
    paper="arXiv:2505.10978",
    repeat_times=8,
    policy_loss="ppo",
    advantage="gigpo",
    **_RL,
)
class GiGPOAlgorithm(AlgorithmType):
    recipe = "step_grpo"
    trainer = "StepGRPOTrainer"


@_preset(
    "on_policy_distill",
    display_name="On-policy distillation",
    paper_title="On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
    description="On-policy distillation: per-token teacher log-ratio as advantage",
    paper="arXiv:2306.13649",
    repeat_times=8,
    policy_loss="ppo",
    advantage=Component("on_policy_distill", kl_coef=1.0),
    **_NO_KL,
)
class OnPolicyDistillAlgorithm(AlgorithmType):
    use_reference = False
    compute_advantage_in_trainer = True


@_preset(
    "m2po",
    display_name="M2PO",
    paper_title="Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?",
    description="M2PO: an unclipped policy gradient masking the stale tokens of largest squared log-ratio",
    paper="arXiv:2510.01161",
    repeat_times=8,
    policy_loss="m2po",
    advantage="grpo",
    **_NO_KL,
)
class M2POAlgorithm(AlgorithmType):
    use_reference = False


def build_component(registry: Registry, component: Component, **trainer_arguments: Any):
    """The component ``component`` names, built from its arguments (and ``trainer_arguments``, constructor
    arguments a trainer derives itself, such as CHORD's sample weights). An argument the component does not take, or
    a value of another type than its annotation, is a one-line ``ValueError`` that lists the arguments and their
    types; a value the constructor refuses is its own one-line ``ValueError``."""
    cls = registry.get(component.name)
    args = component.with_args(**trainer_arguments).args
    check_arguments(registry.kind, component.name, cls, args)
    return cls(**args)


@dataclass
class AlgorithmConfig:
    """A fully resolved algorithm (docs/algorithms/presets.md#resolution): each component a `Component` naming it
    with every argument it is built with, the aggregation, and the preset's flags."""

    algorithm: str
    policy_loss: Component
    advantage: Component
    kl_penalty: Component
    kl_loss: Component
    entropy_loss: Component
    loss_agg_mode: str
    sample_strategy: str
    repeat_times: int | None
    use_critic: bool
    compute_advantage_in_trainer: bool
    can_balance_batch: bool
    schema: str
    uses_advantage: bool

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are needed: a KL term or penalty, or a loss that reads them (DPO)."""
        return (
            KL_FN.get(self.kl_loss.name).enabled
            or KL_FN.get(self.kl_penalty.name).enabled
            or "ref_logprob" in POLICY_LOSS_FN.get(self.policy_loss.name).inputs
        )

    def build_policy_loss(self, **trainer_arguments: Any):
        """The policy loss, built from `policy_loss` (and ``trainer_arguments``, see `build_component`)."""
        loss = build_component(POLICY_LOSS_FN, self.policy_loss, **trainer_arguments)
        check_aggregation_contract(loss)  # refused here, at construction, never at the first step
        return loss

    def build_advantage_fn(self):
        return build_component(ADVANTAGE_FN, self.advantage)

    def build_kl_loss(self):
        return build_component(KL_FN, self.kl_loss)

    def build_kl_penalty(self):
        return build_component(KL_FN, self.kl_penalty)

    def build_entropy_loss(self):
        return build_component(ENTROPY_LOSS_FN, self.entropy_loss)

    def to_dict(self) -> dict[str, Any]:
        """Every field, each component in its YAML spelling (``{"name": "cispo", "clip_range_high": 0.28, ...}``)."""
        return {name: value.to_dict() if isinstance(value, Component) else value for name, value in vars(self).items()}


def _resolved_arguments(
    cls: type, given: Component, preset: Component | None, merge_args: bool, kind: str
) -> dict[str, Any]:
    """Step 3 of docs/algorithms/presets.md#resolution for one component: the arguments it is built with."""
    if not given.args:
        same = preset is not None and preset.name == given.name and preset.args
        return dict(preset.args) if same else cls.default_args()
    args = rename_trl_arguments(kind, given.name, cls, given.args)
    return cls.merged_args(args) if merge_args else args


def resolve_algorithm_config(
    algorithm: str,
    *,
    merge_args: bool = False,
    force_loss_agg_mode: bool = False,
    policy_loss: ComponentValue = None,
    advantage: ComponentValue = None,
    kl_penalty: ComponentValue = None,
    kl_loss: ComponentValue = None,
    entropy_loss: ComponentValue = None,
    loss_agg_mode: str | None = None,
    sample_strategy: str | None = None,
    repeat_times: int | None = None,
) -> AlgorithmConfig:
    """Resolve a preset plus the user's components into concrete ones (docs/algorithms/presets.md#resolution).

    Each component is a `Component` (or a bare name, or a mapping with an optional ``name`` key): ``None`` or a
    ``Component`` without a name keeps the preset's choice; a ``Component`` without arguments uses the preset's
    arguments for that component, else its ``default_args()``.

    1. Settings left ``None`` take the preset's value, else `GLOBAL_DEFAULTS` (`DEFAULT_LOSS_AGG_MODE`).
    2. Preset-specific checks (DPO forces ``repeat_times=2`` and a KL loss).
    3. A component's arguments **replace** its ``default_args()`` (reference behaviour; missing keys fall back to
       constructor defaults) unless ``merge_args=True``, in which case they are laid over them
       (``cls.merged_args``: a user's symmetric ``clip_range`` then also replaces GSPO's preset bounds).
    4. If the policy loss's arguments hold a ``loss_agg_mode``, the global ``loss_agg_mode`` wins. With
       ``force_loss_agg_mode=True`` it also wins when they do not (a ``replace``-mode component without it), for
       every loss that takes an aggregation mode, so the policy loss always aggregates like the KL and entropy
       terms (Trinity keeps the loss's constructor default then).

    Every name is checked against its registry and every argument's name and type against the constructor's
    signature; nothing is built here (a trainer config builds its components once, `build_component`).
    """
    preset = ALGORITHM_TYPE.get(algorithm)
    preset_cfg = preset.default_config()
    user: dict[str, Any] = {
        "policy_loss": policy_loss,
        "advantage": advantage,
        "kl_penalty": kl_penalty,
        "kl_loss": kl_loss,
        "entropy_loss": entropy_loss,
    }
    config: dict[str, Any] = {
        "sample_strategy": sample_strategy or preset_cfg.get("sample_strategy") or GLOBAL_DEFAULTS["sample_strategy"],
        "repeat_times": repeat_times if repeat_times is not None else preset_cfg.get("repeat_times"),
    }
    for field_name, value in user.items():
        given = Component.parse("resolve_algorithm_config", field_name, value) or Component()
        fallback = preset_cfg.get(field_name) or Component(GLOBAL_DEFAULTS[field_name])
        config[field_name] = Component(given.name or fallback.name, **given.args)
    loss_agg_mode = loss_agg_mode if loss_agg_mode is not None else DEFAULT_LOSS_AGG_MODE
    check_loss_agg_mode(loss_agg_mode)
    preset.check_config(config)

    for field_name, registry in COMPONENTS.items():
        given = config[field_name]
        cls = registry.get(given.name)  # unknown name -> ValueError listing known names
        args = _resolved_arguments(cls, given, preset_cfg.get(field_name), merge_args, registry.kind)
        check_arguments(registry.kind, given.name, cls, args)
        config[field_name] = Component(given.name, **args)

    policy = config["policy_loss"]
    takes_mode = "loss_agg_mode" in argument_types(POLICY_LOSS_FN.get(policy.name))
    if "loss_agg_mode" in policy.args or (force_loss_agg_mode and takes_mode):
        config["policy_loss"] = policy.with_args(loss_agg_mode=loss_agg_mode)

    advantage_cls = ADVANTAGE_FN.get(config["advantage"].name)
    if preset.uses_advantage and advantage_cls.compute_in_trainer() != preset.compute_advantage_in_trainer:
        where = "in the trainer on padded batches" if preset.compute_advantage_in_trainer else "on experience groups"
        raise ValueError(
            f"algorithm {algorithm!r} computes advantages {where}, but advantage={config['advantage'].name!r} "
            f"is a {'batch' if advantage_cls.compute_in_trainer() else 'group'} function"
        )

    return AlgorithmConfig(
        algorithm=algorithm,
        loss_agg_mode=loss_agg_mode,
        use_critic=preset.use_critic,
        compute_advantage_in_trainer=preset.compute_advantage_in_trainer,
        can_balance_batch=preset.can_balance_batch,
        schema=preset.schema,
        uses_advantage=preset.uses_advantage,
        **config,
    )
