"""``TrinityConfig``: a ``GRPOConfig`` whose algorithm is chosen by preset and components."""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from trl import GRPOConfig

from ..algorithms import ALGORITHM_TYPE, GLOBAL_DEFAULTS, POLICY_LOSS_FN, AlgorithmConfig, resolve_algorithm_config
from ..algorithms.component import Component
from ..packing.compiled import check_compile_request
from ..packing.selection import KERNEL_CHOICES as PREFIX_PACKING_KERNELS
from ..training.decoding import COMPILE_GENERATION_CHOICES
from ..training.loss import LOSS_NORMALIZATIONS
from .components import ComponentsBuiltOnce, component_fields
from .machine import MachineFields
from .spellings import RefusesRemovedSpellings, flat_component_spellings

# GRPOConfig fields that TRL's built-in loss or advantage uses and that trinity_trl replaces by a
# component. Each non-default value is rejected with the way to get the same effect here, so no
# option is silently ignored. Every other GRPOConfig field is honoured by TRL/transformers as usual
# (tests/trainers/test_config.py walks all fields to keep this list complete).
REPLACED_GRPO_FIELDS: dict[str, str] = {
    "beta": "TRL's k3 KL; use kl_loss={'name': 'k3', 'kl_coef': ...} (or any KL)",
    "loss_type": "TRL's loss; choose policy_loss (or an algorithm preset) and loss_agg_mode",
    "epsilon": "TRL's relative clip bound, accepted for losses with the same bounds (ppo, gspo, mix, mix_chord) as "
    "clip_range; for this loss use policy_loss={...} (see its arguments)",
    "epsilon_high": "TRL's upper clip, accepted for losses with relative bounds (ppo, gspo, mix, mix_chord) as "
    "clip_range_high; TRL's CISPO cap is absolute: use clip_range_high = epsilon_high - 1",
    "delta": "TRL's two-sided clip; use policy_loss={'clip_ratio_c': ...} (dual clip, ppo)",
    "importance_sampling_level": "sequence-level ratios; use policy_loss='gspo' (algorithm='gspo')",
    "scale_rewards": "reward normalisation; use advantage={'std_cal_level': 'batch'} for grpo",
    "multi_objective_aggregation": "reward normalisation is done by the advantage on the weighted reward sum",
    "vespo_k_pos": "VESPO is not a trinity_trl loss; choose another policy_loss",
    "vespo_lambda_pos": "VESPO is not a trinity_trl loss; choose another policy_loss",
    "vespo_k_neg": "VESPO is not a trinity_trl loss; choose another policy_loss",
    "vespo_lambda_neg": "VESPO is not a trinity_trl loss; choose another policy_loss",
    "top_entropy_quantile": "TRL's entropy token mask is not applied by trinity_trl losses; entropy terms are "
    "entropy_loss",
    "entropy_coef": "use entropy_loss={'entropy_coef': ...}",
    "use_adaptive_entropy": "adaptive entropy is TRL's; use entropy_loss={'entropy_coef': ...}",
    "entropy_coef_min": "only used by TRL's adaptive entropy; use entropy_loss={'entropy_coef': ...}",
    "entropy_coef_max": "only used by TRL's adaptive entropy; use entropy_loss={'entropy_coef': ...}",
    "entropy_coef_delta": "only used by TRL's adaptive entropy; use entropy_loss={'entropy_coef': ...}",
    "entropy_target": "only used by TRL's adaptive entropy; use entropy_loss={'entropy_coef': ...}",
    "off_policy_mask_threshold": (
        "use policy_loss={'enable_sequence_masking': True, 'delta_sequence_masking': ...} (ppo)"
    ),
    "use_bias_correction_kl": "only applies to TRL's built-in KL (beta); kl_loss='corrected_k3' is the "
    "ratio-corrected k3",
    "sapo_temperature_pos": "only used with policy_loss='sapo' (becomes tau_pos)",
    "sapo_temperature_neg": "only used with policy_loss='sapo' (becomes tau_neg)",
}
# The GRPOConfig fields above that a policy loss may declare as its own (PolicyLossFn.trl_config_fields)
# are passed to it; see docs/configuration.md#trls-names.

#: what an unset ``kl_loss`` / ``kl_penalty`` resolves to in a trainer config: TRL's ``beta=0.0`` means no KL term,
#: and a trainer config keeps that meaning for every preset (CHORD's released configuration uses none either). A
#: preset's Trinity-RFT default (``k2``, ``kl_coef`` 0.001 for most) stays in its ``default_config()``
#: (`trinity_trl.algorithms.presets`) and comes back when the config names a KL: ``kl_loss="k2"``
#: (docs/configuration.md#kl).
NO_KL = "none"

