"""Base class of every policy loss (docs/algorithms/index.md#default-arguments), and how its per-token losses become
one loss (docs/algorithms/custom-components.md#aggregation)."""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..args import ComponentArgs
from ..inputs import PER_TOKEN_INPUTS, backend_name, check_backend, metrics_to_floats, resolve_inputs
from ..masked import agg_loss, check_loss_agg_mode, masked_fill_invalid
from ..registry import Registry

#: the contracts a policy loss can keep (`PolicyLossFn.loss_contract`)
TOKEN_LOSSES, AGGREGATES_ITSELF, OLD_CONTRACT = "token_losses", "aggregates_itself", "compute"
#: the release that drops the adapter of the old contract (``compute`` taking ``loss_agg_mode``)
OLD_CONTRACT_REMOVED_IN = "0.3.0"


@dataclass(frozen=True)
class RowClass:
    """Rows of a micro-batch whose token losses are aggregated apart (MIX/CHORD: rollouts and demonstrations,
    docs/algorithms/chord.md#normalisation).

    The class adds ``coefficient · n · w · AGG(ℓ[rows], m[rows], loss_agg_mode)`` to the loss, ``AGG`` over this
    micro-batch's rows of the class (``n`` of them), ``w`` its per-sample weight: ``sample_weight``, the loss's own,
    unless the trainer gives the class a weight of its step (`PolicyLossFn.aggregate`). Every metric named
    ``<name>/...`` is scaled by ``n · w`` with it, and ``<name>/<loss_metric>`` is the class's loss.

    Attributes:
        name: the class's name, the prefix of its metrics (``usual``, ``expert``).
        rows: ``(B,)`` bool, the rows of the class.
        loss_agg_mode: how the class's token losses are aggregated.
        coefficient: the class's share of the loss (CHORD's ``1 − μ`` and ``μ``).
        sample_weight: the loss's per-sample weight ``w``.
        loss_metric: the metric of the class's loss (``pg_loss``, ``sft_loss``, ...).
    """

    name: str
    rows: torch.Tensor
    loss_agg_mode: str
    coefficient: float
    sample_weight: float
    loss_metric: str


def _reads(key: str) -> property:
    """A `PolicyLossFn` property: whether the loss's ``inputs`` hold ``key`` (what a trainer must provide)."""
    return property(lambda self: key in self.inputs, doc=f"Whether the loss reads ``{key}`` (it is in ``inputs``).")


