"""The one place that decides how a forward runs: packed with which kernel, or TRL's padded rows.

``prefix_packing_kernel`` (`KERNEL_CHOICES`):

* a kernel name forces it: a kernel that cannot run on the training device at all (no CUDA, torch
  too old, FlashAttention not installed) is an error when the trainer is built; one that cannot run
  a given forward (a float32 model for ``varlen``/``flash_attn``) sends that forward to the padded
  layout, with one log line. A forced ``flex`` counts the graphs it compiles (`CompileBudget`);
* ``auto``: on CPU, ``sdpa_segments`` (measured faster than padded rows on CPU:
  ``benchmarks/results/prefix_packing.md``); on CUDA, the best fused kernel the software offers for
  the compute dtype (``flash_attn``, else ``varlen``; fp16/bf16 only), kept only where it was
  MEASURED faster than the padded forward on this very run (`Calibration`). ``auto`` never
  picks ``flex`` (its compilation costs 20-60 s whatever the verdict, and no GPU measurement has
  shown it faster than ``varlen`` yet) nor ``sdpa_segments`` on a GPU (launch-bound: 8-12x slower
  than padded rows on an H100); on other devices, the padded forward.
"""

from __future__ import annotations

import contextlib
import logging
import math
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
    """What one calibration micro-batch of a shape class runs.

    ``extras``: layouts run on this micro-batch BEFORE its real pass, each timed, their gradients
    computed with ``torch.autograd.grad`` on the unwrapped model and discarded (no accumulation, no
    gradient all-reduce). ``real``: the layout of the micro-batch's real pass (what the trainer
    trains on), timed where ``time_real``."""

    real: str
    time_real: bool = False
    extras: tuple[str, ...] = ()


@dataclass
class _Class:
    stage: int = 0  # calibration micro-batches run so far
    passed: bool = False  # some calibration micro-batch passed the prefix_packing_max_token_ratio check
    unpackable: int = 0  # calibration micro-batches that could not be packed at all
    pairs: list[dict[str, Stopwatch]] = field(default_factory=list)
    result: tuple[float, float, bool] | None = None  # (packed s, padded s, passed): this rank's measurement
    verdict: bool | None = None  # True: packed kept


#: ``gather(payload)`` -> every rank's payload, in rank order (``torch.distributed.all_gather_object``)
Gather = Callable[[Any], list]


def gather_objects(payload: Any) -> list:
    """Every rank's ``payload`` over the default process group (a `Gather`)."""
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, payload)
    return out


