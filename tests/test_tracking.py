"""Experiment tracking without a network: `report_to=["trackio"]` (local SQLite) and `report_to=["wandb"]`
(`WANDB_MODE=offline`) receive our trainers' own metrics (`actor/*`, `chord/*`), one row per logged step."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import trackio  # both come with the `test` extra
import wandb
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from huggingface_hub.errors import HfHubHTTPError
from trackio.sqlite_storage import SQLiteStorage

from trinity_trl.trainers import ChordConfig, ChordTrainer, CISPOConfig, CISPOTrainer

# our metrics as the integrations name them: transformers' `rewrite_logs` prefixes training logs with "train/"
CHORD_KEYS = (
    "train/actor/mu",
    "train/actor/expert/sft_loss",
    "train/actor/usual/pg_loss",
    "train/chord/expert_rows",
    "train/actor/loss",
    "train/loss",
    "train/reward",
)
CISPO_KEYS = (
    "train/actor/cispo_loss",
    "train/actor/unmasked_frac",
    "train/actor/pg_clipfrac",
    "train/actor/loss",
    "train/actor/kl_loss",
    "train/loss",
    "train/reward",
)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def trackio_dir(tmp_path, monkeypatch):
    """Trackio's local storage under `tmp_path/trackio`. trackio reads `TRACKIO_DIR` once at import and its modules
    copy the paths, so the module constants are patched as well as the environment."""
    path = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(path))
    for name, module in list(sys.modules.items()):
        if name == "trackio" or name.startswith("trackio."):
            for attribute, value in (
                ("TRACKIO_DIR", path),
                ("MEDIA_DIR", path / "media"),
                ("ARTIFACTS_DIR", path / "artifacts"),
            ):
                if hasattr(module, attribute):
                    monkeypatch.setattr(module, attribute, value)
    return path


def chord_args_and_expert(tmp_path, **config):
    expert = Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
            for a, b in [(1, 2), (3, 4), (5, 6)]
        ]
    )
    args = ChordConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), expert_batch_size=2, **config))
    return args, expert


def logged_steps(trainer, keys) -> dict[int, dict[str, float]]:
    """`{global_step: {key: value}}` of the trainer's per-step logs, keys renamed as the integrations log them."""
    return {
        entry["step"]: {key: entry[key.removeprefix("train/")] for key in keys}
        for entry in trainer.state.log_history
        if "loss" in entry
    }


def assert_rows_match(rows: dict[int, dict], expected: dict[int, dict[str, float]]) -> None:
    assert sorted(rows) == sorted(expected) == [1, 2]
    for step, values in expected.items():
        for key, value in values.items():
            assert rows[step][key] == pytest.approx(value, rel=1e-6), (step, key)


def test_chord_metrics_go_to_trackio_locally_and_push_creates_no_space(tmp_path, tiny_model_dir, trackio_dir, fake_hub):
    args, expert = chord_args_and_expert(
        tmp_path,
        report_to=["trackio"],
        project="chord-tracking",
        run_name="run-1",
        trackio_static_space_id=False,
        push_to_hub=True,
        hub_model_id="tester/chord-trackio",
    )
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        expert_dataset=expert,
    )
    trainer.train()

    assert (trackio_dir / "chord-tracking.db").is_file()
    assert [run.name for run in trackio.Api().runs("chord-tracking")] == ["run-1"]
    logs = SQLiteStorage.get_logs("chord-tracking", "run-1")
    rows = {row["train/global_step"]: row for row in logs if "train/actor/mu" in row}
    assert_rows_match(rows, logged_steps(trainer, CHORD_KEYS))
    # ChordConfig()'s CHORD-μ: μ decaying (cosine) from 0.9 to 0.05 over the run's max_steps (2)
    from trinity_trl.algorithms.policy_loss.chord import mu_schedule_function

    logged = [row["train/actor/mu"] for _, row in sorted(rows.items())]
    assert logged == pytest.approx([mu_schedule_function(int(s), 0, 2, 0.9, 0.05) for s in sorted(rows)])

    trainer.push_to_hub()
    assert "model.safetensors" in fake_hub.files("tester/chord-trackio")
    # with trackio_static_space_id=False the Trackio callback syncs nothing on push: only the model repo is touched
    assert set(fake_hub.repos) == {("model", "tester/chord-trackio")}
    assert all("/spaces/" not in path and "/buckets/" not in path for _, path in fake_hub.requests)
    assert fake_hub.blocked == []


def test_trackio_default_static_space_makes_push_reach_for_the_hub(tmp_path, tiny_model_dir, trackio_dir, fake_hub):
    """Why docs and tests set `trackio_static_space_id=False`: left at None, `push_to_hub` first syncs the Trackio
    project to a static Space (and a Bucket) on the Hub, which an offline push cannot do."""
    args, expert = chord_args_and_expert(
        tmp_path,
        max_steps=1,
        report_to=["trackio"],
        project="chord-default",
        push_to_hub=True,
        hub_model_id="tester/chord-default",
    )
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        expert_dataset=expert,
    )
    trainer.train()
    with pytest.raises(HfHubHTTPError, match="/api/buckets/tester/chord-default-static-"):
        trainer.push_to_hub()
    assert any(path.startswith("/api/spaces/tester/chord-default-static-") for _, path in fake_hub.requests)
    assert fake_hub.commits("tester/chord-default") == ["initial commit"]  # the model never got uploaded


def wandb_records(path, block_size: int = 32768) -> list:
    """Records of an offline run's `run-*.wandb` file: a 7-byte header (":W&B", magic, version), then LevelDB-log
    style chunks (crc32c, little-endian length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) that never cross a 32 KiB block."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, parts, records = 7, [], []
    while position + 7 <= len(data):
        left = block_size - position % block_size
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        parts.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def test_cispo_metrics_go_to_an_offline_wandb_run(tmp_path, tiny_model_dir, monkeypatch):
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_PROJECT": "cispo-tracking",
        "WANDB_SILENT": "true",
        "WANDB_API_KEY": "",
    }.items():
        monkeypatch.setenv(name, value)
    args = CISPOConfig(
        **tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), report_to=["wandb"], run_name="run-1"), kl_loss="k2"
    )
    trainer = CISPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )
    try:
        trainer.train()
    finally:
        wandb.finish()  # transformers leaves the run open after training
        wandb.teardown()  # and stop the wandb-core service this test started

    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    records = wandb_records(run_files[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "cispo-tracking" and run.display_name == "run-1"
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]
    rows = {row["train/global_step"]: row for row in history if "train/actor/cispo_loss" in row}
    assert_rows_match(rows, logged_steps(trainer, CISPO_KEYS))
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # the run was closed cleanly


def test_evaluate_after_train_with_trackio(tmp_path, tiny_model_dir, trackio_dir):
    """TRL 1.16 logs its profiling timers straight to trackio, so `evaluate()` after `train()` failed with "Call
    trackio.init() before trackio.log()" once the training run was finished; our trainers re-open a run."""
    args = CISPOConfig(
        **{
            **tiny_grpo_kwargs(output_dir=str(tmp_path / "cispo"), max_steps=1),
            "report_to": ["trackio"],
            "project": "eval-tracking",
            "run_name": "run-1",
            "trackio_static_space_id": False,
            "per_device_eval_batch_size": 4,
        }
    )
    trainer = CISPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        eval_dataset=tiny_conversational_dataset(4),
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_actor/loss" in metrics
    trackio.finish()
    logged = [
        row for run in trackio.Api().runs("eval-tracking") for row in SQLiteStorage.get_logs("eval-tracking", run.name)
    ]
    assert any("eval/reward" in row for row in logged), logged[-1:]
