"""One phase timer for a trainer step: generation, reward, log-prob forwards, loss forward, backward, optimizer and
the rest, for our trainers and TRL's ``GRPOTrainer`` alike.

    timer = PhaseTimer(trainer)        # wraps the seams on this trainer instance (nothing global)
    trainer.train()
    timer.steps                        # one record per optimizer step (below)
    timer.remove()                     # the instance's own methods again

The seams (wrapped on the instance, so other trainers in the process are untouched: `SEAMS`, the log-probs
without gradients, ``rollout_func``, ``accelerator.backward``, the optimizer step by callback), the phases, how they
nest and add up to the step (``rest``: everything no seam covers), and why the timer adds no device sync (CUDA events
read only once the device has passed them): docs/benchmarks.md#whole-step ("The split").

**Checking the seams** (``check=True``, for tests and dry runs): a forward pre-hook on the policy's decoder and a
gradient hook on one trainable parameter raise `PhaseError` when a forward runs outside ``generation``, ``logprob``,
``loss`` and ``backward``, or a gradient is accumulated outside ``backward``: a trainer that forwards or backwards
through a path no seam wraps fails instead of hiding that time in ``rest``. The hooks are Python callbacks on the
model, so timed runs leave them off (a compiled forward would trace them).
"""

from __future__ import annotations

import time
from collections import defaultdict

PHASES = ("generation", "reward", "logprob", "loss", "backward", "optimizer", "rest")
#: trainer attribute -> phase
SEAMS = {
    "_generate_single_turn": "generation",
    "_calculate_rewards": "reward",
    "compute_loss": "loss",
    "_clip_grad_norm": "optimizer",
}
#: phases inside which a forward of the policy may run (``backward``: activation checkpointing's recomputation)
FORWARD_PHASES = frozenset({"generation", "logprob", "loss", "backward"})


_CLASS = object()  # marks a seam that was the class's method (no instance attribute to put back)


class PhaseError(RuntimeError):
    """A seam the timer needs is missing, or (``check=True``) the model ran outside every wrapped seam."""


