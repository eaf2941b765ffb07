"""``TrinitySFTTrainer``: TRL's ``SFTTrainer`` with Trinity-RFT's SFT losses (preset ``sft``).

The seam is the one forward pass ``SFTTrainer.compute_loss`` already makes: it calls the model with
TRL's fused LM head (``model(**inputs, fused_lm_head=True)``), which returns the per-token
log-probabilities of the shifted labels (``log_probs``, zero where the label is ``-100``) and the
mask of trained tokens (``label_mask``), without building the full-vocabulary logits. We let TRL
run its ``compute_loss`` unchanged (so its metrics ``entropy``, ``mean_token_accuracy`` and
``num_tokens`` stay exactly TRL's), catch that forward's outputs with a module hook, and return
the library loss (``sft``, ``sft_is`` or ``sft_phi``) computed on them instead of TRL's NLL. No
second forward, no copied TRL code.

Gradient accumulation follows Trinity (docs/algorithms/entropy.md#actor-loss,
docs/algorithms/trl-differences.md#aggregation): the loss is aggregated per micro-batch
(``token-mean`` = mean over that micro-batch's trained tokens) and divided by the number of
accumulation steps (``loss_is_scaled_for_ga = False``: ``Trainer.training_step`` divides it).
TRL's own NLL instead divides the micro-batch sum by ``num_items_in_batch`` (the token count of the
whole accumulation window, summed over processes when ``average_tokens_across_devices``). Both
agree for one micro-batch on one process; with several micro-batches of different token counts
Trinity's token-mean weights each micro-batch equally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from trl import SFTConfig, SFTTrainer

from ..algorithms import POLICY_LOSS_FN, AlgorithmConfig, resolve_algorithm_config
from ..algorithms.component import Component
from ..algorithms.masked import check_loss_agg_mode
from ..checkpointing.checkpoints import CompleteCheckpoints
from ..data.model import resolve_model
from ..training.grpo_seams import bind_trl_arguments
from ..training.metrics import append_process_means
from ..training.model_card import paper_for
from .card import AlgorithmCardMixin
from .common import capture_fused_outputs, default_output_dir, init_trl_trainer
from .components import ComponentsBuiltOnce, component_fields
from .config import ShowsWhatTrains, from_trl_config
from .machine import MachineFields
from .spellings import RefusesRemovedSpellings, flat_component_spellings

# SFTConfig / TrainingArguments fields that would change or replace the loss this trainer computes.
# A non-default value raises an error that says how to get the same effect (or why it cannot work).
REPLACED_SFT_FIELDS: dict[str, tuple[Any, str]] = {
    "loss_type": (
        "nll",
        "TRL's loss is replaced by policy_loss; loss_type='dft' (−ℓ·sg(p)) is policy_loss='sft_is'",
    ),
    "label_smoothing_factor": (
        0.0,
        "label smoothing needs the full logits and replaces the token log-likelihood; no trinity_trl SFT loss uses it",
    ),
}


@dataclass
class TrinitySFTConfig(MachineFields, ShowsWhatTrains, ComponentsBuiltOnce, RefusesRemovedSpellings, SFTConfig):
    r"""
    Configuration of [`TrinitySFTTrainer`][]: every
    [`SFTConfig`](https://huggingface.co/docs/trl/sft_trainer#trl.SFTConfig) option, plus Trinity-RFT's SFT loss.

    Parameters:
        policy_loss (`str`, `dict` or `Component`, *optional*, defaults to `"sft"`):
            The loss on the trained (completion / assistant) tokens and its arguments, laid over its
            `default_args()`: `sft` (negative log-likelihood `−ℓ`), `sft_is` (`−ℓ·sg(p)`,
            importance-weighted; TRL calls it DFT), `sft_phi` (`−ℓ'·sg(p(1−p))`, CHORD's φ weighting,
            e.g. `{"name": "sft_phi", "cutoff_prob": 0.9}`), or any registered loss that reads only the
            log-probs of the trained tokens. A `loss_agg_mode` key is overridden by `loss_agg_mode` below.
        loss_agg_mode (`str`, *optional*, defaults to `"token-mean"`):
            How a micro-batch's per-token losses become one number: `token-mean`, `seq-mean-token-sum`,
            `seq-mean-token-mean` or `seq-mean-token-sum-norm` (docs/algorithms/aggregation.md#loss-agg-mode). The
            result is divided by the gradient-accumulation steps. With `packing` or `padding_free` a row holds several
            sequences, so only `token-mean` is allowed there.

    `loss_type` must stay `"nll"` (`"dft"` is `policy_loss="sft_is"`) and `label_smoothing_factor`
    must stay 0: both would replace the loss this trainer computes. Every other option is honoured;
    in particular `completion_only_loss` and `assistant_only_loss` choose the trained tokens as in
    TRL. `average_tokens_across_devices` only changes TRL's `num_items_in_batch`, which Trinity's
    per-micro-batch aggregation does not use.
    """

    removed_spellings = flat_component_spellings("policy_loss")

    policy_loss: dict | str | None = field(
        default=None,
        metadata={
            "help": "SFT loss and its arguments: 'sft' (NLL, default), 'sft_is' (importance-weighted), 'sft_phi' "
            "(φ-weighted), e.g. {name: sft_phi, cutoff_prob: 0.9}; --policy_loss.cutoff_prob 0.9."
        },
    )
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={
            "help": "Aggregation of per-token losses: token-mean, seq-mean-token-sum, seq-mean-token-mean or "
            "seq-mean-token-sum-norm."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        component_fields(self, ("policy_loss",))
        if not POLICY_LOSS_FN.get(self._policy_loss_name()).is_sft_type():
            sft_type = [n for n in POLICY_LOSS_FN.names() if POLICY_LOSS_FN.get(n).is_sft_type()]
            raise ValueError(
                f"{owner}: policy_loss must be a loss that reads only the trained tokens' log-probs "
                f"({', '.join(sft_type)}), got {self._policy_loss_name()!r}"
            )
        check_loss_agg_mode(self.loss_agg_mode)
        for name, (default, why) in REPLACED_SFT_FIELDS.items():
            value = getattr(self, name)
            if value != default:
                raise ValueError(f"{owner}: {name}={value!r} is not supported ({why}). Leave it at {default!r}.")
        if self.loss_agg_mode != "token-mean":
            for name in ("packing", "padding_free", "eval_packing"):
                if getattr(self, name):
                    raise ValueError(
                        f"{owner}: {name}=True puts several sequences in one row, so loss_agg_mode="
                        f"{self.loss_agg_mode!r} would average over rows that are not sequences; use "
                        "loss_agg_mode='token-mean' or turn packing / padding-free off"
                    )
        self.check_components()  # built now (bad loss arguments fail here), once: the trainer takes them

    def resolved_algorithm(self) -> AlgorithmConfig:
        """The `sft` preset with this config's loss and arguments (docs/algorithms/presets.md#resolution; args
        merged)."""
        return resolve_algorithm_config(
            "sft",
            merge_args=True,
            policy_loss=Component(self._policy_loss_name(), **(self.policy_loss.args if self.policy_loss else {})),
            loss_agg_mode=self.loss_agg_mode,
        )

    def _policy_loss_name(self) -> str:
        return (self.policy_loss.name if self.policy_loss is not None else None) or "sft"

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.policy_loss is not None:
            out["policy_loss"] = self.policy_loss.to_dict()
        return out


# ----------------------------------------------------------------------------------------- trainer
class TrinitySFTTrainer(AlgorithmCardMixin, CompleteCheckpoints, SFTTrainer):
    """An ``SFTTrainer`` whose loss is Trinity-RFT's `sft`, `sft_is` or `sft_phi` (see [`TrinitySFTConfig`][]).

    Arguments are those of [`SFTTrainer`](https://huggingface.co/docs/trl/sft_trainer#trl.SFTTrainer), except
    `compute_loss_func` (deprecated in TRL, and it would replace the loss this trainer computes).
    ``args`` must be a [`TrinitySFTConfig`][].

    Logged metrics: TRL's (`loss`, `entropy`, `mean_token_accuracy`, `num_tokens`, `aux_loss` for
    MoE models) plus the loss's own, prefixed `actor/` (`actor/sft_loss`, `actor/sft_is_loss` or
    `actor/sft_phi_loss`; the micro-batch value before the accumulation division).
    """

    _tag_names: ClassVar[list[str]] = ["trl", "trinity_trl", "sft"]
    _name = "SFT"
    config_class = TrinitySFTConfig
    # the loss is a per-micro-batch aggregate; Trainer.training_step divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(self, model, args: TrinitySFTConfig | None = None, *pos, compute_loss_func=None, **kwargs):
        model = resolve_model(model)  # "bundled" works here too
        if args is None:
            args = self.config_class(output_dir=default_output_dir(model, "TrinitySFT"))
        args = from_trl_config(args, self.config_class, type(self).__name__)  # a plain SFTConfig is converted
        if compute_loss_func is not None:
            raise ValueError(
                f"{type(self).__name__} computes its loss from policy_loss; compute_loss_func would replace it "
                "(choose policy_loss instead)"
            )
        components = args.take_components()  # built once, when the config was checked
        self.algorithm = components.algorithm
        given = bind_trl_arguments(SFTTrainer, model, args, *pos, **kwargs)
        if given.get("compute_loss_func") is not None:  # passed positionally
            raise ValueError(f"{type(self).__name__} computes its loss from policy_loss; do not pass compute_loss_func")
        init_trl_trainer(self, super().__init__, model, args, given, components)
        self._name, self._paper = paper_for(self.algorithm.algorithm)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        # TRL runs its forward (and logs its metrics) unchanged; its loss is discarded
        with capture_fused_outputs([model, self.model]) as calls:
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if len(calls) != 1:
            raise RuntimeError(
                f"{type(self).__name__} expected SFTTrainer.compute_loss to run exactly one fused-LM-head forward, "
                f"saw {len(calls)}; the TRL version may have changed this seam"
            )
        outputs = calls[0]
        loss, metrics = self.policy_loss.evaluate(logprob=outputs.log_probs, action_mask=outputs.label_mask)
        if self.aux_loss_enabled:
            # as in SFTTrainer: the MoE load-balancing loss is added once per micro-batch
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
        logged = {f"actor/{k}": v for k, v in metrics.items()}
        append_process_means(self._metrics[mode], logged, self.accelerator.gather, self.accelerator.device)
        if return_outputs:
            return loss, result[1]
        return loss


__all__ = ["TrinitySFTConfig", "TrinitySFTTrainer"]
