"""The mask a policy loss chooses over a whole optimizer step (``needs_step_mask``: M2PO,
docs/algorithms/custom-components.md#step-mask).

M2PO masks, among every trained token of an optimizer step (each micro-batch, each process), those with the largest
squared log-ratio under the current weights. Chosen per micro-batch it is another algorithm (a micro-batch of small
log-ratios would no longer let another keep its larger ones). So before the step's first backward the trainer runs a
pass without gradient over the step's micro-batches (their log-prob forward only: about a third of the compute of
their forward and backward), gathers every process's log-ratios and advantages, asks the loss for its mask
(`PolicyLossFn.step_mask`), and hands each micro-batch its part as a batch field (`STEP_MASK_KEY`), which the loss
reads as its ``step_mask`` input. The loss zeroes the masked tokens; the aggregation still counts them.

Where the trainers call it: `trinity_trl.trainers.trinity.TrinityTrainer` at the first micro-batch of each optimizer
step, over TRL's buffered generation batch (`step_members`); `trinity_trl.trainers.async_trinity.AsyncTrinityTrainer`
in ``get_batch_samples``, which holds the step's micro-batches before the first forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the batch field that carries a micro-batch's part of the step's mask (``(B, T)``, 1: kept) to the loss
STEP_MASK_KEY = "step_mask"
#: the batch field naming the optimizer step (``global_step``) whose mask ``STEP_MASK_KEY`` holds
STEP_MASK_STEP_KEY = "step_mask_step"


def window_refusal(
    steps_per_generation: int, num_iterations: int, gradient_accumulation_steps: int, old_logps_always: bool
) -> str | None:
    """Why a synchronous trainer cannot choose the mask over each optimizer step before its first backward, else
    ``None``.

    TRL generates a batch every ``steps_per_generation * num_iterations`` micro-batches (``G``) and computes
    behaviour log-probs when an optimizer step of ``A = gradient_accumulation_steps`` micro-batches may train samples
    of earlier weights (``A`` not a multiple of ``G``) or with vLLM's correction (``old_logps_always``); without them
    every log-ratio is 0 and nothing is masked. With them, every micro-batch of a step must already be generated at
    its first micro-batch and none trained twice in it: ``G`` a multiple of ``A``, and ``steps_per_generation >= A``.
    """
    window = steps_per_generation * num_iterations
    if not (old_logps_always or gradient_accumulation_steps % window):
        return None
    if window % gradient_accumulation_steps:
        return (
            f"an optimizer step of gradient_accumulation_steps={gradient_accumulation_steps} micro-batches spans two "
            f"generation batches (one every steps_per_generation * num_iterations = {window}), so its later "
            f"micro-batches are not generated yet at its first backward; make {window} a multiple of "
            f"{gradient_accumulation_steps}"
        )
    if steps_per_generation < gradient_accumulation_steps:
        return (
            f"an optimizer step of gradient_accumulation_steps={gradient_accumulation_steps} micro-batches trains some "
            f"of the steps_per_generation={steps_per_generation} micro-batches twice; set steps_per_generation >= "
            f"{gradient_accumulation_steps}"
        )
    return None


def step_members(
    buffered: Sequence[dict[str, Any]] | None,
    micro_step: int,
    steps_per_generation: int,
    generate_every: int,
    accumulation_steps: int,
    current: dict[str, Any],
) -> list[dict[str, Any]]:
    """The micro-batches of the optimizer step that ``current`` (TRL's micro-batch of this ``training_step``) starts,
    in the order TRL hands them out: ``buffered`` is TRL's buffered generation batch, ``micro_step`` TRL's counter of
    ``training_step`` calls (``_step``), ``generate_every`` ``steps_per_generation * num_iterations``. Raises
    ``RuntimeError`` when they are not all in the buffer (a loop the trainer does not know)."""
    position = micro_step % generate_every
    if buffered is None or buffered[micro_step % steps_per_generation] is not current:
        raise RuntimeError("the step mask: this micro-batch is not the one TRL's buffer holds for this training step")
    if position + accumulation_steps > generate_every:
        raise RuntimeError(
            f"the step mask: the optimizer step starting at micro-batch {position} of {generate_every} spans two "
            "generation batches"
        )
    members = [buffered[(micro_step + i) % steps_per_generation] for i in range(accumulation_steps)]
    if len({id(m) for m in members}) != len(members):
        raise RuntimeError("the step mask: the optimizer step trains a micro-batch twice")
    return members


@dataclass(frozen=True)
class StepTokens:
    """One micro-batch's trained tokens as the mask reads them: ``log_ratio`` (``ℓ − ℓo`` under the current weights),
    ``advantages`` and ``valid`` (the trained tokens with finite values), ``(B, T)`` each."""

    log_ratio: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(cls, loss_inputs: dict[str, Any], mask: torch.Tensor) -> StepTokens:
        """From a trainer's policy-loss inputs (``logprob``, ``old_logprob``, ``advantages``: ``(B,)`` or ``(B, T)``)
        and its trained ``mask``."""
        log_ratio = (loss_inputs["logprob"] - loss_inputs["old_logprob"]).detach()
        advantages = loss_inputs["advantages"]
        if advantages.dim() < log_ratio.dim():
            advantages = advantages.reshape(-1, 1).expand(log_ratio.shape)
        valid = (mask != 0) & torch.isfinite(log_ratio) & torch.isfinite(advantages)
        return cls(log_ratio, advantages.detach(), valid)


#: gathers every process's ``(n, k)`` rows: ``(all rows in process order, offset of this process's rows)``
GatherRows = Callable[[torch.Tensor], tuple[torch.Tensor, int]]


def one_process(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    return rows, 0


def process_gather(gather: Callable, pad_across_processes: Callable, process_index: int, num_processes: int):
    """`GatherRows` from accelerate's ``gather`` and ``pad_across_processes`` (one process: `one_process`)."""
    if num_processes == 1:
        return one_process

    def gathered(rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        counts = gather(torch.tensor([rows.shape[0]], device=rows.device)).tolist()
        padded = gather(pad_across_processes(rows, dim=0)).view(num_processes, -1, rows.shape[1])
        every = torch.cat([padded[p, : counts[p]] for p in range(num_processes)])
        return every, sum(counts[:process_index])

    return gathered


def step_masks(policy_loss: Any, parts: Sequence[StepTokens], gather_rows: GatherRows = one_process) -> list:
    """Each micro-batch's ``(B, T)`` float mask (1: kept; untrained positions 1) of the mask ``policy_loss`` chooses
    over the trained tokens of ``parts`` (this process's micro-batches of the step, in order) and of every other
    process (``gather_rows``): the tokens in process order, then micro-batch, row and position order."""
    device = parts[0].log_ratio.device
    dtype = torch.promote_types(parts[0].log_ratio.dtype, parts[0].advantages.dtype)  # what a loss call would see
    rows = torch.cat(
        [
            torch.stack([p.log_ratio[p.valid].to(device, dtype), p.advantages[p.valid].to(device, dtype)], 1)
            for p in parts
        ]
    )
    every, offset = gather_rows(rows)
    keep = policy_loss.step_mask(every[:, 0], every[:, 1])[offset : offset + rows.shape[0]]
    masks, start = [], 0
    for part in parts:
        count = int(part.valid.sum())
        mask = torch.ones(part.valid.shape, dtype=torch.float32, device=device)
        mask[part.valid] = keep[start : start + count].to(torch.float32)
        masks.append(mask)
        start += count
    return masks
