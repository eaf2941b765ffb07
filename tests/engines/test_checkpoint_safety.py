"""Checkpoints are complete or never resumed from, and loading one never runs code from it (`checkpointing/`).

* The completion marker: written last, after every file of every process; a folder without it (a run killed while
  writing), or whose files no longer match its manifest (truncated, missing), is skipped by
  `resume_from_checkpoint=True` with a log line, and refused when named explicitly.
* Our files are written atomically (temporary file, then rename): a failed write leaves nothing behind.
* Every file we write is read with `torch.load(weights_only=True)`; a checkpoint whose state file carries a pickle
  that runs code is refused with an error naming the file, and the code does not run. transformers' own loads
  (`rng_state*.pth`, `optimizer.pt`, `scheduler.pt`) use `weights_only=True` as well (the last test shows it refuses
  such a file too).
"""

from __future__ import annotations

import builtins
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

from trinity_trl.checkpointing.checkpoints import (
    BUFFER_FILE,
    COMPLETE_FILE,
    incompleteness,
    last_complete_checkpoint,
    load_generation_buffer,
    mark_complete,
    resume_checkpoint,
    save_plain,
)
from trinity_trl.trainers import PPOConfig, PPOTrainer, TrinityConfig, TrinityTrainer
from trinity_trl.training.critic_engine import CRITIC_OPTIMIZER_FILE


def fake_checkpoint(output_dir: Path, step: int, complete: bool = True) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 100)
    (folder / "sub" / "part.bin").write_bytes(b"y" * 10)
    if complete:
        mark_complete(str(folder), step)
    return folder


# ------------------------------------------------------------------------------------------------ completion
def test_resume_true_picks_the_last_complete_checkpoint_and_says_which_it_skips(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    fake_checkpoint(tmp_path, 6, complete=False)  # killed while writing
    truncated = fake_checkpoint(tmp_path, 8)
    (truncated / "model.safetensors").write_bytes(b"x" * 50)
    missing = fake_checkpoint(tmp_path, 10)
    (missing / "sub" / "part.bin").unlink()
    (tmp_path / "checkpoint-12-tmp").mkdir()  # not a checkpoint name
    lines: list[str] = []
    assert resume_checkpoint(True, str(tmp_path), lines.append) == str(tmp_path / "checkpoint-4")
    assert lines == [
        f"Skipping checkpoint {missing} for resuming: sub/part.bin is missing.",
        f"Skipping checkpoint {truncated} for resuming: model.safetensors has 50 bytes, 100 when the checkpoint was "
        "completed.",
        f"Skipping checkpoint {tmp_path / 'checkpoint-6'} for resuming: it has no {COMPLETE_FILE}: the run stopped "
        "before the checkpoint was completely written (or the checkpoint was not written by a trinity_trl trainer).",
    ]
    # the recipes' --resume_from_checkpoint: "true"/"last", or the output folder itself
    for value in ("true", "True", "last", str(tmp_path)):
        assert resume_checkpoint(value, str(tmp_path), lambda _: None) == str(tmp_path / "checkpoint-4")
    assert resume_checkpoint(None, str(tmp_path)) is None and resume_checkpoint(False, str(tmp_path)) is None


def test_an_explicit_incomplete_checkpoint_is_refused(tmp_path):
    fake_checkpoint(tmp_path, 2)
    partial = fake_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(
        ValueError,
        match=rf"cannot resume from {partial}: it has no {COMPLETE_FILE}.*the last "
        rf"complete checkpoint next to it is {tmp_path / 'checkpoint-2'}",
    ):
        resume_checkpoint(str(partial), str(tmp_path))
    assert resume_checkpoint(str(tmp_path / "checkpoint-2"), "unused") == str(tmp_path / "checkpoint-2")


def test_no_complete_checkpoint_is_an_error(tmp_path):
    fake_checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(ValueError, match=r"no complete checkpoint to resume from .* \(checkpoint-4 are incomplete\)"):
        resume_checkpoint(True, str(tmp_path), lambda _: None)
    with pytest.raises(ValueError, match="no such folder"):
        resume_checkpoint(str(tmp_path / "nowhere"), str(tmp_path))


def test_the_marker_is_written_atomically_after_every_file(tmp_path):
    folder = fake_checkpoint(tmp_path, 1, complete=False)
    (folder / f"leftover{'.tmp-'}123").write_bytes(b"z")  # a temporary file of an interrupted atomic write
    mark_complete(str(folder), 1)
    assert sorted(os.listdir(folder)) == sorted(["model.safetensors", "sub", COMPLETE_FILE, "leftover.tmp-123"])
    assert incompleteness(str(folder)) is None
    assert last_complete_checkpoint(str(tmp_path)) == str(folder)


def test_an_interrupted_atomic_write_leaves_nothing(tmp_path):
    class Unsaveable:
        def __reduce__(self):
            raise RuntimeError("disk full")

    path = tmp_path / "state.pt"
    with pytest.raises(RuntimeError, match="disk full"):
        save_plain({"a": torch.ones(2), "b": Unsaveable()}, str(path))
    assert os.listdir(tmp_path) == []


def test_trainer_checkpoints_are_marked_complete_and_resume_skips_a_partial_one(tmp_path, tiny_model_dir, caplog):
    def trainer(out):
        args = TrinityConfig(
            **tiny_grpo_kwargs(
                output_dir=str(out),
                max_steps=3,
                save_strategy="steps",
                save_steps=1,
                save_total_limit=2,
                disable_tqdm=True,
            )
        )
        return TrinityTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset(8)
        )

    trainer(tmp_path).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for step in (2, 3):
        assert incompleteness(str(tmp_path / f"checkpoint-{step}")) is None
    (tmp_path / "checkpoint-3" / COMPLETE_FILE).unlink()  # as a run killed before the marker leaves it
    resumed = trainer(tmp_path)
    caplog.set_level(logging.WARNING, logger="trinity_trl")
    resumed.train(resume_from_checkpoint=True)
    assert any("Skipping checkpoint" in r.getMessage() and "checkpoint-3" in r.getMessage() for r in caplog.records)
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3]  # step 3 trained again
    assert incompleteness(str(tmp_path / "checkpoint-3")) is None  # written again, whole


