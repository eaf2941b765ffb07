"""Parity with TRL 1.16's real ``GRPOTrainer._compute_loss`` for the losses TRL also has
(docs/algorithms/trl-differences.md).

The TRL method is driven unchanged: a trainer object is made without ``__init__`` and given only
the attributes ``_compute_loss`` reads (set from a real ``GRPOConfig`` the way ``GRPOTrainer.__init__``
sets them), and its log-prob helper is replaced on the instance so TRL sees our differentiable
``logprob`` tensor. If TRL renames or adds something ``_compute_loss`` needs, these tests fail loudly.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN

trl = pytest.importorskip("trl")
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from .support import spec_value  # noqa: E402

# raised by transformers' own TrainingArguments for a field we never set
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")


def test_trl_is_the_pinned_version():
    """The attribute list below mirrors trl 1.16's ``GRPOTrainer``; re-read it when TRL moves."""
    assert trl.__version__.startswith("1.16."), trl.__version__


class _SingleProcessAccelerator:
    """What ``_compute_loss`` asks of ``accelerate.Accelerator`` in a 1-process run."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


def make_trl_trainer(tmp_path, logprob: torch.Tensor, entropies: torch.Tensor, **config) -> GRPOTrainer:
    """A ``GRPOTrainer`` whose ``_compute_loss`` runs for real on the given ``logprob``."""
    args = GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **config)
    trainer = object.__new__(GRPOTrainer)
    # the same assignments as GRPOTrainer.__init__ (trl 1.16 grpo_trainer.py:782-1080)
    trainer.args = args
    trainer.max_completion_length = args.max_completion_length
    trainer.use_vllm = args.use_vllm
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer.loss_type = args.loss_type
    trainer.aux_loss_enabled = False
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.entropy_coef = args.entropy_coef
    trainer.use_adaptive_entropy = args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.beta = args.beta
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.current_gradient_accumulation_steps = 1
    trainer.accelerator = _SingleProcessAccelerator()
    trainer.model = SimpleNamespace(training=True)

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == logprob.shape[1]
        return logprob, entropies, None

    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    return trainer


def trl_loss(trainer: GRPOTrainer, data: dict[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """TRL's loss on ``data`` with ``mask`` as ``completion_mask`` (int, as TRL builds it)."""
    batch, width = mask.shape
    completion_mask = mask.to(torch.long)
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long),
        "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch, width, dtype=torch.long),
        "completion_mask": completion_mask,
        "advantages": data["advantages"],
        "old_per_token_logps": data["old_logprob"],
        # one process, GA = steps_per_generation = 1: the dapo/cispo normaliser is the token count
        "num_items_in_batch": completion_mask.sum(),
    }
    return trainer._compute_loss(trainer.model, inputs)


def _value(x: torch.Tensor) -> float:
    return x.detach().item()


