"""Base class of every policy loss (docs/algorithms/index.md#default-arguments)."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from ..args import ComponentArgs
from ..inputs import PER_TOKEN_INPUTS, backend_name, check_backend, metrics_to_floats, resolve_inputs
from ..masked import check_loss_agg_mode, masked_fill_invalid
from ..registry import Registry


class PolicyLossFn(ComponentArgs):
    """A policy loss: ``loss, metrics = fn(logprob=..., **inputs)``.

    Subclasses set `inputs` (what they need besides ``logprob``) and implement
    `compute`, which receives the inputs under their internal names, already cleaned:
    per-token tensors hold 0 wherever ``action_mask`` is 0, so NaN/inf in padding can leak
    neither into the loss nor into its gradient. ``compute`` returns ``(loss, metrics)`` where
    metric values may be tensors; `__call__` turns them into Python floats.

    ``default_args()`` is derived from the constructor signature (see `trinity_trl.algorithms.args.ComponentArgs`);
    a subclass lists in ``preset_defaults`` only the preset values that differ from its constructor.
    """

    name: ClassVar[str]
    inputs: ClassVar[tuple[str, ...]] = ("old_logprob", "action_mask", "advantages")
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    # TRL ``GRPOConfig`` fields that mean exactly one of this loss's arguments: {TRL field: argument}.
    # Trainer configs accept them and pass them on (a field whose meaning differs is not listed).
    trl_config_fields: ClassVar[dict[str, str]] = {}
    # constructor arguments that a trainer config sets from its own schedule fields (CHORD's μ schedule)
    schedule_args: ClassVar[tuple[str, ...]] = ()

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

    @classmethod
    def card_note(cls, args: dict[str, Any]) -> str | None:
        """One sentence for the model card about the configuration ``args`` (a variant, a schedule), or ``None``."""
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
        """The aggregation the loss applies to its token losses (``None`` if it has none). Usually its
        ``loss_agg_mode``; a loss whose definition fixes the mode (REC's ``gspo-one-side``) says so."""
        return getattr(self, "loss_agg_mode", None)

    @property
    def weighs_samples_itself(self) -> bool:
        """Whether the loss normalises its samples itself across a whole optimizer step (MIX/CHORD,
        docs/algorithms/chord.md#normalisation). A trainer then divides it only by gradient accumulation, and must not
        pass an aggregation of its own (`aggregated_with`)."""
        return False

    def aggregated_with(self, loss_agg_mode: Any) -> PolicyLossFn:
        """A shallow copy of this loss that aggregates with ``loss_agg_mode`` (a mode name or an
        aggregation callable, see [`agg_loss`][trinity_trl.algorithms.agg_loss]). Trainers use it to
        normalise a micro-batch by a count of their choosing (e.g. every token of the optimizer step)."""
        if self.effective_loss_agg_mode is None or self.weighs_samples_itself:
            raise ValueError(
                f"policy loss {getattr(self, 'name', type(self).__name__)!r} has no aggregation to replace"
            )
        copy_ = copy.copy(self)
        copy_.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)
        return copy_

    @property
    def select_keys(self) -> list[str]:
        """The inputs this loss needs besides ``logprob``, in the backend's names."""
        return [backend_name(k, self.backend) for k in self.inputs]

    def __call__(self, logprob: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = self.evaluate(logprob, **kwargs)
        return loss, metrics_to_floats(metrics)

    def evaluate(self, logprob: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Like ``__call__`` but metric values stay detached 0-d tensors (no device sync), for
        callers that gather or average metrics themselves."""
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
        loss, metrics = self.compute(raw_advantages=raw_advantages, **inputs)
        return loss, {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}

    def compute(self, **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class AggregatedLossFn(PolicyLossFn):
    """A policy loss whose only option is how token losses are aggregated
    (docs/algorithms/aggregation.md#loss-agg-mode)."""

    def __init__(self, backend: str = "trl", loss_agg_mode: str = "token-mean"):
        super().__init__(backend)
        self.loss_agg_mode = check_loss_agg_mode(loss_agg_mode)


POLICY_LOSS_FN: Registry[type[PolicyLossFn]] = Registry("policy loss")
