"""Checkpoints that are complete or never resumed from, and whose files never run code when read.

What our checkpoints hold beyond transformers'/TRL's:

* ``trinity_trainer_state.json``: the state of our components (KL controllers, CHORD's expert cursor, generation and
  micro-step counters), JSON.
* ``trinity_generation_buffer_rank{rank}.pt``: a checkpoint taken while a generation batch is still being trained on
  (``num_iterations > 1``, or ``steps_per_generation > gradient_accumulation_steps``) keeps each process's remaining
  batch, so a resumed run trains on the same rows instead of generating a new batch early.
* PPO: ``critic/`` (the value model's weights, safetensors) and its optimizer state (``critic_optimizer.pt``, or one
  file per process under DeepSpeed ZeRO, whose optimizer state is partitioned).

Every ``.pt`` file we write holds tensors, numbers, strings, lists and dicts only, and is read with
``torch.load(weights_only=True)``, which refuses anything else (checkpoints are shared on the Hub; a pickled object
can run code when loaded): `load_plain` turns the refusal into an error that names the file.

**Completion.** A process killed while writing a checkpoint leaves a ``checkpoint-N`` folder that transformers'
``get_last_checkpoint`` (``resume_from_checkpoint=True``) would pick, being the highest-numbered one. So the last
file written into a checkpoint is `COMPLETE_FILE`, written atomically after every process has written all of
its files (transformers', TRL's and ours): a manifest of every file with its size. A folder without it, or whose
files no longer match it, is incomplete and is never resumed from (`resume_checkpoint`). Our own files are
written atomically too (a temporary file renamed over the final name), so a file is either whole or absent.

**Why `CompleteCheckpoints` runs the push and the rotation itself.** Three invariants: a pushed checkpoint is
complete; an old checkpoint is deleted (``save_total_limit``) only once a newer one is complete; a checkpoint whose
writing was interrupted is never resumed from. So the order must be: every file (transformers', TRL's, ours) ->
every process done -> the marker -> the Hub push -> the rotation. transformers 5.24's ``Trainer._save_checkpoint``
(``transformers/trainer.py``) writes its files, ``trainer_state.json`` last (line 3417), then pushes
(``self._push_from_checkpoint(output_dir)``, lines 3419-3420) and rotates (``rotate_checkpoints(...)``, lines
3423-3430) in the same method, and no seam it offers falls between the last file and the push:

* ``_save_optimizer_and_scheduler`` / ``_save_scaler`` / ``_save_rng_state`` (lines 3398-3403) run before
  ``trainer_state.json`` is written, and not at all with ``save_only_model=True``: a marker there would describe
  a folder that is not finished;
* ``_push_from_checkpoint`` (and the ``on_push_begin`` callback inside it) is called only when ``push_to_hub`` is
  on (and ``on_push_begin`` on process 0 only): without a push there would be no marker, and the rotation
  still follows;
* the ``on_save`` callback runs after ``_save_checkpoint`` has returned (``_maybe_log_save_evaluate``, lines
  2285-2286), once the old checkpoints are already deleted: with ``save_total_limit=1``, a run killed between the
  rotation and the marker would leave no complete checkpoint (``tests/engines/test_crash_resume.py``);
* ``rotate_checkpoints`` is a module function that ``transformers.trainer`` imports by name (line 143), called
  with ``args.save_total_limit``: the argument is the only handle that defers it without patching transformers'
  module for every trainer in the process.

Also, TRL's trainers write files of their own into the checkpoint after transformers' method returns (GRPOTrainer's
``entropy_ctrl_state.json``, ``trl/trainer/grpo_trainer.py`` line 3394), i.e. after transformers' push. Hence
`CompleteCheckpoints._save_checkpoint` runs TRL's and transformers' ``_save_checkpoint`` whole, with
``push_to_hub`` and ``save_total_limit`` switched off for that call (`trinity_trl.overrides.temporarily`), then
writes our files and the marker and calls transformers' own ``_push_from_checkpoint`` and ``rotate_checkpoints``
with the run's arguments: transformers' code does the push and the rotation; only the moment is ours.
``tests/test_hub.py::test_a_checkpoint_is_pushed_only_once_it_is_complete`` and
``tests/engines/test_crash_resume.py::test_killed_while_writing_a_checkpoint`` fail if they run in transformers'
order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("trinity_trl")

TRAINER_STATE_FILE = "trinity_trainer_state.json"
BUFFER_FILE = "trinity_generation_buffer_rank{rank}.pt"
COMPLETE_FILE = "trinity_checkpoint_complete.json"
COMPLETE_FORMAT = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_TEMP_MARK = ".tmp-"


# ---------------------------------------------------------------------------------------------- writing
def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some file systems do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Write ``path`` through ``write(temporary_path)``, then rename it into place: ``path`` is whole or absent."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}{_TEMP_MARK}{os.getpid()}"
    try:
        write(temporary)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    _fsync_dir(folder)


def save_plain(obj: Any, path: str) -> None:
    """``torch.save`` of tensors, numbers, strings, lists and dicts, written atomically."""
    write_atomically(path, lambda tmp: torch.save(obj, tmp))


def load_plain(path: str, map_location: Any = "cpu", what: str = "checkpoint file") -> Any:
    """Read a file written by `save_plain` without unpickling objects: anything but tensors, numbers, strings,
    lists and dicts is refused with an error naming the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 (any unpickling refusal, whatever torch calls it)
        raise ValueError(
            f"refusing to load the {what} {path}: it holds something other than tensors, lists and numbers (or "
            f"strings and dicts), and unpickling it could run code (checkpoints are shared; a checkpoint must never "
            f"run code when it is loaded). Torch said: {err}"
        ) from None


