"""`trinity_trl/training/loss.py`: every aggregation mode as a weighted token sum over a count.

The expected values come from the documented aggregation (docs/algorithms/aggregation.md)
(`trinity_trl.algorithms.agg_loss`, itself tested against the formulas in tests/algorithms/test_masked.py) on an
independent layout of the same data: one row per sample instead of segments packed in a row, the concatenated optimizer
step instead of its micro-batches.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from tolerance import approx, assert_close

from trinity_trl.algorithms import POLICY_LOSS_FN, agg_loss
from trinity_trl.algorithms.masked import AGGREGATION_MODES, AggregationMode
from trinity_trl.training.loss import LossBatch, LossNormalizer, WeightedSum, masked_finite

SPEC_EPSILON = 1e-8  # the spec's masked mean: sum / (count + 1e-8)

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def ragged_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()


def loss_batch(mask: torch.Tensor, **fields) -> LossBatch:
    """A micro-batch of ``mask`` with the optional ``fields`` of :class:`LossBatch` (its layout, global counts)."""
    return LossBatch(mask=mask, advantages=torch.zeros(mask.shape[0]), **fields)


def micro_batch(mode: str, mask: torch.Tensor, **fields) -> WeightedSum:
    return LossNormalizer("micro_batch", num_processes=1, steps_per_generation=1).plan(
        loss_batch(mask, **fields), mask, mode
    )


def test_masked_finite_keeps_trained_gradients_and_blocks_padding():
    mask = torch.tensor([[1.0, 0.0]])
    logps = torch.tensor([[-1.0, 5.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -torch.inf]])
    ratio = torch.exp(masked_finite(logps, mask) - masked_finite(old, mask))
    (ratio * mask).sum().backward()
    assert logps.grad.tolist() == [[1.0, 0.0]]
    assert masked_finite(torch.tensor([1.0, torch.nan, torch.inf]), mask).tolist() == [1.0, 0.0, 0.0]
    assert masked_finite(torch.tensor([[1, 2]]), mask).dtype == torch.long  # masks and ids pass through
    assert masked_finite(None, mask) is None


# ------------------------------------------------------------------------------------------------ bad arguments
def test_loss_batch_takes_its_fields_from_trls_dict():
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    trl_dict = {
        "completion_mask": completion_mask,
        "tool_mask": torch.tensor([[1, 0, 1], [1, 1, 0]]),
        "advantages": torch.tensor([1.0, -1.0]),
        "old_per_token_logps": torch.zeros(2, 3),
        "expert_mask": torch.tensor([False, True]),
        "segment_ids": torch.tensor([[0, -1, -1], [0, 0, -1]]),
        "global_loss_tokens": torch.tensor(7.0),
    }
    batch = LossBatch.from_trl(trl_dict)
    assert batch.mask.tolist() == [[1, 0, 0], [1, 1, 0]]  # tool-result tokens are not trained
    assert batch.old_logps is trl_dict["old_per_token_logps"] and batch.expert_rows is trl_dict["expert_mask"]
    assert batch.segment_ids is trl_dict["segment_ids"] and batch.global_tokens is trl_dict["global_loss_tokens"]
    assert batch.ref_logps is None and batch.sample_count is None and batch.global_samples is None
    assert (
        LossBatch.from_trl({"completion_mask": completion_mask, "advantages": torch.zeros(2)}).mask is completion_mask
    )


def test_global_normalization_without_global_counts_is_a_clear_error():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="global counts"):
        LossNormalizer("global", 1, 1).plan(loss_batch(mask), mask, "token-mean")


def test_unknown_normalization_is_rejected():
    with pytest.raises(ValueError, match=r"loss_normalization must be one of \('micro_batch', 'global'\), got 'step'"):
        LossNormalizer("step", 1, 1)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="Unknown loss_agg_mode 'token-sum'"):
        micro_batch("token-sum", torch.ones(2, 3))


def test_a_plan_applied_to_another_shape_is_a_clear_error():
    plan = micro_batch("token-mean", torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"planned for a \(2, 3\) batch, got a mask of shape \(2, 4\)"):
        plan(torch.zeros(2, 4), torch.ones(2, 4))
    ppo = POLICY_LOSS_FN.get("ppo")(clip_range=0.2)
    logps = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"planned for a \(2, 3\) batch"):
        ppo(
            logprob=logps, old_logprob=logps, action_mask=torch.ones(2, 4), advantages=torch.ones(2), loss_agg_mode=plan
        )


# ------------------------------------------------------------------------------ micro_batch: the documented modes
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool, torch.float32])
def test_micro_batch_plan_is_the_spec_aggregation(mode, mask_dtype):
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = ragged_mask([6, 3, 0, 1], 6).to(mask_dtype)  # an empty row counts as a row in the seq-mean modes
    loss[mask == 0] = torch.nan  # padding values never leak
    got = micro_batch(mode, mask)(loss, mask)
    want = agg_loss(torch.nan_to_num(loss), mask, mode)
    assert got.dtype == torch.float64
    # two weighted sums of the 24 values in another order; near-zero results cancel terms of the loss's magnitude;
    # the spec's means divide by (count + 1e-8), the plan by the count: 1e-8 relative at most (counts >= 1)
    assert_close(got, want, terms=loss.numel(), scale=torch.nan_to_num(loss).abs().max(), known_rtol=SPEC_EPSILON)


@pytest.mark.parametrize("mode", MODES)
def test_ppo_with_the_plan_equals_ppo_with_the_mode(mode):
    """The library loss given `WeightedSum` as its aggregation equals the same loss aggregating with the mode name:
    value, gradient and metrics (the loss still sees its plain mask)."""
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 7, generator=generator) * 3
    mask = ragged_mask([7, 5, 2, 0], 7)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5])
    results = []
    for aggregation in (mode, "plan"):
        logps = (old + 0.5 * torch.randn(4, 7, generator=torch.Generator().manual_seed(2))).requires_grad_()
        ppo = POLICY_LOSS_FN.get("ppo")(clip_range=0.2, loss_agg_mode=mode)
        plan = micro_batch(ppo.effective_loss_agg_mode, mask) if aggregation == "plan" else None
        loss, metrics = ppo(logprob=logps, old_logprob=old, action_mask=mask, advantages=advantages, loss_agg_mode=plan)
        loss.backward()
        results.append((loss.detach(), logps.grad, metrics))
    (spec_loss, spec_grad, spec_metrics), (plan_loss, plan_grad, plan_metrics) = results
    assert spec_grad.abs().sum() > 0 and spec_metrics["pg_clipfrac"] > 0  # the clip is exercised
    # the same 28 per-token terms summed in another order (a weighted sum against the mode's sums and divisions)
    terms = mask.numel()
    assert_close(plan_loss, spec_loss, terms=terms, scale=(advantages.abs().max() * (logps - old).exp().max()))
    # each gradient element is one token's term times its weight: a division and a product apart
    assert_close(plan_grad, spec_grad)
    assert plan_metrics.keys() == spec_metrics.keys()
    for key in spec_metrics:
        assert plan_metrics[key] == approx(spec_metrics[key], terms=terms), key


def test_seq_mean_token_sum_norm_divides_by_the_padded_width():
    mask = ragged_mask([2, 1], 5)
    plan = micro_batch("seq-mean-token-sum-norm", mask)
    assert plan.count.item() == 5.0
    assert plan(torch.ones(2, 5), mask).item() == approx(3 / 5, terms=3)


def test_a_mode_declared_once_is_used_by_agg_loss_and_by_the_plan(monkeypatch):
    """A mode is one entry of AGGREGATION_MODES: both aggregations build it from that declaration alone."""
    mode = AggregationMode("seq-mean-token-mean-norm", mean_within_sample=True, divide_by="width")
    monkeypatch.setitem(AGGREGATION_MODES, mode.name, mode)
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 9.0]])
    mask = ragged_mask([2, 1], 4)
    expected = ((1.0 + 2.0) / 2 + 4.0) / 4  # each sample's mean, summed, over the padded width
    assert agg_loss(loss, mask, mode.name).item() == approx(expected, terms=loss.numel())
    assert micro_batch(mode.name, mask)(loss, mask).item() == approx(expected, terms=loss.numel())
    packed = micro_batch(mode.name, mask, segment_ids=torch.tensor([[0, 1, -1, -1], [0, -1, -1, -1]]))
    assert packed(loss, mask).item() == approx((1.0 + 2.0 + 4.0) / 4, terms=loss.numel())  # three 1-token samples


# ----------------------------------------------------------------------------- segments: several samples per row
def packed_and_per_sample(mode: str):
    """Three samples (turns) of lengths 2, 3 and 1 packed in one row with untrained tokens between them, a second row
    with one sample of length 4, and a padding row; and the same samples one per row (Trinity-RFT's layout)."""
    generator = torch.Generator().manual_seed(3)
    segments = torch.tensor(
        [
            [0, 0, -1, -1, 1, 1, 1, -1, 2, -1],  # -1: observation tokens, trained by no sample
            [0, 0, 0, 0, -1, -1, -1, -1, -1, -1],
            [-1] * 10,  # padding row (sample_count 0)
        ]
    )
    mask = (segments >= 0).long()
    loss = torch.randn(segments.shape, generator=generator)
    inputs = {"segment_ids": segments, "sample_count": torch.tensor([3, 1, 0]), "step_width": torch.tensor([3, 4, 1])}
    samples = [loss[0, 0:2], loss[0, 4:7], loss[0, 8:9], loss[1, 0:4]]
    width = max(len(s) for s in samples)
    per_sample = torch.zeros(len(samples), width)
    per_sample_mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, values in enumerate(samples):
        per_sample[i, : len(values)] = values
        per_sample_mask[i, : len(values)] = 1
    return (loss, mask, inputs), (per_sample, per_sample_mask)


@pytest.mark.parametrize("mode", MODES)
def test_packed_segments_equal_one_row_per_sample(mode):
    (loss, mask, inputs), (per_sample, per_sample_mask) = packed_and_per_sample(mode)
    got = micro_batch(mode, mask, **inputs)(loss, mask)
    # seq-mean-token-sum-norm: one row per sample is padded to the widest sample (step_width), not to the packed row
    want = agg_loss(per_sample, per_sample_mask, mode)
    assert_close(got, want, terms=loss.numel(), scale=loss.abs().max())  # the same 10 values, summed another way


def test_segment_counts():
    (loss, mask, inputs), _ = packed_and_per_sample("seq-mean-token-mean")
    assert micro_batch("seq-mean-token-sum", mask, **inputs).count.item() == 4  # (row, segment) pairs with tokens
    assert micro_batch("token-mean", mask, **inputs).count.item() == 10
    assert micro_batch("seq-mean-token-sum-norm", mask, **inputs).count.item() == 4  # the widest sample
    weights = micro_batch("seq-mean-token-mean", mask, **inputs).weights
    assert weights[0, :2].tolist() == [0.5, 0.5] and weights[0, 4:7].tolist() == approx([1 / 3] * 3)
    assert weights[0, 8].item() == 1.0 and weights[1, :4].tolist() == [0.25] * 4


def test_a_segment_with_no_trained_token_is_not_a_sample():
    """A turn of a filtered group keeps its segment id but leaves the mask: it does not count."""
    segments = torch.tensor([[0, 0, -1, 1, 1]])
    mask = torch.tensor([[1, 1, 0, 0, 0]])  # segment 1 untrained
    plan = micro_batch("seq-mean-token-sum", mask, segment_ids=segments)
    assert plan.count.item() == 1


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_padding_rows_count_no_sample(mode):
    """One row per sample with padding rows (`sample_count` 0, as StepGRPO pads a batch to split evenly): the
    padding rows are not samples, so the value is the documented one over the real rows only."""
    generator = torch.Generator().manual_seed(4)
    loss = torch.randn(4, 5, generator=generator)
    mask = ragged_mask([5, 2, 0, 0], 5)
    got = micro_batch(mode, mask, sample_count=torch.tensor([1, 1, 0, 0]))(loss, mask)
    # the same 20 values summed in another order (a weighted sum against per-row sums)
    tol = {"terms": loss.numel(), "scale": loss.abs().max()}
    assert_close(got, agg_loss(loss[:2], mask[:2], mode), **tol)
    # without sample_count, every row is a sample (docs/algorithms/aggregation.md#loss-agg-mode: empty rows count in B)
    assert_close(micro_batch(mode, mask)(loss, mask), agg_loss(loss, mask, mode), **tol)


# ------------------------------------------------------------------------------------------- empty masks, clamps
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["rows", "segments", "padding_rows"])
def test_an_empty_mask_gives_zero_with_a_zero_gradient(mode, layout):
    mask = torch.zeros(3, 4, dtype=torch.long)
    inputs = {
        "rows": {},
        "segments": {"segment_ids": torch.full((3, 4), -1)},
        "padding_rows": {"sample_count": torch.zeros(3, dtype=torch.long)},
    }[layout]
    values = torch.tensor([[torch.nan, torch.inf, -torch.inf, 1.0]] * 3, requires_grad=True)
    plan = micro_batch(mode, mask, **inputs)
    assert plan.count.item() >= 1  # clamped: never a division by zero
    loss = plan(values, mask)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(3, 4))


