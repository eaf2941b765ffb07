"""Pieces every trinity_trl trainer shares: args parsing, the algorithm model card, TRL seams."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from typing import Any

import torch

from ..algorithms import AlgorithmConfig
from ..algorithms.inputs import metrics_to_floats
from .model_card import algorithm_card_section


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


class AlgorithmCardMixin:
    """Appends the algorithm section (name, paper, resolved components) to TRL's model card, and
    writes the card on ``save_model`` too, not only on checkpoints and Hub pushes."""

    algorithm: AlgorithmConfig

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
            extra = getattr(self, "model_card_extra", None)  # e.g. the recipes' evaluation section
            if extra:
                card.write(extra)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            target = output_dir or self.args.output_dir
            saved_output_dir, self.args.output_dir = self.args.output_dir, target
            try:
                self.create_model_card(model_name=os.path.basename(os.path.normpath(target)))
            finally:
                self.args.output_dir = saved_output_dir


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
