"""The per-sample layout of a packed micro-batch (trinity_trl/asynchronous/batch.py)."""

from __future__ import annotations

import pytest
import torch
from async_helpers import packed_batch, rollout_sample

import trinity_trl.trainers.async_trinity  # noqa: F401 (imports TRL's experimental module without its warning)
from trinity_trl.asynchronous.async_grpo_seams import EXPERT_KEY, POLICY_VERSION_KEY
from trinity_trl.asynchronous.batch import SampleLayout, unpack


def test_terms_land_in_their_samples_row_in_order_and_gradients_flow_back():
    segment = torch.tensor([0, 0, 0, 2, 2, 3])  # sample 1 has no trained token
    layout = SampleLayout(segment, samples=4)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], requires_grad=True)
    padded = layout.pad(values, fill=-9.0)
    assert padded.tolist() == [[1, 2, 3], [-9, -9, -9], [4, 5, -9], [6, -9, -9]]
    assert layout.mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0]]
    (padded * layout.mask * torch.arange(12.0).view(4, 3)).sum().backward()
    assert values.grad.tolist() == [0.0, 1.0, 2.0, 6.0, 7.0, 9.0]


def test_a_row_without_trained_tokens():
    layout = SampleLayout(torch.zeros(0, dtype=torch.long), samples=2)
    assert layout.shape == (2, 1) and layout.mask.sum() == 0
    assert layout.pad(torch.zeros(0)).tolist() == [[0.0], [0.0]]


def test_unpack_reads_trls_row_and_our_fields():
    samples = [
        rollout_sample([5, 6, 7], [8, 9], [-0.5, -0.25], 1.5, group_id=0, metrics={POLICY_VERSION_KEY: 3.0}),
        rollout_sample([5, 6, 7], [8, 10, 11], [-1.0, -2.0, -3.0], -1.5, group_id=0, metrics={POLICY_VERSION_KEY: 2.0}),
        rollout_sample([5, 6], [12], [0.0], 0.0, group_id=0, metrics={EXPERT_KEY: 1.0}),
        rollout_sample([5], [13, 14], [-1.0, -1.0], 0.0, group_id=1, trained=False, metrics={POLICY_VERSION_KEY: 1.0}),
    ]
    packed = unpack(packed_batch(samples, pad_token_id=0))
    assert packed.samples == 4
    assert packed.expert.tolist() == [False, False, True, False]
    assert packed.policy_version[[0, 1, 3]].tolist() == [3.0, 2.0, 1.0]
    layout = packed.layout  # the per-sample layout unpack builds
    assert packed.pad(packed.old_logps).tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0], [0.0, 0.0, 0.0], [0.0] * 3]
    assert packed.pad(packed.advantages)[:, 0].tolist() == [1.5, -1.5, 0.0, 0.0]
    assert layout.mask.sum(1).tolist() == [2.0, 3.0, 1.0, 0.0]  # the untrained sample stays a (masked) sample
    assert packed.micro_batch["samples"] == 4.0 and packed.micro_batch["expert_samples"] == 1.0
    assert packed.micro_batch["trained_tokens"] == 6.0


def test_terms_out_of_sample_order_are_refused():
    batch = packed_batch([rollout_sample([5], [6, 7], [-1.0, -1.0], 1.0, group_id=0)] * 2, pad_token_id=0)
    selected = batch["token_index"][0] >= 0
    batch["segment_id"][0, selected] = batch["segment_id"][0, selected].flip(0)
    with pytest.raises(ValueError, match="no longer grouped by sample"):
        unpack(batch)
