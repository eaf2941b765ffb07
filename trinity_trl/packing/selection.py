"""The one place that decides how a forward runs: packed with which kernel, or TRL's padded rows.

``prefix_packing_kernel`` (:data:`KERNEL_CHOICES`):

* a kernel name forces it: a kernel that cannot run on the training device at all (no CUDA, torch
  too old, FlashAttention not installed) is an error when the trainer is built; one that cannot run
  a given forward (a float32 model for ``varlen``/``flash_attn``) sends that forward to the padded
  layout, with one log line;
* ``auto``: on CPU, ``sdpa_segments`` (measured faster than padded rows on CPU:
  ``benchmarks/results/prefix_packing.md``); on CUDA, the best fused kernel the software offers for
  the compute dtype (``flash_attn``, else ``varlen`` for fp16/bf16; ``flex``, also for fp32), kept
  only where it was MEASURED faster than the padded forward on this very run (:class:`Calibration`);
  never ``sdpa_segments`` (launch-bound on a GPU: 8-12x slower than padded rows on an H100); on other
  devices, the padded forward.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .kernels import KERNELS, TreeKernel

logger = logging.getLogger("trinity_trl")

KERNEL_CHOICES = ("auto", "varlen", "flash_attn", "flex", "sdpa_segments")
#: ``auto``'s preference on CUDA, best first (FlashAttention 2 and torch's varlen_attn run the same algorithm;
#: the installed package is usually the newer build)
CUDA_PREFERENCE = ("flash_attn", "varlen", "flex")


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
        f"no fused tree-attention kernel for {str(dtype).removeprefix('torch.')} on CUDA with torch "
        f"{torch.__version__} (varlen needs torch >= 2.10 and fp16/bf16, flex torch >= 2.5); padded rows, which are "
        "faster than the per-node kernel on a GPU",
    )


# ============================================================================ calibration
def shape_class(model: torch.nn.Module, grad: bool, rows: int, width: int) -> tuple:
    """Forwards whose packed-vs-padded verdict is shared: same model, with or without a backward, same
    number of rows, width rounded up to a power of two."""
    return (id(model), grad, rows, 1 << max(0, math.ceil(math.log2(max(width, 1)))))


class Stopwatch:
    """A start and an end mark on the device's timeline: CUDA events (no host sync; read once both
    have completed) or, elsewhere, ``time.perf_counter``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._end = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        if self._start is None:  # the first mark counts (a packed forward starts before the packing)
            self._start = self._mark()

    def stop(self) -> None:
        if self._start is not None and self._end is None:
            self._end = self._mark()

    def seconds(self) -> float | None:
        """Elapsed seconds, or ``None`` while the end mark has not been reached (or was never set)."""
        if self._start is None or self._end is None:
            return None
        if self.cuda:
            if not self._end.query():
                return None
            return self._start.elapsed_time(self._end) / 1000.0
        return self._end - self._start


class _BackwardStamp(torch.autograd.Function):
    """Identity whose backward stops a stopwatch: placed on the input embeddings, it marks the end of
    the model's backward (``anchor`` requires grad, so it runs even where the embeddings are frozen)."""

    @staticmethod
    def forward(ctx, hidden, anchor, stopwatch):
        ctx.stopwatch = stopwatch
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        ctx.stopwatch.stop()
        return grad, None, None


def time_model(model: torch.nn.Module, stopwatch: Stopwatch, grad: bool) -> list:
    """Hooks on ``model`` (the transformers model) that time its next call: start at the call, stop at the
    end of its backward (``grad``) or of its forward. Returns the handles; they remove themselves."""
    handles = []
    embeddings = model.get_input_embeddings()

    def remove():
        for h in handles:
            h.remove()

    def pre(module, args, kwargs):
        stopwatch.start()

    def stamp(module, args, output):
        anchor = torch.zeros((), device=output.device, requires_grad=True)
        return _BackwardStamp.apply(output, anchor, stopwatch)

    def post(module, args, kwargs, output):
        if not grad:
            stopwatch.stop()
        remove()
        return output

    handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
    if grad:
        handles.append(embeddings.register_forward_hook(stamp))
    handles.append(model.register_forward_hook(post, with_kwargs=True))
    return handles


@dataclass
class _Trials:
    packed: list[Stopwatch] = field(default_factory=list)
    padded: list[Stopwatch] = field(default_factory=list)
    verdict: bool | None = None  # True: packed kept


class Calibration:
    """``auto`` on CUDA: per shape class (:func:`shape_class`), run the first micro-batches alternately
    packed and padded, time each on the real step (forward and backward), and keep the faster layout
    for the rest of the run; one log line per class.

    ``trials`` timed runs per layout after one untimed warm-up each (compilation, allocator); the
    verdict compares the fastest of each. Until the verdict is read (the marks are read without
    synchronising, once the GPU has passed them) the class runs padded.
    """

    def __init__(self, trials: int = 2):
        self.trials = trials
        self.classes: dict[tuple, _Trials] = {}

    def next_layout(self, key: tuple) -> tuple[bool, bool]:
        """``(packed, timed)`` for the next forward of ``key``."""
        trials = self.classes.setdefault(key, _Trials())
        if trials.verdict is not None:
            return trials.verdict, False
        runs = 1 + self.trials  # warm-up + timed
        if len(trials.packed) < runs or len(trials.padded) < runs:
            packed = len(trials.packed) <= len(trials.padded)
            return packed, True
        self._decide(key, trials)
        return (trials.verdict if trials.verdict is not None else False), False

    def record(self, key: tuple, packed: bool, stopwatch: Stopwatch) -> None:
        (self.classes[key].packed if packed else self.classes[key].padded).append(stopwatch)

    def _decide(self, key: tuple, trials: _Trials) -> None:
        packed = [s.seconds() for s in trials.packed[1:]]
        padded = [s.seconds() for s in trials.padded[1:]]
        if any(t is None for t in packed + padded):
            if all(s._end is not None for s in trials.packed[1:] + trials.padded[1:]):
                return  # marks set but not reached by the GPU yet: read again at the next forward
            trials.verdict = False  # a mark never set (no backward reached the embeddings): keep TRL's layout
            logger.warning("prefix packing: could not time shape class %s; padded rows kept", _describe(key))
            return
        fast_packed, fast_padded = min(packed), min(padded)
        trials.verdict = fast_packed <= fast_padded
        logger.warning(
            "prefix packing, %s: packed %.1f ms vs padded %.1f ms (fastest of %d each): %s kept",
            _describe(key),
            fast_packed * 1e3,
            fast_padded * 1e3,
            len(packed),
            "packed" if trials.verdict else "padded",
        )

    def verdict(self, key: tuple) -> bool | None:
        trials = self.classes.get(key)
        return None if trials is None else trials.verdict


def _describe(key: tuple) -> str:
    _, grad, rows, width = key
    return f"{rows} rows up to {width} tokens, {'forward+backward' if grad else 'forward'}"


def compute_dtype(model: torch.nn.Module, device: torch.device, autocast: Any) -> torch.dtype:
    """The dtype a forward of ``model`` computes attention in: autocast's inside ``autocast()``, else the
    model's floating parameters'."""
    with autocast():
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()