def save_trainer_state(folder: str, state: dict[str, Any]) -> None:
    def write(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state, f)

    write_atomically(os.path.join(folder, TRAINER_STATE_FILE), write)


def load_trainer_state(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, TRAINER_STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save_generation_buffer(folder: str, rank: int, buffer: list[dict[str, Any]]) -> None:
    save_plain(buffer, os.path.join(folder, BUFFER_FILE.format(rank=rank)))


def load_generation_buffer(folder: str, rank: int, device: torch.device | str) -> list[dict[str, Any]] | None:
    path = os.path.join(folder, BUFFER_FILE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    return load_plain(path, map_location=device, what="buffered generation batch")


# ------------------------------------------------------------------------------------------- completion
def _files_of(folder: str) -> dict[str, int]:
    """Relative path -> size of every file under ``folder`` except the marker and leftover temporary files."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative == COMPLETE_FILE or _TEMP_MARK in name:
                continue
            files[relative.replace(os.sep, "/")] = os.path.getsize(path)
    return dict(sorted(files.items()))


def mark_complete(folder: str, global_step: int) -> None:
    """Write the completion marker (last, atomically): the checkpoint's step and a manifest of its files."""
    manifest = {"format": COMPLETE_FORMAT, "global_step": int(global_step), "files": _files_of(folder)}

    def write(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=0)

    write_atomically(os.path.join(folder, COMPLETE_FILE), write)


def unmark(folder: str) -> None:
    """Remove the marker before a checkpoint folder is written again (e.g. a resumed run saving the same step)."""
    path = os.path.join(folder, COMPLETE_FILE)
    if os.path.exists(path):
        os.remove(path)
        _fsync_dir(folder)


def incompleteness(folder: str) -> str | None:
    """``None`` when ``folder`` is a complete checkpoint, else why it is not."""
    path = os.path.join(folder, COMPLETE_FILE)
    if not os.path.isfile(path):
        return (
            f"it has no {COMPLETE_FILE}: the run stopped before the checkpoint was completely written (or the "
            "checkpoint was not written by a trinity_trl trainer)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {COMPLETE_FILE} is unreadable ({err})"
    for relative, size in files.items():
        file = os.path.join(folder, *relative.split("/"))
        if not os.path.isfile(file):
            return f"{relative} is missing"
        if os.path.getsize(file) != size:
            return f"{relative} has {os.path.getsize(file)} bytes, {size} when the checkpoint was completed"
    return None


def checkpoint_folders(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the ``checkpoint-N`` folders of ``output_dir``, highest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def last_complete_checkpoint(output_dir: str, log: Callable[[str], None] = logger.warning) -> str | None:
    """The highest-numbered complete checkpoint of ``output_dir``; each newer incomplete one is skipped, with a log
    line saying why."""
    for _, folder in checkpoint_folders(output_dir):
        problem = incompleteness(folder)
        if problem is None:
            return folder
        log(f"Skipping checkpoint {folder} for resuming: {problem}.")
    return None


def resume_checkpoint(value: Any, output_dir: str, log: Callable[[str], None] = logger.warning) -> str | None:
    """What ``train(resume_from_checkpoint=value)`` resumes from: ``None``/``False`` (nothing), ``True`` or the
    strings ``"true"``/``"last"`` (the last complete checkpoint of ``output_dir``), a folder holding ``checkpoint-N``
    folders (its last complete one), or a checkpoint folder (which must be complete)."""
    if value is None or value is False:
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "last", "latest")):
        where = output_dir
    else:
        where = os.fspath(value)
        if not os.path.isdir(where):
            raise ValueError(f"resume_from_checkpoint={value!r}: no such folder")
        if _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(where))) or not checkpoint_folders(where):
            problem = incompleteness(where)
            if problem is not None:
                newest = last_complete_checkpoint(os.path.dirname(os.path.normpath(where)), log=lambda _: None)
                hint = f"; the last complete checkpoint next to it is {newest}" if newest else ""
                raise ValueError(f"cannot resume from {where}: {problem}{hint}")
            return where
    found = last_complete_checkpoint(where, log)
    if found is None:
        present = [os.path.basename(p) for _, p in checkpoint_folders(where)]
        raise ValueError(
            f"no complete checkpoint to resume from in {where}"
            + (f" ({', '.join(present)} are incomplete)" if present else " (no checkpoint-N folder)")
        )
    return found


