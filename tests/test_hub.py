"""Hub pushes against the local fake Hub (`tests/fake_hub.py`, fixture `fake_hub`): what a trainer uploads, and
that `from_pretrained` of the pushed repo, downloaded into a fresh cache, gives back the trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from helpers import length_reward, tiny_conversational_dataset, tiny_grpo_kwargs
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from trinity_trl.trainers import (
    ChordConfig,
    ChordTrainer,
    TrinityConfig,
    TrinityTrainer,
)

LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def expert_dataset() -> Dataset:
    return Dataset.from_list(
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


def assert_same_tensors(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def assert_tokenizer_round_trip(repo_id: str, trained_tokenizer) -> None:
    pulled = AutoTokenizer.from_pretrained(repo_id)
    text = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
    assert pulled(text)["input_ids"] == trained_tokenizer(text)["input_ids"]
    assert pulled.eos_token == trained_tokenizer.eos_token and pulled.pad_token == trained_tokenizer.pad_token
    assert pulled.chat_template == trained_tokenizer.chat_template


def test_chord_lora_push_uploads_adapter_tokenizer_and_card_and_pulls_back(tmp_path, tiny_model_dir, fake_hub):
    args = ChordConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path / "out"), expert_batch_size=2, push_to_hub=True, hub_model_id="tester/chord-tiny"
        )
    )
    trainer = ChordTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        expert_dataset=expert_dataset(),
        peft_config=LORA,
    )
    trainer.train()
    trainer.push_to_hub()

    files = fake_hub.files("tester/chord-tiny")
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} | TOKENIZER_FILES <= set(files)
    assert "model.safetensors" not in files  # a LoRA push uploads the adapter, not the merged model
    card = files["README.md"].decode()
    assert "## Algorithm: CHORD" in card and "`mix_chord` preset" in card
    assert "On-Policy RL Meets Off-Policy Experts" in card
    assert "| policy_loss | `mix_chord` |" in card
    assert fake_hub.commits("tester/chord-tiny")[-1] == "End of training"

    trained = get_peft_model_state_dict(trainer.model)
    assert any(("lora_B" in name) and tensor.abs().sum() > 0 for name, tensor in trained.items())  # it trained
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    pulled = PeftModel.from_pretrained(base, "tester/chord-tiny")
    assert_same_tensors(trained, get_peft_model_state_dict(pulled))
    assert_tokenizer_round_trip("tester/chord-tiny", trainer.processing_class)
    # it came through the server, into the fixture's fresh cache
    assert ("GET", "/tester/chord-tiny/resolve/main/adapter_model.safetensors") in fake_hub.requests
    assert list((tmp_path / "hf_home" / "hub").glob("models--tester--chord-tiny/snapshots/*/adapter_model.safetensors"))
    assert fake_hub.blocked == []


def test_full_model_push_pulls_back_the_trained_weights(tmp_path, tiny_model_dir, fake_hub):
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(tmp_path / "out"), algorithm="cispo", push_to_hub=True, hub_model_id="tester/cispo-full"
        )
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=tiny_conversational_dataset()
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    trainer.push_to_hub()

    files = fake_hub.files("tester/cispo-full")
    assert {"model.safetensors", "config.json", "README.md"} | TOKENIZER_FILES <= set(files)
    assert "## Algorithm: CISPO" in files["README.md"].decode()

    trained = trainer.model.state_dict()
    assert any(not torch.equal(before[k], trained[k]) for k in trained)  # it trained
    pulled = AutoModelForCausalLM.from_pretrained("tester/cispo-full")
    assert_same_tensors(trained, pulled.state_dict())
    assert_tokenizer_round_trip("tester/cispo-full", trainer.processing_class)
    assert fake_hub.blocked == []


def test_fake_hub_answers_unknown_repos_files_and_revisions_with_hub_errors(fake_hub):
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import get_session

    api = HfApi()
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("tester/missing", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("tester/missing")
    with pytest.raises(RepositoryNotFoundError):  # a push to a repo nobody created fails instead of creating it
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="tester/missing")

    api.create_repo("tester/present")
    api.upload_file(path_or_fileobj=b"hello", path_in_repo="a/b.txt", repo_id="tester/present")
    api.create_repo("tester/present", exist_ok=True)
    with pytest.raises(HfHubHTTPError, match="409"):
        api.create_repo("tester/present")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("tester/present", "absent.txt")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("tester/present", "a/b.txt", revision="0" * 40)
    assert api.list_repo_files("tester/present") == ["a/b.txt"]
    assert Path(hf_hub_download("tester/present", "a/b.txt")).read_bytes() == b"hello"
    assert (Path(snapshot_download("tester/present")) / "a" / "b.txt").read_bytes() == b"hello"
    assert api.whoami()["name"] == "tester"
    with pytest.raises(RuntimeError, match="outside the fake hub"):  # the guard: no request leaves for another host
        get_session().get("https://huggingface.co/api/whoami-v2")
    assert fake_hub.blocked == ["https://huggingface.co/api/whoami-v2"]


def test_a_folder_saved_offline_is_pushed_later_and_pulls_back(tmp_path, tiny_model_dir, fake_hub):
    """Train and save with no network (HF_HUB_OFFLINE=1), then push the saved folder as it is: with `hf upload` (the
    README's line) and with `HfApi.upload_folder` from Python; both pull back the trained adapter and tokenizer."""
    import os
    import subprocess
    import sys

    from huggingface_hub import HfApi, constants

    folder = tmp_path / "saved"
    with pytest.MonkeyPatch.context() as offline:
        offline.setenv("HF_HUB_OFFLINE", "1")
        offline.setattr(constants, "HF_HUB_OFFLINE", True)
        trainer = TrinityTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), algorithm="cispo")),
            train_dataset=tiny_conversational_dataset(),
            peft_config=LORA,
        )
        trainer.train()
        trainer.save_model(str(folder))
    requests_before_push = len(fake_hub.requests)
    assert requests_before_push == 0  # nothing reached the Hub while offline
    saved = set(os.listdir(folder))
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} | TOKENIZER_FILES <= saved

    # later, online: the CLI (it creates the repo) ...
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "hf"), "upload", "tester/pushed-later", str(folder), "."],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # ... or Python
    api = HfApi()
    api.create_repo("tester/pushed-later-py")
    api.upload_folder(repo_id="tester/pushed-later-py", folder_path=str(folder))

    trained = get_peft_model_state_dict(trainer.model)
    assert any(("lora_B" in name) and tensor.abs().sum() > 0 for name, tensor in trained.items())  # it trained
    for repo in ("tester/pushed-later", "tester/pushed-later-py"):
        assert saved <= set(fake_hub.files(repo))
        assert "## Algorithm: CISPO" in fake_hub.files(repo)["README.md"].decode()
        pulled = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), repo)
        assert_same_tensors(trained, get_peft_model_state_dict(pulled))
        assert_tokenizer_round_trip(repo, trainer.processing_class)
    assert fake_hub.blocked == []


