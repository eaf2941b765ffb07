"""The training engine of a run (plain processes / DDP, DeepSpeed ZeRO, FSDP) and the models we add to it.

TRL prepares the policy, its reference model and reward models; the models trinity_trl adds (a teacher for
on-policy distillation, PPO's value model) must join the same engine, or they break where parameters are
sharded: under ZeRO-3 a model loaded while ``zero3_init_flag`` is on holds empty parameter shards until an engine
gathers them, and under FSDP every rank must run the same collectives.

* `prepare_frozen_model`: a model that is only evaluated (teacher), prepared as TRL prepares the reference
  model (``prepare_deepspeed`` / ``prepare_fsdp`` / ``accelerator.prepare_model``).
* `check_engine`: a run that asked for FSDP (an accelerate config with ``distributed_type: FSDP``, or
  ``fsdp=...``) but got another engine is refused. Accelerate 1.15 keeps ``DistributedType.MULTI_CPU`` for CPU
  processes and drops the FSDP plugin (``accelerate/state.py`` turns only GPU-like distributed types into ``FSDP``),
  so the model would silently be trained with DDP (or in one unsharded process).
"""

from __future__ import annotations

from typing import Any


def engine_of(accelerator) -> str:
    """``"deepspeed"``, ``"fsdp"``, ``"ddp"`` (several processes) or ``"single"``."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if kind == DistributedType.FSDP:
        return "fsdp"
    return "ddp" if accelerator.num_processes > 1 else "single"


def zero_stage(accelerator) -> int | None:
    """The DeepSpeed ZeRO stage of the run, ``None`` without DeepSpeed."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def prepare_frozen_model(model: Any, accelerator) -> Any:
    """``model`` (frozen, in eval mode) prepared for evaluation in the run's engine, as TRL prepares the reference
    model: a DeepSpeed inference engine (ZeRO-3 shards it like the policy, other stages keep a full copy), FSDP
    wrapping, or device placement (no DDP: it has no gradient)."""
    from trl.models import prepare_deepspeed, prepare_fsdp

    engine = engine_of(accelerator)
    if engine == "deepspeed":
        return prepare_deepspeed(model, accelerator)
    if engine == "fsdp":
        return prepare_fsdp(model, accelerator)
    return accelerator.prepare_model(model, evaluation_mode=True)


def check_engine(accelerator: Any, args: Any) -> None:
    """Refuse a run whose requested engine Accelerate did not set up (see the module docstring); ``args``: the run's
    ``TrainingArguments`` (its ``fsdp`` option), ``accelerator``: the one set up for them."""
    import os

    from accelerate.utils import DistributedType

    state = accelerator.state
    requested = (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        or bool(args.fsdp)
        or getattr(state, "fsdp_plugin", None) is not None
    )
    if requested and state.distributed_type != DistributedType.FSDP:
        raise ValueError(
            f"FSDP was requested (accelerate config or fsdp=...), but Accelerate set up {state.distributed_type.value} "
            "instead: Accelerate 1.15 never uses FSDP for CPU processes (use_cpu=True), it wraps the model in DDP and "
            "ignores the FSDP plugin. On a CPU use DeepSpeed (recipes/accelerate/zero2.yaml, zero3.yaml) or plain "
            "data parallelism (ddp.yaml); on GPUs leave use_cpu unset"
        )