def _data(data: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """docs/algorithms/reference-values.md#policy-loss-values data in ``dtype``, with a fresh ``logprob`` leaf that
    requires grad."""
    out = {k: data[k].to(dtype) for k in ("logprob", "old_logprob", "advantages")}
    out["action_mask"] = data["action_mask"]
    out["logprob"].requires_grad_(True)
    return out


def _compare(tmp_path, policy_data, ours_fn, config: dict, dtype=torch.float64):
    """Loss, gradient w.r.t. logprob, and every per-token loss (one-token masks) of ours vs TRL."""
    data = _data(policy_data, dtype)
    logprob, mask = data["logprob"], data["action_mask"]
    trainer = make_trl_trainer(tmp_path, logprob, torch.zeros_like(logprob.detach()), **config)

    ours, _ = ours_fn(**data)
    theirs = trl_loss(trainer, data, mask)
    # TRL's and our formulas over the batch's tokens, at the per-token terms' scale (spec_value's derivation in
    # tests/algorithms/support.py). On float64 data TRL's SAPO loss still differs from ours by 1.3e-7 relative (seen:
    # 0.2233231873 vs 0.2233231573), float32's rounding: some step of TRL's runs in float32, so float32's bound holds
    tol = {"dtype": torch.float32, "scale": 1.0}
    assert _value(ours) == approx(_value(theirs), terms=logprob.numel(), **tol)
    (grad_ours,) = torch.autograd.grad(ours, logprob)
    (grad_theirs,) = torch.autograd.grad(theirs, logprob)
    assert_close(grad_ours, grad_theirs, **tol)  # one token's derivative each: a few elementwise operations

    # one-token masks: with a single active token both aggregations reduce to that token's loss
    # (divided by B for the per-row modes), so this compares the per-token losses one by one
    for b, t in mask.nonzero().tolist():
        single = torch.zeros_like(mask)
        single[b, t] = True
        ours_tok, _ = ours_fn(**{**data, "action_mask": single})
        theirs_tok = trl_loss(trainer, data, single)
        assert _value(ours_tok) == approx(_value(theirs_tok), **tol), (b, t)


@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_paper_form_matches_trl_sapo(tmp_path, policy_data, tau_pos, tau_neg):
    ours = POLICY_LOSS_FN.get("sapo")(
        tau_pos=tau_pos, tau_neg=tau_neg, loss_agg_mode="seq-mean-token-mean", form="paper"
    )
    config = {"loss_type": "sapo", "sapo_temperature_pos": tau_pos, "sapo_temperature_neg": tau_neg}
    _compare(tmp_path, policy_data, ours, config)


def test_sapo_paper_form_trl_value_on_reference_data(tmp_path, policy_data):
    """docs/algorithms/trl-differences.md#sapo: TRL-style SAPO on docs/algorithms/reference-values.md#policy-loss-values
    data (float32) is 0.22332315146923065."""
    data = _data(policy_data, torch.float32)
    trainer = make_trl_trainer(tmp_path, data["logprob"], torch.zeros_like(data["logprob"].detach()), loss_type="sapo")
    ours, _ = POLICY_LOSS_FN.get("sapo")(loss_agg_mode="seq-mean-token-mean", form="paper")(**data)
    assert _value(trl_loss(trainer, data, data["action_mask"])) == spec_value(0.22332315146923065)
    assert _value(ours) == spec_value(0.22332315146923065)


def test_sapo_trinity_form_differs_from_trl(tmp_path, policy_data):
    """Guard against the comparison passing vacuously: Trinity's form is a different loss
    (docs/algorithms/trl-differences.md#sapo)."""
    data = _data(policy_data, torch.float64)
    trainer = make_trl_trainer(tmp_path, data["logprob"], torch.zeros_like(data["logprob"].detach()), loss_type="sapo")
    ours, _ = POLICY_LOSS_FN.get("sapo")(loss_agg_mode="seq-mean-token-mean", form="trinity")(**data)
    assert abs(_value(ours) - _value(trl_loss(trainer, data, data["action_mask"]))) > 0.1


@pytest.mark.parametrize("clip_range_high", [0.28, 4.0])
def test_cispo_matches_trl_cispo_with_absolute_cap(tmp_path, policy_data, clip_range_high):
    ours = POLICY_LOSS_FN.get("cispo")(clip_range_high=clip_range_high)
    config = {"loss_type": "cispo", "epsilon_high": 1.0 + clip_range_high}
    _compare(tmp_path, policy_data, ours, config)


@pytest.mark.parametrize(
    "epsilon_high, expected",
    [(1.28, -0.015564538538455963), (0.2, -0.0038359786849468946), (5.0, -0.050453174859285355)],
)
def test_cispo_trl_values_on_reference_data(tmp_path, policy_data, epsilon_high, expected):
    """docs/algorithms/trl-differences.md#cispo on docs/algorithms/reference-values.md#policy-loss-values data
    (float32), one micro-batch; 0.2 is TRL's silent default cap."""
    data = _data(policy_data, torch.float32)
    entropies = torch.zeros_like(data["logprob"].detach())
    trainer = make_trl_trainer(tmp_path, data["logprob"], entropies, loss_type="cispo", epsilon_high=epsilon_high)
    assert _value(trl_loss(trainer, data, data["action_mask"])) == spec_value(expected)
    if epsilon_high >= 1.0:  # below 1 the cap is not a Trinity clip range (clip_range_high >= 0)
        ours, _ = POLICY_LOSS_FN.get("cispo")(clip_range_high=epsilon_high - 1.0)(**data)
        assert _value(ours) == spec_value(expected)
