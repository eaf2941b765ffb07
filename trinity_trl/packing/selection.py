"""The one place that decides how a forward runs: packed with which kernel, or TRL's padded rows.

``prefix_packing_kernel`` (`KERNEL_CHOICES`):

* a kernel name forces it: a kernel that cannot run on the training device at all (no CUDA, torch
  too old, FlashAttention not installed) is an error when the trainer is built; one that cannot run
  a given forward (a float32 model for ``varlen``/``flash_attn``) sends that forward to the padded
  layout, with one log line. A forced ``flex`` counts the graphs it compiles (`CompileBudget`);
* ``auto``: on CPU, ``sdpa_segments`` (measured faster than padded rows on CPU:
  ``benchmarks/results/prefix_packing.md``); on CUDA, the best fused kernel the software offers for
  the compute dtype (``flash_attn``, else ``varlen``; fp16/bf16 only), kept only where its real
  passes were MEASURED faster than the padded forward's on this very run, on evidence (at least three
  pairs, medians, a margin from the spread seen) and re-timed every 100 micro-batches (`Calibration`). ``auto`` never
  picks ``flex`` (its compilation costs 20-60 s whatever the verdict, and no GPU measurement has
  shown it faster than ``varlen`` yet) nor ``sdpa_segments`` on a GPU (launch-bound: 8-12x slower
  than padded rows on an H100); on other devices, the padded forward.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .kernels import KERNELS, TreeKernel

logger = logging.getLogger("trinity_trl")

KERNEL_CHOICES = ("auto", "varlen", "flash_attn", "flex", "sdpa_segments")
#: ``auto``'s candidates on CUDA, best first (FlashAttention 2 and torch's varlen_attn run the same algorithm;
#: the installed package is usually the newer build). ``flex`` is not one: it compiles (see the module docs)
CUDA_PREFERENCE = ("flash_attn", "varlen")


def check_kernel_request(kernel: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` where ``kernel`` (``prefix_packing_kernel``) can never run on ``device``."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"prefix_packing_kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if kernel == "auto":
        return
    reason = KERNELS[kernel].unavailable(torch.device(device))
    if reason is not None:
        raise ValueError(
            f"prefix_packing_kernel={kernel!r} cannot run here: {reason}. Use 'auto' (it picks what runs and is "
            "fastest) or set prefix_packing=False"
        )


@dataclass
class Choice:
    """How one forward runs: ``kernel`` (``None``: the padded forward, for ``reason``) and whether
    ``auto`` still has to measure this shape class (``calibrate``)."""

    kernel: TreeKernel | None
    reason: str | None = None
    calibrate: bool = False


def choose(requested: str, device: torch.device, dtype: torch.dtype) -> Choice:
    """The kernel for a forward on ``device`` computing in ``dtype`` (before any measurement)."""
    if requested != "auto":
        kernel = KERNELS[requested]
        reason = kernel.unavailable(device) or kernel.unsupported_dtype(dtype)
        return Choice(None, reason) if reason else Choice(kernel)
    if device.type == "cpu":
        return Choice(KERNELS["sdpa_segments"])
    if device.type != "cuda":
        return Choice(None, f"no tree-attention kernel is measured on {device.type}; padded rows there")
    for name in CUDA_PREFERENCE:
        kernel = KERNELS[name]
        if kernel.unavailable(device) is None and kernel.unsupported_dtype(dtype) is None:
            return Choice(kernel, calibrate=True)
    return Choice(
        None,
        f"no fused tree-attention kernel that 'auto' may pick for {str(dtype).removeprefix('torch.')} on CUDA with "
        f"torch {torch.__version__} (varlen needs torch >= 2.10 and fp16/bf16, flash_attn the flash-attn package and "
        "fp16/bf16; 'auto' never compiles flex: force it with prefix_packing_kernel='flex'); padded rows, which are "
        "faster than the per-node kernel on a GPU",
    )


# ============================================================================ timing
class Stopwatch:
    """Elapsed time over one or more marked intervals on the device's timeline: CUDA events (no host
    sync; read once the GPU has passed them) or, elsewhere, ``time.perf_counter``.

    ``start`` opens an interval (no-op while one is open), ``stop`` closes it; `seconds` sums
    the closed intervals once ``expected`` of them are closed. A timed forward+backward has two (the
    forward, then the backward from the first gradient reaching the outputs), so the host work the
    trainer does between them (the loss, metrics) is not counted.
    """

    def __init__(self, device: torch.device, layout: str = ""):
        self.cuda = device.type == "cuda"
        self.layout = layout
        self.expected = 1
        self._open = None
        self._intervals: list[tuple[Any, Any]] = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        if self._open is None:
            self._open = self._mark()

    def stop(self) -> None:
        if self._open is not None:
            self._intervals.append((self._open, self._mark()))
            self._open = None

    @property
    def closed(self) -> int:
        """Intervals closed so far."""
        return len(self._intervals)

    def seconds(self) -> float | None:
        """Elapsed seconds, or ``None`` while fewer than ``expected`` intervals are closed or the GPU
        has not reached their marks."""
        if len(self._intervals) < self.expected:
            return None
        if self.cuda:
            if not all(end.query() for _, end in self._intervals):
                return None
            return sum(s.elapsed_time(e) for s, e in self._intervals) / 1000.0
        return sum(e - s for s, e in self._intervals)


#: ``timer(device, layout)``: a new stopwatch for one timed run of ``layout`` ("packed" or "padded")
Timer = Callable[[torch.device, str], Stopwatch]


class _BackwardStamp(torch.autograd.Function):
    """Identity whose backward calls ``mark`` (placed on the input embeddings, it marks the end of the
    model's backward; on the outputs, its start). ``anchor`` requires grad, so it runs even where the
    embeddings are frozen."""

    @staticmethod
    def forward(ctx, hidden, anchor, mark):
        ctx.mark = mark
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        ctx.mark()
        return grad, None, None


@dataclass
class Timing:
    """The hooks `time_model` placed: ``anchors`` (tensors that require grad and lead to the
    end-of-backward mark: pass them to ``torch.autograd.grad`` with the parameters)."""

    handles: list = field(default_factory=list)
    anchors: list = field(default_factory=list)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def time_model(model: torch.nn.Module, stopwatch: Stopwatch, grad: bool) -> Timing:
    """Hooks on ``model`` (the transformers model) that time its next call on ``stopwatch``: the
    forward (from the call to its return) and, with ``grad``, the backward (from the first gradient
    reaching an output to the input embeddings). The forward hooks remove themselves."""
    timing = Timing()
    stopwatch.expected = stopwatch.closed + (2 if grad else 1)  # after any interval already closed (packing)

    def pre(module, args, kwargs):
        stopwatch.start()

    def stamp(module, args, output):
        anchor = torch.zeros((), device=output.device, requires_grad=True)
        timing.anchors.append(anchor)
        return _BackwardStamp.apply(output, anchor, stopwatch.stop)

    def post(module, args, kwargs, output):
        stopwatch.stop()
        timing.remove()
        if grad and hasattr(output, "items"):  # the backward starts where the first gradient reaches an output
            for name, value in list(output.items()):
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    anchor = torch.zeros((), device=value.device, requires_grad=True)
                    output[name] = _BackwardStamp.apply(value, anchor, stopwatch.start)
        return output

    timing.handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
    if grad:
        timing.handles.append(model.get_input_embeddings().register_forward_hook(stamp))
    timing.handles.append(model.register_forward_hook(post, with_kwargs=True))
    return timing


# ============================================================================ calibration
def shape_class(model: torch.nn.Module, grad: bool, rows: int, width: int) -> tuple:
    """Forwards whose packed-vs-padded verdict is shared: same model, with or without a backward, same
    number of rows, width rounded up to a power of two."""
    return (id(model), grad, rows, 1 << max(0, math.ceil(math.log2(max(width, 1)))))


@dataclass
class Trial:
    """What one micro-batch of a shape class runs while ``auto`` measures it.

    ``real``: the layout of the micro-batch's real pass (what the trainer trains on), timed where ``time_real``.
    ``extras``: layouts run on this micro-batch BEFORE its real pass, each timed, their gradients computed with
    ``torch.autograd.grad`` on the unwrapped model and discarded: only where the real pass cannot be timed (DDP's
    synchronising micro-batch, whose backward holds the gradient all-reduce)."""

    real: str
    time_real: bool = False
    extras: tuple[str, ...] = ()


#: the layouts of a trial's real passes, in turn: pairs in alternating order (packed then padded, then padded then
#: packed), so that a drift of the machine's speed over the trial weighs on both layouts alike
ORDER = ("packed", "padded", "padded", "packed")


@dataclass
class _Class:
    samples: dict[str, list[float]] = field(default_factory=lambda: {"packed": [], "padded": []})
    pending: list[list] = field(default_factory=list)  # [layout, stopwatch, reads so far, target] not read yet
    position: int = 0  # the trial's next position in ORDER
    passed: bool = False  # some micro-batch of the trial passed the prefix_packing_max_token_ratio check
    unpackable: int = 0  # micro-batches of the trial that could not be packed at all
    result: tuple | None = None  # (packed s, padded s, passed, margin): this rank's measurement, verdict pending
    verdict: bool | None = None  # True: packed kept
    margin: float | None = None  # the relative margin the verdict was taken with
    since: int = 0  # micro-batches of the class since its verdict or its last re-timing
    recheck: dict | None = None  # a re-timing in progress: its layouts in turn, position, samples
    trials: int = 0  # trials completed (the first, and those a re-timing reopened)
    rechecks: int = 0  # re-timings completed
    extra_runs: int = 0
    not_passing: int = 0  # trial micro-batches that failed the ratio check
    last: tuple | None = None  # this rank's last (packed s, padded s, margin)


#: ``gather(payload)`` -> every rank's payload, in rank order (``torch.distributed.all_gather_object``)
Gather = Callable[[Any], list]


def gather_objects(payload: Any) -> list:
    """Every rank's ``payload`` over the default process group (a `Gather`)."""
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, payload)
    return out