def test_push_to_hub_without_a_hub_is_one_line(tmp_path, tiny_model_dir, monkeypatch):
    """`trainer.push_to_hub()` with the Hub switched off or unreachable says so in one line, as `push_to_hub=True`
    in the config does (issue 35: it was a raw connection error from inside `create_repo`)."""
    from huggingface_hub import constants

    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "out"), algorithm="cispo")),
        train_dataset=tiny_conversational_dataset(),
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"^trainer.push_to_hub\(\), but the Hugging Face Hub is switched off") as err:
        trainer.push_to_hub()
    assert "\n" not in str(err.value) and "upload the folder later" in str(err.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    import huggingface_hub.hf_api

    for where in (constants, huggingface_hub.hf_api.api):  # the discard port: nothing answers
        monkeypatch.setattr(where, "ENDPOINT" if where is constants else "endpoint", "http://127.0.0.1:9")
    with pytest.raises(
        ValueError, match=r"^trainer.push_to_hub\(\), but the Hugging Face Hub at http://127.0.0.1:9 is"
    ):
        trainer.push_to_hub()


def test_a_checkpoint_is_pushed_only_once_it_is_complete(tmp_path, tiny_model_dir, fake_hub):
    """Invariant of `CompleteCheckpoints` (checkpointing/checkpoints.py): transformers pushes a checkpoint at the end
    of its ``_save_checkpoint``, before our files and the completion marker exist; ours pushes it after the marker.
    Each push starts (TrainerCallback.on_push_begin) on a complete checkpoint, and what reaches the Hub is the
    checkpoint the marker describes, our files included."""
    from transformers import TrainerCallback

    from trinity_trl.checkpointing.checkpoints import COMPLETE_FILE, TRAINER_STATE_FILE, incompleteness

    out = tmp_path / "out"
    at_push: dict[int, str | None] = {}

    class AtPush(TrainerCallback):
        def on_push_begin(self, args, state, control, **kwargs):
            at_push[state.global_step] = incompleteness(str(out / f"checkpoint-{state.global_step}"))

    repo = "tester/pushed-checkpoints"
    args = TrinityConfig(
        **tiny_grpo_kwargs(
            output_dir=str(out),
            algorithm="cispo",
            save_strategy="steps",
            save_steps=1,
            push_to_hub=True,
            hub_model_id=repo,
            hub_strategy="all_checkpoints",
            hub_always_push=True,  # every checkpoint is pushed, even while the previous push is running
        )
    )
    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=args,
        train_dataset=tiny_conversational_dataset(),
        callbacks=[AtPush()],
    )
    trainer.train()

    assert at_push == {1: None, 2: None}  # (on the old order: "it has no trinity_checkpoint_complete.json")
    files = fake_hub.files(repo)
    for step in (1, 2):
        prefix = f"checkpoint-{step}/"
        pushed = {name[len(prefix) :] for name in files if name.startswith(prefix)}
        manifest = json.loads(files[prefix + COMPLETE_FILE])
        assert manifest["global_step"] == step
        assert TRAINER_STATE_FILE in manifest["files"] and "trainer_state.json" in manifest["files"]
        assert pushed == set(manifest["files"]) | {COMPLETE_FILE}
    assert fake_hub.blocked == []
