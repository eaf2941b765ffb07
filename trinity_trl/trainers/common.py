"""Pieces every trinity_trl trainer shares: args parsing, the built components, the model card."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..algorithms import AlgorithmConfig
from ..algorithms.advantage import AdvantageFn
from ..algorithms.component import Component
from ..algorithms.entropy import EntropyLossFn
from ..algorithms.inputs import metrics_to_floats
from ..algorithms.kl import KLFn
from ..algorithms.policy_loss import PolicyLossFn
from ..checkpointing.checkpoints import CompleteCheckpoints
from ..overrides import temporarily
from ..training.model_card import ModelCard, paper_for

_CPU_DEFAULTS_ANNOUNCED = False


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
    "torch.set_num_threads when the config is built. Default: one thread per process on a CPU (unless "
    "OMP_NUM_THREADS is set), torch's own choice with an accelerator; 0 = torch's own choice (one per core)."
)


def torch_threads_field() -> Any:
    """The ``torch_threads`` field every trinity_trl config has (see :func:`apply_cpu_defaults`)."""
    return dataclasses.field(default=None, metadata={"help": TORCH_THREADS_HELP})


def apply_cpu_defaults(config: Any) -> None:
    """Defaults that suit where the run happens, before TRL's own ``__post_init__``.

    TRL turns bf16 on and activation (gradient) checkpointing on unless told otherwise. Without an
    accelerator, bf16 is emulated (on a 2-core CPU one forward+backward of SmolLM2-135M took 247 s in bf16
    against 11 s in float32) and checkpointing only costs a second forward; so when the user set neither
    ``bf16``/``fp16`` nor ``activation_checkpointing``, a run without an accelerator (or with ``use_cpu``)
    trains in float32 without checkpointing, and says so once. With an accelerator TRL's defaults stay,
    under the current name ``activation_checkpointing`` (no deprecation warning for TRL's old name).

    Threads: torch starts one thread per core, and on a small CPU that other work shares, every small op then
    waits for a descheduled thread (a step of the bundled model several times slower, see
    ``benchmarks/results/threads.md``). So without an accelerator torch gets one thread per process unless
    ``OMP_NUM_THREADS`` is set or the config's ``torch_threads`` says otherwise (0: torch's own choice); an
    explicit ``torch_threads`` applies with an accelerator too. The config's value stays as given.
    """
    global _CPU_DEFAULTS_ANNOUNCED
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
    changed = []
    if config.bf16 is None and not config.fp16 and on_cpu:
        config.bf16 = False
        changed.append("training in float32 (bf16=True to override)")
    if config.activation_checkpointing is None:
        config.activation_checkpointing = bool(config.gradient_checkpointing) and not on_cpu
        if on_cpu and config.gradient_checkpointing:
            changed.append("without activation checkpointing (activation_checkpointing=True to override)")
    if config.activation_checkpointing_kwargs is None and config.gradient_checkpointing_kwargs is not None:
        config.activation_checkpointing_kwargs = config.gradient_checkpointing_kwargs
    if threads is None and on_cpu and not os.environ.get("OMP_NUM_THREADS"):
        threads = 1
        changed.append("with one torch thread per process (torch_threads or OMP_NUM_THREADS to override)")
    if threads:
        torch.set_num_threads(threads)
    if changed and not _CPU_DEFAULTS_ANNOUNCED:
        _CPU_DEFAULTS_ANNOUNCED = True
        import logging

        logging.getLogger("trinity_trl").warning("No GPU or other accelerator: %s.", ", ".join(changed))


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


def component_fields(config: Any, fields: Iterable[str]) -> None:
    """Read the component fields of ``config`` (``policy_loss``, ...) into :class:`Component` values, in place."""
    owner = type(config).__name__
    for name in fields:
        setattr(config, name, Component.parse(owner, name, getattr(config, name)))


@dataclass
class Components:
    """An algorithm's components, built once from its resolved config (trainers ask their properties)."""

    policy_loss: PolicyLossFn
    kl_loss: KLFn
    kl_penalty: KLFn
    entropy_loss: EntropyLossFn
    advantage_fn: AdvantageFn | None

    @classmethod
    def build(cls, algorithm: AlgorithmConfig, policy_loss_overrides: dict[str, Any] | None = None) -> Components:
        """``policy_loss_overrides``: constructor arguments a trainer sets itself (ChordTrainer's
        batch geometry); the user may not set them too (an error, never silently overwritten)."""
        overrides = policy_loss_overrides or {}
        clash = sorted(set(overrides) & set(algorithm.policy_loss_fn_args))
        if clash:
            raise ValueError(
                f"policy_loss sets {clash}, which the trainer derives from its own batch geometry "
                f"(would be { ({k: overrides[k] for k in clash}) }); remove them"
            )
        return cls(
            policy_loss=algorithm.build_policy_loss(**overrides),
            kl_loss=algorithm.build_kl_loss(),
            kl_penalty=algorithm.build_kl_penalty(),
            entropy_loss=algorithm.build_entropy_loss(),
            advantage_fn=algorithm.build_advantage_fn() if algorithm.uses_advantage else None,
        )


