"""The 19 algorithm presets and configuration resolution (docs/algorithms/presets.md).

A preset is a class with flags (``use_critic``, ``use_reference``, ``compute_advantage_in_trainer``,
``can_balance_batch``, ``use_rollout``), a data ``schema`` and ``default_config()``: the components
it sets. `resolve_algorithm_config` fills in everything else as Trinity does.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from .advantage import ADVANTAGE_FN
from .component import check_arguments, rename_trl_arguments
from .entropy import ENTROPY_LOSS_FN
from .kl import KL_FN
from .masked import check_loss_agg_mode
from .policy_loss import POLICY_LOSS_FN
from .policy_loss.base import check_aggregation_contract
from .registry import Registry

# docs/algorithms/presets.md#resolution step 1: used for every field neither the user nor the preset sets
GLOBAL_DEFAULTS: dict[str, Any] = {
    "sample_strategy": "warmup",
    "policy_loss_fn": "ppo",
    "advantage_fn": "ppo",
    "kl_penalty_fn": "none",
    "kl_loss_fn": "k2",
    "entropy_loss_fn": "default",
    "loss_agg_mode": "token-mean",
}

# component field -> registry it names
COMPONENTS: dict[str, Registry] = {
    "policy_loss_fn": POLICY_LOSS_FN,
    "advantage_fn": ADVANTAGE_FN,
    "kl_penalty_fn": KL_FN,
    "kl_loss_fn": KL_FN,
    "entropy_loss_fn": ENTROPY_LOSS_FN,
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
        """The settings this preset makes (docs/algorithms/presets.md#preset-table; footnoted components come from
        `GLOBAL_DEFAULTS` instead)."""
        return {}

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """Preset-specific adjustments applied during resolution (in place)."""


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

    def decorator(cls: type[AlgorithmType]) -> type[AlgorithmType]:
        config: dict[str, Any] = {"sample_strategy": sample_strategy, **settings}
        if repeat_times is not None:
            config = {"repeat_times": repeat_times, **config}
        cls.default_config = classmethod(
            lambda c, _cfg=config: {k: (dict(v) if isinstance(v, dict) else v) for k, v in _cfg.items()}
        )  # type: ignore[method-assign]
        cls.description = description
        cls.paper = paper
        cls.display_name = display_name
        cls.paper_title = paper_title
        ALGORITHM_TYPE.register(key)(cls)
        cls.freeze()
        return cls

    return decorator


_RL = {"kl_penalty_fn": "none", "kl_loss_fn": "k2", "entropy_loss_fn": "default"}
_NO_KL = {"kl_penalty_fn": "none", "kl_loss_fn": "none", "entropy_loss_fn": "none"}


@_preset(
    "sft",
    display_name="SFT",
    description="Supervised fine-tuning on demonstrations",
    repeat_times=None,
    policy_loss_fn="sft",
    kl_loss_fn="none",
    entropy_loss_fn="none",
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
    policy_loss_fn="ppo",
    advantage_fn="ppo",
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
    policy_loss_fn="ppo",
    advantage_fn="grpo",
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
    policy_loss_fn="ppo",
    advantage_fn="reinforceplusplus",
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
    policy_loss_fn="ppo",
    advantage_fn="rloo",
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
    policy_loss_fn="opmd",
    advantage_fn="opmd",
    **_RL,
)
class OPMDAlgorithm(AlgorithmType):
    pass


@_preset(
    "asymre",
    display_name="AsymRE",
    description="Asymmetric REINFORCE (shifted group baseline)",
    paper="arXiv:2506.20520",
    policy_loss_fn="opmd",
    advantage_fn="asymre",
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
    policy_loss_fn="dpo",
    kl_loss_fn="k2",
    entropy_loss_fn="default",
)
class DPOAlgorithm(AlgorithmType):
    trainer = "TrinityDPOTrainer"
    can_balance_batch = False  # chosen/rejected rows must stay adjacent
    schema = "dpo"
    uses_advantage = False

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        config["repeat_times"] = 2
        if config["kl_loss_fn"] == "none":
            config["kl_loss_fn"] = "k2"


@_preset(
    "topr",
    display_name="TOPR",
    description="Tapered off-policy REINFORCE",
    paper="arXiv:2503.14286",
    policy_loss_fn="topr",
    advantage_fn="reinforce",
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
    policy_loss_fn="cispo",
    advantage_fn="grpo",
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
    policy_loss_fn="gspo",
    advantage_fn="grpo",
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
    policy_loss_fn="sapo",
    advantage_fn="grpo",
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
    policy_loss_fn="mix",
    advantage_fn="grpo",
    entropy_loss_fn="mix",
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
    policy_loss_fn="mix_chord",
    advantage_fn="grpo",
    entropy_loss_fn="mix",
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
    policy_loss_fn="sft",
    kl_loss_fn="none",
    entropy_loss_fn="none",
)
class RAFTAlgorithm(AlgorithmType):
    use_reference = False
    uses_advantage = False


@_preset(
    "sppo",
    display_name="sPPO",
    description="sPPO: log-ratio policy gradient inside a trust region",
    paper="arXiv:2108.05828",
    policy_loss_fn="sppo",
    advantage_fn="opmd",
    **_NO_KL,
)
class sPPOAlgorithm(AlgorithmType):  # noqa: N801 (Trinity's name)
    use_reference = False


@_preset(
    "rec",
    display_name="REC",
    description="REC: group-relative REINFORCE with optional clipping",
    paper="arXiv:2509.24203",
    policy_loss_fn="rec",
    advantage_fn="rec",
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
    policy_loss_fn="ppo",
    advantage_fn="step_wise_grpo",
    **_RL,
)
class MultiStepGRPOAlgorithm(AlgorithmType):
    recipe = "step_grpo"
    trainer = "StepGRPOTrainer"
    pass


@_preset(
    "on_policy_distill",
    display_name="On-policy distillation",
    paper_title="On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
    description="On-policy distillation: per-token teacher log-ratio as advantage",
    paper="arXiv:2306.13649",
    repeat_times=8,
    policy_loss_fn="ppo",
    advantage_fn="on_policy_distill",
    advantage_fn_args={"kl_coef": 1.0},
    **_NO_KL,
)
class OnPolicyDistillAlgorithm(AlgorithmType):
    use_reference = False
    compute_advantage_in_trainer = True


def build_component(registry: Registry, name: str, args: dict[str, Any]):
    """``registry.get(name)(**args)``; an argument the component does not take, or a value of another
    type than its annotation, is a one-line ``ValueError`` that lists the arguments and their types."""
    cls = registry.get(name)
    check_arguments(registry.kind, name, cls, args)
    return cls(**args)


@dataclass
class AlgorithmConfig:
    """A fully resolved algorithm: component names, their argument dicts and the preset flags."""

    algorithm: str
    policy_loss_fn: str
    policy_loss_fn_args: dict[str, Any]
    advantage_fn: str
    advantage_fn_args: dict[str, Any]
    kl_penalty_fn: str
    kl_penalty_fn_args: dict[str, Any]
    kl_loss_fn: str
    kl_loss_fn_args: dict[str, Any]
    entropy_loss_fn: str
    entropy_loss_fn_args: dict[str, Any]
    loss_agg_mode: str
    sample_strategy: str
    repeat_times: int | None
    use_critic: bool
    compute_advantage_in_trainer: bool
    can_balance_batch: bool
    schema: str
    uses_advantage: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are needed: a KL term or penalty, or a loss that reads them (DPO)."""
        return (
            KL_FN.get(self.kl_loss_fn).enabled
            or KL_FN.get(self.kl_penalty_fn).enabled
            or "ref_logprob" in POLICY_LOSS_FN.get(self.policy_loss_fn).inputs
        )

    def build_policy_loss(self, **kwargs: Any):
        loss = build_component(POLICY_LOSS_FN, self.policy_loss_fn, {**self.policy_loss_fn_args, **kwargs})
        check_aggregation_contract(loss)  # refused here, at construction, never at the first step
        return loss

    def build_advantage_fn(self):
        return build_component(ADVANTAGE_FN, self.advantage_fn, self.advantage_fn_args)

    def build_kl_loss(self):
        return build_component(KL_FN, self.kl_loss_fn, self.kl_loss_fn_args)

    def build_kl_penalty(self):
        return build_component(KL_FN, self.kl_penalty_fn, self.kl_penalty_fn_args)

    def build_entropy_loss(self):
        return build_component(ENTROPY_LOSS_FN, self.entropy_loss_fn, self.entropy_loss_fn_args)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_algorithm_config(
    algorithm: str,
    *,
    merge_args: bool = False,
    force_loss_agg_mode: bool = False,
    policy_loss_fn: str | None = None,
    policy_loss_fn_args: dict[str, Any] | None = None,
    advantage_fn: str | None = None,
    advantage_fn_args: dict[str, Any] | None = None,
    kl_penalty_fn: str | None = None,
    kl_penalty_fn_args: dict[str, Any] | None = None,
    kl_loss_fn: str | None = None,
    kl_loss_fn_args: dict[str, Any] | None = None,
    entropy_loss_fn: str | None = None,
    entropy_loss_fn_args: dict[str, Any] | None = None,
    loss_agg_mode: str | None = None,
    sample_strategy: str | None = None,
    repeat_times: int | None = None,
    construct: bool = True,
) -> AlgorithmConfig:
    """Resolve a preset plus user overrides into concrete components (docs/algorithms/presets.md#resolution).

    1. Fields left ``None`` take the preset's value, else `GLOBAL_DEFAULTS`.
    2. A component without a user args dict uses its ``default_args()`` (or the preset's args
       for that same component). A user args dict **replaces** ``default_args()`` (reference
       behaviour; missing keys fall back to constructor defaults) unless ``merge_args=True``, in
       which case it is laid over ``default_args()`` (a user ``clip_range`` then also replaces the
       default ``clip_range_low``/``clip_range_high``, so it is never silently overridden).
    3. If ``loss_agg_mode`` is a key of the policy-loss args, the global ``loss_agg_mode`` wins. With
       ``force_loss_agg_mode=True`` it also wins when the key is absent (a ``replace``-mode args dict
       without it), for every loss that takes an aggregation mode, so the policy loss always
       aggregates like the KL and entropy terms (Trinity keeps the loss's constructor default then).
    4. Preset-specific checks (DPO forces ``repeat_times=2`` and a KL loss).

    Every name is checked against its registry, and (``construct=True``) every component is constructed once so
    that invalid arguments fail here, not in the first training step. A trainer resolves its validated config
    with ``construct=False`` and builds its components itself, once.
    """
    preset = ALGORITHM_TYPE.get(algorithm)
    preset_cfg = preset.default_config()
    user = {
        "policy_loss_fn": policy_loss_fn,
        "advantage_fn": advantage_fn,
        "kl_penalty_fn": kl_penalty_fn,
        "kl_loss_fn": kl_loss_fn,
        "entropy_loss_fn": entropy_loss_fn,
        "loss_agg_mode": loss_agg_mode,
        "sample_strategy": sample_strategy,
        "repeat_times": repeat_times,
    }
    user_args = {
        "policy_loss_fn": policy_loss_fn_args,
        "advantage_fn": advantage_fn_args,
        "kl_penalty_fn": kl_penalty_fn_args,
        "kl_loss_fn": kl_loss_fn_args,
        "entropy_loss_fn": entropy_loss_fn_args,
    }
    config: dict[str, Any] = {}
    for key, value in user.items():
        if value is not None:
            config[key] = value
        elif key in preset_cfg:
            config[key] = preset_cfg[key]
        else:
            config[key] = GLOBAL_DEFAULTS.get(key)
    check_loss_agg_mode(config["loss_agg_mode"])
    preset.check_config(config)

    for key, registry in COMPONENTS.items():
        name = config[key]
        cls = registry.get(name)  # unknown name -> ValueError listing known names
        given = user_args[key]
        if given is not None and not isinstance(given, dict):
            raise ValueError(f"{key}_args must be a dict, got {type(given).__name__}")
        if given is not None:
            given = rename_trl_arguments(registry.kind, name, cls, given)
        if given is None:
            preset_args = preset_cfg.get(f"{key}_args") if preset_cfg.get(key) == name else None
            args = dict(preset_args) if preset_args is not None else cls.default_args()
        elif merge_args:
            defaults = cls.default_args()
            if "clip_range" in given:
                # a user's symmetric clip_range must not lose to default specific bounds (GSPO's 3e-4/4e-4)
                defaults.pop("clip_range_low", None)
                defaults.pop("clip_range_high", None)
            args = {**defaults, **given}
        else:
            args = dict(given)
        config[f"{key}_args"] = args

    policy_args = config["policy_loss_fn_args"]
    accepts_mode = "loss_agg_mode" in inspect.signature(POLICY_LOSS_FN.get(config["policy_loss_fn"])).parameters
    if "loss_agg_mode" in policy_args or (force_loss_agg_mode and accepts_mode):
        policy_args["loss_agg_mode"] = config["loss_agg_mode"]

    advantage_cls = ADVANTAGE_FN.get(config["advantage_fn"])
    if preset.uses_advantage and advantage_cls.compute_in_trainer() != preset.compute_advantage_in_trainer:
        where = "in the trainer on padded batches" if preset.compute_advantage_in_trainer else "on experience groups"
        raise ValueError(
            f"algorithm {algorithm!r} computes advantages {where}, but advantage={config['advantage_fn']!r} "
            f"is a {'batch' if advantage_cls.compute_in_trainer() else 'group'} function"
        )

    resolved = AlgorithmConfig(
        algorithm=algorithm,
        use_critic=preset.use_critic,
        compute_advantage_in_trainer=preset.compute_advantage_in_trainer,
        can_balance_batch=preset.can_balance_batch,
        schema=preset.schema,
        uses_advantage=preset.uses_advantage,
        **config,
    )
    if not construct:
        return resolved
    # construct every component once so bad arguments fail at resolution time
    resolved.build_policy_loss()
    resolved.build_kl_loss()
    resolved.build_kl_penalty()
    resolved.build_entropy_loss()
    if preset.uses_advantage:
        resolved.build_advantage_fn()
    return resolved
