"""The one helper that sets attributes of a library's object for a block and restores them.

Where TRL or transformers read a value from an attribute instead of taking an argument, the trainers set it for the
duration of one call with `temporarily` (each use says why). It lives at the bottom of the package, importing
nothing of it, so the rooms that need it (``checkpointing/``, ``training/``, ``trainers/``) import it downwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def temporarily(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``obj`` for the duration of the block, then restore them (even on error).

    Used where TRL reads a value from an attribute instead of taking an argument:

    * ``args.beta`` while ``GRPOTrainer.__init__`` runs: TRL loads a reference model (or plans to
      disable the LoRA adapter for it) and computes reference log-probs iff ``beta != 0``. Our KL
      terms are components (``kl_loss``, ``kl_penalty``) and never read ``beta``, so it is only
      raised while TRL decides whether to load the reference.
    * ``args.output_dir`` while TRL's ``create_model_card`` runs: it always writes the card into
      ``args.output_dir``; ``save_model(other_dir)`` wants it next to the saved weights.
    * ``args.push_to_hub`` and ``args.save_total_limit`` while transformers' ``_save_checkpoint`` runs:
      it pushes the checkpoint and deletes old ones at its end, before our files and the completion
      marker are written; `trinity_trl.checkpointing.checkpoints.CompleteCheckpoints` does both
      after the marker.
    * ``args.per_device_train_batch_size`` while ``AsyncGRPOTrainer.get_train_dataloader`` runs for
      AsyncChordTrainer: TRL's fixed-count batcher takes its micro-batch size from it, and a CHORD micro-batch holds
      the demonstrations beside that many rollouts.
    """
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)