def test_micro_batch_counts_are_clamped_at_one():
    empty = torch.zeros(2, 3)
    assert micro_batch("token-mean", empty).count.item() == 1.0
    assert micro_batch("seq-mean-token-sum", empty, sample_count=torch.tensor([0, 0])).count.item() == 1.0
    assert micro_batch("seq-mean-token-sum", empty, segment_ids=torch.full((2, 3), -1)).count.item() == 1.0
    # a row without tokens keeps a finite weight (1 / clamp(0, 1)); its mask zeroes it anyway
    assert torch.isfinite(micro_batch("seq-mean-token-mean", empty).weights).all()


# -------------------------------------------------------------------------------------------------------- global
def global_counts_of(micro_batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer gathers: each generation batch's (tokens, samples), summed over processes."""
    counts = [LossNormalizer.global_counts(loss_batch(mb["mask"])) for mb in micro_batches]
    return torch.stack(counts).sum(0)


def test_global_counts_are_tokens_and_samples():
    mask = ragged_mask([3, 0, 2], 4)
    assert LossNormalizer.global_counts(loss_batch(mask)).tolist() == [5.0, 3.0]
    assert LossNormalizer.global_counts(loss_batch(mask, sample_count=torch.tensor([2, 0, 1]))).tolist() == [5.0, 3.0]
    assert LossNormalizer.global_counts(loss_batch(mask, sample_count=torch.tensor([1, 0, 0]))).tolist() == [5.0, 1.0]


def test_global_count_is_the_average_of_one_micro_step():
    normalizer = LossNormalizer("global", num_processes=2, steps_per_generation=3)
    mask = ragged_mask([4, 1], 4)
    inputs = loss_batch(mask, global_tokens=torch.tensor(60.0), global_samples=torch.tensor(12.0))
    # a division or two of float32 counts
    assert normalizer.plan(inputs, mask, "token-mean").count.item() == approx(10.0)  # 60 / (2 · 3)
    assert normalizer.plan(inputs, mask, "seq-mean-token-sum").count.item() == approx(2.0)
    assert normalizer.plan(inputs, mask, "seq-mean-token-mean").count.item() == approx(2.0)
    # seq-mean-token-sum-norm is defined per micro-batch: the padded width, whatever the normalisation
    assert normalizer.plan(inputs, mask, "seq-mean-token-sum-norm").count.item() == 4.0


def test_global_count_is_clamped_above_zero():
    normalizer = LossNormalizer("global", num_processes=1, steps_per_generation=1)
    mask = torch.zeros(2, 3)
    plan = normalizer.plan(loss_batch(mask, global_tokens=torch.tensor(0.0)), mask, "token-mean")
    assert plan.count.item() == approx(1e-8)  # the float32 clamp value
    assert plan(torch.full((2, 3), torch.inf), mask).item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_global_normalization_of_the_micro_batches_is_the_spec_over_the_whole_step(mode):
    """2 processes x 2 micro-steps with different token counts: gradient accumulation averages the micro-steps and
    DDP averages the processes, so the optimizer sees the mean of the 4 planned losses. With global normalisation
    that mean is the documented aggregation over the whole step's rows; per micro-batch it is not (token-mean)."""
    generator = torch.Generator().manual_seed(5)
    lengths = [[6, 6], [1, 2], [5, 0], [3, 6]]  # process 0: micro-batches 0, 1; process 1: 2, 3
    micro_batches = [{"loss": torch.randn(2, 6, generator=generator), "mask": ragged_mask(rows, 6)} for rows in lengths]
    tokens, samples = global_counts_of(micro_batches)
    normalizer = LossNormalizer("global", num_processes=2, steps_per_generation=2)
    planned = [
        normalizer.plan(loss_batch(mb["mask"], global_tokens=tokens, global_samples=samples), mb["mask"], mode)
        for mb in micro_batches
    ]
    step_loss = sum(plan(mb["loss"], mb["mask"]) for plan, mb in zip(planned, micro_batches)) / 4
    whole = agg_loss(
        torch.cat([mb["loss"] for mb in micro_batches]), torch.cat([mb["mask"] for mb in micro_batches]), mode
    )
    # the same 48 values summed in another order (4 planned sums averaged against one sum over the step)
    everything = torch.cat([mb["loss"] for mb in micro_batches])
    assert_close(step_loss, whole, terms=everything.numel(), scale=everything.abs().max())
    if mode == "token-mean":
        per_micro_batch = sum(micro_batch(mode, mb["mask"])(mb["loss"], mb["mask"]) for mb in micro_batches) / 4
        assert not torch.allclose(per_micro_batch, whole, rtol=1e-3)


# --------------------------------------------------------------------- the trainers' micro-batches, before and after
# Issue 54 item 1: the trainers take per-token losses and aggregate them here once. Each case runs one micro-batch
# through a trainer's own loss code (`TrinityLossMixin._micro_batch_loss` of the real trainer class, its host built
# without a model) in float64, and compares its loss, gradient with respect to the log-probs and metrics with those
# the code of commit 7fef122 gave (`micro_batch_losses_before.json`): synchronous trainers (padded rows, StepGRPO's
# packed segments, both normalisations, KL and entropy terms, CHORD/MIX training and evaluation) and asynchronous
# ones (step counts, staleness, CHORD's weights from each optimizer step's counts).
MICRO_BATCHES_BEFORE = pathlib.Path(__file__).with_name("micro_batch_losses_before.json")
ROWS, WIDTH, ACCUMULATION = 6, 7, 2
KL_ENTROPY = {"kl_loss": {"name": "k3", "kl_coef": 0.05}, "entropy_loss": {"name": "default", "entropy_coef": 0.01}}
#: `ChordConfig()` before 0.2.0 (CHORD-phi, constant mu 0.1): the values recorded before the loss contract used it
CHORD_PHI_BEFORE = {"enable_phi_function": True, "mu_peak": 0.1, "mu_valley": 0.1, "mu_decay_steps": 0}
#: (case id, trainer, config options, batch options)
TRAINER_CASES: list[tuple[str, str, dict, dict]] = [
    ("grpo", "TrinityTrainer", {**KL_ENTROPY}, {}),
    (
        "grpo-global-seqmean",
        "TrinityTrainer",
        {"loss_normalization": "global", "loss_agg_mode": "seq-mean-token-mean"},
        {},
    ),
    ("grpo-is-ratio", "TrinityTrainer", {"loss_agg_mode": "seq-mean-token-sum-norm"}, {"is_ratio": True}),
    ("gspo", "TrinityTrainer", {"algorithm": "gspo"}, {}),
    ("cispo-global", "TrinityTrainer", {"algorithm": "cispo", "loss_normalization": "global"}, {}),
    ("sapo", "TrinityTrainer", {"algorithm": "sapo", **KL_ENTROPY}, {"token_advantages": True}),
    ("rec-gspo", "TrinityTrainer", {"algorithm": "rec", "policy_loss": {"clip_mode": "gspo-one-side"}}, {}),
    ("opmd", "TrinityTrainer", {"algorithm": "opmd"}, {}),
    ("topr", "TrinityTrainer", {"algorithm": "topr", "loss_agg_mode": "seq-mean-token-sum"}, {}),
    ("sppo", "TrinityTrainer", {"algorithm": "sppo"}, {}),
    ("raft", "TrinityTrainer", {"algorithm": "raft"}, {}),
    ("importance_sampling", "TrinityTrainer", {"policy_loss": "importance_sampling"}, {}),
    ("ppo-seqmask", "TrinityTrainer", {"policy_loss": {"clip_range": 0.2, "enable_sequence_masking": True}}, {}),
    (
        "segments-global",
        "TrinityTrainer",
        {"loss_normalization": "global", "loss_agg_mode": "seq-mean-token-mean"},
        {"segments": True},
    ),
    ("guards", "TrinityTrainer", {**KL_ENTROPY}, {"poison": True}),
    ("chord", "ChordTrainer", {"expert_batch_size": 2, **KL_ENTROPY, **CHORD_PHI_BEFORE}, {"experts": 2}),
    ("chord-eval", "ChordTrainer", {"expert_batch_size": 2, **CHORD_PHI_BEFORE}, {"mode": "eval"}),
    ("chord-mu", "ChordTrainer", {"paper_config": "chord_mu", "max_steps": 50, "num_generations": 8}, {"experts": 1}),
    (
        "mix",
        "ChordTrainer",
        {"algorithm": "mix", "sft_loss_agg_mode": "seq-mean-token-mean", "expert_batch_size": 2},
        {"experts": 2},
    ),
    ("async-grpo", "AsyncTrinityTrainer", {**KL_ENTROPY}, {"staleness": True}),
    (
        "async-cispo-global",
        "AsyncTrinityTrainer",
        {"algorithm": "cispo", "loss_normalization": "global"},
        {"staleness": True},
    ),
    ("async-sapo-global", "AsyncTrinityTrainer", {"algorithm": "sapo", "loss_normalization": "global"}, {}),
    (
        "async-chord",
        "AsyncChordTrainer",
        {"expert_batch_size": 2, **CHORD_PHI_BEFORE},
        {"experts": 2, "staleness": True},
    ),
    (
        "async-mix",
        "AsyncChordTrainer",
        {"algorithm": "mix", "grpo_loss_agg_mode": "seq-mean-token-mean"},
        {"experts": 1},
    ),
]


def trainer_config(trainer: str, options: dict):
    """The config of ``trainer`` with ``options`` (``grpo_loss_agg_mode`` goes to the policy loss)."""
    import trinity_trl.trainers as trainers

    options = dict(options)
    if "grpo_loss_agg_mode" in options:
        options["policy_loss"] = {"grpo_loss_agg_mode": options.pop("grpo_loss_agg_mode")}
    config_class = getattr(trainers, trainer.replace("Trainer", "Config"))
    if config_class.__name__ == "TrinityConfig" or config_class.__name__ == "ChordConfig":
        from helpers import tiny_grpo_kwargs

        base = tiny_grpo_kwargs(output_dir="unused", gradient_accumulation_steps=ACCUMULATION)
    else:
        from async_helpers import tiny_async_kwargs

        base = tiny_async_kwargs(output_dir="unused", gradient_accumulation_steps=ACCUMULATION)
    return config_class(**{**base, **options})


def trainer_host(trainer: str, config):
    """An instance of the real trainer class ``trainer`` holding what its loss code reads, built without a model."""
    import types
    from collections import defaultdict

    import trinity_trl.trainers as trainers

    cls = getattr(trainers, trainer)
    host = object.__new__(cls)
    host.args = config
    host.components = config.take_components()
    host.algorithm = host.components.algorithm
    asynchronous = trainer.startswith("Async")
    per_micro_step = config.gradient_accumulation_steps if asynchronous else config.steps_per_generation
    host.loss_normalizer = LossNormalizer(config.loss_normalization, 1, per_micro_step)
    host.current_gradient_accumulation_steps = ACCUMULATION
    host.aux_loss_enabled = False
    host.model = torch.nn.Linear(1, 1)
    host.state = types.SimpleNamespace(global_step=5)
    host.accelerator = types.SimpleNamespace(num_processes=1)
    host._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    host._eval_policy_loss = None
    return host


def trainer_micro_batch(case: str, options: dict) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """``(TRL-style batch dict, log-probs leaf, entropies)`` of one case, float64, ``ROWS`` x ``WIDTH``."""
    generator = torch.Generator().manual_seed(sum(map(ord, case)))
    rand = lambda *shape: torch.rand(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    lengths = [7, 5, 3, 7, 1, 0] if options.get("mode") != "eval" else [7, 5, 3, 7, 2, 6]
    mask = ragged_mask(lengths, WIDTH)
    logps = (-3.0 * rand(ROWS, WIDTH) - 0.05).requires_grad_(True)
    batch = {
        "completion_mask": mask,
        "advantages": 2.0 * rand(ROWS, WIDTH) - 1.0 if options.get("token_advantages") else 2.0 * rand(ROWS) - 1.0,
        "old_per_token_logps": logps.detach() + 0.8 * rand(ROWS, WIDTH) - 0.4,
        "ref_per_token_logps": logps.detach() + 0.6 * rand(ROWS, WIDTH) - 0.3,
    }
    if options.get("is_ratio"):
        batch["importance_sampling_ratio"] = 0.5 + rand(ROWS, WIDTH)
    if options.get("segments"):
        batch["segment_ids"] = torch.tensor(
            [[0, 0, -1, 1, 1, 1, 2], [0, 0, 0, 1, 1, -1, -1], [0, 0, 0, -1, -1, -1, -1]]
            + [[0, 1, 1, 1, 2, 2, 2], [0, -1, -1, -1, -1, -1, -1], [-1] * WIDTH]
        )
        batch["completion_mask"] = mask * (batch["segment_ids"] >= 0)
        batch["sample_count"] = torch.tensor([3, 2, 1, 3, 1, 0])
        batch["step_width"] = torch.tensor([3, 3, 3, 3, 1, 1])
    experts = options.get("experts", 0)
    batch["expert_mask"] = torch.arange(ROWS) >= ROWS - experts
    if options.get("poison"):
        batch["old_per_token_logps"][0, 2] = torch.nan  # a trained token the guards drop
        batch["ref_per_token_logps"][5, 3] = torch.inf  # an untrained one they zero
    counts = LossNormalizer.global_counts(loss_batch(batch["completion_mask"], sample_count=batch.get("sample_count")))
    batch["global_loss_tokens"], batch["global_loss_rows"] = 3.0 * counts[0], 3.0 * counts[1]
    entropies = 3.0 * rand(ROWS, WIDTH)
    return batch, logps, entropies


def loss_result(loss: torch.Tensor, logps: torch.Tensor, metrics: dict) -> dict:
    (grad,) = torch.autograd.grad(loss, logps, allow_unused=True)
    grad = torch.zeros_like(logps) if grad is None else grad
    return {"loss": loss.item(), "grad": grad.tolist(), "metrics": {k: v[-1] for k, v in metrics.items()}}


def async_loss_batch(host, batch: dict, options: dict) -> tuple[LossBatch, dict]:
    """The `LossBatch` `AsyncTrinityTrainer.compute_loss` builds of ``batch``, and the step totals it reads."""
    experts = options.get("experts", 0)
    step = {
        "step_trained_tokens": torch.tensor([3.0 * float(batch["completion_mask"].sum())]),
        "step_samples": torch.tensor([3.0 * ROWS]),
        "step_expert_samples": torch.tensor([3.0 * experts]),
    }
    staleness = torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 0.0]) if options.get("staleness") else torch.zeros(ROWS)
    if experts:
        staleness[ROWS - experts :] = torch.nan
    fields = dict(
        mask=batch["completion_mask"],
        advantages=batch["advantages"],
        old_logps=batch["old_per_token_logps"],
        ref_logps=batch["ref_per_token_logps"] if host.algorithm.needs_reference else None,
        expert_rows=batch["expert_mask"] if host.supports_expert_rows else None,
        global_tokens=step["step_trained_tokens"][0],
        global_samples=step["step_samples"][0],
        staleness=staleness,
    )
    return fields, step


