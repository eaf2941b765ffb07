"""Pieces every trinity_trl trainer shares: args parsing, the built components, the model card."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..algorithms import AlgorithmConfig
from ..algorithms.advantage import AdvantageFn
from ..algorithms.entropy import EntropyLossFn
from ..algorithms.inputs import metrics_to_floats
from ..algorithms.kl import KLFn
from ..algorithms.policy_loss import PolicyLossFn
from .model_card import algorithm_card_section, paper_for
from .trl_seams import temporarily


def parse_args_field(owner: str, name: str, value: Any) -> dict | None:
    """A ``*_args`` field given as a dict, a JSON object string (command line / YAML) or ``None``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"{owner}: {name} must be a dict or a JSON object string, got {value!r}") from err
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{owner}: {name} must be a dict or a JSON object string, got {type(value).__name__}")
    return value



def _name_local_base_model(card_path: str, model_path: str | None) -> None:
    """TRL's card links a base model from a local folder as "[None](https://huggingface.co/None)"; name the folder."""
    if not os.path.exists(card_path):
        return
    with open(card_path, encoding="utf-8") as f:
        text = f.read()
    broken = "[None](https://huggingface.co/None)"
    if broken in text:
        name = os.path.basename(os.path.normpath(model_path)) if model_path else "a local model"
        with open(card_path, "w", encoding="utf-8") as f:
            f.write(text.replace(broken, f"`{name}` (a local model)"))


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
            raise ValueError(f"policy_loss_fn_args sets {clash}, which the trainer derives from its own batch geometry "
                             f"(would be {({k: overrides[k] for k in clash})}); remove them")
        return cls(
            policy_loss=algorithm.build_policy_loss(**overrides),
            kl_loss=algorithm.build_kl_loss(),
            kl_penalty=algorithm.build_kl_penalty(),
            entropy_loss=algorithm.build_entropy_loss(),
            advantage_fn=algorithm.build_advantage_fn() if algorithm.uses_advantage else None,
        )


def load_processor(model: str, args):
    """TRL's processor (tokenizer or VLM processor, with GRPOTrainer's loading options), with
    :func:`trinity_trl.hf_tokenizer`'s pad/eos corrections applied to its tokenizer."""
    from transformers import AutoProcessor

    from ..tokenizer import correct_tokenizer

    processor = AutoProcessor.from_pretrained(
        model, revision=(args.model_init_kwargs or {}).get("revision"), truncation_side="left",
        padding_side="left", trust_remote_code=args.trust_remote_code,
    )
    correct_tokenizer(getattr(processor, "tokenizer", processor), model)
    return processor


def prepare_teacher(teacher_model: Any, accelerator, dtype, temperature: float):
    """A teacher (a model or path) frozen, with TRL's fused LM head, prepared for evaluation."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    if isinstance(teacher_model, str):
        teacher_model = AutoModelForCausalLM.from_pretrained(teacher_model, dtype=dtype)
    teacher_model.eval().requires_grad_(False)
    add_fused_lm_head(teacher_model, temperature=temperature, outputs=("log_probs", "entropy"))
    return accelerator.prepare_model(teacher_model, evaluation_mode=True)


def default_output_dir(model: Any, suffix: str) -> str:
    """``<model name>-<suffix>``, the output folder when a trainer gets no ``args``."""
    name = model if isinstance(model, str) else (getattr(model.config, "_name_or_path", "") or "model")
    return f"{str(name).rstrip('/').split('/')[-1]}-{suffix}"


class AlgorithmCardMixin:
    """Appends the algorithm section (name, paper, resolved components) and any sections added with
    :meth:`add_model_card_section` to TRL's model card, and writes the card on ``save_model`` too,
    not only on checkpoints and Hub pushes."""

    algorithm: AlgorithmConfig

    def __init__(self, *args, **kwargs):
        self._card_sections: list[str] = []
        super().__init__(*args, **kwargs)

    def add_model_card_section(self, markdown: str) -> None:
        """Add a Markdown section (e.g. an evaluation) to every model card written from now on."""
        self._card_sections.append(markdown)

    def _set_card_identity(self) -> None:
        """The card's algorithm name and paper: the trainer's own name (CISPO, SAPO, ...) or the preset's."""
        preset_name, self._paper = paper_for(self.algorithm.algorithm)
        if "_name" not in vars(type(self)) or type(self)._name == "Trinity":
            self._name = preset_name

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        tags = list(tags) if isinstance(tags, (list, tuple)) else ([tags] if tags else [])
        super().create_model_card(model_name=model_name, dataset_name=dataset_name,
                                  tags=tags + [self.algorithm.algorithm])
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        _name_local_base_model(path, getattr(self.model.config, "_name_or_path", None))
        with open(path, "a", encoding="utf-8") as card:
            card.write(algorithm_card_section(self.algorithm, type(self).__name__))
            for section in self._card_sections:
                card.write(section)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            target = output_dir or self.args.output_dir
            with temporarily(self.args, output_dir=target):  # TRL writes the card into args.output_dir
                self.create_model_card(model_name=os.path.basename(os.path.normpath(target)))


class PresetTrainerMixin(AlgorithmCardMixin):
    """What the preset trainers built on TRL's SFT/DPO trainers share: the model card and metric
    logging into TRL's lists, averaged over processes."""

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
