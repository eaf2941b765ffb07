"""MIX: PPO on on-policy rows plus SFT on expert rows, per-sample normalised (docs/algorithms/chord.md).

Both MIX and CHORD (``chord.py``) weigh each usual (on-policy) sample by ``w_u`` and each expert
sample by ``w_e``. A trainer gives these per-sample weights directly (``usual_sample_weight``,
``expert_sample_weight``); Trinity's configuration gives its batch geometry instead
(``ppo_mini_batch_size``, ``train_batch_size_usual``, ...), from which `BatchGeometry` derives
them with the formula of docs/algorithms/chord.md#normalisation.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..masked import check_loss_agg_mode
from .base import POLICY_LOSS_FN, PolicyLossFn, RowClass


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
    return value


def _unit_interval(owner: str, name: str, value: Any) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}: {name} must be in [0, 1], got {value!r}")
    return float(value)


def _positive_float(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _floor_quotient(numerator: str, denominator: str) -> property:
    """A `BatchGeometry` property: the floor division of two of its counts (as the reference derives them)."""
    return property(
        lambda geometry: getattr(geometry, numerator) // getattr(geometry, denominator),
        doc=f"``{numerator} // {denominator}``",
    )


@dataclass(frozen=True)
class BatchGeometry:
    """Trinity's batch geometry of a MIX/CHORD run (docs/algorithms/chord.md#normalisation), and the per-sample weights
    it implies.

    Args:
        use_dynamic_bsz: whether micro-batches have a variable number of rows (verl's dynamic batch
            size); the weights then depend on the row count of each micro-batch.
        ppo_mini_batch_size: samples per optimizer step (Trinity passes the global count).
        ppo_micro_batch_size_per_gpu: rows per micro-batch on one GPU (fixed-size branch).
        ngpus_trainer: number of training GPUs.
        train_batch_size_usual: usual (on-policy) samples per optimizer step, all GPUs.
        train_batch_size_expert: expert (SFT) samples per optimizer step, all GPUs.

    The derived integers (floor divisions, as in the reference) must all be >= 1.
    """

    use_dynamic_bsz: bool = False
    ppo_mini_batch_size: int = 1
    ppo_micro_batch_size_per_gpu: int = 1
    ngpus_trainer: int = 1
    train_batch_size_usual: int = 1
    train_batch_size_expert: int = 1

    def __post_init__(self) -> None:
        owner = "batch geometry"
        for name in (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ngpus_trainer",
            "train_batch_size_usual",
            "train_batch_size_expert",
        ):
            _positive_int(owner, name, getattr(self, name))
        # a zero here would silently zero a loss or divide by zero at call time
        derived = {
            "train_batch_size_usual // ngpus_trainer": self.usual_per_gpu,
            "train_batch_size_expert // ngpus_trainer": self.expert_per_gpu,
        }
        if self.use_dynamic_bsz:
            derived["ppo_mini_batch_size // ngpus_trainer"] = self.experience_per_gpu
        else:
            derived["ppo_mini_batch_size // ppo_micro_batch_size_per_gpu"] = self.gradient_accumulation
        for name, value in derived.items():
            if value < 1:
                raise ValueError(f"{owner}: {name} must be >= 1, got {value}")

    experience_per_gpu = _floor_quotient("ppo_mini_batch_size", "ngpus_trainer")
    gradient_accumulation = _floor_quotient("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu")
    usual_per_gpu = _floor_quotient("train_batch_size_usual", "ngpus_trainer")
    """``Bu``: usual samples per GPU per optimizer step."""
    expert_per_gpu = _floor_quotient("train_batch_size_expert", "ngpus_trainer")
    """``Be``: expert samples per GPU per optimizer step."""

    def sample_weights(self, rows: int) -> tuple[float, float]:
        """``(w_u, w_e)`` for a micro-batch of ``rows`` rows (``B``, usual and expert together)::

            dynamic batch size:  w_u = experience_per_gpu / (B · Bu),   w_e = experience_per_gpu / (B · Be)
            fixed batch size:    w_u = gradient_accumulation / Bu,      w_e = gradient_accumulation / Be

        With Trinity's trainer scaling (÷ gradient_accumulation, or × B / mini-batch size per GPU),
        each usual sample then weighs ``1/Bu`` and each expert sample ``1/Be`` in the optimizer
        step, whatever the make-up of the micro-batch (docs/algorithms/chord.md#normalisation).
        """
        if self.use_dynamic_bsz:
            return (
                self.experience_per_gpu / (rows * self.usual_per_gpu),
                self.experience_per_gpu / (rows * self.expert_per_gpu),
            )
        return step_sample_weights(self.usual_per_gpu, self.expert_per_gpu, self.gradient_accumulation)


def step_sample_weights(usual: float, expert: float, micro_steps: float) -> tuple[float, float]:
    """``(w_u, w_e) = (micro_steps / usual, micro_steps / expert)``: the per-sample weights that make each usual
    (expert) sample weigh ``1 / usual`` (``1 / expert``) in an optimizer step of ``micro_steps`` micro-batches whose
    losses the trainer divides by ``micro_steps`` (docs/algorithms/chord.md#normalisation).

    ``usual``, ``expert``: the samples of each kind in the optimizer step, as the ``micro_steps`` count them (per
    device: Trinity's ``Bu``, ``Be`` and ``gradient_accumulation``; every process: gradient accumulation times
    processes); a count below 1 counts 1. The one formula of every trainer's weights: `BatchGeometry`'s fixed-size
    branch, [`ChordConfig`][trinity_trl.trainers.ChordConfig] and the asynchronous CHORD trainer's each step.
    """
    return micro_steps / max(usual, 1.0), micro_steps / max(expert, 1.0)


def _of_geometry(name: str) -> property:
    """An `ExpertMixLossFn` property: `BatchGeometry`'s ``name`` of the loss's batch geometry, ``None`` when the loss
    was given explicit sample weights."""
    return property(
        lambda loss: None if loss.geometry is None else getattr(loss.geometry, name), doc=f"`BatchGeometry.{name}`"
    )


class ExpertMixLossFn(PolicyLossFn):
    """Shared machinery of ``mix`` and ``mix_chord``: split rows by ``expert_mask``, run the inner
    PPO loss on usual rows and the inner SFT loss on expert rows, and weigh them ``n_u·w_u`` and
    ``n_e·w_e`` (``n`` = rows of that kind in the micro-batch, ``w`` = per-sample weight).

    The weights come from exactly one of:

    * ``usual_sample_weight`` and ``expert_sample_weight`` (keyword-only, both, each > 0): ``w_u``
      and ``w_e`` as given, whatever the micro-batch. A trainer that divides each micro-batch loss
      by its gradient-accumulation steps ``GA`` gives ``w = GA / samples of that kind per device per
      optimizer step``, so every sample of a kind weighs the same in the step.
    * Trinity's batch-geometry arguments (``use_dynamic_bsz``, ``ppo_mini_batch_size``,
      ``ppo_micro_batch_size_per_gpu``, ``ngpus_trainer``, ``train_batch_size_usual``,
      ``train_batch_size_expert``), turned into weights by `BatchGeometry.sample_weights`. A
      geometry argument left ``None`` takes Trinity's default (``False`` / ``1``); with none given
      and no explicit weights, all are defaults (``w_u = w_e = 1``), as in the reference.

    Giving both forms is a ``ValueError``.

    The inner losses are built from the registry: ``ppo`` with the clip range and
    ``grpo_loss_agg_mode or loss_agg_mode`` (every other PPO argument at its constructor default:
    dual clip 3.0 on, no sequence masking or truncation), and the SFT loss of `build_sft_loss_fn`
    with ``sft_loss_agg_mode or loss_agg_mode``. Each sees only its own rows: ``(n_u, T)`` and
    ``(n_e, T)`` slices of the ``(B, T)`` inputs.
    """

    inputs = ("old_logprob", "action_mask", "advantages", "expert_mask")
    # TRL's epsilon / epsilon_high are the PPO part's relative clip bounds
    trl_config_fields = {"epsilon": "clip_range", "epsilon_high": "clip_range_high"}

    # per-sample weights w_u, w_e over the optimizer step (docs/algorithms/chord.md#normalisation)
    weighs_samples_itself = True
    loss_metric = "loss"

    @classmethod
    def summary_metrics(cls) -> dict[str, tuple[str, ...]]:
        """The RL part on usual rows, the SFT part on expert rows, and μ."""
        return {"rl": ("usual/pg_loss",), "sft": ("expert/sft_loss", "expert/sft_phi_loss"), "mu": ("mu",)}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass declares only its own arguments, ``__init__(self, backend="trl", <its own>, **shared)``, and
        passes ``shared`` on to this class's constructor: its constructor then takes its own arguments and, after
        them, every argument of this one, as one signature (what `argument_types`, ``default_args()`` and positional
        calls see). The shared arguments are declared once, here."""
        init = cls.__dict__.get("__init__")
        if init is not None and "shared" in inspect.signature(init).parameters:
            cls.__init__ = _with_shared_arguments(init)
        super().__init_subclass__(**kwargs)

    def __init__(
        self,
        backend: str = "trl",
        clip_range: float | None = None,
        clip_range_low: float | None = None,
        clip_range_high: float | None = None,
        use_dynamic_bsz: bool | None = None,
        ppo_mini_batch_size: int | None = None,
        ppo_micro_batch_size_per_gpu: int | None = None,
        ngpus_trainer: int | None = None,
        train_batch_size_usual: int | None = None,
        train_batch_size_expert: int | None = None,
        loss_agg_mode: str = "token-mean",
        sft_loss_agg_mode: str | None = None,
        grpo_loss_agg_mode: str | None = None,
        *,
        usual_sample_weight: float | None = None,
        expert_sample_weight: float | None = None,
    ):
        super().__init__(backend)
        owner = type(self).__name__
        geometry = {
            "use_dynamic_bsz": use_dynamic_bsz,
            "ppo_mini_batch_size": ppo_mini_batch_size,
            "ppo_micro_batch_size_per_gpu": ppo_micro_batch_size_per_gpu,
            "ngpus_trainer": ngpus_trainer,
            "train_batch_size_usual": train_batch_size_usual,
            "train_batch_size_expert": train_batch_size_expert,
        }
        given = {name: value for name, value in geometry.items() if value is not None}
        if usual_sample_weight is None and expert_sample_weight is None:
            if "use_dynamic_bsz" in given:
                given["use_dynamic_bsz"] = bool(given["use_dynamic_bsz"])
            try:
                self.geometry: BatchGeometry | None = BatchGeometry(**given)
            except ValueError as error:
                raise ValueError(f"{owner}: {error}") from None
            self.usual_sample_weight = self.expert_sample_weight = None
        else:
            if usual_sample_weight is None or expert_sample_weight is None:
                raise ValueError(f"{owner}: give both usual_sample_weight and expert_sample_weight, or neither")
            if given:
                raise ValueError(
                    f"{owner}: usual_sample_weight/expert_sample_weight replace the batch geometry, but "
                    f"{', '.join(sorted(given))} were given too; pass one form or the other"
                )
            self.geometry = None
            self.usual_sample_weight = _positive_float(owner, "usual_sample_weight", usual_sample_weight)
            self.expert_sample_weight = _positive_float(owner, "expert_sample_weight", expert_sample_weight)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        self.grpo_loss_fn = POLICY_LOSS_FN.get("ppo")(
            clip_range=clip_range,
            clip_range_low=clip_range_low,
            clip_range_high=clip_range_high,
            loss_agg_mode=grpo_loss_agg_mode or loss_agg_mode,
        )
        self.sft_loss_fn = self.build_sft_loss_fn(sft_loss_agg_mode or loss_agg_mode)

    # Trinity's derived values (docs/algorithms/chord.md#normalisation), None when explicit sample weights are used
    use_dynamic_bsz = _of_geometry("use_dynamic_bsz")
    experience_per_gpu = _of_geometry("experience_per_gpu")
    gradient_accumulation = _of_geometry("gradient_accumulation")
    train_batch_size_usual = _of_geometry("usual_per_gpu")
    """``Bu`` (per GPU)."""
    train_batch_size_expert = _of_geometry("expert_per_gpu")
    """``Be`` (per GPU)."""

    def sample_weights(self, rows: int) -> tuple[float, float]:
        """``(w_u, w_e)`` for a micro-batch of ``rows`` rows."""
        if self.geometry is None:
            return self.usual_sample_weight, self.expert_sample_weight
        return self.geometry.sample_weights(rows)

    def build_sft_loss_fn(self, loss_agg_mode: str) -> PolicyLossFn:
        return POLICY_LOSS_FN.get("sft")(loss_agg_mode=loss_agg_mode)

    def expert_mask_of(self, expert_mask: Any, logprob: torch.Tensor) -> torch.Tensor:
        """``expert_mask`` as a ``(B,)`` bool tensor on ``logprob``'s device."""
        mask = torch.as_tensor(expert_mask, device=logprob.device).to(torch.bool)
        if mask.shape != logprob.shape[:1]:
            raise ValueError(
                f"{getattr(self, 'name', type(self).__name__)}: expert_mask must have shape ({logprob.shape[0]},), "
                f"got {tuple(mask.shape)}"
            )
        return mask

    def mu_of(self, step: Any, rows: int) -> float:
        """The expert rows' share μ of the loss at the batch's ``step`` (``1 − μ`` for the usual rows); ``rows``: the
        micro-batch's."""
        raise NotImplementedError

    def token_losses(self, logprob, old_logprob, action_mask, advantages, expert_mask, **_):
        """The inner PPO loss's per-token losses on usual rows and the inner SFT loss's on expert rows, each computed
        on its own rows (``(n_u, T)``, ``(n_e, T)`` slices of the ``(B, T)`` inputs), and their metrics under
        ``usual/`` and ``expert/``; aggregated by `row_classes` (docs/algorithms/chord.md#normalisation).

        ``logprob``, ``old_logprob``, ``action_mask``, ``advantages``: ``(B, T)``; ``expert_mask``: ``(B,)`` bool.
        A subset with no rows contributes no metrics.
        """
        expert = self.expert_mask_of(expert_mask, logprob)
        parts, metrics = [], {}
        n_expert = int(expert.sum())
        for name, rows, loss_fn, count in (
            ("usual", ~expert, self.grpo_loss_fn, len(expert) - n_expert),
            ("expert", expert, self.sft_loss_fn, n_expert),
        ):
            if count:
                part, met = loss_fn.token_losses(
                    logprob=logprob[rows],
                    old_logprob=old_logprob[rows],
                    action_mask=action_mask[rows],
                    advantages=advantages[rows],
                    raw_advantages=advantages[rows],
                )
                parts.append((rows, part))
                metrics.update({f"{name}/{k}": v for k, v in met.items()})
        # one tensor in the widest dtype of the parts (the PPO part follows float32 advantages, the SFT part ℓ's dtype)
        dtype = functools.reduce(torch.promote_types, (part.dtype for _, part in parts), logprob.dtype)
        values = torch.zeros(logprob.shape, dtype=dtype, device=logprob.device)
        for rows, part in parts:
            values = values.index_put((rows,), part.to(dtype))
        return values, metrics

    def row_classes(self, logprob, expert_mask, step=None, **_) -> tuple[RowClass, ...]:
        """Usual rows (PPO, ``grpo_loss_agg_mode``, ``1 − μ``, ``w_u``) and expert rows (SFT, ``sft_loss_agg_mode``,
        ``μ``, ``w_e``): ``(1−μ)·n_u·w_u·L_u + μ·n_e·w_e·L_e`` (docs/algorithms/chord.md#normalisation)."""
        expert = self.expert_mask_of(expert_mask, logprob)
        w_usual, w_expert = self.sample_weights(logprob.shape[0])
        mu = self.mu_of(step, logprob.shape[0])
        usual, sft = self.grpo_loss_fn, self.sft_loss_fn
        return (
            RowClass("usual", ~expert, usual.effective_loss_agg_mode, 1.0 - mu, w_usual, usual.loss_metric_name()),
            RowClass("expert", expert, sft.effective_loss_agg_mode, mu, w_expert, sft.loss_metric_name()),
        )


def _with_shared_arguments(init: Any) -> Any:
    """``init`` (``__init__(self, backend, <own arguments>, **shared)``) with the signature of its own arguments
    followed by `ExpertMixLossFn`'s (`ExpertMixLossFn.__init_subclass__`): a call is bound to that signature, so a
    positional or unknown argument is placed or refused as by a hand-written constructor."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not p.VAR_KEYWORD]
    shared = list(inspect.signature(ExpertMixLossFn.__init__).parameters.values())[2:]  # after self and backend
    parameters = own + shared
    parameters.sort(key=lambda p: p.kind is p.KEYWORD_ONLY)  # stable: the keyword-only ones last
    signature = inspect.Signature(parameters)

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
        except TypeError as error:
            raise TypeError(f"{init.__qualname__}() {error}") from None
        init(**arguments)

    __init__.__signature__ = signature
    hints = {**ExpertMixLossFn.__init__.__annotations__, **init.__annotations__}
    __init__.__annotations__ = {name: hint for name, hint in hints.items() if name != "shared"}
    return __init__


@POLICY_LOSS_FN.register("mix")
class MIXPolicyLossFn(ExpertMixLossFn):
    """MIX: ``(1−mu)·L_u + mu·L_e`` with a constant ``mu`` in ``[0, 1]`` (docs/algorithms/chord.md#mix).

    Shapes: ``logprob``, ``old_logprob``, ``advantages``, ``action_mask``: ``(B, T)``;
    ``expert_mask``: ``(B,)`` bool, True for SFT demonstration rows. Every other argument: see
    `ExpertMixLossFn` (a preset uses ``clip_range=0.2``).
    """

    preset_defaults = {"clip_range": 0.2}

    def __init__(self, backend: str = "trl", mu: float = 0.1, **shared: Any):
        super().__init__(backend, **shared)
        self.mu = _unit_interval("mix", "mu", mu)

    def mu_of(self, step: Any, rows: int) -> float:
        return self.mu