def run_trainer_case(trainer: str, config_options: dict, options: dict, case: str) -> dict:
    config = trainer_config(trainer, config_options)
    host = trainer_host(trainer, config)
    batch, logps, entropies = trainer_micro_batch(case, options)
    mode = options.get("mode", "train")
    entropies = entropies if host.components.entropy_loss.enabled else None
    if trainer.startswith("Async"):
        fields, step = async_loss_batch(host, batch, options)
        loss = host._micro_batch_loss(host.model, async_batch(host, fields, step), logps, entropies, None, mode)
    else:
        loss = host._micro_batch_loss(host.model, LossBatch.from_trl(batch), logps, entropies, None, mode)
    return loss_result(loss, logps, host._metrics[mode])


def async_batch(host, fields: dict, step: dict) -> LossBatch:
    """The asynchronous trainer's `LossBatch`, with CHORD's per-sample weights of this optimizer step."""
    return LossBatch(**fields, class_weights=host._class_weights(step))


#: metrics logged since the recording, by case (CISPO's share of capped weights)
METRICS_ADDED_SINCE = {case: {"actor/pg_clipfrac"} for case in ("cispo-global", "async-cispo-global")}


def test_every_trainer_case_was_recorded():
    recorded = json.loads(MICRO_BATCHES_BEFORE.read_text())["cases"]
    assert set(recorded) == {case for case, *_ in TRAINER_CASES}


