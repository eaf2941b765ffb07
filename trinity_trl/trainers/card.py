"""The model card's seams of the trainers, and metric logging of the preset trainers built on TRL's SFT/DPO
trainers."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..algorithms import AlgorithmConfig
from ..algorithms.inputs import metrics_to_floats
from ..overrides import temporarily
from ..training.model_card import ModelCard, paper_for, record_public_base_model
from .components import Components


class AlgorithmCardMixin:
    """The trainer's seams for its model card: after TRL writes its card (checkpoints, Hub pushes), the composed
    `trinity_trl.training.model_card.ModelCard` (``self.model_card``) completes it with the algorithm
    section, the training set-up and any added sections; ``save_model`` writes the card too. Nothing else: the
    checkpoints are their own mixin (`trinity_trl.checkpointing.checkpoints.CompleteCheckpoints`), and what
    a trainer checks and sets when it starts is `trinity_trl.trainers.machine.start_run` /
    `trinity_trl.trainers.machine.check_run`, which each trainer calls.

    A mixin only because it overrides TRL's ``create_model_card`` and transformers' ``save_model``; it must come
    before a TRL trainer in the bases. What it reads of its host is declared below: the trainer sets ``algorithm``
    (and ``components``, ``_name``) before the first card is written; the rest is TRL's / transformers'.
    """

    #: set by the trainer: the resolved algorithm the card describes
    algorithm: AlgorithmConfig
    #: the built components of trainers that run rollouts (TrinityTrainer); None for SFT / DPO
    components: Components | None = None
    #: the algorithm's display name on the card (TRL's class attribute; a trainer's own name such as CISPO, or the
    #: preset's, see `_set_card_identity`)
    _name: str
    # what the host TRL trainer provides
    args: Any  # TrainingArguments
    model: Any  # the policy, possibly wrapped
    train_dataset: Any
    accelerator: Any  # accelerate.Accelerator

    def __init__(self, *args, **kwargs):
        self.model_card = ModelCard(type(self).__name__)
        super().__init__(*args, **kwargs)

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

    def push_to_hub(self, *args, **kwargs):
        from ..training.checks import hub_unavailable

        try:
            return super().push_to_hub(*args, **kwargs)
        except Exception as err:  # a raw connection error from inside huggingface_hub: one line instead
            instead = "save with trainer.save_model() and upload the folder later (docs/distributed.md#push-later)"
            message = hub_unavailable("trainer.push_to_hub()", instead, err)
            if message is None:
                raise
            raise ValueError(message) from None

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        record_public_base_model(output_dir or self.args.output_dir)  # the bundled model's Hub id, not the cache

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
