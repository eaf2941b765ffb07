"""Where the run happens: precision and checkpointing defaults a config takes on a machine without an accelerator,
torch's thread count when a trainer starts, and the saving options that would do nothing."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch


def accelerator_available() -> bool:
    """Whether torch sees a GPU (CUDA/ROCm), an Apple MPS device, an Intel XPU or an Ascend NPU."""
    if torch.cuda.is_available():
        return True
    for backend in ("mps", "xpu", "npu"):
        module = getattr(torch, backend, None) or getattr(torch.backends, backend, None)
        if module is not None and getattr(module, "is_available", lambda: False)():
            return True
    return False


TORCH_THREADS_HELP = (
    "torch.set_num_threads when the trainer starts. Default: one thread per process on a CPU (unless "
    "OMP_NUM_THREADS is set), torch's own choice with an accelerator; 0 = torch's own choice (one per core)."
)


def torch_threads_field() -> Any:
    """The ``torch_threads`` field every trinity_trl config has (see `apply_cpu_defaults`)."""
    return dataclasses.field(default=None, metadata={"help": TORCH_THREADS_HELP})


@dataclasses.dataclass
class MachineFields:
    """What every trinity_trl config shares about the machine it runs on: the ``torch_threads`` field, the CPU
    defaults set before TRL's own ``__post_init__`` (`apply_cpu_defaults`), and the saving options checked after it
    (`check_saving_options`). First among a config's bases, so that its ``__post_init__`` wraps TRL's."""

    torch_threads: int | None = torch_threads_field()

    def __post_init__(self):
        apply_cpu_defaults(self)  # before TRL's defaults: float32 and no checkpointing without an accelerator
        self.check_before_trl()
        super().__post_init__()
        check_saving_options(self)

    def check_before_trl(self) -> None:
        """What the config refuses before TRL's ``__post_init__`` runs (nothing by default)."""


def apply_cpu_defaults(config: Any) -> None:
    """The precision and checkpointing defaults that suit where the run happens, set on ``config`` before TRL's own
    ``__post_init__`` (which would turn bf16 on, and transformers then refuse the config on a machine without GPU).

    TRL turns bf16 on and activation (gradient) checkpointing on unless told otherwise. Without an
    accelerator, bf16 is emulated (on a 2-core CPU one forward+backward of SmolLM2-135M took 247 s in bf16
    against 11 s in float32) and checkpointing only costs a second forward; so when the user set neither
    ``bf16``/``fp16`` nor ``activation_checkpointing``, a run without an accelerator (or with ``use_cpu``)
    trains in float32 without checkpointing. With an accelerator TRL's defaults stay, under the current name
    ``activation_checkpointing`` (no deprecation warning for TRL's old name).

    Only this config's own values change: nothing process-wide happens until a trainer starts
    (`start_on_this_machine` sets torch's threads and says what was chosen).
    """
    on_cpu = config.use_cpu or not accelerator_available()
    if config.fp16 and on_cpu:
        # accelerate 1.15 enables fp16 autocast and its gradient scaler only on GPU-like devices (Accelerator
        # sets native_amp for fp16 when the device is not "cpu"): on a CPU fp16=True would train in float32
        raise ValueError(
            f"{type(config).__name__}: fp16=True does nothing on a CPU (Accelerate runs fp16 only on "
            "GPUs and would silently train in float32 here); use bf16=True, or leave both unset for "
            "float32"
        )
    threads = getattr(config, "torch_threads", None)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
        raise ValueError(f"{type(config).__name__}: torch_threads must be a whole number >= 0, got {threads!r}")
    if config.bf16 is None and not config.fp16 and on_cpu:
        config.bf16 = False
    if config.activation_checkpointing is None:
        config.activation_checkpointing = bool(config.gradient_checkpointing) and not on_cpu
    if config.activation_checkpointing_kwargs is None and config.gradient_checkpointing_kwargs is not None:
        config.activation_checkpointing_kwargs = config.gradient_checkpointing_kwargs


def start_on_this_machine(config: Any) -> None:
    """What a trainer does first, for the config it runs: torch's thread count, and one log line naming the CPU
    choices.

    Threads: torch starts one thread per core, and on a small CPU that other work shares, every small op then
    waits for a descheduled thread (a step of the bundled model several times slower, see
    ``benchmarks/results/threads.md``). So without an accelerator torch gets one thread per process unless
    ``OMP_NUM_THREADS`` is set or the config's ``torch_threads`` says otherwise (0: torch's own choice); an
    explicit ``torch_threads`` applies with an accelerator too. The config's value stays as given.
    """
    on_cpu = config.use_cpu or not accelerator_available()
    threads = getattr(config, "torch_threads", None)
    said = []
    if on_cpu and not config.bf16 and not config.fp16:
        said.append("training in float32 (bf16=True to override)")
    if on_cpu and not config.activation_checkpointing and _checkpoints_by_default(config):
        said.append("without activation checkpointing (activation_checkpointing=True to override)")
    if threads is None and on_cpu and not os.environ.get("OMP_NUM_THREADS"):
        threads = 1
        said.append("with one torch thread per process (torch_threads or OMP_NUM_THREADS to override)")
    if threads:
        torch.set_num_threads(threads)
    if said:
        logging.getLogger("trinity_trl").warning("No GPU or other accelerator: %s.", ", ".join(said))


def _checkpoints_by_default(config: Any) -> bool:
    """Whether TRL's config class would have turned activation (gradient) checkpointing on."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))} if dataclasses.is_dataclass(config) else {}
    return bool(defaults.get("gradient_checkpointing", False))


def check_saving_options(config: Any) -> None:
    """Options that would do nothing with ``save_strategy="no"`` are errors, not silent no-ops."""
    if config.save_strategy != "no":
        return
    owner = type(config).__name__
    default_steps = next(f.default for f in dataclasses.fields(type(config)) if f.name == "save_steps")
    if config.save_steps != default_steps:
        raise ValueError(
            f"{owner}: save_steps={config.save_steps} writes no checkpoint with save_strategy='no'; "
            "set save_strategy='steps' as well"
        )
    if config.resume_from_checkpoint:
        raise ValueError(
            f"{owner}: resume_from_checkpoint is set but save_strategy='no' would write no further "
            "checkpoint; set save_strategy='steps' (or 'epoch'), or pass the checkpoint to train()"
        )


def start_run(config: Any) -> None:
    """What every trainer does before TRL builds it: torch's threads and the CPU notice
    (`start_on_this_machine`), and the Hub reachable when the run pushes (before transformers creates the
    repository)."""
    from ..training.checks import check_hub_reachable

    start_on_this_machine(config)
    check_hub_reachable(config)


def check_run(accelerator: Any, args: Any) -> None:
    """What every trainer checks once TRL has built it (``accelerator``: the one TRL set up for ``args``): the engine
    it asked for is the one Accelerate set up."""
    from ..training.engines import check_engine

    check_engine(accelerator, args)  # FSDP asked for but not set up by Accelerate (engines.py)