# the component fields of a config, each a `Component` and the field of the same name of the resolved algorithm
COMPONENT_FIELDS = ("policy_loss", "advantage", "kl_loss", "kl_penalty", "entropy_loss")
ARGS_MODES = ("merge", "replace")


class ShowsWhatTrains:
    """Mixin of the trainer configs: the repr shows what a run of the config trains with (`shown_settings`): the
    preset, each component as it is built, the aggregation, this package's options that are set and the TRL options
    that differ from TRL's defaults, rather than the ~200 fields as given (where ``kl_loss=None`` would hide which KL
    the preset resolves to)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # ``@dataclass`` writes a field-by-field ``__repr__`` into every class it decorates unless the class defines
        # one itself; defining it on each subclass here (before the decorator runs) keeps this one for all of them,
        # users' subclasses included
        cls.__repr__ = ShowsWhatTrains.__repr__

    def __repr__(self) -> str:
        try:
            shown = shown_settings(self)
        except Exception as err:  # noqa: BLE001 - a config changed after it was checked: say so, never fail a repr
            return f"{type(self).__name__}(<does not resolve: {err}>)"
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in shown.items())})"

    __str__ = __repr__


def shown_settings(config: Any) -> dict[str, Any]:
    """What a run of the trainer config ``config`` trains with, in the order `--print_config`, the config's repr and
    the tests show it:

    * ``algorithm``, then each component field of the config as the config builds it (`Component`, every argument
      resolved); a component that is off (``kl_loss``, ``kl_penalty``, ``entropy_loss`` named ``none``) as
      ``Component("none")``; ``advantage`` only for presets that compute one; then ``loss_agg_mode``;
    * this package's other options that differ from their defaults (``prefix_packing``, ``expert_batch_size``, ...);
    * the fields of TRL's config class (``GRPOConfig``, ``SFTConfig``, ``DPOConfig``) that differ from TRL's own
      defaults (`changed_trl_fields`), ``output_dir`` always.
    """
    from ..algorithms import ADVANTAGE_FN, ENTROPY_LOSS_FN, KL_FN

    algorithm = config.resolved_algorithm()
    own = _own_fields(type(config))
    shown: dict[str, Any] = {"algorithm": algorithm.algorithm}
    registries = {"kl_loss": KL_FN, "kl_penalty": KL_FN, "entropy_loss": ENTROPY_LOSS_FN, "advantage": ADVANTAGE_FN}
    for name in COMPONENT_FIELDS:
        if name not in own:
            continue
        if name == "advantage" and not algorithm.uses_advantage:
            continue
        component = getattr(algorithm, name)
        off = name in ("kl_loss", "kl_penalty", "entropy_loss") and not registries[name].get(component.name).enabled
        shown[name] = Component(component.name) if off else component
    shown["loss_agg_mode"] = algorithm.loss_agg_mode
    for f in fields(config):
        if f.name in own and f.init and f.name not in shown and f.name not in COMPONENT_FIELDS:
            value = getattr(config, f.name)
            if value != _declared_default(f):
                shown[f.name] = value
    return shown | changed_trl_fields(config)


def changed_trl_fields(config: Any) -> dict[str, Any]:
    """The fields of the TRL config class ``config`` extends (or is) whose values differ from that class's defaults,
    ``{name: value}`` in field order, ``output_dir`` first. TRL's defaults are those of an instance built on this
    machine, so a default TRL resolves when the config is built (``bf16``, ``activation_checkpointing``) counts with
    its resolved value; ``use_cpu`` is compared with its declared default, and what TrainingArguments derives from
    it (`_SET_FROM_USE_CPU`) with the derived value only when ``use_cpu`` is set."""
    trl_base = _trl_base(type(config))
    defaults, own = _trl_defaults(trl_base), _own_fields(type(config))
    changed = {"output_dir": config.output_dir}
    for f in fields(trl_base):
        if not f.init or f.name in own or f.name == "output_dir":
            continue
        declared = f.name == "use_cpu" or (f.name in _SET_FROM_USE_CPU and not config.use_cpu)
        if f.name in _RESOLVED_FROM_LOGGING:
            default = _RESOLVED_FROM_LOGGING[f.name]()
        else:
            default = _declared_default(f) if declared else defaults[f.name]
        if getattr(config, f.name) != default:
            changed[f.name] = getattr(config, f.name)
    return changed


def _tqdm_off_by_logging() -> bool:
    import logging

    from transformers.training_args import logger

    return logger.getEffectiveLevel() > logging.WARN


# what TrainingArguments resolves from transformers' logging level when left unset: compared with the level now, not
# with the cached reference instance's (built under whatever level was set then: a config built after
# ``transformers.logging.set_verbosity_error()`` would otherwise show ``disable_tqdm=True`` as a change)
_RESOLVED_FROM_LOGGING = {"disable_tqdm": _tqdm_off_by_logging}

# what TrainingArguments sets from use_cpu=True (the reference instance of `_trl_defaults` is built with it)
_SET_FROM_USE_CPU = ("dataloader_pin_memory",)


@functools.cache
def _trl_defaults(trl_base: type) -> dict[str, Any]:
    """``{field: TRL's default}`` of the TRL config class ``trl_base``: the values of an instance built on this
    machine (with ``use_cpu=True``: TrainingArguments refuses its own bf16 default without a GPU otherwise)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference instance's own deprecation or device notices
        default = trl_base(output_dir="trl-defaults", use_cpu=True)
    return {f.name: getattr(default, f.name) for f in fields(trl_base) if f.init}


def _own_fields(config_class: type) -> set[str]:
    """The fields of ``config_class`` that are not TRL's: its own, and TRL's that it declares anew with another
    default (TrinityConfig's ``epsilon``, ``None``: the loss's own bound)."""
    trl = {f.name: f for f in fields(_trl_base(config_class))}
    return {
        f.name
        for f in fields(config_class)
        if f.name not in trl or _declared_default(f) != _declared_default(trl[f.name])
    }


def _declared_default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def _field_default(config_class: type, name: str) -> Any:
    for f in fields(config_class):
        if f.name == name:
            return f.default
    raise KeyError(name)


@dataclass
class AlgorithmFields(ShowsWhatTrains, ComponentsBuiltOnce, RefusesRemovedSpellings):
    """The algorithm part of a trainer config: the preset, its components and how their losses are aggregated and
    normalised, with the checks and the resolution (`resolved_algorithm`) every such config shares.

    [`TrinityConfig`][] (on TRL's ``GRPOConfig``) and the asynchronous trainers' configs (on TRL's
    ``AsyncGRPOConfig``, `trinity_trl.trainers.async_trinity`) take these fields from here, so an algorithm is
    configured the same way (Python, YAML, command line) whichever TRL trainer runs it. A config calls
    `check_algorithm_fields` at the end of its ``__post_init__``. ``replaced_fields`` lists the fields of the config's
    TRL base whose job a component does (a non-default value is refused with the replacement named).
    """

    replaced_fields: ClassVar[dict[str, str]] = {}

    removed_spellings = flat_component_spellings(*COMPONENT_FIELDS)

    algorithm: str = field(
        default="grpo", metadata={"help": "Algorithm preset (one of the 19 Trinity presets, or 'gigpo')."}
    )
    policy_loss: dict | str | None = field(
        default=None,
        metadata={
            "help": "The policy loss and its arguments: a name ('cispo') or {name: cispo, clip_range_high: 5.0} "
            "(YAML; JSON on the command line), or one argument: --policy_loss.clip_range_high 5.0. "
            "Unset name or arguments: the preset's."
        },
    )
    advantage: dict | str | None = field(
        default=None,
        metadata={"help": "The advantage function and its arguments, e.g. {name: grpo, epsilon: 1e-6}."},
    )
    kl_loss: dict | str | None = field(
        default=None,
        metadata={"help": "The KL estimator added to the loss and its arguments, e.g. {name: k3, kl_coef: 0.001}."},
    )
    kl_penalty: dict | str | None = field(
        default=None,
        metadata={"help": "The KL estimator subtracted from token rewards, e.g. {name: k2, kl_coef: 0.01}."},
    )
    entropy_loss: dict | str | None = field(
        default=None,
        metadata={"help": "The entropy term and its arguments, e.g. {name: default, entropy_coef: 0.001}."},
    )
    loss_agg_mode: str | None = field(default=None, metadata={"help": "Loss aggregation mode (default token-mean)."})
    epsilon: float | None = field(
        default=None,
        metadata={
            "help": "TRL's lower clip bound 1 - epsilon; for ppo, gspo, mix and mix_chord the same as "
            "policy_loss.clip_range (None: the loss's own default)."
        },
    )
    component_args_mode: str = field(
        default="merge",
        metadata={"help": "'merge' a component's arguments over its default_args() or 'replace' them (Trinity)."},
    )
    loss_normalization: str = field(
        default="micro_batch",
        metadata={
            "help": "'micro_batch' (Trinity: token-mean per micro-batch, then / gradient_accumulation_steps) "
            "or 'global' (token-mean terms divided by the global token count of the optimizer step)."
        },
    )

    def check_algorithm_fields(self) -> None:
        """Read and check the algorithm fields, then build the components (bad names and arguments fail here), once:
        the trainer takes them. The config's ``__post_init__`` calls it after TRL's."""
        component_fields(self, COMPONENT_FIELDS)
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(
                f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, got {self.loss_normalization!r}"
            )
        if self.component_args_mode not in ARGS_MODES:
            raise ValueError(f"component_args_mode must be one of {ARGS_MODES}, got {self.component_args_mode!r}")
        ALGORITHM_TYPE.get(self.algorithm)  # unknown preset -> ValueError listing the presets
        self._check_replaced_fields()
        self._check_own_fields()
        self.check_components()

    def to_dict(self) -> dict[str, Any]:
        """TrainingArguments' dict (logged, saved as JSON) with each component in its YAML spelling."""
        out = super().to_dict()
        for name in COMPONENT_FIELDS:
            if isinstance(out.get(name), Component):
                out[name] = out[name].to_dict()
        return out

    def _check_own_fields(self) -> None:
        """Hook for subclasses: check their own fields, after TRL's and before the components are built."""

    def _implied_components(self) -> dict[str, Component]:
        """Hook for subclasses: the components their own options imply, ``{field: Component}``. A name applies
        when the user chose none; the arguments are laid over the user's (the same argument set to another value
        on both sides is an error)."""
        return {}

    def _check_replaced_fields(self) -> None:
        own = POLICY_LOSS_FN.get(self._policy_loss_name()).trl_config_fields
        for name, replacement in self.replaced_fields.items():
            value, default = getattr(self, name), _field_default(type(self), name)
            if (name == "scale_rewards" and value == "group") or name in own:
                continue
            if value != default:
                raise ValueError(
                    f"{type(self).__name__}: {name}={value!r} is not used by trinity_trl ({replacement}). "
                    f"Leave it at its default ({default!r})."
                )

    def _trl_field_arguments(self) -> Component:
        """The TRL fields the user set that mean an argument of the policy loss, as that loss's arguments
        (``epsilon_high=0.3`` -> ``Component(clip_range_high=0.3)``); conflicting values are an error."""
        own = POLICY_LOSS_FN.get(self._policy_loss_name()).trl_config_fields
        given = self.policy_loss.args if self.policy_loss is not None else {}
        arguments: dict[str, Any] = {}
        for trl, ours in own.items():
            if not hasattr(self, trl):  # a TRL field this config does not have (the asynchronous configs')
                continue
            value = getattr(self, trl)
            if value == _field_default(type(self), trl):
                continue
            if ours in given and given[ours] != value:
                raise ValueError(
                    f"{trl}={value} (the policy loss's {ours}) conflicts with policy_loss.{ours}={given[ours]}; "
                    "set it in one place"
                )
            arguments[ours] = value
        return Component(**arguments)

    def _policy_loss_name(self) -> str:
        chosen = self.policy_loss.name if self.policy_loss is not None else None
        return chosen or preset_component(self.algorithm, "policy_loss").name

    def component_name(self, name: str) -> str | None:
        """The name the user chose for component ``name`` (``"advantage"``, ...), ``None`` for the preset's."""
        value = getattr(self, name)
        return value.name if value is not None else None

    def _chosen(self, name: str, implied: dict[str, Component]) -> Component | None:
        """The user's component ``name`` with what this config's own options imply laid over it."""
        given, extra = getattr(self, name), implied.get(name)
        if extra is None:
            return given
        if given is None:
            return extra
        clash = {k for k in extra.args if k in given.args and given.args[k] != extra.args[k]}
        if clash:
            raise ValueError(
                f"{name} sets {sorted(clash)}, which {type(self).__name__} also sets from its own fields "
                f"({ {k: extra.args[k] for k in sorted(clash)} }); set them in one place"
            )
        return Component(given.name or extra.name, **{**given.args, **extra.args})

    def resolved_algorithm(self) -> AlgorithmConfig:
        """The algorithm with every component and argument resolved (docs/algorithms/presets.md#resolution): each
        component the `Component` you gave (with what this config's own options imply), its name and arguments
        completed from the preset. Nothing is built (`take_components` hands the trainer the built components)."""
        implied = self._implied_components()
        trl_arguments = self._trl_field_arguments()
        if trl_arguments.args:
            implied = {
                **implied,
                "policy_loss": (implied.get("policy_loss") or Component()).with_args(**trl_arguments.args),
            }
        kl = {name: self._chosen(name, implied) for name in ("kl_loss", "kl_penalty")}
        resolved = resolve_algorithm_config(
            self.algorithm,
            merge_args=self.component_args_mode == "merge",
            force_loss_agg_mode=True,
            policy_loss=self._chosen("policy_loss", implied),
            advantage=self._chosen("advantage", implied),
            kl_loss=kl["kl_loss"] or NO_KL,
            kl_penalty=kl["kl_penalty"] or NO_KL,
            entropy_loss=self._chosen("entropy_loss", implied),
            loss_agg_mode=self.loss_agg_mode,
        )
        for name, chosen in kl.items():
            if chosen is not None and chosen.name is None and chosen.args and getattr(resolved, name).name == NO_KL:
                raise ValueError(
                    f"{type(self).__name__}: {name} sets {sorted(chosen.args)} but names no KL estimator, and the "
                    f"{self.algorithm!r} preset has none; name one, e.g. {name}={ {'name': 'k2', **chosen.args} }"
                )
        return resolved


COMPILE_GENERATION_HELP = (
    "Decode with transformers' static KV cache and its compilation of the model (CUDA graphs on CUDA): 'auto' (on on "
    "CUDA for one process or DDP, full fine-tuning or LoRA; off elsewhere), 'on' (also on a CPU; refused under "
    "DeepSpeed ZeRO-3, FSDP, quantized or offloaded models) or 'off'. Ignored with vLLM."
)
ONE_PREFILL_PER_GROUP_HELP = (
    "Encode each distinct prompt of a generation batch once (a group's G copies share it) before transformers' "
    "generate samples each copy's completion; the same completions as G prefills up to float rounding."
)


@dataclass
class GenerationFields:
    """How the trainer's transformers generation decodes (`trinity_trl.training.decoding`, docs/generation.md), the
    same fields in every trainer config (synchronous and asynchronous): compiled decoding and one prefill per group.
    A config calls `check_generation_fields` in its ``__post_init__``."""

    compile_generation: str = field(
        default="auto", metadata={"help": COMPILE_GENERATION_HELP, "choices": list(COMPILE_GENERATION_CHOICES)}
    )
    one_prefill_per_group: bool = field(default=True, metadata={"help": ONE_PREFILL_PER_GROUP_HELP})

    def check_generation_fields(self) -> None:
        if self.compile_generation not in COMPILE_GENERATION_CHOICES:
            raise ValueError(
                f"compile_generation must be one of {COMPILE_GENERATION_CHOICES}, got {self.compile_generation!r}"
            )
        if not isinstance(self.one_prefill_per_group, bool):
            raise ValueError(f"one_prefill_per_group must be True or False, got {self.one_prefill_per_group!r}")


@dataclass
class TrinityConfig(MachineFields, AlgorithmFields, GenerationFields, GRPOConfig):
    r"""
    Configuration of [`TrinityTrainer`][]: every
    [`GRPOConfig`](https://huggingface.co/docs/trl/grpo_trainer#trl.GRPOConfig) option, plus the algorithm.

    The algorithm is a preset (`algorithm`) whose components can be replaced one by one. Resolution
    follows Trinity-RFT: an unset component takes the preset's choice, then the global default;
    a component without an args dict uses its `default_args()`.

    Parameters:
        algorithm (`str`, *optional*, defaults to `"grpo"`):
            One of the 19 presets: `sft`, `ppo`, `grpo`, `reinforceplusplus`, `rloo`, `opmd`, `asymre`,
            `dpo`, `topr`, `cispo`, `gspo`, `sapo`, `mix`, `mix_chord`, `raft`, `sppo`, `rec`,
            `multi_step_grpo`, `on_policy_distill`; or `gigpo` (multi-step runs: [`StepGRPOTrainer`][]).
        policy_loss (`str`, `dict`, `Component` or `None`, *optional*):
            The policy loss and its arguments, in one value: a name (`"cispo"`), a mapping
            `{"name": "cispo", "clip_range_high": 5.0}` (YAML `policy_loss: {name: cispo, clip_range_high: 5.0}`,
            a JSON object on the command line, or one argument at a time: `--policy_loss.clip_range_high 5.0`)
            or `Component("cispo", clip_range_high=5.0)`. Without `name` the preset's loss is kept. The
            arguments are checked against the loss's constructor (unknown names and wrong types are errors
            listing the allowed arguments); TRL's names of them (`epsilon`, `epsilon_high`) are accepted.
        advantage (`str`, `dict`, `Component` or `None`, *optional*): The advantage function, likewise
            (e.g. `{"name": "grpo", "std_threshold": 0.0}`).
        kl_loss (`str`, `dict`, `Component` or `None`, *optional*): The KL estimator added to the loss
            (`none`, `k1`, `k2`, `k3`, `low_var_kl`, `abs`, `corrected_k3`), e.g. `{"name": "k3", "kl_coef": 0.001}`.
        kl_penalty (`str`, `dict`, `Component` or `None`, *optional*): The KL estimator subtracted from token
            rewards before trainer-side advantages (presets `reinforceplusplus`, `rloo`, `on_policy_distill`),
            e.g. `{"kl_coef": 0.01, "adaptive": True, "target_kl": 0.1, "horizon": 10000}`.
        entropy_loss (`str`, `dict`, `Component` or `None`, *optional*): `default`, `mix` or `none`, e.g.
            `{"entropy_coef": 0.001}`.
        loss_agg_mode (`str` or `None`, *optional*):
            `token-mean` (default), `seq-mean-token-sum`, `seq-mean-token-mean` or
            `seq-mean-token-sum-norm`. It also overrides the policy loss's own mode, and the KL and
            entropy terms use it.
        loss_normalization (`str`, *optional*, defaults to `"micro_batch"`):
            How `token-mean` terms are normalised. `"micro_batch"` (Trinity-RFT, verl): each micro-batch's
            token mean, divided by `gradient_accumulation_steps`; micro-batches and processes with fewer
            tokens then weigh their tokens more. `"global"`: every token of the optimizer step weighs the
            same, across micro-batches and processes (like TRL's `dapo`), so N processes give exactly the
            gradients of one. For the `seq-mean-*` modes the same holds per sample (row, or turn in
            StepGRPO); `seq-mean-token-sum-norm` is always per micro-batch.
        prefix_packing (`bool`, *optional*, defaults to `True`):
            Forward the rows of each micro-batch (and of the behaviour, reference, teacher and critic
            passes) as one packed row in which each shared prefix (a group's prompt, earlier turns, a
            common system prompt) is encoded once and no padding is forwarded. Log-probs, loss and
            gradients equal those of TRL's padded rows up to float rounding. Models or inputs the
            packed forward does not support (docs/prefix-packing.md) run padded, with one log line saying why.
        prefix_packing_max_token_ratio (`float`, *optional*, defaults to `0.9`):
            Pack a forward only when the packed row holds at most this fraction of the tokens of the
            padded rows; with less to save, the padded forward is as fast.
        prefix_packing_kernel (`str`, *optional*, defaults to `"auto"`):
            The tree-attention kernel of packed forwards: `"auto"`, `"varlen"` (torch's `varlen_attn`, CUDA,
            fp16/bf16, torch >= 2.10), `"flash_attn"` (FlashAttention 2 installed, CUDA, fp16/bf16), `"flex"`
            (FlexAttention, CUDA) or `"sdpa_segments"` (one SDPA per prefix-tree node: the CPU kernel).
            `"auto"` uses `sdpa_segments` on CPU; on CUDA `flash_attn` or `varlen` (never `flex`, which compiles),
            kept only for the shapes where it times faster than the padded forward on the same first
            micro-batches (one log line each), else the padded forward. A forced kernel that cannot run on the
            device is an error.
        prefix_packing_whole_groups (`bool` or `None`, *optional*, defaults to `None`):
            Shuffle each generation batch by groups rather than by rows (TRL), so that a micro-batch holds
            whole groups and packing shares their prompts (`per_device_train_batch_size` a multiple of
            `num_generations`). `None`: on exactly where the optimizer step's gradient is unchanged by it
            (`loss_normalization="global"`, a `loss_agg_mode` other than `seq-mean-token-sum-norm`,
            `steps_per_generation` above 1 and dividing `gradient_accumulation_steps`), TRL's row shuffle elsewhere.
            `True` turns it on anyway: under `"micro_batch"` each micro-batch's mean then weighs whole groups, and
            seeded runs change (docs/prefix-packing.md#whole-groups-per-micro-batch). Batches that are not whole
            groups keep TRL's shuffle (one log line where set to `True`).
        prefix_packing_compile (`bool`, *optional*, defaults to `False`):
            Compile the decoder layers for packed training forwards (`torch.compile` with dynamic shapes, the
            inductor backend; generation and padded forwards stay as they are), with the tree attention as one
            custom op, so that a layer compiles once whatever the tree and launches fewer kernels (the packed pass
            at TRL's micro-batch is bound by the host's launches on a GPU). Off until a GPU measurement shows it
            pays (docs/prefix-packing.md#compiled-layers); with `auto` on CUDA the packed passes are timed only
            once compiled. Not under DeepSpeed or FSDP, nor with `torch_compile=True` or `prefix_packing_kernel="flex"`.
        prefix_packing_token_budget (`int` or `None`, *optional*, defaults to `None`):
            Token budget of the packed training forwards, in forwarded packed tokens per forward. The micro-batches
            of one optimizer step (gradient accumulation, `steps_per_generation` above 1; within one generation
            batch) are forwarded in as few packed forwards as the budget allows, with the gradient of the unmerged
            micro-batches (each normalised as alone). `None`: the tokens of TRL's padded micro-batch
            (`per_device_train_batch_size` rows times the padded width); `0`: off, one forward per micro-batch.
            Under DeepSpeed, FSDP and with CHORD's expert rows the default is off (one log line) and a set budget
            is an error (docs/prefix-packing.md#token-budget).
        component_args_mode (`str`, *optional*, defaults to `"merge"`):
            How a component value's arguments combine with the component's `default_args()`: `"merge"` lays
            your keys over the defaults (so `policy_loss={"clip_range_high": 0.28}` keeps `clip_range=0.2`);
            `"replace"` uses your arguments alone, as Trinity-RFT does.
        compile_generation (`str`, *optional*, defaults to `"auto"`):
            Decode with transformers' static KV cache and its own compilation of the model's forward
            (`torch.compile`; CUDA graphs on CUDA). `"auto"`: on on CUDA in one process or DDP, full fine-tuning or
            LoRA; off on a CPU (where it does not pay) and where it cannot run. `"on"`: also on a CPU; an error under
            DeepSpeed ZeRO-3, FSDP, with a quantized model or layers offloaded to the CPU. `"off"`: TRL's eager
            decoding. With vLLM or continuous batching it does nothing (one log line when set to `"on"`). The cache's
            length is fixed once per run (docs/generation.md#compiled-decoding).
        one_prefill_per_group (`bool`, *optional*, defaults to `True`):
            Encode each distinct prompt of a generation batch once, not once per copy: the group's G rows start from
            one shared KV cache, each encodes its prompt's last token and samples its own completion (the same
            completions as separate prefills, up to float rounding). Transformers generation only: vLLM and continuous
            batching share prompts their own way.

    TRL options whose job a component takes over (`beta`, `loss_type`, `epsilon`, `epsilon_high`,
    `delta`, `importance_sampling_level`, `scale_rewards`, `multi_objective_aggregation`,
    `entropy_coef` and the adaptive-entropy options, `top_entropy_quantile`,
    `off_policy_mask_threshold`, `use_bias_correction_kl`, the VESPO options) must keep their
    defaults: a different value raises an error that names the replacement.
    Where a TRL field means exactly an argument of the policy loss, it is accepted and passed on:
    `epsilon` / `epsilon_high` (relative clip bounds of `ppo`, `gspo`, `mix`, `mix_chord`: `clip_range` /
    `clip_range_high`) and `sapo_temperature_pos` / `_neg` (`sapo`: `tau_pos` / `tau_neg`).
    """

    replaced_fields = REPLACED_GRPO_FIELDS

    prefix_packing: bool = field(
        default=True,
        metadata={
            "help": "Forward each distinct token of a micro-batch once (shared prompts, no padding); same "
            "log-probs and gradients as padded rows. Unsupported models run padded."
        },
    )
    prefix_packing_max_token_ratio: float = field(
        default=0.9,
        metadata={"help": "Pack a forward only if the packed row has at most this fraction of the padded tokens."},
    )
    prefix_packing_kernel: str = field(
        default="auto",
        metadata={
            "help": "Tree-attention kernel of packed forwards: auto, varlen, flash_attn, flex or sdpa_segments. "
            "auto: sdpa_segments on CPU; on CUDA flash_attn or varlen (never flex) only where it times faster than "
            "padded rows."
        },
    )
    prefix_packing_whole_groups: bool | None = field(
        default=None,
        metadata={
            "help": "Shuffle generation batches by groups, not rows, so micro-batches hold whole groups. None: on "
            "only where the step's gradient is unchanged (global normalisation, whole generation batches per step)."
        },
    )

    prefix_packing_compile: bool = field(
        default=False,
        metadata={
            "help": "Compile the decoder layers for packed training forwards (torch.compile, dynamic shapes; the tree "
            "attention as one custom op): fewer kernel launches. Off until measured faster on a GPU."
        },
    )

    # token-budget micro-batches (training/token_budget.py)
    prefix_packing_token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of packed training forwards, in forwarded packed tokens per forward: the micro-"
            "batches of an optimizer step share as few packed forwards as it allows (same gradient). None: the "
            "tokens of TRL's padded micro-batch (per_device_train_batch_size x padded width); 0: off."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.prefix_packing_max_token_ratio <= 1.0:
            raise ValueError(
                f"prefix_packing_max_token_ratio must be in (0, 1], got {self.prefix_packing_max_token_ratio!r}"
            )
        if self.prefix_packing_kernel not in PREFIX_PACKING_KERNELS:
            raise ValueError(
                f"prefix_packing_kernel must be one of {PREFIX_PACKING_KERNELS}, got {self.prefix_packing_kernel!r}"
            )
        if not self.prefix_packing and self.prefix_packing_kernel != "auto":
            raise ValueError(
                f"prefix_packing_kernel={self.prefix_packing_kernel!r} has no effect with prefix_packing=False"
            )
        _check_token_budget(self.prefix_packing_token_budget, self.prefix_packing)
        self.check_generation_fields()
        check_compile_request(self.prefix_packing_compile, self.prefix_packing, self.prefix_packing_kernel, self)
        self.check_algorithm_fields()  # builds the components now (bad names and arguments fail here), once


def _check_token_budget(budget: int | None, prefix_packing: bool) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ValueError(f"prefix_packing_token_budget must be None, 0 (off) or a number of tokens, got {budget!r}")
    if budget and not prefix_packing:
        raise ValueError(f"prefix_packing_token_budget={budget} has no effect with prefix_packing=False")


def preset_component(algorithm: str, name: str) -> Component:
    """The component ``name`` that preset ``algorithm`` sets, else the global default's."""
    return ALGORITHM_TYPE.get(algorithm).default_config().get(name) or Component(GLOBAL_DEFAULTS[name])


def _trl_base(config_class: type) -> type:
    """The TRL config class that ``config_class`` extends (``GRPOConfig``, ``SFTConfig``, ``DPOConfig``)."""
    return next(c for c in config_class.__mro__ if c.__module__.split(".")[0] == "trl")


def from_trl_config(args: Any, config_class: type, trainer: str) -> Any:
    """``args`` as a ``config_class``: returned as it is when it already is one; a plain TRL config of the class
    ``config_class`` extends (``GRPOConfig`` for the RL trainers, ``SFTConfig`` / ``DPOConfig`` for the SFT / DPO
    trainers) is converted, keeping every field the user set (each one that differs from that TRL class's
    default). ``config_class`` then checks them as it checks its own: a TRL option whose job a trinity_trl
    component does (``beta``, ``loss_type``, ...) is refused with its replacement named. Anything else is a
    ``TypeError``."""
    trl_base = _trl_base(config_class)
    if isinstance(args, config_class) or not isinstance(args, trl_base):
        if args is not None and not isinstance(args, config_class):
            raise TypeError(
                f"{trainer} needs a {config_class.__name__} (or TRL's {trl_base.__name__}), got {type(args).__name__}"
            )
        return args
    if type(args).__module__.split(".")[0] != "trl":  # another trinity_trl config, or a user's subclass
        raise TypeError(
            f"{trainer} needs a {config_class.__name__} or a plain TRL {trl_base.__name__}, got {type(args).__name__}"
        )
    given = changed_trl_fields(args)
    try:
        return config_class(**given)
    except ValueError as err:
        raise ValueError(f"{trainer} with TRL's {trl_base.__name__}: {err}") from err
