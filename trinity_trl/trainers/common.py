"""What the trainers share to meet TRL: the processor a model name loads, a frozen teacher, the default output folder,
the fused-LM-head outputs of TRL's SFT/DPO forwards, the parallelism they refuse, and the SFT/DPO trainers'
shared start.

The other shared pieces have their own homes: `machine` (where the run happens), `components` (the
algorithm's components), `card` (the model card's seams)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from .machine import check_run, start_run


def load_processor(model: str, args, rl: bool = True):
    """The processor TRL would load for ``model`` (a tokenizer or VLM processor, same options), with
    `trinity_trl.hf_tokenizer`'s pad/eos corrections applied to its tokenizer. ``rl``: left padding and
    truncation as GRPOTrainer loads it; otherwise the tokenizer's own sides, as the SFT/DPO trainers load it."""
    from transformers import AutoProcessor

    from ..tokenizer import correct_tokenizer

    sides = {"truncation_side": "left", "padding_side": "left"} if rl else {}
    processor = AutoProcessor.from_pretrained(
        model,
        revision=(args.model_init_kwargs or {}).get("revision"),
        trust_remote_code=args.trust_remote_code,
        **sides,
    )
    correct_tokenizer(getattr(processor, "tokenizer", processor), model)
    return processor


def prepare_teacher(teacher_model: Any, accelerator, dtype, temperature: float):
    """A teacher (a model or path) frozen, with TRL's fused LM head, prepared for evaluation in the run's engine
    (sharded like TRL's reference model under DeepSpeed ZeRO-3 and FSDP)."""
    from transformers import AutoModelForCausalLM

    from ..training.engines import prepare_frozen_model
    from ..training.grpo_seams import add_fused_lm_head

    if isinstance(teacher_model, str):
        teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=dtype)
    teacher_model.eval().requires_grad_(False)
    add_fused_lm_head(teacher_model, temperature=temperature, outputs=("log_probs", "entropy"))
    return prepare_frozen_model(teacher_model, accelerator)


def default_output_dir(model: Any, suffix: str) -> str:
    """``<model name>-<suffix>``, the output folder when a trainer gets no ``args``."""
    name = model if isinstance(model, str) else (getattr(model.config, "_name_or_path", "") or "model")
    return f"{str(name).rstrip('/').split('/')[-1]}-{suffix}"


@contextlib.contextmanager
def capture_fused_outputs(modules: Iterable[torch.nn.Module]):
    """Record the outputs of the outermost ``fused_lm_head=True`` calls of ``modules``, in call order.

    TRL's SFT and DPO trainers call the policy (and the reference) with ``fused_lm_head=True``; the
    outputs carry per-token ``log_probs``, ``entropy`` and ``label_mask``. A call through a wrapper
    (DDP, PEFT) also runs the wrapped module's hooks, so calls nested inside another recorded call
    are skipped: each forward is recorded once.
    """
    calls: list[Any] = []
    depth = [0]

    def is_fused(kwargs: dict) -> bool:
        return bool(kwargs.get("fused_lm_head"))

    def pre_hook(module, args, kwargs):
        if is_fused(kwargs):
            depth[0] += 1

    def post_hook(module, args, kwargs, output):
        if is_fused(kwargs):
            depth[0] -= 1
            if depth[0] == 0:
                calls.append(output)

    handles = []
    seen: set[int] = set()
    try:
        for module in modules:
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(module.register_forward_hook(post_hook, with_kwargs=True))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def reject_sequence_sharding(trainer, owner: str) -> None:
    """Context / sequence parallelism split each sequence across processes before the loss, so a
    process would aggregate over a shard, not over the micro-batch the loss is defined on."""
    config = getattr(trainer.accelerator, "parallelism_config", None)
    if config is None:
        return
    for flag in ("cp_enabled", "sp_enabled"):
        if getattr(config, flag, False):
            raise ValueError(
                f"{owner} does not support context or sequence parallelism ({flag}): Trinity's losses aggregate over "
                "whole sequences of a micro-batch, which these modes split across processes"
            )


def init_trl_trainer(trainer, trl_init, model, args, given: dict[str, Any], components) -> None:
    """The shared start of the SFT and DPO trainers: TRL's ``__init__`` (``trl_init``) on the bound arguments
    ``given``, with the processor `load_processor` gives a model named by a string (no RL padding), inside the run's
    machine checks (`trinity_trl.trainers.machine.start_run` / ``check_run``), then the checks and the policy loss
    every trainer of a non-GRPO TRL class needs."""
    if isinstance(model, str) and given.get("processing_class") is None:
        given["processing_class"] = load_processor(model, args, rl=False)  # with hf_tokenizer's corrections
    start_run(args)
    trl_init(**given)
    check_run(trainer.accelerator, trainer.args)
    reject_sequence_sharding(trainer, type(trainer).__name__)
    trainer.policy_loss = components.policy_loss