@pytest.mark.parametrize("case, trainer, config_options, options", TRAINER_CASES, ids=[c[0] for c in TRAINER_CASES])
def test_each_trainer_micro_batch_gives_the_loss_gradient_and_metrics_it_gave_before(
    case, trainer, config_options, options
):
    """The loss, its gradient with respect to the log-probs and the metrics of a micro-batch through the trainer's own
    loss code equal those the code before per-token losses gave, in float64: the same per-token terms, aggregated in
    another order at most (42 tokens, terms of magnitude at most a few units)."""
    before = json.loads(MICRO_BATCHES_BEFORE.read_text())["cases"][case]
    got = run_trainer_case(trainer, config_options, options, case)
    terms = ROWS * WIDTH
    assert got["loss"] == approx(before["loss"], dtype=torch.float64, terms=terms, scale=max(1.0, abs(before["loss"])))
    assert_close(*(torch.tensor(g, dtype=torch.float64) for g in (got["grad"], before["grad"])), terms=terms, scale=1.0)
    assert set(got["metrics"]) == set(before["metrics"]) | METRICS_ADDED_SINCE.get(case, set())
    for key, value in before["metrics"].items():
        assert got["metrics"][key] == approx(value, dtype=torch.float64, terms=terms, scale=max(1.0, abs(value))), key
