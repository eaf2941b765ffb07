"""Token-budget micro-batches: the micro-batches of one optimizer step forwarded in as few packed forwards as a token
budget allows (``prefix_packing_token_budget``, docs/prefix-packing.md#token-budget).

TRL forwards each micro-batch of an optimizer step on its own: ``gradient_accumulation_steps`` (and, with
``steps_per_generation`` above 1, the slices of one buffered generation batch) padded forwards. A packed micro-batch
forwards a fraction of those tokens (each group's prompt once, no padding), so several micro-batches fit in the tokens
of one padded micro-batch. Here they share one packed forward and one backward.

**Window.** The micro-batches that can share a forward are the consecutive ones of one *window*: inside one optimizer
step and one buffered generation batch (TRL generates a batch, splits it into ``steps_per_generation`` micro-batches
and hands them out one per ``training_step``). When the window's first micro-batch arrives, every micro-batch of the
window is already in TRL's buffer, so the window is planned then, from their token counts.

**Plan.** Consecutive micro-batches are grouped greedily into *bins*: a micro-batch joins the open bin while the bin's
packed tokens stay within the budget (and within ``prefix_packing_max_token_ratio`` of its padded tokens, as packing
itself requires); else it opens the next bin. The packed tokens of a bin are counted exactly without building its
prefix tree (`WindowTokens`: the window's distinct rows sorted once, a tree's size read from neighbours' common
prefixes), rounded up to the kernel's block, so a bin's forward holds at most the budget. A micro-batch over the
budget on its own is a bin of its own and runs as it would without a budget (never dropped, never split).

**Run.** A bin runs at the ``training_step`` of its last member; the window's last bin ends on the window's last
micro-batch, so the optimizer step's synchronising micro-batch (DDP's gradient all-reduce) is always the last one of a
forward. The earlier members' ``training_step`` return a zero loss (a leaf tensor: its backward touches no parameter,
no DDP hook, no all-reduce) and run no forward. The bin's ``training_step`` forwards all its members' rows as one
packed row and returns ``sum_m loss_m``, each member's loss computed from its own rows of that forward exactly as the
member would be alone (its own aggregation and normalisation, its own guards and metrics, divided by the accumulation
steps), so the gradient of the optimizer step equals the sum of the unmerged micro-batches' gradients, and the loss
transformers logs (the sum over the step's ``training_step`` calls) is unchanged.

**Fallback.** Where the packed forward of a bin does not run (packing declined it: ``auto``'s verdict is padded, an
input that cannot be packed), the bin's members run one by one at the bin's ``training_step``, each its own forward
and backward (the earlier ones under ``no_sync``): the same gradient, never a padded forward of several micro-batches.
A bin is planned only where packing can run at all (packing on, a supported model, a kernel for the device, no MoE
auxiliary loss or multimodal input); elsewhere every micro-batch is a bin of its own.

**Where it is refused.** DeepSpeed (whose engine counts its own micro-steps and reduces gradients on each), FSDP
(which reduce-scatters in every backward of a sharded model) and CHORD's appended expert rows are not shown exact
under merged forwards: the default budget is then switched off with one log line, and a budget set by the user is an
error when the trainer is built.

**Measured, not assumed.** The budget bounds the tokens of a forward; the activation memory of a packed forward is not
proportional to them (tree attention gathers each node's ancestor keys), so whether a budget fits is measured on the
GPU (docs/prefix-packing.md#token-budget).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .trl_generation import FORWARD_KEYS

logger = logging.getLogger("trinity_trl")

#: the engines under which merged forwards are not shown exact (`resolve_token_budget`)
REFUSED_ENGINES = ("deepspeed", "fsdp")
#: the keys a forward reads from a micro-batch
ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


def resolve_token_budget(
    requested: int | None, trainer: str, engine: str, expert_rows: bool, prefix_packing: bool
) -> int | None:
    """The budget a trainer runs with: ``None`` (the default: one padded micro-batch's tokens), a positive number of
    tokens, or ``0`` (off: one forward per micro-batch).

    ``requested``: ``prefix_packing_token_budget``; ``engine``: `trinity_trl.training.engines.engine_of`;
    ``expert_rows``: the trainer appends expert rows to its generation batches (ChordTrainer). Where merged forwards
    are not shown exact (DeepSpeed, FSDP, expert rows) the default is switched off with one log line and a budget the
    user set raises ``ValueError``."""
    if requested == 0 or not prefix_packing:
        return 0
    reason = None
    if engine in REFUSED_ENGINES:
        reason = f"{'DeepSpeed' if engine == 'deepspeed' else 'FSDP'} reduces gradients in every backward"
    elif expert_rows:
        reason = f"{trainer} appends expert rows to each micro-batch"
    if reason is None:
        return requested
    if requested is not None:
        raise ValueError(
            f"prefix_packing_token_budget={requested} is not supported here: {reason}, and merged forwards are not "
            "tested exact there; leave it unset or set it to 0"
        )
    logger.warning("prefix_packing_token_budget: off (one forward per micro-batch): %s", reason)
    return 0


# ---------------------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class WindowTokens:
    """The packed tokens of any set of a window's micro-batches, exactly, without building a prefix tree.

    A prefix tree over a set of token sequences holds ``sum of their lengths - sum of the common prefixes of
    neighbours in lexicographic order`` tokens (each sequence adds what it does not share with the one before it);
    for a subset, the common prefix of two neighbours is the smallest common prefix between them in the order of the
    whole set. So the window's distinct rows are sorted once (`of`) and any union of micro-batches is counted on the
    host (`packed_tokens`): the tokens of the packed row `trinity_trl.packing.pack_rows` builds, before the kernel's
    block padding.

    Attributes:
        rows: per micro-batch, the sorted positions of its rows among the window's distinct rows.
        lengths: per distinct row (lexicographic order), its tokens.
        shared: per distinct row, the tokens it shares with the one before it (0 for the first).
        padded: per micro-batch, its rows times its padded width (what TRL forwards).
    """

    rows: list[list[int]]
    lengths: list[int]
    shared: list[int]
    padded: list[int]

    @classmethod
    def of(cls, micro_batches: Sequence[dict[str, Any]]) -> WindowTokens:
        """The window of ``micro_batches`` (TRL's dicts of one generation batch, equal widths; ``prompt_*`` then
        ``completion_*`` are a row's tokens where its masks are 1), with one host synchronisation."""
        ids = torch.cat([torch.cat([b["prompt_ids"], b["completion_ids"]], 1) for b in micro_batches])
        mask = torch.cat([torch.cat([b["prompt_mask"], b["completion_mask"]], 1) for b in micro_batches]) != 0
        width = ids.shape[1]
        # each row's tokens from its first one on (one contiguous run: `pack_rows` requires it), then -1
        first, count = mask.to(torch.int32).argmax(1), mask.sum(1)
        columns = torch.arange(width, device=ids.device)
        aligned = ids.gather(1, (first[:, None] + columns).clamp(max=width - 1))
        aligned = aligned.masked_fill(columns >= count[:, None], -1)
        distinct, inverse = torch.unique(aligned, dim=0, return_inverse=True)  # sorted: -1 below every token
        lengths = (distinct >= 0).sum(1)
        same = (distinct[1:] == distinct[:-1]) & (distinct[:-1] >= 0)
        shared = torch.cat([lengths.new_zeros(1), same.to(torch.int64).cumprod(1).sum(1)])
        host = torch.cat([inverse, lengths, shared]).tolist()
        n, d = inverse.numel(), distinct.shape[0]
        inverse_h, lengths_h, shared_h = host[:n], host[n : n + d], host[n + d :]
        rows, start = [], 0
        for b in micro_batches:
            stop = start + b["prompt_ids"].shape[0]
            rows.append(sorted(set(inverse_h[start:stop])))
            start = stop
        padded = [b["prompt_ids"].shape[0] * width for b in micro_batches]
        return cls(rows, lengths_h, shared_h, padded)

    def packed_tokens(self, members: Sequence[int]) -> int:
        """The tokens of the prefix tree of micro-batches ``members`` forwarded together."""
        chosen = sorted({r for m in members for r in self.rows[m]})
        total, previous = 0, None
        for r in chosen:
            common = 0
            if previous is not None:  # the smallest common prefix between the neighbours previous .. r
                common = min(self.shared[previous + 1 : r + 1])
            total += self.lengths[r] - common
            previous = r
        return total


def plan_bins(
    window: WindowTokens,
    budget: int,
    max_token_ratio: float = 1.0,
    pad: Callable[[int], int] = lambda n: n,
) -> list[int]:
    """Sizes of the consecutive bins the window's micro-batches are forwarded in (they sum to their number).

    Greedy, which gives the fewest consecutive bins: a micro-batch joins the open bin while the bin's packed tokens
    (``pad``-ded to the kernel's block) stay at most ``budget`` and at most ``max_token_ratio`` of its padded tokens
    (packing's own condition); a micro-batch that fits in no bin with another is a bin of its own."""
    count = len(window.rows)
    sizes: list[int] = []
    start = 0
    for end in range(2, count + 1):
        if end - start == 1:
            continue  # a bin holds at least its first micro-batch
        members = range(start, end)
        tokens = pad(window.packed_tokens(members))
        if tokens > budget or tokens > max_token_ratio * sum(window.padded[m] for m in members):
            sizes.append(end - 1 - start)
            start = end - 1
    if start < count:
        sizes.append(count - start)
    return sizes


# ----------------------------------------------------------------------------------------------------------- run
@dataclass(frozen=True)
class MicroStep:
    """Where a ``training_step`` stands, read from transformers' and TRL's loop by the trainer at each call.

    ``optimizer_step``: ``state.global_step``; ``accumulation_steps``: the ``training_step`` calls of this optimizer
    step (``current_gradient_accumulation_steps``); ``synchronizes``: the accelerator syncs gradients in this call
    (the step's last micro-batch); ``buffered``: the micro-batches of the current generation batch (TRL's buffer),
    ``None`` outside TRL's loop; ``index``: this micro-batch's place in it."""

    optimizer_step: int
    accumulation_steps: int
    synchronizes: bool
    buffered: Sequence[dict[str, Any]] | None
    index: int


@dataclass
class _Window:
    expected: list[dict[str, Any]]  # the window's micro-batches, in the order they come
    ends: set[int]  # positions (1-based counts of members seen) at which a bin runs
    pending: list[dict[str, Any]] = field(default_factory=list)
    seen: int = 0


#: a micro-batch's loss, normalised as if alone; ``forward``: its rows' ``(logps, entropies, aux_loss)`` from a merged
#: forward, ``None``: it runs its own forward
MemberLoss = Callable[[torch.nn.Module, dict[str, Any], "tuple | None"], torch.Tensor]


class TokenBudget:
    """Runs the training micro-batches of each optimizer step in token-budget bins (see the module docs).

    Args:
        budget: `resolve_token_budget`'s result: ``None`` (one padded micro-batch's tokens), tokens, or 0 (off).
        packing: the trainer's `trinity_trl.packing.PrefixPacking` (asked whether and with which kernel a forward
            can be packed; never run here).
        forward: ``forward(model, input_ids, attention_mask, logits_to_keep, batch_size)`` -> ``(logps, entropies,
            aux_loss)`` of a PACKED forward of the rows, or ``None`` where packing declines (no padded fallback).
        backward: the accelerator's ``backward``; ``no_sync``: its ``no_sync(model)`` (the fallback's earlier members).
        metrics: appends training metrics (``packing/forwards_per_step``).
        aux_loss: the model adds an MoE auxiliary loss (not per micro-batch: never merged).
    """

    def __init__(
        self,
        budget: int | None,
        packing: Any,
        forward: Callable[..., tuple | None],
        backward: Callable[[torch.Tensor], None],
        no_sync: Callable[[torch.nn.Module], Any],
        metrics: Callable[[dict[str, float]], None],
        aux_loss: bool = False,
    ):
        if budget is not None and budget < 0:
            raise ValueError(f"prefix_packing_token_budget must be >= 0 (0: off), got {budget}")
        self.budget = budget
        self.enabled = budget != 0
        self._packing = packing
        self._forward = forward
        self._backward = backward
        self._no_sync = no_sync
        self._metrics = metrics
        self._aux_loss = aux_loss
        self._window: _Window | None = None
        self._optimizer_step: int | None = None
        self._calls = 0  # training_step calls of this optimizer step so far
        self._forwards = 0  # training forwards of this optimizer step so far
        self._logged: set[str] = set()

    # ------------------------------------------------------------------------------------------- the seam
    def loss(self, model: torch.nn.Module, inputs: dict[str, Any], step: MicroStep, member_loss: MemberLoss):
        """The loss ``training_step`` backpropagates for micro-batch ``inputs`` (see the module docs): a zero leaf
        while its bin waits for later members, else the sum of the bin's members' losses."""
        if step.optimizer_step != self._optimizer_step:
            self._optimizer_step, self._calls, self._forwards, self._window = step.optimizer_step, 0, 0, None
        window = self._window
        if window is None:
            window = self._window = self._plan(model, inputs, step)
        if window.seen >= len(window.expected) or inputs is not window.expected[window.seen]:
            # not the micro-batch the plan expected (a loop the plan does not know): what waits runs now, each alone
            loss = self._alone(model, [*window.pending, inputs], member_loss)
            self._window = None
        else:
            window.pending.append(inputs)
            window.seen += 1
            last = window.seen == len(window.expected)
            if window.seen in window.ends or last or step.synchronizes:
                loss = self._run(model, window.pending, member_loss)
                window.pending = []
                if last or step.synchronizes:
                    self._window = None
            else:
                loss = torch.zeros((), device=inputs["completion_ids"].device, requires_grad=True)
        self._calls += 1
        if step.synchronizes:
            self._metrics({"packing/forwards_per_step": float(self._forwards)})
            self._optimizer_step, self._calls, self._forwards, self._window = None, 0, 0, None
        return loss

    # ------------------------------------------------------------------------------------------------ plan
    def _plan(self, model: torch.nn.Module, inputs: dict[str, Any], step: MicroStep) -> _Window:
        buffered, index = step.buffered, step.index
        if buffered is None or not 0 <= index < len(buffered) or buffered[index] is not inputs:
            return _Window([inputs], set())
        count = max(1, min(len(buffered) - index, step.accumulation_steps - self._calls))
        members = list(buffered[index : index + count])
        pad = self._mergeable(model, members)
        if pad is None or count == 1:
            return _Window(members, set(range(1, count + 1)))
        budget = self.budget if self.budget is not None else members[0]["prompt_ids"].shape[0] * _width(members[0])
        budget = min(budget, self._cap(model, members[0]))
        sizes = plan_bins(WindowTokens.of(members), budget, self._packing.max_token_ratio, pad)
        ends, total = set(), 0
        for size in sizes:
            total += size
            ends.add(total)
        return _Window(members, ends)

    def _mergeable(self, model: torch.nn.Module, members: list[dict[str, Any]]) -> Callable[[int], int] | None:
        """The kernel's token padding where ``members`` can share a packed forward, else ``None``."""
        packing = self._packing
        if not packing.enabled or self._aux_loss or packing.model_reason(model) is not None:
            return None
        if any(m.get(k) is not None for m in members for k in FORWARD_KEYS):  # multimodal rows: packing declines
            return None
        if any(k not in m for m in members for k in ROW_KEYS) or len({_width(m) for m in members}) != 1:
            self._log_once("the micro-batches of this generation batch differ in width; one forward each")
            return None
        kernel = packing.choice(model, members[0]["prompt_ids"].device).kernel
        if kernel is None:
            return None
        return lambda n: 0 if n == 0 else max(n + (-n % kernel.pad_multiple), kernel.min_tokens)

    def _cap(self, model: torch.nn.Module, first: dict[str, Any]) -> int:
        """The most tokens a bin may hold whatever the budget: under ``auto``'s measurement (CUDA), a merged forward
        follows the verdict measured on one micro-batch (`_chunk_rows`), whose shape holds one padded micro-batch's
        tokens; elsewhere no cap."""
        if not self._packing.choice(model, first["prompt_ids"].device).calibrate:
            return torch.iinfo(torch.int64).max
        cap = first["prompt_ids"].shape[0] * _width(first)
        if self.budget is not None and self.budget > cap:
            self._log_once(
                f"prefix_packing_token_budget={self.budget} is capped at {cap} tokens (one padded micro-batch): "
                "with prefix_packing_kernel='auto' on CUDA a merged forward follows the verdict measured on one "
                "micro-batch; force a kernel for larger bins"
            )
        return cap

    def _chunk_rows(self, model: torch.nn.Module, members: list[dict[str, Any]]) -> int | None:
        """The ``batch_size`` of a merged forward: under ``auto``'s measurement the rows of one micro-batch, so that
        packing applies the verdict of that shape (TRL's chunked-forward rule) and measures no merged shape;
        elsewhere ``None`` (one packed row)."""
        first = members[0]
        return (
            first["prompt_ids"].shape[0] if self._packing.choice(model, first["prompt_ids"].device).calibrate else None
        )

    # ------------------------------------------------------------------------------------------------- run
    def _run(self, model: torch.nn.Module, members: list[dict[str, Any]], member_loss: MemberLoss) -> torch.Tensor:
        if len(members) == 1:
            self._forwards += 1
            return member_loss(model, members[0], None)
        ids = torch.cat([torch.cat([m["prompt_ids"], m["completion_ids"]], dim=1) for m in members])
        mask = torch.cat([torch.cat([m["prompt_mask"], m["completion_mask"]], dim=1) for m in members])
        forward = self._forward(
            model, ids, mask, members[0]["completion_ids"].shape[1], self._chunk_rows(model, members)
        )
        if forward is None:
            return self._alone(model, members, member_loss)
        self._forwards += 1
        logps, entropies, _ = forward
        loss = None
        for m, rows in zip(members, member_rows(members), strict=True):
            part = member_loss(model, m, (logps[rows], None if entropies is None else entropies[rows], None))
            loss = part if loss is None else loss + part
        return loss

    def _alone(self, model: torch.nn.Module, members: list[dict[str, Any]], member_loss: MemberLoss) -> torch.Tensor:
        """Each member its own forward and backward (the earlier ones under ``no_sync``); the last one's loss is
        returned for ``training_step``'s backward, with the earlier losses added as constants (logging only)."""
        done = None
        for m in members[:-1]:
            with self._no_sync(model):
                part = member_loss(model, m, None)
                self._backward(part)
            self._forwards += 1
            done = part.detach() if done is None else done + part.detach()
        self._forwards += 1
        last = member_loss(model, members[-1], None)
        return last if done is None else last + done

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            logger.warning("prefix_packing_token_budget: %s", message)


def member_rows(members: Sequence[dict[str, Any]]) -> list[slice]:
    """Each member's rows in the forward of ``members`` concatenated in order."""
    out, row = [], 0
    for m in members:
        out.append(slice(row, row + m["completion_ids"].shape[0]))
        row = out[-1].stop
    return out


def _width(micro_batch: dict[str, Any]) -> int:
    return micro_batch["prompt_ids"].shape[1] + micro_batch["completion_ids"].shape[1]