class CompleteCheckpoints:
    """Trainer mixin: a checkpoint is marked complete once every process wrote all of its files, and resuming picks
    complete checkpoints only (see the module docstring).

    A trainer writes its own files in `_save_checkpoint_extras` (called on every process, before the
    marker). transformers' Hub push of the checkpoint and its deletion of old checkpoints (``save_total_limit``) run
    after the marker: a pushed checkpoint is complete, and an old checkpoint is deleted only once a newer one is
    (why transformers' own sequence cannot give that order: the module docstring).

    It overrides two methods of transformers' ``Trainer`` (``_save_checkpoint``, ``train``), which is why it is a
    mixin and not an object the trainer composes; it must come before a ``transformers.Trainer`` in the bases, and
    uses only what that ``Trainer`` defines: the attributes declared below and its methods ``_get_output_dir``,
    ``_push_from_checkpoint`` and ``is_world_process_zero``.
    """

    # what the host transformers.Trainer provides
    args: Any  # TrainingArguments
    state: Any  # TrainerState
    accelerator: Any  # accelerate.Accelerator

    def _save_checkpoint_extras(self, folder: str) -> None:
        """Write this trainer's own checkpoint files into ``folder`` (every process calls it)."""

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        from ..overrides import temporarily

        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):
            # written before (a resumed run saving the same step again, or a crashed run's leftover): start afresh,
            # so no file of the older write survives into this checkpoint
            unmark(folder)
            shutil.rmtree(folder, ignore_errors=True)
        self.accelerator.wait_for_everyone()  # (unconditional: every process reaches it)
        # transformers pushes the checkpoint and deletes old ones at the end of its _save_checkpoint: both wait
        # until this checkpoint is complete (done below)
        with temporarily(self.args, push_to_hub=False, save_total_limit=None):
            super()._save_checkpoint(model, trial)
        self._save_checkpoint_extras(folder)
        self.accelerator.wait_for_everyone()  # every process's files are written
        if self.args.should_save:
            mark_complete(folder, self.state.global_step)
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        log = logger.warning if self.is_world_process_zero() else (lambda _: None)
        resume_from_checkpoint = resume_checkpoint(resume_from_checkpoint, self.args.output_dir, log)
        if resume_from_checkpoint is not None and self.is_world_process_zero():
            logger.info("Resuming from %s", resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)


class TrainerStateFiles:
    """The files a GRPO-based trainer's checkpoint carries beyond TRL's (see the module docstring), for one process.

    The trainer composes one and calls it from its two checkpoint seams (``_save_checkpoint_extras``,
    ``_load_optimizer_and_scheduler``), passing what to save; this object knows where and how it is written.

    Args:
        rank: this process's index (each process writes and reads its own generation batch).
        device: where a read generation batch is placed.
    """

    def __init__(self, rank: int, device: torch.device | str):
        self.rank = rank
        self.device = device

    def save(self, folder: str, state: dict[str, Any] | None, unfinished_batch: list[dict[str, Any]] | None) -> None:
        """Write ``state`` (JSON-able; ``None`` on processes that do not save) and, when the checkpoint falls inside a
        generation batch, this process's ``unfinished_batch`` (``None`` otherwise)."""
        if state is not None:
            save_trainer_state(folder, state)
        if unfinished_batch is not None:
            save_generation_buffer(folder, self.rank, unfinished_batch)

    def load(self, folder: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
        """``(state, unfinished batch)`` of the checkpoint ``folder``; each ``None`` when the checkpoint has none
        (e.g. written by plain TRL, or between generation batches)."""
        return load_trainer_state(folder), load_generation_buffer(folder, self.rank, self.device)