def load_processor(model: str, args, rl: bool = True):
    """The processor TRL would load for ``model`` (a tokenizer or VLM processor, same options), with
    :func:`trinity_trl.hf_tokenizer`'s pad/eos corrections applied to its tokenizer. ``rl``: left padding and
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
    from trl.trainer.utils import add_fused_lm_head

    from ..training.engines import prepare_frozen_model

    if isinstance(teacher_model, str):
        teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=dtype)
    teacher_model.eval().requires_grad_(False)
    add_fused_lm_head(teacher_model, temperature=temperature, outputs=("log_probs", "entropy"))
    return prepare_frozen_model(teacher_model, accelerator)


def default_output_dir(model: Any, suffix: str) -> str:
    """``<model name>-<suffix>``, the output folder when a trainer gets no ``args``."""
    name = model if isinstance(model, str) else (getattr(model.config, "_name_or_path", "") or "model")
    return f"{str(name).rstrip('/').split('/')[-1]}-{suffix}"


class AlgorithmCardMixin(CompleteCheckpoints):
    """The trainer's seams for its model card: after TRL writes its card (checkpoints, Hub pushes), the composed
    :class:`~trinity_trl.training.model_card.ModelCard` (``self.model_card``) completes it with the algorithm
    section, the training set-up and any added sections; ``save_model`` writes the card too. Checkpoints are marked
    complete and resuming skips incomplete ones
    (:class:`~trinity_trl.checkpointing.checkpoints.CompleteCheckpoints`).

    A mixin only because it overrides TRL's ``create_model_card`` and transformers' ``save_model``; it must come
    before a TRL trainer in the bases. What it reads of its host is declared below: the trainer sets ``algorithm``
    (and ``components``, ``_name``) before the first card is written; the rest is TRL's / transformers'.
    """

    #: set by the trainer: the resolved algorithm the card describes
    algorithm: AlgorithmConfig
    #: the built components of trainers that run rollouts (TrinityTrainer); None for SFT / DPO
    components: Components | None = None
    #: the algorithm's display name on the card (TRL's class attribute; a trainer's own name such as CISPO, or the
    #: preset's, see :meth:`_set_card_identity`)
    _name: str
    # what the host TRL trainer provides
    args: Any  # TrainingArguments
    model: Any  # the policy, possibly wrapped
    train_dataset: Any
    accelerator: Any  # accelerate.Accelerator

    def __init__(self, *args, **kwargs):
        from transformers import TrainingArguments

        from ..training.checks import check_hub_reachable
        from ..training.engines import check_engine

        self.model_card = ModelCard(type(self).__name__)
        config = kwargs.get("args") or next((a for a in args if isinstance(a, TrainingArguments)), None)
        check_hub_reachable(config)  # before transformers creates the Hub repository
        super().__init__(*args, **kwargs)
        check_engine(self)  # FSDP asked for but not set up by Accelerate (engines.py)

    def add_model_card_section(self, markdown: str) -> None:
        """Add a Markdown section (e.g. an evaluation) to every model card written from now on."""
        self.model_card.add_section(markdown)

    def set_model_card_dataset(self, name: str) -> None:
        """Name the training data on the model card (default: the train dataset's own name, if it has one)."""
        self.model_card.dataset = name

    def _set_card_identity(self) -> None:
        """The card's algorithm name and paper: the trainer's own name (CISPO, SAPO, ...) or the preset's."""
        preset_name, self._paper = paper_for(self.algorithm.algorithm)
        if "_name" not in vars(type(self)) or type(self)._name == "Trinity":
            self._name = preset_name

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        tags = list(tags) if isinstance(tags, (list, tuple)) else ([tags] if tags else [])
        super().create_model_card(
            model_name=model_name, dataset_name=dataset_name, tags=tags + [self.algorithm.algorithm]
        )
        if not self.is_world_process_zero():
            return
        self.model_card.complete(
            os.path.join(self.args.output_dir, "README.md"),
            algorithm=self.algorithm,
            components=self.components,
            args=self.args,
            model=self.accelerator.unwrap_model(self.model),
            dataset_name=dataset_name,
            train_dataset=self.train_dataset,
            load_from=getattr(self, "hub_model_id", None) or self.args.output_dir,
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            target = output_dir or self.args.output_dir
            with temporarily(self.args, output_dir=target):  # TRL writes the card into args.output_dir
                self.create_model_card(model_name=os.path.basename(os.path.normpath(target)))


class PresetTrainerMixin(AlgorithmCardMixin):
    """What the preset trainers built on TRL's SFT/DPO trainers share: the model card and metric
    logging into TRL's lists, averaged over processes."""

    # what the host TRL trainer provides: its per-mode metric lists
    _metrics: dict[str, dict[str, list[float]]]

    def _log_local_metrics(self, mode: str, metrics: dict[str, Any]) -> None:
        """Average each metric over processes (one gather) and append it to TRL's per-mode lists."""
        floats = metrics_to_floats(metrics)
        if not floats:
            return
        keys = sorted(floats)
        values = torch.tensor([floats[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        values = self.accelerator.gather(values.unsqueeze(0)).mean(dim=0).tolist()
        for key, value in zip(keys, values):
            self._metrics[mode][key].append(value)


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
