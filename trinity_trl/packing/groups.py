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
micro-batch); with ``"micro_batch"`` each micro-batch's mean weighs its own rows, so whole groups change
the gradient (and a seeded run) against TRL's random split.

Hence the default (``None``, `resolve_whole_groups`): on exactly where the gradient is provably unchanged
(and there is more than one micro-batch per generation batch), TRL's row shuffle elsewhere, ``"micro_batch"``
included. ``True`` turns it on anyway, ``False`` off.

Where the generation batch is not made of such blocks (CHORD's appended expert rows, StepGRPO's
per-step rows, groups split across processes), TRL's row shuffle runs instead, with one log line
where the option was set to ``True``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
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


def resolve_whole_groups(
    requested: bool | None,
    loss_normalization: str,
    loss_agg_mode: str,
    steps_per_generation: int,
    gradient_accumulation_steps: int,
    per_device_train_batch_size: int,
    num_generations: int,
) -> tuple[bool, str]:
    """``(on, why)``: whether generation batches are shuffled by groups, for ``prefix_packing_whole_groups`` =
    ``requested`` (``None``: on exactly where the optimizer step's gradient is provably unchanged; see the module
    docs)."""
    if requested is not None:
        return bool(requested), "set"
    if steps_per_generation <= 1:
        return False, "one micro-batch per generation batch holds whole groups already"
    if per_device_train_batch_size % num_generations:
        return False, "micro-batches are not whole groups (per_device_train_batch_size not a multiple of G)"
    if loss_normalization != "global":
        return False, f"loss_normalization={loss_normalization!r}: whole groups would change each micro-batch's mean"
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return False, "seq-mean-token-sum-norm normalises per micro-batch"
    if gradient_accumulation_steps % steps_per_generation:
        return False, "steps_per_generation does not divide gradient_accumulation_steps"
    return True, "the step's gradient is unchanged (global normalisation, whole generation batches per step)"


def trainer_whole_groups(trainer: Any) -> tuple[bool, str]:
    """`resolve_whole_groups` for ``trainer``'s config and algorithm."""
    args = trainer.args
    return resolve_whole_groups(
        getattr(args, "prefix_packing_whole_groups", False),
        getattr(args, "loss_normalization", "micro_batch"),
        trainer.algorithm.loss_agg_mode,
        args.steps_per_generation,
        args.gradient_accumulation_steps,
        args.per_device_train_batch_size,
        trainer.num_generations,
    )


@contextlib.contextmanager
def whole_groups(trainer: Any) -> Iterator[None]:
    """While TRL's ``_prepare_inputs`` runs: shuffle generation batches by groups instead of rows, where the
    trainer's ``args.prefix_packing_whole_groups`` asks for it or its default turns it on (see the module docs)."""
    on, _ = trainer_whole_groups(trainer)
    if not on:
        yield
        return
    explicit = getattr(trainer.args, "prefix_packing_whole_groups", None) is not None
    import trl.trainer.grpo_trainer as grpo

    row_shuffle = grpo.shuffle_sequence_dict
    group = trainer.num_generations
    logged = trainer.__dict__.setdefault("_whole_groups_logged", set())

    def shuffle(batch):
        reason = group_blocks_reason(batch, group)
        if reason is None:
            return shuffle_groups(batch, group)
        if reason not in logged:
            logged.add(reason)
            (logger.warning if explicit else logger.debug)(
                "prefix_packing_whole_groups: TRL's row shuffle for this batch: %s", reason
            )
        return row_shuffle(batch)

    grpo.shuffle_sequence_dict = shuffle
    try:
        yield
    finally:
        grpo.shuffle_sequence_dict = row_shuffle
