"""`trinity_trl/checkpointing/checkpoints.py`: the trainer-state JSON and the generation buffer, written and read back,
and a buffer file that would run code when unpickled is refused. Resuming whole runs:
tests/reliability/test_resume.py."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from trinity_trl.checkpointing.checkpoints import (
    BUFFER_FILE,
    TRAINER_STATE_FILE,
    TrainerStateFiles,
    load_generation_buffer,
    load_trainer_state,
    save_generation_buffer,
    save_trainer_state,
)


def write_marker(path: str) -> str:
    """What unpickling `CodeOnLoad` calls: proves that loading ran code."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("code ran while loading")
    return path


class CodeOnLoad:
    """A pickled object whose unpickling calls `write_marker(path)`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return write_marker, (self.path,)


def test_trainer_state_round_trip(tmp_path):
    state = {
        "kl_penalty": {"kl_coef": 0.0375},
        "kl_loss": {"kl_coef": 0.001},
        "generation_count": 7,
        "micro_step": 12,
        "expert_cursor": 6,
        "nested": {"list": [1, 2.5, None, "x"]},
    }
    folder = tmp_path / "checkpoint-3"
    save_trainer_state(str(folder), state)  # creates the folder
    path = folder / TRAINER_STATE_FILE
    assert path.is_file()
    assert json.loads(path.read_text(encoding="utf-8")) == state  # plain JSON, readable by anything
    assert load_trainer_state(str(folder)) == state


def test_trainer_state_of_a_checkpoint_without_one_is_none(tmp_path):
    assert load_trainer_state(str(tmp_path)) is None  # e.g. a checkpoint written by plain TRL


def test_trainer_state_must_be_json(tmp_path):
    with pytest.raises(TypeError):
        save_trainer_state(str(tmp_path), {"coef": torch.tensor(1.0)})


def test_generation_buffer_round_trip(tmp_path):
    buffer = [
        {
            "prompt_ids": torch.tensor([[1, 2, 3]]),
            "completion_mask": torch.tensor([[1, 1, 0]]),
            "advantages": torch.tensor([0.5, -0.5]),
            "num_items_in_batch": torch.tensor(2),
            "sampling_per_token_logps": None,
        },
        {"prompt_ids": torch.tensor([[4, 5, 6]]), "names": ["a", "b"], "count": 3, "ratio": 0.25},
    ]
    save_generation_buffer(str(tmp_path / "ckpt"), 1, buffer)
    assert (tmp_path / "ckpt" / BUFFER_FILE.format(rank=1)).is_file()
    loaded = load_generation_buffer(str(tmp_path / "ckpt"), 1, "cpu")
    assert len(loaded) == 2 and [set(b) for b in loaded] == [set(b) for b in buffer]
    for got, want in zip(loaded, buffer):
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got[key], value) and got[key].dtype == value.dtype, key
            else:
                assert got[key] == value, key
    # each rank has its own file
    assert load_generation_buffer(str(tmp_path / "ckpt"), 0, "cpu") is None


def test_trainer_state_files_save_what_they_are_given_for_their_process(tmp_path):
    folder = str(tmp_path / "checkpoint-3")
    batch = [{"advantages": torch.tensor([0.5, -0.5])}]
    TrainerStateFiles(rank=1, device="cpu").save(folder, {"generation_count": 2}, batch)
    assert sorted(os.listdir(folder)) == [BUFFER_FILE.format(rank=1), TRAINER_STATE_FILE]
    state, unfinished = TrainerStateFiles(rank=1, device="cpu").load(folder)
    assert state == {"generation_count": 2}
    assert torch.equal(unfinished[0]["advantages"], batch[0]["advantages"])
    assert TrainerStateFiles(rank=0, device="cpu").load(folder) == (state, None)  # another process's batch is not ours
    # a process that does not save the state, between generation batches: nothing is written
    TrainerStateFiles(rank=0, device="cpu").save(str(tmp_path / "other"), None, None)
    assert not os.path.exists(tmp_path / "other")
    assert TrainerStateFiles(rank=0, device="cpu").load(str(tmp_path / "other")) == (None, None)


def test_generation_buffer_of_a_checkpoint_without_one_is_none(tmp_path):
    assert load_generation_buffer(str(tmp_path), 0, "cpu") is None


def test_a_pickled_object_in_the_buffer_file_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "marker.txt"
    folder = tmp_path / "ckpt"
    save_generation_buffer(str(folder), 0, [{"prompt_ids": torch.tensor([1]), "payload": CodeOnLoad(str(marker))}])
    with pytest.raises(ValueError, match=r"refusing to load .*trinity_generation_buffer_rank0\.pt") as error:
        load_generation_buffer(str(folder), 0, "cpu")
    assert "tensors, lists and numbers" in str(error.value)
    assert not marker.exists()
    # the file really runs code when unpickled without the restriction: the refusal above is what prevented it
    torch.load(folder / BUFFER_FILE.format(rank=0), weights_only=False)
    assert marker.read_text(encoding="utf-8") == "code ran while loading"


def test_a_plain_pickle_in_the_buffer_file_is_refused(tmp_path):
    marker = tmp_path / "marker.txt"
    folder = tmp_path / "ckpt"
    os.makedirs(folder)
    with open(folder / BUFFER_FILE.format(rank=0), "wb") as f:
        pickle.dump(CodeOnLoad(str(marker)), f, protocol=2)
    with pytest.raises(ValueError, match="refusing to load"):
        load_generation_buffer(str(folder), 0, "cpu")
    assert not marker.exists()