class PolicyLossFn(ComponentArgs):
    """A policy loss: ``loss, metrics = fn(logprob=..., **inputs)``.

    Subclasses set `inputs` (what they need besides ``logprob``) and implement `token_losses`, which receives the
    inputs under their internal names, already cleaned: per-token tensors hold 0 wherever ``action_mask`` is 0 (so
    NaN/inf in padding can leak neither into the loss nor into its gradient) and advantages are ``(B, T)``; besides
    them ``raw_advantages`` (the advantages before that cleaning). It returns the ``(B, T)`` per-token losses and a
    dict of metrics (values may be tensors).

    The aggregation (docs/algorithms/custom-components.md#aggregation): a loss gives per-token losses and never
    aggregates them. A trainer aggregates them once, normalising over the count of its choosing (every token of the
    optimizer step, say); a direct call (``__call__``) aggregates them with the loss's own mode
    (`effective_loss_agg_mode`, else ``token-mean``) and logs the result as `loss_metric`. A loss whose rows fall in
    classes aggregated apart (MIX, CHORD) declares them with `row_classes`. A loss that cannot give per-token losses
    (DPO's pairs) declares ``weighs_samples_itself = True`` and implements ``compute`` returning ``(loss,
    metrics)``. A loss written to the old contract (``compute`` taking ``loss_agg_mode``) trains through an adapter,
    with a deprecation warning, until `OLD_CONTRACT_REMOVED_IN`. Any other loss is refused when it is built
    (`check_aggregation_contract`), never at the first step.

    ``default_args()`` is derived from the constructor signature (see `trinity_trl.algorithms.args.ComponentArgs`);
    a subclass lists in ``preset_defaults`` only the preset values that differ from its constructor.
    """

    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]] = ("old_logprob", "action_mask", "advantages")
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    # TRL ``GRPOConfig`` fields that mean exactly one of this loss's arguments: {TRL field: argument}.
    # Trainer configs accept them and pass them on (a field whose meaning differs is not listed).
    trl_config_fields: ClassVar[dict[str, str]] = {}
    #: the metric of the aggregated loss ("": ``<name>_loss``), see `loss_metric_name`
    loss_metric: ClassVar[str] = ""
    #: which contract the class keeps, derived from what it defines when it is created: `TOKEN_LOSSES`,
    #: `AGGREGATES_ITSELF`, `OLD_CONTRACT`, or ``None`` (none: refused)
    loss_contract: ClassVar[str | None] = None

    def __init__(self, backend: str = "trl"):
        self.backend = check_backend(backend)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.loss_contract = _contract_of(cls)

    # ------------------------------------------------------------------ what a trainer needs to know
    # Trainers ask these properties and never compare registry names, so a loss defined outside the
    # package (registered with ``POLICY_LOSS_FN.register``) is trained correctly without any change
    # to a trainer. Override them where the answer depends on the loss's arguments.

    @classmethod
    def is_sft_type(cls) -> bool:
        """Whether the loss trains on demonstrations alone: it reads nothing but the log-probs of the
        trained tokens and their mask (``inputs``), so ``TrinitySFTTrainer`` can run it."""
        return set(cls.inputs) <= {"action_mask"}

    @classmethod
    def summary_metrics(cls) -> dict[str, tuple[str, ...]]:
        """What the one-line progress summary shows of this loss: ``{label: metric keys}`` (its own metric
        names, without ``actor/``; the first one logged is shown). By default the loss's ``pg_loss`` or
        `loss_metric_name`, labelled ``sft`` for an SFT-type loss and ``rl`` otherwise."""
        return {"sft" if cls.is_sft_type() else "rl": tuple(dict.fromkeys(("pg_loss", cls.loss_metric_name())))}

    def card_note(self) -> str | None:
        """One sentence for the model card about this loss as built (a variant, a schedule), or ``None``."""
        return None

    reads_advantages = _reads("advantages")
    """Whether the loss uses advantages. A trainer gives a loss that does not (an SFT loss) the
    best-rewarded completions of each group instead (RAFT)."""
    needs_old_logprob = _reads("old_logprob")
    """Whether the loss reads the behaviour (old) log-probs."""
    needs_ref_logprob = _reads("ref_logprob")
    """Whether the loss reads reference-model log-probs (DPO): the trainer must load a reference."""
    needs_expert_rows = _reads("expert_mask")
    """Whether the loss mixes expert (SFT) rows into the batch (``expert_mask``, MIX/CHORD)."""
    needs_step = _reads("step")
    """Whether the loss reads the global training ``step`` (CHORD's μ schedule)."""

    @property
    def linear_in_advantage(self) -> bool:
        """Whether multiplying the advantages by a positive per-token weight ``w`` multiplies each
        token's loss (and gradient) by ``w``. TRL's vLLM importance-sampling correction is applied
        that way; a loss for which this is false cannot take it. Default: true when the loss reads
        advantages."""
        return self.reads_advantages

    @property
    def sequence_level(self) -> bool:
        """Whether the loss uses statistics over a whole row (a sequence-level ratio or mask), so a
        row must hold exactly one sample: a multi-turn row packing several turns would mix them."""
        return False

    @property
    def effective_loss_agg_mode(self) -> str | None:
        """The mode the loss aggregates its token losses with: the one a trainer builds its aggregation for
        and a direct call uses. Its constructor's ``loss_agg_mode``; a loss whose definition fixes the mode
        (REC's ``gspo-one-side``) says so; ``None`` for a loss without a mode of its own (a trainer then
        uses the config's ``loss_agg_mode``)."""
        return getattr(self, "loss_agg_mode", None)

    #: Whether the loss normalises its samples itself across a whole optimizer step instead of taking the trainer's
    #: normalisation: MIX/CHORD (per-sample weights of their row classes, docs/algorithms/chord.md#normalisation),
    #: DPO (one loss per pair). A trainer then aggregates its per-token losses over the micro-batch with its own
    #: modes (a loss without per-token losses aggregates itself in ``compute``) and divides the loss only by gradient
    #: accumulation.
    weighs_samples_itself: ClassVar[bool] = False
    #: Whether the loss compares chosen/rejected pairs of rows (DPO): only TrinityDPOTrainer can run it.
    pairwise: ClassVar[bool] = False
    #: Whether the loss masks tokens chosen over the whole optimizer step (M2PO): a trainer computes `step_mask` over
    #: every trained token of the step (each micro-batch and process) in a pass without gradient before the step's
    #: first backward, and gives each micro-batch its part as the ``step_mask`` input
    #: (docs/algorithms/custom-components.md#step-mask).
    needs_step_mask: ClassVar[bool] = False

    @classmethod
    def takes_aggregation(cls) -> bool:
        """Whether a trainer aggregates the loss: it gives per-token losses, or keeps the old contract (a ``compute``
        naming a ``loss_agg_mode`` parameter; a ``**kwargs`` catch-all does not count)."""
        return cls.loss_contract in (TOKEN_LOSSES, OLD_CONTRACT)

    @classmethod
    def loss_metric_name(cls) -> str:
        """The metric that logs the aggregated loss: `loss_metric`, else ``<registered name>_loss``."""
        return cls.loss_metric or f"{cls.display_name()}_loss"

    @property
    def select_keys(self) -> list[str]:
        """The inputs this loss needs besides ``logprob``, in the backend's names."""
        return [backend_name(k, self.backend) for k in self.inputs]

    # ------------------------------------------------------------------ the per-token losses and their aggregation
    def token_losses(self, **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(per-token losses (B, T), metrics)`` of the cleaned ``inputs`` (see the class docs). What a subclass
        implements; never aggregated here."""
        raise NotImplementedError

    def step_mask(self, log_ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """The tokens to keep, ``(N,)`` bool, of an optimizer step's ``N`` trained tokens (every micro-batch and
        process, in the trainer's order), from their log-ratios ``ℓ − ℓo`` under the current weights and their
        advantages (``(N,)`` each). What a loss with `needs_step_mask` implements."""
        raise NotImplementedError(f"policy loss {self.display_name()!r} declares no step mask")

    def row_classes(self, **inputs: Any) -> tuple[RowClass, ...]:
        """The classes of rows whose token losses are aggregated apart (MIX/CHORD), for these ``inputs``; ``()``
        (the default): one aggregation over every row."""
        return ()

    def aggregate(
        self,
        token_losses: torch.Tensor,
        metrics: dict[str, Any],
        inputs: dict[str, Any],
        aggregation: Any = None,
        class_weights: dict[str, float] | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of ``token_losses`` (``(B, T)``, from `token_losses` on ``inputs``) and the metrics with it
        (`loss_metric_name`).

        ``aggregation``: a mode name or an aggregation callable (`trinity_trl.algorithms.masked.agg_loss`, a trainer's
        normalisation); ``None``: the loss's own mode (`effective_loss_agg_mode`, else ``token-mean``). A loss with
        `row_classes` aggregates each class over the micro-batch with the class's mode, weight and coefficient
        (`RowClass`), and takes no aggregation; ``class_weights`` (``{class name: w}``, a trainer's weights of its
        optimizer step's samples) replace the classes' own ``sample_weight``.
        """
        mask = inputs["action_mask"]
        if not isinstance(token_losses, torch.Tensor) or token_losses.shape != mask.shape:
            shape = tuple(token_losses.shape) if isinstance(token_losses, torch.Tensor) else type(token_losses).__name__
            raise ValueError(
                f"policy loss {self.display_name()!r}: token_losses() must return the (B, T) = {tuple(mask.shape)} "
                f"per-token losses, got {shape}"
            )
        metrics = dict(metrics)
        classes = self.row_classes(**inputs)
        if classes:
            if aggregation is not None:
                raise ValueError(
                    f"policy loss {self.display_name()!r} aggregates its row classes with their own modes: it takes "
                    "no aggregation"
                )
            loss = _aggregate_classes(token_losses, mask, classes, metrics, class_weights)
        else:
            mode = aggregation if aggregation is not None else self.effective_loss_agg_mode or "token-mean"
            loss = agg_loss(token_losses, mask, mode)
        metrics[self.loss_metric_name()] = loss.detach()
        return loss, metrics

    # ------------------------------------------------------------------ the public call
    def __call__(self, logprob: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = self.evaluate(logprob, **kwargs)
        return loss, metrics_to_floats(metrics)

    def evaluate(
        self, logprob: torch.Tensor | None = None, *, loss_agg_mode: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Like ``__call__`` but metric values stay detached 0-d tensors (no device sync), for
        callers that gather or average metrics themselves.

        ``loss_agg_mode``: the aggregation of the token losses, a mode name or an aggregation callable (see
        `trinity_trl.algorithms.masked.agg_loss`); ``None``: the loss's own mode (`effective_loss_agg_mode`, else
        ``token-mean``). A loss that weighs its samples itself takes none.
        """
        contract = self.loss_contract
        if contract is None:
            check_aggregation_contract(self)
        if self.weighs_samples_itself:
            if loss_agg_mode is not None:
                raise ValueError(
                    f"policy loss {self.display_name()!r} weighs its samples itself: it takes no aggregation"
                )
            mode = None
        else:
            mode = check_loss_agg_mode(
                loss_agg_mode if loss_agg_mode is not None else self.effective_loss_agg_mode or "token-mean"
            )
        inputs = self.cleaned_inputs(logprob, kwargs)
        if contract == TOKEN_LOSSES:
            loss, metrics = self.aggregate(*self.token_losses(**inputs), inputs, mode)
        elif contract == AGGREGATES_ITSELF:
            loss, metrics = self.compute(**inputs)
        else:
            _warn_old_contract(type(self))
            loss, metrics = self.compute(loss_agg_mode=mode, **inputs)
        return loss, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}

    def cleaned_inputs(self, logprob: torch.Tensor | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The inputs of `token_losses` (or ``compute``) from a call's keyword arguments: picked under any of their
        names (docs/algorithms/index.md#call-convention), sequence advantages ``(B,)`` spread over their tokens,
        per-token tensors 0 where ``action_mask`` is 0, and ``raw_advantages`` (the advantages before that)."""
        if logprob is not None:
            kwargs = {**kwargs, "logprob": logprob}
        inputs = resolve_inputs(kwargs, ("logprob", *self.inputs), self.optional_inputs)
        mask = inputs["action_mask"]
        if mask.shape != inputs["logprob"].shape:
            raise ValueError(f"action_mask shape {tuple(mask.shape)} != logprob shape {tuple(inputs['logprob'].shape)}")
        advantages = inputs.get("advantages")
        if isinstance(advantages, torch.Tensor) and advantages.dim() < mask.dim():
            # TRL-style sequence advantages (B,) -> one value per token
            inputs["advantages"] = advantages.reshape(mask.shape[0], 1).expand(mask.shape)
        raw_advantages = inputs.get("advantages")
        for key in PER_TOKEN_INPUTS:
            value = inputs.get(key)
            if isinstance(value, torch.Tensor) and value.shape == mask.shape:
                inputs[key] = masked_fill_invalid(value, mask)
        return {**inputs, "raw_advantages": raw_advantages}

    def compute(self, loss_agg_mode: Any = None, **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(loss, metrics)`` of the cleaned ``inputs``. What a loss that weighs its samples itself implements (DPO);
        here, for code written to the old contract (``super().compute(..., loss_agg_mode=...)``), the per-token
        losses aggregated with ``loss_agg_mode`` (`aggregate`)."""
        return self.aggregate(*self.token_losses(**inputs), inputs, loss_agg_mode)

    @classmethod
    def display_name(cls) -> str:
        """The registered name, else the class name."""
        return getattr(cls, "name", None) or cls.__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


def _aggregate_classes(
    token_losses: torch.Tensor,
    mask: torch.Tensor,
    classes: tuple[RowClass, ...],
    metrics: dict[str, Any],
    class_weights: dict[str, float] | None,
) -> torch.Tensor:
    """``Σ_c coefficient_c · n_c · w_c · AGG_c`` over the row classes (`RowClass`); scales each class's metrics in
    ``metrics`` and adds its loss there. A class without rows adds 0 and no metrics."""
    if class_weights is not None and {c.name for c in classes} - set(class_weights):
        raise ValueError(
            f"class_weights {sorted(class_weights)} lack a weight for the row classes "
            f"{sorted({c.name for c in classes} - set(class_weights))}"
        )
    total = None
    for row_class in classes:
        rows = int(row_class.rows.sum())
        part = torch.zeros((), dtype=token_losses.dtype, device=token_losses.device)
        if rows:
            weight = row_class.sample_weight if class_weights is None else class_weights[row_class.name]
            scale = rows * weight
            part = agg_loss(token_losses[row_class.rows], mask[row_class.rows], row_class.loss_agg_mode) * scale
            prefix = f"{row_class.name}/"
            metrics.update({k: v * scale for k, v in metrics.items() if k.startswith(prefix)})
            metrics[prefix + row_class.loss_metric] = part.detach()
        term = row_class.coefficient * part
        total = term if total is None else total + term
    return total


def _defined_by(cls: type, name: str) -> type:
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def _contract_of(cls: type[PolicyLossFn]) -> str | None:
    """The contract a loss class keeps (`PolicyLossFn.loss_contract`): a ``compute`` defined below its per-token
    method (or without one) is what runs."""
    per_token, compute = _defined_by(cls, "token_losses"), _defined_by(cls, "compute")
    below = compute is not per_token and issubclass(compute, per_token)
    if compute is not PolicyLossFn and (per_token is PolicyLossFn or below):
        if cls.weighs_samples_itself:
            return AGGREGATES_ITSELF
        return OLD_CONTRACT if _names_loss_agg_mode(cls.compute) else None
    return TOKEN_LOSSES if per_token is not PolicyLossFn else None


@functools.cache
def _names_loss_agg_mode(compute: Any) -> bool:
    parameter = inspect.signature(compute).parameters.get("loss_agg_mode")
    return parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD


def _qualified(cls: type) -> str:
    return f"{cls.display_name()!r} ({cls.__module__}.{cls.__qualname__})"


@functools.cache
def _warn_old_contract(cls: type[PolicyLossFn]) -> None:
    """One deprecation warning per loss class written to the old contract."""
    warnings.warn(
        f"policy loss {_qualified(cls)} aggregates its token losses in compute(loss_agg_mode=...), a contract that "
        f"trains through an adapter until trinity_trl {OLD_CONTRACT_REMOVED_IN}: return the (B, T) per-token losses "
        "from token_losses() instead (docs/algorithms/custom-components.md#aggregation)",
        FutureWarning,
        stacklevel=3,
    )


#: what a probe call of `token_losses` gives each input (`check_aggregation_contract`): ``(B, T) = (2, 3)``
_PROBE_ROWS, _PROBE_WIDTH = 2, 3


def _probe_inputs(loss: PolicyLossFn) -> dict[str, Any]:
    shape = (_PROBE_ROWS, _PROBE_WIDTH)
    given = {
        "logprob": torch.full(shape, -1.0),
        "old_logprob": torch.full(shape, -1.2),
        "ref_logprob": torch.full(shape, -0.8),
        "teacher_logprobs": torch.full(shape, -0.9),
        "action_mask": torch.ones(shape),
        "advantages": torch.tensor([[1.0] * _PROBE_WIDTH, [-1.0] * _PROBE_WIDTH]),
        "entropy": torch.ones(shape),
        "expert_mask": torch.tensor([False, True]),
        "step": 1,
        "step_mask": torch.ones(shape),
    }
    names = ("logprob", *loss.inputs, *loss.optional_inputs)
    inputs = {name: given.get(name, torch.zeros(_PROBE_ROWS)) for name in names}  # other inputs: one value per row
    return {**inputs, "raw_advantages": inputs.get("advantages")}


def _probe(loss: PolicyLossFn) -> None:
    """Refuse, in one line, a per-token method that returns no ``(B, T)`` tensor on dummy inputs (a loss averaging
    its own tokens would otherwise train at the wrong scale)."""
    what = f"policy loss {_qualified(type(loss))}: token_losses() must return ((B, T) per-token losses, metrics)"
    try:
        with torch.no_grad():
            result = loss.token_losses(**_probe_inputs(loss))
        values = result[0] if isinstance(result, tuple) and len(result) == 2 else result
    except Exception as error:  # noqa: BLE001 - any failure of the probe is reported in one line
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise ValueError(f"{what}; a probe call with dummy (2, 3) inputs raised {reason}") from error
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != (_PROBE_ROWS, _PROBE_WIDTH):
        got = f"shape {tuple(values.shape)}" if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"{what}; a probe call with dummy (2, 3) inputs gave {got}: a loss averaging its own tokens would train at "
            "the wrong scale (docs/algorithms/custom-components.md#aggregation)"
        )


def check_aggregation_contract(loss: PolicyLossFn | type[PolicyLossFn]) -> None:
    """Refuse a policy loss that neither gives per-token losses (nor keeps the old contract) nor weighs its samples
    itself, in one line naming what to add; probe a built loss's per-token method (`_probe`); warn once about the
    old contract. Without it a trainer could not normalise the loss: it would fail or silently keep the loss's own
    micro-batch mean."""
    cls = loss if isinstance(loss, type) else type(loss)
    if cls.loss_contract is None:
        raise ValueError(
            f"policy loss {_qualified(cls)} gives no per-token losses: implement token_losses() returning the "
            "(B, T) per-token losses and metrics, which the trainers aggregate (a compute() taking loss_agg_mode "
            "still trains, deprecated), or, if it normalises its samples itself, declare weighs_samples_itself = True "
            "and return its loss from compute() (docs/algorithms/custom-components.md#aggregation)"
        )
    if cls.loss_contract == OLD_CONTRACT:
        _warn_old_contract(cls)
    elif cls.loss_contract == TOKEN_LOSSES and not isinstance(loss, type):
        _probe(loss)


class AggregatedLossFn(PolicyLossFn):
    """A policy loss whose only option is how token losses are aggregated
    (docs/algorithms/aggregation.md#loss-agg-mode)."""

    def __init__(self, backend: str = "trl", loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)


POLICY_LOSS_FN: Registry[type[PolicyLossFn]] = Registry("policy loss")
