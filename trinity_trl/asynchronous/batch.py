"""A packed micro-batch of TRL's ``AsyncGRPOTrainer`` as the padded per-sample layout our losses read.

TRL's collator packs a micro-batch's samples into one row per process (a prefix tree: shared tokens forwarded once)
and lists the row's loss terms: which packed position predicts which trained token (``token_index``), with the
sample it belongs to (``segment_id``), its behaviour log-prob and advantage. Our losses (and their aggregation modes,
sequence-level ratios, expert rows) read ``(S, L)`` tensors, one row per sample and its trained tokens in order: the
layout of the synchronous trainers' ``(B, T)`` completions, without their untrained positions. `SampleLayout` maps
the terms there and back (a scatter, so gradients flow to the packed forward's log-probs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: TRL's keys of a packed row's tree attention (the forward's keyword arguments)
TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


@dataclass
class PackedMicroBatch:
    """One process's packed row of a micro-batch, unpadded as TRL's ``compute_loss`` reads it.

    Attributes:
        forward: the model's inputs: ``input_ids``, ``position_ids``, ``shift_labels`` ``(1, N)`` and the tree
            keywords (``tree_kv_index``, ``tree_cu_seqlens_q`` / ``_k``, ``tree_max_seqlen_q`` / ``_k``).
        token_index, old_logps, advantages, segment: ``(M,)`` the row's loss terms: the packed position whose
            prediction is the trained token, its behaviour log-prob and advantage, and its sample (``0 .. S-1``).
        samples: ``S``, the samples packed in the row (those without a trained token included).
        policy_version: ``(S,)`` the optimizer steps whose weights generated each sample (NaN: a demonstration, or a
            worker that does not say).
        model_version: ``(S,)`` the same as TRL counts it (weight syncs; NaN: a demonstration).
        expert: ``(S,)`` bool, the demonstrations (CHORD).
        group: ``(S,)`` int64, each sample's prompt group (TRL's ``group_id``: the worker's stream position).
        micro_batch: the micro-batch's counts over every process's row, as floats: ``trained_tokens``,
            ``forward_tokens``, ``mean_seq_len``, ``samples``, ``expert_samples``.
        step_mask: ``(M,)`` each loss term's value of the mask the policy loss chose over the optimizer step (1: kept;
            `trinity_trl.training.step_mask`), or ``None`` when none was chosen.
        layout: where each loss term sits in the ``(S, L)`` per-sample layout the losses read (`pad` puts term values
            there).
    """

    forward: dict[str, Any]
    token_index: torch.Tensor
    old_logps: torch.Tensor
    advantages: torch.Tensor
    segment: torch.Tensor
    samples: int
    policy_version: torch.Tensor
    model_version: torch.Tensor
    expert: torch.Tensor
    group: torch.Tensor
    micro_batch: dict[str, float]
    step_mask: torch.Tensor | None = None
    layout: SampleLayout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layout = SampleLayout(self.segment, self.samples)

    def pad(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``(M,)`` values of the row's loss terms (its own fields, or the forward's outputs at ``token_index``) as
        ``(S, L)``, ``fill`` where a sample has no token (differentiable)."""
        return self.layout.pad(values, fill)


def unpack(inputs: dict[str, Any]) -> PackedMicroBatch:
    """``inputs``: what the trainer's ``compute_loss`` receives for this process (one row of TRL's collated
    micro-batch, with the per-sample fields of `trinity_trl.asynchronous.async_grpo_seams.SampleFieldsCollator`). The
    padding TRL adds so rows of different processes stack is dropped, as TRL's own ``compute_loss`` drops it."""
    attended = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    forward = {key: inputs[key][attended].unsqueeze(0) for key in ("input_ids", "position_ids", "shift_labels")}
    forward.update({key: inputs[key][inputs[key] >= 0] for key in TREE_KEYS})
    forward["tree_max_seqlen_q"], forward["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    segment = inputs["segment_id"][selected]
    if segment.numel() > 1 and bool((segment[1:] < segment[:-1]).any()):
        raise ValueError("TRL's packed loss terms are no longer grouped by sample in order (segment_id decreases)")
    samples = int(inputs["sample_count"][0])
    micro_batch = {
        "trained_tokens": float(inputs["global_n_tokens"][0]),
        "forward_tokens": float(inputs["global_n_forward_tokens"][0]),
        "mean_seq_len": float(inputs["mean_seq_len"][0]),
        "samples": float(inputs["global_n_samples"][0]),
        "expert_samples": float(inputs["global_n_expert"][0]),
    }
    return PackedMicroBatch(
        forward=forward,
        token_index=inputs["token_index"][selected],
        old_logps=inputs["old_log_probs"][selected],
        advantages=inputs["advantages"][selected],
        segment=segment,
        samples=samples,
        policy_version=inputs["sample_policy_version"][0, :samples],
        model_version=inputs["sample_model_version"][0, :samples],
        expert=inputs["sample_expert"][0, :samples] != 0,
        group=inputs["sample_group"][0, :samples],
        micro_batch=micro_batch,
        step_mask=inputs["step_mask"][selected] if "step_mask" in inputs else None,
    )


class SampleLayout:
    """Where each of a row's ``M`` loss terms sits in the ``(S, L)`` layout of its ``S`` samples: sample ``s``'s
    trained tokens in order in row ``s``, ``L`` the most any sample has (at least 1).

    Args:
        segment: ``(M,)`` each term's sample, non-decreasing (TRL lists a row's terms sample by sample, each sample's
            in token order).
        samples: ``S``.
    """

    def __init__(self, segment: torch.Tensor, samples: int):
        counts = torch.bincount(segment, minlength=samples) if segment.numel() else segment.new_zeros(samples)
        if counts.numel() != samples:
            raise ValueError(f"loss terms name sample {int(segment.max())}, but the row holds {samples} samples")
        self.shape = (samples, max(1, int(counts.max())) if samples else 1)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(segment.numel(), device=segment.device) - starts[segment]
        self.flat = segment * self.shape[1] + position  # (M,) index into the flattened (S, L)
        self.mask = (torch.arange(self.shape[1], device=segment.device).unsqueeze(0) < counts.unsqueeze(1)).to(
            torch.float32
        )

    def pad(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``(M,)`` term values as ``(S, L)``, ``fill`` where a sample has no token (differentiable)."""
        out = values.new_full((self.shape[0] * self.shape[1],), fill)
        return out.scatter(0, self.flat, values).view(self.shape)