class Calibration:
    """``auto`` on CUDA: per shape class (`shape_class`), time packed against padded ON THE SAME
    micro-batch and keep the faster layout for the rest of the run (one log line per class).

    The first micro-batches of a class (`next_trial`): one runs packed and one padded (their real
    passes, untimed: warm-up of kernels and allocator for both layouts, at no extra cost), then a pair:
    the real pass runs padded, timed, and the same micro-batch's packed forward (+ backward) runs
    before it as an extra whose gradients are discarded. Where the pair is closer than ``close``, a
    second pair with the roles swapped (real packed, extra padded; order effects cancel). Where the
    real pass cannot be timed without a gradient all-reduce in it (DDP's synchronising micro-batch),
    both layouts run as extras. The ratio check does not choose which micro-batches are sampled; but a
    class none of whose calibration micro-batches passed it is decided padded (it would never pack)
    and never builds its tree again.

    The verdict: packed where its time is below ``1 - margin`` of padded's (a near tie keeps TRL's
    layout). With several ranks (``gather``), a class's verdict is taken at `synchronize`, which
    every rank calls at the same points (each optimizer step): the measurements of all ranks are
    gathered and summed per class, so every rank takes the same verdict; until then the class runs
    padded. ``timer`` makes the stopwatches (injectable for tests).
    """

    def __init__(
        self, timer: Timer = Stopwatch, gather: Gather | None = None, margin: float = 0.02, close: float = 0.10
    ):
        self.timer = timer
        self.gather = gather
        self.margin = margin
        self.close = close
        self.classes: dict[tuple, _Class] = {}
        self._ordinals: dict[int, int] = {}  # id(model) -> order of first sight (the same on every rank)
        self._remote: dict[tuple, bool] = {}  # verdicts gathered for classes this rank has not seen yet
        #: per class, the extra runs made (layout, grad): the calibration's own work beyond training
        self.extra_runs: dict[tuple, list[str]] = {}

    # ---------------------------------------------------------------- per forward
    def calibrating(self, key: tuple) -> bool:
        """Whether forwards of ``key`` still take part in the measurement (then call `next_trial`)."""
        self._see(key)
        c = self.classes[key]
        return c.verdict is None and c.result is None

    def next_trial(self, key: tuple, timeable: bool, passes: bool) -> Trial | None:
        """The plan for this micro-batch of ``key``; ``None``: no trial, run the verdict (or, pending,
        padded). ``timeable``: the real pass can be timed (no gradient all-reduce in it); ``passes``:
        the micro-batch passes the ratio check (else its real pass is padded)."""
        c = self._see(key)
        if c.verdict is not None or c.result is not None:
            return None
        c.passed |= passes
        if c.stage == 0:
            c.stage = 1
            return Trial("packed" if passes else "padded")
        if c.stage == 1:
            c.stage = 2
            return Trial("padded")
        if c.pairs:
            times = self._read(key, c)
            if times is None:
                return None  # the GPU has not reached the marks yet: padded, read again at the next forward
            packed, padded = times
            if len(c.pairs) >= 2 or abs(packed - padded) > self.close * max(packed, padded):
                self._complete(key, c, packed, padded)
                return None
        real = "padded" if not c.pairs or not passes else "packed"
        other = "packed" if real == "padded" else "padded"
        c.pairs.append({})
        if timeable:
            return Trial(real, True, (other,))
        return Trial(real, False, (other, real))

    def record(self, key: tuple, layout: str, stopwatch: Stopwatch, extra: bool = False) -> None:
        """``stopwatch`` times ``layout`` for the current pair of ``key`` (``extra``: a run the
        calibration added)."""
        self.classes[key].pairs[-1][layout] = stopwatch
        if extra:
            self.extra_runs.setdefault(key, []).append(layout)

    def unpackable(self, key: tuple) -> None:
        """A calibration micro-batch of ``key`` could not be packed at all: two such and no packed
        one decide the class padded."""
        c = self._see(key)
        c.unpackable += 1
        if c.unpackable >= 2 and not c.passed and c.verdict is None and c.result is None:
            self._complete(key, c, math.inf, 0.0)

    def verdict(self, key: tuple) -> bool | None:
        c = self.classes.get(key)
        return None if c is None else c.verdict

    def summary(self) -> list[dict]:
        """Per shape class: its shape, this rank's packed and padded seconds (``None`` until measured), the
        verdict (``"packed"``, ``"padded"`` or ``None``) and the extra runs it took (for reports)."""
        rows = []
        for key, c in self.classes.items():
            grad, rows_, width = key[1:]
            packed, padded, passed = c.result if c.result else (None, None, c.passed)
            verdict = None if c.verdict is None else ("packed" if c.verdict else "padded")
            rows.append(
                {
                    "grad": grad,
                    "rows": rows_,
                    "width": width,
                    "packed_s": packed,
                    "padded_s": padded,
                    "passed_ratio_check": passed,
                    "verdict": verdict,
                    "extra_runs": len(self.extra_runs.get(key, [])),
                }
            )
        return rows

    # ---------------------------------------------------------------- across ranks
    def synchronize(self) -> None:
        """Every rank, at the same points (each optimizer step): gather the measurements of all ranks
        and decide, per class, from their sums (no-op on one process)."""
        if self.gather is None:
            return
        mine = {self._canonical(k): c.result for k, c in self.classes.items() if c.result and c.verdict is None}
        merged: dict[tuple, list] = {}
        for payload in self.gather(mine):
            for canon, (packed, padded, passed) in payload.items():
                total = merged.setdefault(canon, [0.0, 0.0, False])
                total[0] += packed
                total[1] += padded
                total[2] = total[2] or passed
        local = {self._canonical(k): k for k in self.classes}
        for canon in sorted(merged):
            packed, padded, passed = merged[canon]
            verdict = self._verdict(canon[1:], packed, padded, passed, ranks=True)
            if canon in local:
                self.classes[local[canon]].verdict = verdict
            else:
                self._remote[canon] = verdict

    # ---------------------------------------------------------------- internals
    def _see(self, key: tuple) -> _Class:
        if key not in self.classes:
            self._ordinals.setdefault(key[0], len(self._ordinals))
            c = self.classes[key] = _Class()
            remote = self._remote.pop(self._canonical(key), None)
            if remote is not None:
                c.verdict = remote
        return self.classes[key]

    def _canonical(self, key: tuple) -> tuple:
        return (self._ordinals[key[0]], *key[1:])

    def _read(self, key: tuple, c: _Class) -> tuple[float, float] | None:
        """Mean packed and padded seconds over the pairs, ``None`` while a mark is not reached."""
        sums = {"packed": 0.0, "padded": 0.0}
        for pair in c.pairs:
            for layout in sums:
                watch = pair.get(layout)
                seconds = None if watch is None else watch.seconds()
                if seconds is None:
                    if watch is not None and watch.closed >= watch.expected:
                        return None  # marks set, not reached by the GPU yet
                    # never set (no backward reached the embeddings, a layout not run): keep TRL's layout
                    logger.warning("prefix packing: could not time %s; padded rows kept", _describe(key[1:]))
                    c.verdict = False
                    return None
                sums[layout] += seconds
        return sums["packed"] / len(c.pairs), sums["padded"] / len(c.pairs)

    def _complete(self, key: tuple, c: _Class, packed: float, padded: float) -> None:
        c.result = (packed, padded, c.passed)
        if self.gather is None:
            c.verdict = self._verdict(key[1:], packed, padded, c.passed)

    def _verdict(self, shape: tuple, packed: float, padded: float, passed: bool, ranks: bool = False) -> bool:
        if not passed:
            logger.warning(
                "prefix packing, %s: no micro-batch passed prefix_packing_max_token_ratio; padded rows kept, the "
                "tree is not built again",
                _describe(shape),
            )
            return False
        verdict = packed < (1.0 - self.margin) * padded
        logger.warning(
            "prefix packing, %s: packed %.1f ms vs padded %.1f ms (same micro-batches%s): %s kept",
            _describe(shape),
            packed * 1e3,
            padded * 1e3,
            ", summed over ranks" if ranks else "",
            "packed" if verdict else "padded",
        )
        return verdict


def _describe(shape: tuple) -> str:
    grad, rows, width = shape
    return f"{rows} rows up to {width} tokens, {'forward+backward' if grad else 'forward'}"


# ============================================================================ compilation (forced flex)
def _recompile_limit_name() -> str:
    import torch._dynamo.config as dynamo_config

    return "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


class CompileBudget:
    """The graphs a forced ``flex`` compiles: ``graphs_per_signature`` (a static graph for the first
    packed length, then a dynamic one) for each signature (grad mode, dtype, head dim, heads and KV
    heads) seen; `limit` raises dynamo's recompile limit (``torch._dynamo.config``, its public
    knob) around the packed forward so that these graphs never hit it (past the limit, torch falls
    back to eager FlexAttention, which materialises the whole score matrix)."""

    def __init__(self, graphs_per_signature: int = 2, read_limit: Callable[[], int] | None = None):
        self.graphs_per_signature = graphs_per_signature
        self.signatures: set[tuple] = set()
        self._read_limit = read_limit

    def add(self, signature: tuple) -> int:
        """Count ``signature``; returns the graphs needed so far."""
        self.signatures.add(signature)
        return self.graphs

    @property
    def graphs(self) -> int:
        return self.graphs_per_signature * len(self.signatures)

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