# ------------------------------------------------------------------------------------------ malicious pickles
class RunsCode:
    """Unpickling this object creates the file ``path`` (any code could run instead)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


def plant(file: Path, tmp_path: Path) -> Path:
    """Replace ``file`` by a pickle that would create a file when loaded; return that file's path."""
    evidence = tmp_path / "code_ran"
    torch.save({"state": RunsCode(str(evidence))}, file)
    return evidence


def test_a_generation_buffer_carrying_a_pickled_object_is_refused(tmp_path):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    evidence = plant(folder / BUFFER_FILE.format(rank=0), tmp_path)
    file = BUFFER_FILE.format(rank=0)
    with pytest.raises(ValueError, match=rf"refusing to load the buffered generation batch .*{file}.*could run code"):
        load_generation_buffer(str(folder), 0, "cpu")
    assert not evidence.exists()


def test_resuming_from_a_checkpoint_whose_critic_state_carries_a_pickled_object_is_refused(tmp_path, tiny_model_dir):
    def trainer(out):
        args = PPOConfig(
            **tiny_grpo_kwargs(output_dir=str(out), max_steps=1, save_strategy="steps", save_steps=1, disable_tqdm=True)
        )
        return PPOTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset(8)
        )

    trainer(tmp_path / "run").train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    evidence = plant(checkpoint / CRITIC_OPTIMIZER_FILE, tmp_path)
    mark_complete(str(checkpoint), 1)  # a consistent, "complete" checkpoint as someone could publish it
    with pytest.raises(
        ValueError,
        match=rf"refusing to load the critic state {checkpoint / CRITIC_OPTIMIZER_FILE}: "
        r"it holds something other than tensors.*could run code",
    ):
        trainer(tmp_path / "resumed").train(resume_from_checkpoint=str(checkpoint))
    assert not evidence.exists()


def test_transformers_refuses_a_pickled_object_in_its_own_files_too(tmp_path, tiny_model_dir):
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path / "run"), max_steps=1, save_strategy="steps", save_steps=1, disable_tqdm=True
        )
    )

    def trainer():
        return TrinityTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset(8)
        )

    trainer().train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    evidence = plant(checkpoint / "rng_state.pth", tmp_path)
    mark_complete(str(checkpoint), 1)
    with pytest.raises(Exception, match="Weights only load failed"):
        trainer().train(resume_from_checkpoint=str(checkpoint))
    assert not evidence.exists()


def test_the_recipe_resume_option_skips_a_partial_checkpoint(tmp_path, tiny_model_dir, caplog):
    """`trinity-trl cispo ... --resume_from_checkpoint true` (or the output folder) resumes from the last complete
    checkpoint of the output folder."""
    from trinity_trl.cli import run as cli

    tiny = [
        "--config",
        "cispo_cpu",
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path),
        "--num_train_rows",
        "8",
        "--num_eval_rows",
        "4",
        "--max_completion_length",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--save_strategy",
        "steps",
        "--save_steps",
        "1",
        "--plot",
        "false",
        "--disable_tqdm",
        "true",
    ]
    cli(["cispo", *tiny, "--max_steps", "2"])
    (tmp_path / "checkpoint-2" / COMPLETE_FILE).unlink()
    caplog.set_level(logging.INFO, logger="trinity_trl")
    trainer = cli(["cispo", *tiny, "--max_steps", "3", "--resume_from_checkpoint", "true"])
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"Skipping checkpoint {tmp_path / 'checkpoint-2'}" in m for m in messages)
    assert f"Resuming from {tmp_path / 'checkpoint-1'}" in messages
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3]  # steps 2 and 3 after resuming
    assert all(incompleteness(str(tmp_path / f"checkpoint-{s}")) is None for s in (1, 2, 3))
