"""``TrinityDPOTrainer``: TRL's ``DPOTrainer`` running Trinity-RFT's ``dpo`` preset.

Preset ``dpo`` (docs/algorithms/policy-losses.md#dpo, docs/algorithms/presets.md#preset-table) = the DPO sigmoid loss
with label smoothing per preference pair, plus a KL loss (Trinity forces ``k2``, ``kl_coef = 0.001``) and the default
entropy term
(``entropy_coef = 0``), all aggregated with ``loss_agg_mode`` over the chosen and rejected
completion tokens.

The seam is the forward passes ``DPOTrainer._compute_loss`` already makes: one of the policy and,
unless reference log-probs were precomputed, one of the reference, both through TRL's fused LM
head, which returns per-token ``log_probs`` (and the policy's differentiable ``entropy``). TRL's
``compute_loss`` runs unchanged, so its metrics (``rewards/*``, ``logps/*``, ``logits/*``,
``entropy``, ``mean_token_accuracy``, ``num_tokens``) stay TRL's; a module hook catches the two
forwards' outputs, and the trainer returns its own loss computed on them:

* the library ``dpo`` loss, called once per pair (rows ``(chosen_i, rejected_i)``: the library sums
  over all rows of a micro-batch, which is per-pair DPO only for one pair), averaged over pairs as
  TRL does;
* ``+ kl_coef · AGG(kl(ℓ, ℓr), m)`` with the per-token policy and reference log-probs of both
  completions (no extra forward);
* ``− entropy_coef · AGG(H, m)``.

TRL's batch holds ``[chosen_1..chosen_B, rejected_1..rejected_B]``; pairs are rebuilt from that
layout, so no batch reordering can split them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from trl import DPOConfig, DPOTrainer

from ..algorithms import ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN, AlgorithmConfig, resolve_algorithm_config
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

# DPOConfig / TrainingArguments fields that select or reshape TRL's own DPO loss. The trainer computes
# the library `dpo` loss instead, so a non-default value would be silently ignored: it is rejected.
REPLACED_DPO_FIELDS: dict[str, tuple[Any, str]] = {
    "loss_type": (
        ["sigmoid"],
        "the dpo preset is the sigmoid loss (with label_smoothing); other TRL DPO losses are not Trinity's",
    ),
    "loss_weights": (None, "only one loss (sigmoid) is used"),
    "ld_alpha": (None, "LD-DPO length weighting changes the summed log-probs the dpo loss is defined on"),
    "f_divergence_type": ("reverse_kl", "the dpo loss is defined on log-ratios (reverse KL)"),
    "f_alpha_divergence_coef": (0.5, "only used with f_divergence_type='alpha_divergence'"),
    "use_weighting": (False, "WPO weighting is not part of the dpo loss"),
    "discopop_tau": (0.05, "only used by loss_type='discopop'"),
    "label_smoothing_factor": (
        0.0,
        (
            "token-level label smoothing of Trainer; for conservative DPO set label_smoothing (or "
            "policy_loss={'label_smoothing': ...})"
        ),
    ),
}
_DPO_FIELD_DEFAULTS = {"beta": 0.1, "label_smoothing": 0.0}


@dataclass
class TrinityDPOConfig(MachineFields, ShowsWhatTrains, ComponentsBuiltOnce, RefusesRemovedSpellings, DPOConfig):
    r"""
    Configuration of [`TrinityDPOTrainer`][]: every
    [`DPOConfig`](https://huggingface.co/docs/trl/dpo_trainer#trl.DPOConfig) option, plus the `dpo` preset's KL
    and entropy terms.

    Parameters:
        policy_loss (`dict`, `str` (JSON) or `Component`, *optional*):
            Arguments of the `dpo` loss, laid over its `default_args()` (`beta=0.1`,
            `label_smoothing=0.0`). `beta` and `label_smoothing` may be given here or as the
            DPOConfig fields of the same name (which TRL's metrics also use); the two are kept equal.
            A key here wins over a field left at its default; a field set to another value that
            differs from the key is an error.
        kl_loss (`str`, `dict` or `Component`, *optional*, defaults to `"k2"`):
            KL estimator added to the loss (`k1`, `k2`, `k3`, `low_var_kl`, `abs` or `corrected_k3`) and
            its arguments, e.g. `{"name": "k2", "kl_coef": 0.001}` (the default coefficient), merged over
            the estimator's `default_args()`. The preset always has one (Trinity turns `none` into `k2`),
            so `none` is refused; switch the term off with `kl_loss={"kl_coef": 0.0}`.
        entropy_loss (`str`, `dict` or `Component`, *optional*, defaults to `"default"`):
            `default` (subtract `entropy_coef · AGG(H, m)`) or `none`, e.g. `{"entropy_coef": 0.001}`;
            the default coefficient is 0.
        loss_agg_mode (`str`, *optional*, defaults to `"token-mean"`):
            Aggregation of the KL and entropy terms over the chosen and rejected completion tokens
            of a micro-batch (docs/algorithms/aggregation.md#loss-agg-mode). The DPO term itself is a mean over pairs.

    TRL options that choose or reshape TRL's own DPO loss (`loss_type` other than `["sigmoid"]`,
    `loss_weights`, `ld_alpha`, `f_divergence_type`, `f_alpha_divergence_coef`, `use_weighting`,
    `discopop_tau`) and `label_smoothing_factor` must keep their defaults. With
    `precompute_ref_log_probs=True` TRL keeps only summed reference log-probs, so the per-token KL
    term needs `kl_coef = 0`. Every other option is honoured.
    """

    removed_spellings = flat_component_spellings("policy_loss", "kl_loss", "entropy_loss")

    policy_loss: dict | str | None = field(
        default=None,
        metadata={"help": "dpo loss arguments, e.g. {beta: 0.1, label_smoothing: 0.0}; --policy_loss.beta 0.2."},
    )
    kl_loss: dict | str | None = field(
        default="k2",
        metadata={"help": "KL loss term: k1, k2, k3, low_var_kl, abs, corrected_k3, e.g. {name: k2, kl_coef: 0.001}."},
    )
    entropy_loss: dict | str | None = field(
        default="default", metadata={"help": "Entropy term: 'default' or 'none', e.g. {entropy_coef: 0.001}."}
    )
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={"help": "Aggregation of the KL and entropy terms: token-mean, seq-mean-token-sum, ..."},
    )

    def __post_init__(self):
        super().__post_init__()
        owner = type(self).__name__
        component_fields(self, ("policy_loss", "kl_loss", "entropy_loss"))
        # a component value without a name keeps this config's (kl_loss={"kl_coef": 0.0} is still k2)
        for name, default in (("policy_loss", "dpo"), ("kl_loss", "k2"), ("entropy_loss", "default")):
            value = getattr(self, name)
            if value is None or value.name is None:
                setattr(self, name, Component(default, **(value.args if value is not None else {})))
        inputs = POLICY_LOSS_FN.get(self.policy_loss.name).inputs  # a preference loss: reference, no advantages
        if "ref_logprob" not in inputs or "advantages" in inputs:
            raise ValueError(
                f"{owner}: policy_loss must be a preference loss such as 'dpo', got {self.policy_loss.name!r}"
            )
        check_loss_agg_mode(self.loss_agg_mode)
        for name, (default, why) in REPLACED_DPO_FIELDS.items():
            value = getattr(self, name)
            if value != default and not (name == "loss_weights" and value == [1.0]):
                raise ValueError(f"{owner}: {name}={value!r} is not supported ({why}). Leave it at {default!r}.")
        if not KL_FN.get(self.kl_loss.name).enabled:
            raise ValueError(
                f"{owner}: kl_loss='none' is not allowed: the dpo preset always has a KL loss (Trinity-RFT replaces "
                "'none' by 'k2'); use kl_loss={'kl_coef': 0.0} to switch the term off"
            )
        if ENTROPY_LOSS_FN.get(self.entropy_loss.name).needs_expert_mask:
            raise ValueError(
                f"{owner}: entropy_loss must not read expert rows (DPO has none), got {self.entropy_loss.name!r}"
            )
        self._sync_dpo_fields(owner)
        kl_loss = self.check_components().kl_loss  # built now (bad arguments fail here), once: the trainer takes them
        if self.precompute_ref_log_probs and kl_loss.kl_coef != 0.0:
            raise ValueError(
                f"{owner}: precompute_ref_log_probs=True keeps only the summed reference log-prob of each completion, "
                f"so the per-token KL loss ({self.kl_loss.name}, kl_coef={kl_loss.kl_coef}) "
                "cannot be computed; set kl_loss={'kl_coef': 0.0} or precompute_ref_log_probs=False"
            )

    def _sync_dpo_fields(self, owner: str) -> None:
        """Make DPOConfig's `beta` / `label_smoothing` and `policy_loss`'s arguments say the same thing."""
        args = dict(self.policy_loss.args)
        for name, default in _DPO_FIELD_DEFAULTS.items():
            from_field = getattr(self, name)
            if name in args:
                if from_field != default and from_field != args[name]:
                    raise ValueError(
                        f"{owner}: {name}={from_field} conflicts with policy_loss[{name!r}]={args[name]}; "
                        "set it in one place"
                    )
                setattr(self, name, args[name])  # TRL's metrics (rewards/*) use the same beta
            else:
                args[name] = from_field
        self.policy_loss = Component(self.policy_loss.name, **args)

    def resolved_algorithm(self) -> AlgorithmConfig:
        """The `dpo` preset with this config's components and arguments (docs/algorithms/presets.md#resolution; args
        merged)."""
        return resolve_algorithm_config(
            "dpo",
            merge_args=True,
            policy_loss=self.policy_loss,
            kl_loss=self.kl_loss,
            entropy_loss=self.entropy_loss,
            loss_agg_mode=self.loss_agg_mode,
        )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for name in ("policy_loss", "kl_loss", "entropy_loss"):
            out[name] = getattr(self, name).to_dict()
        return out


def pair_rows(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` chosen and rejected rows -> ``(2B, T)`` interleaved ``c1, r1, c2, r2, ...``."""
    return torch.stack([chosen, rejected], dim=1).flatten(0, 1)


class TrinityDPOTrainer(AlgorithmCardMixin, CompleteCheckpoints, DPOTrainer):
    """A ``DPOTrainer`` whose loss is Trinity-RFT's `dpo` preset (see [`TrinityDPOConfig`][]).

    Arguments are those of [`DPOTrainer`](https://huggingface.co/docs/trl/dpo_trainer#trl.DPOTrainer); ``args``
    must be a [`TrinityDPOConfig`][].

    Logged metrics: TRL's (`loss`, `rewards/chosen|rejected|accuracies|margins`, `logps/*`,
    `logits/*`, `entropy`, `mean_token_accuracy`, `num_tokens`) plus, prefixed `actor/`, the
    library's per-pair means (`dpo_loss`, `chosen_reward`, `rejected_reward`, `accuracy_mean`), and
    `kl_loss`, `kl_coef`, `entropy_loss` (the aggregated values before their coefficients).
    """

    _tag_names: ClassVar[list[str]] = ["trl", "trinity_trl", "dpo"]
    config_class = TrinityDPOConfig
    # the loss is a per-micro-batch mean; Trainer.training_step divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(self, model, ref_model=None, args: TrinityDPOConfig | None = None, *pos, **kwargs):
        model, ref_model = resolve_model(model), resolve_model(ref_model)  # "bundled" works here too
        if args is None:
            args = self.config_class(output_dir=default_output_dir(model, "TrinityDPO"))
        args = from_trl_config(args, self.config_class, type(self).__name__)  # a plain DPOConfig is converted
        components = args.take_components()  # built once, when the config was checked
        self.algorithm = components.algorithm
        given = bind_trl_arguments(DPOTrainer, model, ref_model, args, *pos, **kwargs)
        init_trl_trainer(self, super().__init__, model, args, given, components)
        self.kl_loss = components.kl_loss
        self.entropy_loss = components.entropy_loss
        self._name, self._paper = paper_for(self.algorithm.algorithm)
        self._paper = {**DPOTrainer._paper, **self._paper}  # keep TRL's DPO citation

    def pair_losses(
        self, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The library `dpo` loss of each pair, shape ``(B,)``.

        ``logps``, ``mask``: ``(2B, T)`` in TRL's layout (the ``B`` chosen rows, then the ``B``
        rejected rows of the same pairs). ``ref_logps``: ``(2B, T)`` per-token reference log-probs,
        or ``(2B, 1)`` summed ones (``precompute_ref_log_probs``). Returns the per-pair losses and the
        per-pair mean of each library metric.
        """
        if ref_logps.shape != logps.shape:
            # a summed reference becomes one extra token, trained for the reference only: the
            # library's MSUM(ℓ) − MSUM(ℓr) is then unchanged for the policy and equals the sum for ℓr
            extra = torch.ones_like(ref_logps, dtype=mask.dtype)
            ref_logps = torch.cat([torch.zeros_like(logps), ref_logps.to(logps.dtype)], dim=1)
            logps = torch.cat([logps, torch.zeros_like(extra, dtype=logps.dtype)], dim=1)
            mask = torch.cat([mask, extra], dim=1)
        logps, ref_logps, mask = (pair_rows(*x.chunk(2)) for x in (logps, ref_logps, mask))
        losses, metrics = [], []
        for pair in range(logps.shape[0] // 2):
            rows = slice(2 * pair, 2 * pair + 2)
            loss, pair_metrics = self.policy_loss.evaluate(
                logprob=logps[rows], ref_logprob=ref_logps[rows], action_mask=mask[rows]
            )
            losses.append(loss)
            metrics.append(pair_metrics)
        mean = {k: torch.stack([torch.as_tensor(m[k]).float() for m in metrics]).mean() for k in metrics[0]}
        return torch.stack(losses), mean

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        precomputed = self.precompute_ref_logps
        # TRL runs its forwards (policy, then reference) and logs its metrics unchanged; its loss is discarded
        with capture_fused_outputs([model, self.model, self.ref_model]) as calls:
            result = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        expected = 1 if precomputed else 2
        if len(calls) != expected:
            raise RuntimeError(
                f"{type(self).__name__} expected DPOTrainer.compute_loss to run {expected} fused-LM-head forward(s) "
                f"(policy{'' if precomputed else ', reference'}), saw {len(calls)}; the TRL version may have changed "
                "this seam"
            )
        mask = inputs["completion_mask"][:, 1:]
        width = mask.shape[1]
        # prompt-learning PEFT prepends virtual tokens to the outputs; keep the real positions (as TRL does)
        outputs = calls[0]
        logps = outputs.log_probs[:, -width:]
        if precomputed:
            ref_logps = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]]).unsqueeze(1)
        else:
            ref_logps = calls[1].log_probs[:, -width:]
        losses, dpo_metrics = self.pair_losses(logps, ref_logps.to(logps.dtype), mask)
        loss = losses.mean()  # TRL averages its per-pair loss too
        metrics: dict[str, Any] = {f"actor/{k}": v for k, v in dpo_metrics.items()}
        agg = self.algorithm.loss_agg_mode
        if not precomputed:
            # with kl_coef = 0 the KL is still logged, from detached log-probs (no backward through it)
            policy = logps if self.kl_loss.kl_coef != 0.0 else logps.detach()
            kl_term, kl_metrics = self.kl_loss.calculate_kl_loss(policy, ref_logps, mask, agg)
            loss = loss + kl_term
            metrics.update({f"actor/{k}": v for k, v in kl_metrics.items()})
        if self.entropy_loss.enabled:
            entropy = outputs.entropy[:, -width:]
            if self.entropy_loss.entropy_coef == 0.0:
                entropy = entropy.detach()  # metric only: no backward through the entropy
            entropy_term, entropy_metrics = self.entropy_loss(entropy=entropy, action_mask=mask, loss_agg_mode=agg)
            loss = loss - entropy_term
            metrics.update({f"actor/{k}": v for k, v in entropy_metrics.items()})
        if self.aux_loss_enabled:
            # as in DPOTrainer: the MoE load-balancing loss is added once per micro-batch
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss
        append_process_means(self._metrics[mode], metrics, self.accelerator.gather, self.accelerator.device)
        if return_outputs:
            return loss, result[1]
        return loss


__all__ = ["TrinityDPOConfig", "TrinityDPOTrainer"]