class PhaseTimer:
    """Splits every optimizer step of ``trainer`` into `PHASES` (see the module's docstring).

    ``steps``: one dict per finished step, in order: ``global_step`` (at its start), ``step_s`` (host seconds),
    ``host`` and ``device`` (``{phase: seconds}`` over every phase, 0 where it did not run; ``device`` None off
    CUDA and until the step's events are read), ``calls`` (``{phase: entries}``).
    """

    def __init__(self, trainer, *, cuda: bool | None = None, check: bool = False, event_class=None):
        import torch

        self.trainer = trainer
        self.cuda = (trainer.accelerator.device.type == "cuda") if cuda is None else cuda
        event_class = event_class or (torch.cuda.Event if self.cuda else None)  # a stand-in in the CPU tests
        self._event = (lambda: _recorded(event_class(enable_timing=True))) if self.cuda else (lambda: None)
        self.steps: list[dict] = []
        self._stack: list[str] = []
        self._marks: list[tuple[float, object, str]] | None = None  # the open step's boundaries
        self._calls: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[dict, list]] = []  # finished steps whose device events are not read yet
        self._wrapped: list[tuple[object, str]] = []
        self._hooks: list = []
        for attr, phase in SEAMS.items():
            self._wrap(trainer, attr, phase)
        if getattr(trainer, "rollout_func", None) is not None:
            self._wrap(trainer, "rollout_func", "generation")
        # the log-prob forwards without gradients; the training forward's call is part of the loss that makes it
        self._wrap(trainer, "_get_per_token_logps_and_entropies", "logprob", untimed=torch.is_grad_enabled)
        self._wrap(trainer.accelerator, "backward", "backward")
        self._callback = _StepCallback(self)
        trainer.add_callback(self._callback)
        if check:
            self._add_checks()

    # ------------------------------------------------------------------------------------------------ phases
    def enter(self, phase: str) -> None:
        self._stack.append(phase)
        self._calls[phase] += 1 if self._marks is not None else 0
        self._mark(phase)

    def exit(self) -> None:
        self._stack.pop()
        self._mark(self._stack[-1] if self._stack else "rest")

    def _mark(self, phase: str) -> None:
        if self._marks is not None:
            self._marks.append((time.perf_counter(), self._event(), phase))

    def begin_step(self, global_step: int) -> None:
        self.end_step()
        self.read_device(wait=False)
        self._marks, self._calls = [], defaultdict(int)
        self._global_step = global_step
        self._mark(self._stack[-1] if self._stack else "rest")

    def end_step(self) -> None:
        """Close the open step (at the next step's start, or at the end of training)."""
        if self._marks is None:
            return
        self._mark("rest")
        marks, self._marks = self._marks, None
        host = dict.fromkeys(PHASES, 0.0)
        for (t0, _, phase), (t1, _, _) in zip(marks, marks[1:]):
            host[phase] += t1 - t0
        record = {
            "global_step": self._global_step,
            "step_s": marks[-1][0] - marks[0][0],
            "host": host,
            "device": None,
            "calls": {p: self._calls.get(p, 0) for p in PHASES if p != "rest"},
        }
        self.steps.append(record)
        if self.cuda:
            self._pending.append((record, marks))

    def read_device(self, wait: bool) -> None:
        """Fill ``device`` of the finished steps whose last event the device has passed (all with ``wait``)."""
        still = []
        for record, marks in self._pending:
            last = marks[-1][1]
            if not last.query():
                if not wait:
                    still.append((record, marks))
                    continue
                last.synchronize()  # only at the end of training
            device = dict.fromkeys(PHASES, 0.0)
            for (_, e0, phase), (_, e1, _) in zip(marks, marks[1:]):
                device[phase] += e0.elapsed_time(e1) / 1e3
            record["device"] = device
            record["device_step_s"] = sum(device.values())
        self._pending = still

    def finish(self) -> None:
        self.end_step()
        self.read_device(wait=True)

    # ------------------------------------------------------------------------------------------------- seams
    def _wrap(self, obj, attr: str, phase: str, untimed=None) -> None:
        """Time ``obj.attr`` as ``phase``, except the calls where ``untimed()`` is true (their caller's phase)."""
        if not callable(getattr(obj, attr, None)):
            raise PhaseError(f"{type(obj).__name__} has no method {attr!r}: the phase timer cannot time {phase}")
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            if untimed is not None and untimed():
                return original(*args, **kwargs)
            self.enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        self._replace(obj, attr, timed)

    def _replace(self, obj, attr: str, wrapper) -> None:
        own = vars(obj).get(attr, _CLASS)  # an instance attribute (rollout_func) is put back, a method deleted
        setattr(obj, attr, wrapper)
        self._wrapped.append((obj, attr, own))

    def _add_checks(self) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        decoder = base.get_decoder() if hasattr(base, "get_decoder") else base

        def forward_check(module, args):
            if self._marks is not None and (not self._stack or self._stack[-1] not in FORWARD_PHASES):
                where = self._stack[-1] if self._stack else "no phase"
                raise PhaseError(f"a forward of the policy ran in {where}: a seam that runs the model is not wrapped")

        def gradient_check(parameter):
            if self._marks is not None and "backward" not in self._stack:
                raise PhaseError("a gradient was accumulated outside accelerator.backward: a backward is not wrapped")

        self._hooks.append(decoder.register_forward_pre_hook(forward_check))
        parameter = next(p for p in model.parameters() if p.requires_grad)
        self._hooks.append(parameter.register_post_accumulate_grad_hook(gradient_check))

    def remove(self) -> None:
        """Unwrap every seam (the instance's class methods again), drop the callback and the check hooks."""
        for obj, attr, own in reversed(self._wrapped):
            if own is _CLASS:
                delattr(obj, attr)
            else:
                setattr(obj, attr, own)
        for hook in self._hooks:
            hook.remove()
        self.trainer.remove_callback(self._callback)
        self._wrapped, self._hooks = [], []


def _recorded(event):
    event.record()
    return event


def _callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class _StepCallback(_callback_base()):
    """Step boundaries and the optimizer phase from transformers' callback events."""

    def __init__(self, timer: PhaseTimer):
        self.timer = timer

    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timer.enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timer.exit()

    def on_train_end(self, args, state, control, **kwargs):
        self.timer.finish()


def summarise_steps(steps: list[dict], skip: int = 0) -> dict:
    """The median over ``steps[skip:]`` of the step and of each phase, host and (where read) device seconds."""
    import statistics

    timed = steps[skip:]
    if not timed:
        return {}
    out = {
        "step_s": statistics.median(s["step_s"] for s in timed),
        "host": {p: statistics.median(s["host"][p] for s in timed) for p in PHASES},
    }
    if all(s["device"] is not None for s in timed):
        out["device"] = {p: statistics.median(s["device"][p] for s in timed) for p in PHASES}
        out["device_step_s"] = statistics.median(s["device_step_s"] for s in timed)
    return out
