"""What our checkpoints hold beyond TRL's, written and read without running code from the files.

* ``trinity_trainer_state.json``: the state of our components (KL controllers, CHORD's expert
  cursor, generation and micro-step counters), JSON.
* ``trinity_generation_buffer_rank{rank}.pt``: a checkpoint taken while a generation batch is still
  being trained on (``num_iterations > 1``, or ``steps_per_generation > gradient_accumulation_steps``)
  keeps each process's remaining batch, so a resumed run trains on the same rows instead of
  generating a new batch early. Tensors, lists and numbers only: it is read with
  ``torch.load(weights_only=True)``, which refuses pickled objects (checkpoints are shared on the Hub).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

TRAINER_STATE_FILE = "trinity_trainer_state.json"
BUFFER_FILE = "trinity_generation_buffer_rank{rank}.pt"


def save_trainer_state(folder: str, state: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(state, f)


def load_trainer_state(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, TRAINER_STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save_generation_buffer(folder: str, rank: int, buffer: list[dict[str, Any]]) -> None:
    os.makedirs(folder, exist_ok=True)
    torch.save(buffer, os.path.join(folder, BUFFER_FILE.format(rank=rank)))


def load_generation_buffer(folder: str, rank: int, device: torch.device | str) -> list[dict[str, Any]] | None:
    path = os.path.join(folder, BUFFER_FILE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 (any unpickling refusal)
        raise ValueError(
            f"refusing to load {path}: it holds something other than tensors, lists and numbers (a checkpoint must "
            f"never run code when it is loaded): {err}"
        ) from None
