"""A training process killed with SIGKILL resumes from its last complete checkpoint and ends as if never killed.

Real subprocesses (`scripts/crash_run.py`, one process each) kill themselves with SIGKILL (no handler, no atexit,
no flush) at a chosen point:

* PPO (critic weights and optimizer, adaptive KL controller; a checkpoint every step, `save_total_limit=1`) is killed
  while writing checkpoint-3, after transformers' and TRL's files, our trainer state and the critic's weights, before
  the critic's optimizer state and the completion marker. transformers alone (`get_last_checkpoint`) would resume
  from that checkpoint-3, and its `save_total_limit` would already have deleted checkpoint-2;
* CHORD (expert cursor; `num_iterations=2`, so checkpoint-3 holds the rest of a generation batch) is killed in the
  middle of step 4, after its backward and before its optimizer step.

The rerun with `resume_from_checkpoint=True` must skip the partial checkpoint (saying so) and end with the weights of
the uninterrupted run within Adam's rounding bound (`ATOL`; observed: identical), logging the same losses for the
steps it trains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import SCRIPTS, run_script
from helpers import TINY_MODEL_TERMS, trained_weights_atol
from tolerance import tolerance

from trinity_trl.checkpointing.checkpoints import BUFFER_FILE, COMPLETE_FILE, TRAINER_STATE_FILE, incompleteness
from trinity_trl.training.critic_engine import CRITIC_OPTIMIZER_FILE

pytestmark = pytest.mark.slow
STEPS = 4
# the resumed run replays the steps after the checkpoint: Adam's step bound at lr 1e-2 (tests/helpers.py)
ATOL = trained_weights_atol(steps=STEPS, lr=1e-2)
# the logged losses: the tiny model's chain at the per-token terms' scale (z-score advantages times ratios of 1)
LOSS_ATOL = tolerance(torch.float32, terms=TINY_MODEL_TERMS, scale=1.0)["atol"]


def crash_run(model_dir: str, out: Path, case: str, *options: str, expect_rc: int = 0):
    command = [
        sys.executable,
        str(SCRIPTS / "crash_run.py"),
        model_dir,
        str(out),
        case,
        "--steps",
        str(STEPS),
        *options,
    ]
    return run_script(command, f"{case} {' '.join(options)}", timeout=600, expect_rc=expect_rc)


def uninterrupted(model_dir: str, tmp_path: Path, case: str) -> dict:
    result = tmp_path / f"{case}_straight.pt"
    crash_run(model_dir, tmp_path / "straight", case, "--result", str(result))
    return torch.load(result, weights_only=False)


def resume(model_dir: str, out: Path, case: str, tmp_path: Path):
    result = tmp_path / f"{case}_resumed.pt"
    proc = crash_run(model_dir, out, case, "--resume", "--result", str(result))
    return proc, torch.load(result, weights_only=False)


def assert_same_end(straight: dict, resumed: dict, first_resumed_step: int) -> None:
    for part in ("policy", "critic"):
        if part not in straight:
            continue
        assert straight[part].keys() == resumed[part].keys()
        for name, value in straight[part].items():
            torch.testing.assert_close(
                resumed[part][name], value, atol=ATOL, rtol=0, msg=lambda m, n=name, p=part: f"{p} {n}: {m}"
            )
    # the resumed run's log history: the checkpoint's steps (its trainer_state.json), then the steps it trained
    expected = {log["step"]: log["loss"] for log in straight["logs"]}
    got = {log["step"]: log["loss"] for log in resumed["logs"]}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(first_resumed_step, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], abs=LOSS_ATOL), step


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def test_killed_while_writing_a_checkpoint(tmp_path, tiny_model_dir):
    from transformers.trainer_utils import get_last_checkpoint

    straight = uninterrupted(tiny_model_dir, tmp_path, "ppo")
    out = tmp_path / "run"
    crash_run(tiny_model_dir, out, "ppo", "--kill_in_checkpoint", "3", expect_rc=-9)
    # checkpoint-2 survived save_total_limit=1: old checkpoints are deleted only once a newer one is complete
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    partial = out / "checkpoint-3"
    assert get_last_checkpoint(str(out)) == str(partial)  # what transformers alone would resume from
    assert (partial / "trainer_state.json").is_file() and (partial / TRAINER_STATE_FILE).is_file()
    assert (partial / "critic").is_dir() and not (partial / CRITIC_OPTIMIZER_FILE).exists()
    assert COMPLETE_FILE in incompleteness(str(partial))
    assert incompleteness(str(out / "checkpoint-2")) is None

    proc, resumed = resume(tiny_model_dir, out, "ppo", tmp_path)
    assert f"Skipping checkpoint {partial} for resuming: it has no {COMPLETE_FILE}" in proc.stderr
    assert_same_end(straight, resumed, first_resumed_step=3)
    assert checkpoints(out) == ["checkpoint-4"] and incompleteness(str(out / "checkpoint-4")) is None


def test_killed_in_the_middle_of_a_step(tmp_path, tiny_model_dir):
    straight = uninterrupted(tiny_model_dir, tmp_path, "chord")
    out = tmp_path / "run"
    crash_run(tiny_model_dir, out, "chord", "--kill_in_step", "4", expect_rc=-9)
    assert checkpoints(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert all(incompleteness(str(out / name)) is None for name in checkpoints(out))
    # checkpoint-3 falls inside a generation batch (num_iterations=2): it keeps the rest of the batch
    assert (out / "checkpoint-3" / BUFFER_FILE.format(rank=0)).is_file()

    proc, resumed = resume(tiny_model_dir, out, "chord", tmp_path)
    assert "Skipping checkpoint" not in proc.stderr
    assert_same_end(straight, resumed, first_resumed_step=4)