#: Student's t, two-sided 95%, by degrees of freedom (the margin's multiplier for few readings; 1.96 beyond)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18, 14: 2.14}


def t95(df: int) -> float:
    if df <= 0:
        return T95[1]
    return T95.get(df) or next((T95[k] for k in sorted(T95) if k >= df), 1.96)


#: a stopwatch not closed after this many reads (its pass never reached the end of its backward: a skipped backward,
#: a loss replaced by zero) is dropped from the samples
STALE_READS = 3


class Calibration:
    """``auto`` on CUDA: per shape class (`shape_class`), keep the layout (packed or TRL's padded rows) whose
    REAL passes timed faster on this very run, decided on evidence, re-timed so that a wrong verdict does not last.

    * **The trial** (`next_trial`): the class's real passes run packed and padded in turn, in pairs of alternating
      order (`ORDER`: packed, padded, padded, packed, ...), each timed (forward, then backward from the first
      gradient reaching the outputs to the input embeddings: `time_model`). No extra pass: a pass in the slower
      layout costs only its excess over the faster one. Where the real pass cannot be timed (DDP's synchronising
      micro-batch), its layout is timed as an extra pass before it (gradients discarded).
    * **The verdict** (`_decide`), after at least ``min_pairs`` pairs: the medians of each layout's times; the
      margin from the spread they showed: Student's t (95%, for the few readings) standard errors of the
      difference of the two medians' logarithms
      (each layout's spread estimated by the median absolute deviation of its times' logarithms, pooled over both
      layouts), at least ``min_margin``. Where one median is below the other by more than the margin, its layout is
      kept; in between, another pair, up to ``max_pairs``; then the layout of the lower median (neither is slower by
      more than the margin: a tie, either is right). One log line per verdict.
    * **Re-timing** (every ``recheck_every`` micro-batches of a decided class): three real passes timed, the kept
      layout, the other, the kept layout; where the other beat the kept layout's two (their median) by more than
      ``min_margin``, the trial runs again (a verdict that was wrong, or that the run outgrew, lasts at most
      ``recheck_every`` micro-batches and a trial). A new trial is cheap where the layouts are close, and a reading
      of the slower layout rarely beats the faster one where they are not.
    * **What it costs** (`cost`): the extra passes, plus the excess of every real pass run in the slower layout.
      A class none of whose trial micro-batches passed ``prefix_packing_max_token_ratio`` is decided padded and
      never builds its tree again.

    With several ranks (``gather``), a class's verdict is taken at `synchronize`, which every rank calls at the
    same points (each optimizer step): the medians of all ranks are summed per class (margins: the largest), so
    every rank takes the same verdict; until then the class runs padded. ``timer`` makes the stopwatches
    (injectable for tests).
    """

    def __init__(
        self,
        timer: Timer = Stopwatch,
        gather: Gather | None = None,
        min_pairs: int = 3,
        max_pairs: int = 8,
        z: float | None = None,
        min_margin: float = 0.02,
        recheck_every: int = 100,
    ):
        self.timer = timer
        self.gather = gather
        self.min_pairs, self.max_pairs, self.z, self.min_margin = min_pairs, max_pairs, z, min_margin
        self.recheck_every = recheck_every
        self.classes: dict[tuple, _Class] = {}
        self._ordinals: dict[int, int] = {}  # id(model) -> order of first sight (the same on every rank)
        self._remote: dict[tuple, bool] = {}  # verdicts gathered for classes this rank has not seen yet
        #: per class, the extra runs made (layouts): the calibration's only passes beyond training
        self.extra_runs: dict[tuple, list[str]] = {}

    # ---------------------------------------------------------------- per forward
    def calibrating(self, key: tuple) -> bool:
        """Whether this micro-batch of ``key`` takes part in a measurement (then call `next_trial`): during the
        trial, and at each re-timing of a decided class (counted here: call it once per micro-batch)."""
        c = self._see(key)
        if c.verdict is None:
            return c.result is None
        if c.recheck is None:
            c.since += 1
            if self.recheck_every and c.since >= self.recheck_every:
                c.since = 0
                kept = "packed" if c.verdict else "padded"
                other = "padded" if c.verdict else "packed"
                c.recheck = {"order": (kept, other, kept), "position": 0, "samples": {kept: [], other: []}}
        return c.recheck is not None

    def next_trial(self, key: tuple, timeable: bool, passes: bool) -> Trial | None:
        """The plan for this micro-batch of ``key``; ``None``: no measurement, run the verdict (or, pending,
        padded). ``timeable``: the real pass can be timed (no gradient all-reduce in it); ``passes``: the
        micro-batch passes the ratio check (else it can run padded only)."""
        c = self._see(key)
        self._read(key, c)
        if c.verdict is not None:
            return self._recheck_trial(key, c, timeable, passes)
        if c.result is not None:
            return None
        c.passed |= passes
        c.not_passing += not passes
        if c.not_passing >= 2 and not c.passed:  # it would never pack: padded, and the tree is not built again
            self._complete(key, c, math.inf, 0.0, self.min_margin)
            return None
        if self._decide(key, c):
            return None
        wanted = ORDER[c.position % len(ORDER)]
        if wanted == "packed" and not passes:
            return Trial("padded")  # cannot run packed: untimed, the order waits for a micro-batch that can
        c.position += 1
        if timeable:
            return Trial(wanted, time_real=True)
        return Trial(wanted, time_real=False, extras=(wanted,))

    def record(self, key: tuple, layout: str, stopwatch: Stopwatch, extra: bool = False) -> None:
        """``stopwatch`` times a pass of ``layout`` for ``key``'s measurement in progress (``extra``: a pass the
        calibration added)."""
        c = self.classes[key]
        target = "recheck" if c.verdict is not None and c.recheck is not None else "trial"
        c.pending.append([layout, stopwatch, 0, target])
        if extra:
            c.extra_runs += 1
            self.extra_runs.setdefault(key, []).append(layout)

    def unpackable(self, key: tuple) -> None:
        """A trial micro-batch of ``key`` could not be packed at all: two such and no packed one decide the class
        padded."""
        c = self._see(key)
        c.unpackable += 1
        if c.unpackable >= 2 and not c.passed and c.verdict is None and c.result is None:
            self._complete(key, c, math.inf, 0.0, self.min_margin)

    def verdict(self, key: tuple) -> bool | None:
        c = self.classes.get(key)
        return None if c is None else c.verdict

    def summary(self) -> list[dict]:
        """Per shape class: its shape, this rank's packed and padded medians (``None`` until measured), the margin,
        the verdict (``"packed"``, ``"padded"`` or ``None``), samples, extra runs, trials and re-timings."""
        rows = []
        for key, c in self.classes.items():
            grad, rows_, width = key[1:]
            packed, padded, passed, margin = c.result if c.result else (None, None, c.passed, c.margin)
            verdict = None if c.verdict is None else ("packed" if c.verdict else "padded")
            rows.append(
                {
                    "grad": grad,
                    "rows": rows_,
                    "width": width,
                    "packed_s": packed,
                    "padded_s": padded,
                    "margin": margin,
                    "passed_ratio_check": passed,
                    "verdict": verdict,
                    "samples": {k: len(v) for k, v in c.samples.items()},
                    "extra_runs": c.extra_runs,
                    "trials": c.trials,
                    "rechecks": c.rechecks,
                }
            )
        return rows

    # ---------------------------------------------------------------- across ranks
    def synchronize(self) -> None:
        """Every rank, at the same points (each optimizer step): gather the measurements of all ranks and decide,
        per class, from their sums (no-op on one process)."""
        if self.gather is None:
            return
        mine = {self._canonical(k): c.result for k, c in self.classes.items() if c.result and c.verdict is None}
        merged: dict[tuple, list] = {}
        for payload in self.gather(mine):
            for canon, (packed, padded, passed, margin) in payload.items():
                total = merged.setdefault(canon, [0.0, 0.0, False, 0.0])
                total[0] += packed
                total[1] += padded
                total[2] = total[2] or passed
                total[3] = max(total[3], margin)
        local = {self._canonical(k): k for k in self.classes}
        for canon in sorted(merged):
            packed, padded, passed, margin = merged[canon]
            verdict = self._verdict(canon[1:], packed, padded, passed, margin, ranks=True)
            if canon in local:
                c = self.classes[local[canon]]
                c.verdict, c.margin, c.result = verdict, margin, None
            else:
                self._remote[canon] = verdict

    # ---------------------------------------------------------------- internals
    def _see(self, key: tuple) -> _Class:
        if key not in self.classes:
            self._ordinals.setdefault(key[0], len(self._ordinals))
            c = self.classes[key] = _Class()
            remote = self._remote.pop(self._canonical(key), None)
            if remote is not None:
                c.verdict, c.margin = remote, self.min_margin
        return self.classes[key]

    def _canonical(self, key: tuple) -> tuple:
        return (self._ordinals[key[0]], *key[1:])

    def _read(self, key: tuple, c: _Class) -> None:
        """Move the readable stopwatches' seconds into the samples (CUDA events: read once the GPU passed them,
        never waited for)."""
        waiting = []
        for entry in c.pending:
            layout, watch, reads, target = entry
            seconds = watch.seconds()
            if seconds is None:
                entry[2] = reads + 1
                if watch.closed >= watch.expected or entry[2] < STALE_READS:
                    waiting.append(entry)  # marks set, not reached by the GPU yet; or a backward still to come
                else:
                    logger.debug("prefix packing: a timing of %s never completed; dropped", _describe(key[1:]))
                continue
            if target == "recheck" and c.recheck is not None:
                c.recheck["samples"][layout].append(seconds)
            elif target == "trial":
                c.samples[layout].append(seconds)
        c.pending = waiting

    def _spread_margin(self, times: dict[str, list[float]]) -> float:
        """The relative margin: Student's t (95%, two-sided, for the readings' degrees of freedom; ``z`` where
        given) standard errors of the difference of the two layouts' median log-times, each layout's spread the
        median absolute deviation of its log-times about its median (pooled), at least ``min_margin``."""
        deviations, counts = [], []
        for values in times.values():
            logs = [math.log(v) for v in values if v > 0]
            if not logs:
                continue
            center = statistics.median(logs)
            deviations += [abs(x - center) for x in logs]
            counts.append(len(logs))
        if len(counts) < 2 or not deviations:
            return self.min_margin
        sigma = 1.4826 * statistics.median(deviations)  # a normal spread's MAD -> its standard deviation
        se = 1.2533 * sigma * math.sqrt(sum(1 / n for n in counts))  # a median's standard error, each layout
        multiplier = self.z if self.z is not None else t95(sum(counts) - len(counts))
        return max(self.min_margin, math.expm1(multiplier * se))

    def _decide(self, key: tuple, c: _Class) -> bool:
        """Decide ``key`` from its samples where the evidence suffices (see the class docs); True once decided."""
        packed, padded = c.samples["packed"], c.samples["padded"]
        pairs = min(len(packed), len(padded))
        if pairs < self.min_pairs:
            return False
        margin = self._spread_margin(c.samples)
        mp, md = statistics.median(packed), statistics.median(padded)
        clear = mp < md / (1.0 + margin) or mp > md * (1.0 + margin)
        if not clear and pairs < self.max_pairs:
            return False
        self._complete(key, c, mp, md, margin)
        return True

    def _recheck_trial(self, key: tuple, c: _Class, timeable: bool, passes: bool) -> Trial | None:
        r = c.recheck
        if r is None:
            return None
        kept = "packed" if c.verdict else "padded"
        other = "padded" if c.verdict else "packed"
        if len(r["samples"][kept]) >= 2 and len(r["samples"][other]) >= 1:
            c.recheck = None
            c.rechecks += 1
            reference = statistics.median(r["samples"][kept])
            if r["samples"][other][0] < reference / (1.0 + self.min_margin):  # a new trial settles it
                logger.warning(
                    "prefix packing, %s: re-timed, %s %.1f ms vs %s %.1f ms: the verdict is taken again",
                    _describe(key[1:]),
                    other,
                    r["samples"][other][0] * 1e3,
                    kept,
                    reference * 1e3,
                )
                self._reopen(c)
                return self.next_trial(key, timeable, passes)
            return None
        if r["position"] >= len(r["order"]):
            return None  # all three timed, not all read yet: the kept layout meanwhile
        wanted = r["order"][r["position"]]
        if not timeable or (wanted == "packed" and not passes):
            return None  # no extra pass for a re-timing: wait for a micro-batch whose real pass can be timed
        r["position"] += 1
        return Trial(wanted, time_real=True)

    def _reopen(self, c: _Class) -> None:
        c.samples = {"packed": [], "padded": []}
        c.pending, c.position, c.passed, c.unpackable, c.not_passing = [], 0, False, 0, 0
        c.verdict, c.result, c.since = None, None, 0

    def _complete(self, key: tuple, c: _Class, packed: float, padded: float, margin: float) -> None:
        c.trials += 1
        c.since = 0
        if self.gather is None:
            c.verdict = self._verdict(key[1:], packed, padded, c.passed, margin)
            c.margin = margin
            c.result = None
        else:
            c.result = (packed, padded, c.passed, margin)
        c.last = (packed, padded, margin)

    def _verdict(
        self, shape: tuple, packed: float, padded: float, passed: bool, margin: float, ranks: bool = False
    ) -> bool:
        """Packed where its median is the lower (a trial ends either with a gap beyond the margin or, after
        ``max_pairs`` pairs, with a gap within it: then neither layout is slower by more than the margin)."""
        if not passed:
            logger.warning(
                "prefix packing, %s: no micro-batch passed prefix_packing_max_token_ratio; padded rows kept, the "
                "tree is not built again",
                _describe(shape),
            )
            return False
        verdict = packed < padded
        logger.warning(
            "prefix packing, %s: packed %.1f ms vs padded %.1f ms (medians of real passes%s; margin %.1f%%%s): %s kept",
            _describe(shape),
            packed * 1e3,
            padded * 1e3,
            ", summed over ranks" if ranks else "",
            margin * 100,
            "" if packed * (1 + margin) < padded or padded * (1 + margin) < packed else ", a tie within it",
            "packed" if verdict else "padded",
        )
        return verdict


