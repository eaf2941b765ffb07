"""Base class of every policy loss (docs/algorithms/index.md#default-arguments)."""

from __future__ import annotations

import functools
import inspect
from typing import Any, ClassVar

import torch

from ..args import ComponentArgs
from ..inputs import PER_TOKEN_INPUTS, backend_name, check_backend, metrics_to_floats, resolve_inputs
from ..masked import check_loss_agg_mode, masked_fill_invalid
from ..registry import Registry


class PolicyLossFn(ComponentArgs):
    """A policy loss: ``loss, metrics = fn(logprob=..., loss_agg_mode=..., **inputs)``.

    Subclasses set `inputs` (what they need besides ``logprob``) and implement
    `compute`, which receives the inputs under their internal names, already cleaned:
    per-token tensors hold 0 wherever ``action_mask`` is 0, so NaN/inf in padding can leak
    neither into the loss nor into its gradient. ``compute`` returns ``(loss, metrics)`` where
    metric values may be tensors; `__call__` turns them into Python floats.

    The aggregation contract (docs/algorithms/custom-components.md#aggregation): ``compute`` takes a
    ``loss_agg_mode`` parameter and aggregates its token losses with it
    (``agg_loss(token_loss, action_mask, loss_agg_mode)``); a trainer passes a callable there that
    normalises over the count of its choosing (every token of the optimizer step, say), a direct call
    the loss's own mode. A loss that normalises its samples itself (MIX, CHORD) declares
    ``weighs_samples_itself = True`` instead and gets no aggregation. Any other loss is refused when it
    is built (`check_aggregation_contract`), never at the first step.

    ``default_args()`` is derived from the constructor signature (see `trinity_trl.algorithms.args.ComponentArgs`);
    a subclass lists in ``preset_defaults`` only the preset values that differ from its constructor.
    """

    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]] = ("old_logprob", "action_mask", "advantages")
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    # TRL ``GRPOConfig`` fields that mean exactly one of this loss's arguments: {TRL field: argument}.
    # Trainer configs accept them and pass them on (a field whose meaning differs is not listed).
    trl_config_fields: ClassVar[dict[str, str]] = {}

    def __init__(self, backend: str = "trl"):
        self.backend = check_backend(backend)

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
        ``<name>_loss``, labelled ``sft`` for an SFT-type loss and ``rl`` otherwise."""
        return {"sft" if cls.is_sft_type() else "rl": ("pg_loss", f"{cls.name}_loss")}

    def card_note(self) -> str | None:
        """One sentence for the model card about this loss as built (a variant, a schedule), or ``None``."""
        return None

    @property
    def reads_advantages(self) -> bool:
        """Whether the loss uses advantages. A trainer gives a loss that does not (an SFT loss) the
        best-rewarded completions of each group instead (RAFT)."""
        return "advantages" in self.inputs

    @property
    def needs_old_logprob(self) -> bool:
        """Whether the loss reads the behaviour (old) log-probs."""
        return "old_logprob" in self.inputs

    @property
    def needs_ref_logprob(self) -> bool:
        """Whether the loss reads reference-model log-probs (DPO): the trainer must load a reference."""
        return "ref_logprob" in self.inputs

    @property
    def needs_expert_rows(self) -> bool:
        """Whether the loss mixes expert (SFT) rows into the batch (``expert_mask``, MIX/CHORD)."""
        return "expert_mask" in self.inputs

    @property
    def needs_step(self) -> bool:
        """Whether the loss reads the global training ``step`` (CHORD's μ schedule)."""
        return "step" in self.inputs

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

    #: Whether the loss normalises its samples itself across a whole optimizer step (MIX/CHORD,
    #: docs/algorithms/chord.md#normalisation): its ``compute`` takes no aggregation, and a trainer divides it only
    #: by gradient accumulation.
    weighs_samples_itself: ClassVar[bool] = False
    #: Whether the loss compares chosen/rejected pairs of rows (DPO): only TrinityDPOTrainer can run it.
    pairwise: ClassVar[bool] = False

    @classmethod
    def takes_aggregation(cls) -> bool:
        """Whether `compute` names a ``loss_agg_mode`` parameter (a ``**kwargs`` catch-all does not count:
        it would accept the aggregation and could ignore it)."""
        return _names_loss_agg_mode(cls.compute)

    @property
    def select_keys(self) -> list[str]:
        """The inputs this loss needs besides ``logprob``, in the backend's names."""
        return [backend_name(k, self.backend) for k in self.inputs]

    def __call__(self, logprob: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = self.evaluate(logprob, **kwargs)
        return loss, metrics_to_floats(metrics)

    def evaluate(
        self, logprob: torch.Tensor | None = None, *, loss_agg_mode: Any = None, **kwargs: Any
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Like ``__call__`` but metric values stay detached 0-d tensors (no device sync), for
        callers that gather or average metrics themselves.

        ``loss_agg_mode``: the aggregation of the token losses, a mode name or an aggregation callable (see
        `trinity_trl.algorithms.masked.agg_loss`); ``None``: the loss's own mode
        (`effective_loss_agg_mode`, else ``token-mean``). A loss that weighs its samples itself takes none.
        """
        if self.weighs_samples_itself:
            if loss_agg_mode is not None:
                raise ValueError(
                    f"policy loss {self.display_name()!r} weighs its samples itself: it takes no aggregation"
                )
            aggregation: dict[str, Any] = {}
        else:
            check_aggregation_contract(self)
            mode = loss_agg_mode if loss_agg_mode is not None else self.effective_loss_agg_mode or "token-mean"
            aggregation = {"loss_agg_mode": check_loss_agg_mode(mode)}
        if logprob is not None:
            kwargs["logprob"] = logprob
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
        loss, metrics = self.compute(raw_advantages=raw_advantages, **aggregation, **inputs)
        return loss, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}

    def compute(self, **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError

    @classmethod
    def display_name(cls) -> str:
        """The registered name, else the class name."""
        return getattr(cls, "name", None) or cls.__name__

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


@functools.cache
def _names_loss_agg_mode(compute: Any) -> bool:
    parameter = inspect.signature(compute).parameters.get("loss_agg_mode")
    return parameter is not None and parameter.kind is not inspect.Parameter.VAR_KEYWORD


def check_aggregation_contract(loss: PolicyLossFn | type[PolicyLossFn]) -> None:
    """Refuse a policy loss that neither takes its aggregation nor weighs its samples itself (one line naming
    what to add). Without it a trainer could not normalise the loss: it would fail or silently keep the loss's
    own micro-batch mean."""
    if loss.weighs_samples_itself or loss.takes_aggregation():
        return
    cls = loss if isinstance(loss, type) else type(loss)
    raise ValueError(
        f"policy loss {cls.display_name()!r} ({cls.__module__}.{cls.__qualname__}) does not take its aggregation: "
        "add a loss_agg_mode parameter to its compute() and aggregate with agg_loss(token_loss, action_mask, "
        "loss_agg_mode), or, if it normalises its samples itself, declare weighs_samples_itself = True "
        "(docs/algorithms/custom-components.md#aggregation)"
    )


class AggregatedLossFn(PolicyLossFn):
    """A policy loss whose only option is how token losses are aggregated
    (docs/algorithms/aggregation.md#loss-agg-mode)."""

    def __init__(self, backend: str = "trl", loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)


POLICY_LOSS_FN: Registry[type[PolicyLossFn]] = Registry("policy loss")
