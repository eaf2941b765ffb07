"""Whole groups per micro-batch (``prefix_packing_whole_groups``).

TRL shuffles each generation batch by ROWS before splitting it into ``steps_per_generation``
micro-batches, so with more than one micro-batch per generation batch a group's completions are
scattered and share their prompt less. With this option the generation batch is shuffled by GROUPS
(blocks of ``num_generations`` consecutive rows with the same prompt, as TRL's sampler lays them
out), so a micro-batch of ``per_device_train_batch_size`` rows (a multiple of ``num_generations``)
holds whole groups.

The rows an optimizer step trains on are the same either way; only which of them share a
micro-batch changes. With ``loss_normalization="global"`` (every token of the optimizer step weighs
the same, counted over the whole generation batch) and whole generation batches per optimizer step
(``steps_per_generation`` dividing ``gradient_accumulation_steps``), that leaves the step's gradient
unchanged up to float rounding, except with ``loss_agg_mode="seq-mean-token-sum-norm"`` (always per
micro-batch); with ``"micro_batch"`` each micro-batch's mean weighs its own rows, as with TRL's
random split.

Where the generation batch is not made of such blocks (CHORD's appended expert rows, StepGRPO's
per-step rows, groups split across processes), TRL's row shuffle runs instead, with one log line.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("trinity_trl")


def group_blocks_reason(batch: dict[str, Any], group: int) -> str | None:
    """Why ``batch``'s rows are not consecutive blocks of ``group`` rows with the same prompt (``None``: they are)."""
    prompt_ids, prompt_mask = batch.get("prompt_ids"), batch.get("prompt_mask")
    if not isinstance(prompt_ids, torch.Tensor) or not isinstance(prompt_mask, torch.Tensor):
        return "the generation batch has no prompt_ids / prompt_mask"
    rows = prompt_ids.shape[0]
    if group < 1 or rows % group:
        return f"{rows} rows are not whole groups of {group}"
    ids = prompt_ids.masked_fill(prompt_mask == 0, -1).view(rows // group, group, -1)
    if not bool((ids == ids[:, :1]).all()):
        return f"the rows are not consecutive groups of {group} with one prompt each"
    return None


def shuffle_groups(batch: dict[str, Any], group: int, generator: torch.Generator | None = None) -> dict[str, Any]:
    """``batch`` with its blocks of ``group`` rows in random order, each block's rows kept together (the
    values are permuted as TRL's ``shuffle_sequence_dict`` permutes them: tensors along dim 0, lists, ``None``
    and 0-dim tensors as they are)."""
    rows = len(next(v for v in batch.values() if v is not None))
    blocks = torch.randperm(rows // group, generator=generator)
    permutation = (blocks[:, None] * group + torch.arange(group)).flatten()

    def permute(v):
        if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0):
            return v
        if isinstance(v, torch.Tensor):
            return v[permutation.to(v.device)]
        return [v[i] for i in permutation.tolist()]

    return {key: permute(value) for key, value in batch.items()}
