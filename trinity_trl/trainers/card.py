"""The model card's seams of the trainers: where TRL and transformers write or push a card, the trainer's composed
`trinity_trl.training.model_card.ModelCard` completes it."""

from __future__ import annotations

import os
from typing import Any

from ..algorithms import AlgorithmConfig
from ..overrides import temporarily
from ..training.checks import hub_errors_in_one_line
from ..training.model_card import ModelCard, paper_for, record_public_base_model
from .components import Components


class AlgorithmCardMixin:
    """The trainer's seams for its model card, and nothing else. The card's content is the composed
    `trinity_trl.training.model_card.ModelCard` (``self.model_card``): each time TRL has written its card (on a
    checkpoint, a Hub push, ``save_model``), `create_model_card` hands it to ``self.model_card``, which completes it
    with the algorithm section, the training set-up and any added sections.

    A mixin only because the seams are methods TRL and transformers call by name: TRL's ``create_model_card``,
    transformers' ``save_model`` and ``_save`` (the card and the bundled model's Hub id next to the saved weights) and
    ``push_to_hub`` (which writes the card, then uploads; an unreachable Hub is reported in one line by
    `trinity_trl.training.checks.hub_errors_in_one_line`). Each method passes values to a collaborator and takes
    values back. It must come before a TRL trainer in the bases, inherits nothing and is inherited by nothing of
    ours: the checkpoints are `trinity_trl.checkpointing.checkpoints.CompleteCheckpoints` (a sibling base), the
    checks and settings of a starting run are the functions `trinity_trl.trainers.machine.start_run` /
    `trinity_trl.trainers.machine.check_run` that each trainer calls, and metric logging is
    `trinity_trl.training.metrics`. What it reads of its host is declared below: the trainer sets ``algorithm`` (and
    ``components``, ``_name``) before the first card is written; the rest is TRL's / transformers'.
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

    def set_model_card_demonstrations(self, text: str) -> None:
        """Name the demonstrations on the model card (Markdown; default: the expert dataset's own name, if it has
        one, else its number of rows)."""
        self.model_card.demonstrations = text

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
            expert_dataset=getattr(self, "expert_dataset", None),
        )

    def push_to_hub(self, *args, **kwargs):
        instead = "save with trainer.save_model() and upload the folder later (docs/distributed.md#push-later)"
        with hub_errors_in_one_line("trainer.push_to_hub()", instead):
            return super().push_to_hub(*args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        # the bundled model's Hub id, not the cache; by the process that wrote the folder only (under DeepSpeed every
        # process calls _save, and another one would read adapter_config.json while it is being written)
        if self.args.should_save:
            record_public_base_model(output_dir or self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if not _internal_call and self.is_world_process_zero():
            target = output_dir or self.args.output_dir
            with temporarily(self.args, output_dir=target):  # TRL writes the card into args.output_dir
                self.create_model_card(model_name=os.path.basename(os.path.normpath(target)))