def _describe(shape: tuple) -> str:
    grad, rows, width = shape
    return f"{rows} rows up to {width} tokens, {'forward+backward' if grad else 'forward'}"


# ============================================================================ compilation (one budget per run)
def _recompile_limit_name() -> str:
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


class CompileBudget:
    """The graphs one run compiles, whoever compiles them, and dynamo's recompile limit kept above them.

    Each user counts its signatures (``add``): a forced ``flex`` (``user="flex"``: a static graph for the first packed
    length, then a dynamic one, for each grad mode, dtype, head dim, heads and KV heads), compiled decoder layers
    (``"layers"``: one dynamic graph per grad mode and dtype, `compiled.CompiledLayers`) and compiled generation
    (``"generation"``, one graph per mode and batch bucket) all add to the one budget a trainer holds. `limit` raises
    dynamo's recompile limit (``torch._dynamo.config``, its public knob) around a compiled call so that the graphs
    counted never reach it (past the limit, torch falls back to eager: for flex, the whole score matrix). The limit
    applies per compiled function; the budget's total bounds them all."""

    def __init__(self, graphs_per_signature: int = 2, read_limit: Callable[[], int] | None = None):
        self.graphs_per_signature = graphs_per_signature
        self.signatures: dict[tuple, int] = {}  # (user, signature) -> its graphs
        self._read_limit = read_limit

    def add(self, signature: tuple, user: str = "flex", graphs: int | None = None) -> int:
        """Count ``signature`` of ``user`` (``graphs`` of them; default ``graphs_per_signature``); returns the graphs
        needed so far."""
        self.signatures.setdefault((user, signature), self.graphs_per_signature if graphs is None else graphs)
        return self.graphs

    @property
    def graphs(self) -> int:
        return sum(self.signatures.values())

    def by_user(self) -> dict[str, int]:
        """The graphs counted per user."""
        out: dict[str, int] = {}
        for (user, _), graphs in self.signatures.items():
            out[user] = out.get(user, 0) + graphs
        return out

    def current_limit(self) -> int:
        if self._read_limit is not None:
            return self._read_limit()
        import torch._dynamo.config as dynamo_config

        return getattr(dynamo_config, _recompile_limit_name())

    @contextlib.contextmanager
    def limit(self) -> Iterator[None]:
        """Within: dynamo's recompile limit at least the graphs counted (+1 spare)."""
        needed = self.graphs + 1
        if needed <= self.current_limit():
            yield
            return
        import torch._dynamo.config as dynamo_config

        with dynamo_config.patch(**{_recompile_limit_name(): needed}):
            yield


# ============================================================================ compute dtype
def _fsdp2_param_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """``param_dtype`` of the FSDP2 (``fully_shard``) mixed-precision policy over ``model``, if any.
    torch (2.11-2.13) has no public getter: the policy is read from the module's FSDP state."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for module in model.modules():
        if isinstance(module, FSDPModule):
            get_state = getattr(module, "_get_fsdp_state", None)
            state = get_state() if callable(get_state) else None
            policy = getattr(state, "_mp_policy", None)
            return getattr(policy, "param_dtype", None)
    return None


def compute_dtype(model: torch.nn.Module, device: torch.device, autocast: Any) -> torch.dtype:
    """The dtype a forward of ``model`` computes attention in: autocast's inside ``autocast()``, else
    FSDP2's mixed-precision ``param_dtype``, else the model's floating parameters'."""
    with autocast():
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    fsdp = _fsdp2_param_dtype(model)
    if fsdp is not None:
        return fsdp
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()
