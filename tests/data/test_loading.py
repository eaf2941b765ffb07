"""trinity_trl/data/loading.py: a dataset from a Hub id, a folder, one data file or memory; prompts as text or
conversations; one clear error for a missing path, a missing column or an empty split."""

from __future__ import annotations

import json
import os
import re

import pytest

from trinity_trl.data.loading import (
    check_columns,
    check_demonstrations,
    check_prompts,
    load_splits,
    prompt_token_ids,
    source_name,
)

ROWS = [{"prompt": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(5)]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS]


def write(path, rows, fmt: str) -> str:
    """``rows`` written as a ``fmt`` file (json = a JSON list, jsonl, csv, parquet) with pandas/json only."""
    import pandas as pd

    if fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet"])
def test_one_file_is_the_train_split(tmp_path, fmt):
    path = write(tmp_path / f"problems.{fmt}", ROWS, fmt)
    splits = load_splits(path)
    assert list(splits) == ["train"]
    assert splits["train"]["prompt"] == [r["prompt"] for r in ROWS]
    assert [str(a) for a in splits["train"]["answer"]] == [r["answer"] for r in ROWS]


def test_relative_and_home_paths(tmp_path, monkeypatch):
    write(tmp_path / "x.jsonl", ROWS, "jsonl")
    monkeypatch.chdir(tmp_path)
    assert len(load_splits("./x.jsonl")["train"]) == len(ROWS)
    assert len(load_splits("x.jsonl")["train"]) == len(ROWS)  # a data-file suffix: a path, not a Hub id
    monkeypatch.setenv("HOME", str(tmp_path))
    assert len(load_splits("~/x.jsonl")["train"]) == len(ROWS)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_a_folder_gives_splits_named_by_its_files(tmp_path, fmt):
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / f"train.{fmt}", ROWS[:3], fmt)
    write(folder / f"test.{fmt}", ROWS[3:], fmt)
    splits = load_splits(str(folder))
    assert sorted(splits) == ["test", "train"]
    assert splits["train"]["prompt"] == [r["prompt"] for r in ROWS[:3]]
    assert splits["test"]["prompt"] == [r["prompt"] for r in ROWS[3:]]


def test_conversations_survive_a_jsonl_file(tmp_path):
    splits = load_splits(write(tmp_path / "chat.jsonl", CHAT_ROWS, "jsonl"))
    assert splits["train"][0]["prompt"] == CHAT_ROWS[0]["prompt"]
    check_prompts(splits["train"], "chat", required=("answer",))


def test_in_memory_and_saved_datasets(tmp_path):
    from datasets import Dataset, DatasetDict

    data = Dataset.from_list(ROWS)
    assert load_splits(data)["train"] is data
    both = DatasetDict({"train": data, "test": data})
    assert load_splits(both) is both
    both.save_to_disk(str(tmp_path / "saved"))
    assert sorted(load_splits(str(tmp_path / "saved"))) == ["test", "train"]
    data.save_to_disk(str(tmp_path / "one"))
    assert load_splits(str(tmp_path / "one"))["train"]["answer"] == [r["answer"] for r in ROWS]
    assert source_name(data) == "the dataset" and source_name(tmp_path / "one") == str(tmp_path / "one")
    with pytest.raises(TypeError, match="Hub id, a path or a datasets.Dataset"):
        load_splits(ROWS)


def test_a_missing_path_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("./nothing.jsonl", str(tmp_path / "absent.csv"), "data/train.parquet", "./no_folder"):
        with pytest.raises(FileNotFoundError, match=rf"^{given}: no such file or folder"):
            load_splits(given)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: the folder holds no data files"):
        load_splits("./empty")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"must end in .json, .jsonl, .csv, .parquet .* got '.txt'"):
        load_splits("notes.txt")


def test_missing_columns_and_empty_splits_are_named():
    from datasets import Dataset

    data = Dataset.from_list([{"question": "q", "reply": "r"}])
    with pytest.raises(
        ValueError, match=r"^d\[train\] has no column 'prompt'; its columns are \['question', 'reply'\]"
    ):
        check_prompts(data, "d[train]")
    no_answer = Dataset.from_list([{"prompt": "q"}])
    with pytest.raises(ValueError, match=r"has no column 'answer'; its columns are \['prompt'\]; expected .*'answer'"):
        check_prompts(no_answer, "d", required=("answer",))
    check_prompts(no_answer, "d")  # a reward that does not read 'answer' needs none
    empty = Dataset.from_dict({"prompt": [], "answer": []})
    with pytest.raises(ValueError, match=r"^d\[test\] is empty \(0 rows\)$"):
        check_prompts(empty, "d[test]")
    with pytest.raises(ValueError, match="column 'prompt' must hold text or a list of"):
        check_prompts(Dataset.from_list([{"prompt": 3}]), "d")
    with pytest.raises(ValueError, match="expected x"):
        check_columns(data, ["z"], "d", "x")


def test_demonstrations_in_trl_formats():
    from datasets import Dataset

    check_demonstrations(Dataset.from_list([{"prompt": "q", "completion": "a"}]), "e")
    check_demonstrations(Dataset.from_list([{"messages": [{"role": "user", "content": "q"}]}]), "e")
    with pytest.raises(ValueError, match=r"e has no column 'completion'; its columns are \['prompt'\]; expected"):
        check_demonstrations(Dataset.from_list([{"prompt": "q"}]), "e")
    with pytest.raises(ValueError, match="e is empty"):
        check_demonstrations(Dataset.from_dict({"prompt": [], "completion": []}), "e")


def test_prompt_token_ids_follow_trl(tiny_tokenizer):
    """Text as it is (with the tokenizer's special tokens, as GRPOTrainer calls the tokenizer), a conversation
    through the chat template with the generation prompt."""
    text, chat = "What is 2 plus 1?", [{"role": "user", "content": "What is 2 plus 1?"}]
    ids = prompt_token_ids(tiny_tokenizer, [text, chat])
    assert ids[0] == tiny_tokenizer(text)["input_ids"]
    rendered = tiny_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered != text and ids[1] == tiny_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="text or a list of"):
        prompt_token_ids(tiny_tokenizer, [{"role": "user"}])


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from helpers import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_hub_ids_still_go_to_the_hub(monkeypatch):
    """A name that is not a path (``owner/name``) and that the Hub cache holds goes to ``datasets.load_dataset``
    unchanged."""
    import datasets

    import trinity_trl.data.loading as loading

    seen = []
    monkeypatch.setattr(loading, "in_hub_cache", lambda repo_id, repo_type="model": True)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: seen.append(a) or {"train": []})
    load_splits("openai/gsm8k", "main")
    assert seen == [("openai/gsm8k", "main")]
    assert not os.path.exists("openai/gsm8k")


def test_a_local_look_alike_is_a_missing_path_not_a_hub_id(tmp_path, monkeypatch):
    """``dat/`` (a trailing slash), ``capitals.jsnol`` (a file suffix), ``data/trian.jsonl`` (inside a local folder):
    named as missing local paths, with the closest name beside them, and the Hub is never asked."""
    import datasets

    import trinity_trl.data.loading as loading

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "train.jsonl", ROWS, "jsonl")
    write(tmp_path / "capitals.jsonl", ROWS, "jsonl")
    monkeypatch.setattr(loading, "hub_repo_problem", lambda *a: pytest.fail("asked the Hub about a local path"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("loaded a missing path"))
    for given, close in (
        ("dat/", "data/"),
        ("capitals.jsnol", "capitals.jsonl"),
        ("data/trian.jsonl", "data/train.jsonl"),
        ("./dat/", "./data/"),
        ("notes.md", None),
    ):
        hint = rf"; did you mean {re.escape(close)}\?$" if close else r"\)$"
        with pytest.raises(
            FileNotFoundError, match=rf"^{re.escape(given)}: no such file or folder \(looked for .*{hint}"
        ):
            load_splits(given)
    assert loading.looks_like_path("owner/name.csv") and not loading.looks_like_path("owner/name.v2")
    assert not loading.looks_like_path("gsm8k") and not loading.looks_like_path("openai/gsm8k")


def test_a_hub_id_that_cannot_load_now_is_one_error_before_anything_downloads(monkeypatch):
    """Not in the cache while HF_HUB_OFFLINE is set: said at once, the Hub never asked, datasets never called."""
    import datasets
    from huggingface_hub import constants

    import trinity_trl.data.loading as loading

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(loading, "in_hub_cache", lambda repo_id, repo_type="model": False)
    monkeypatch.setattr(loading, "_ask_hub", lambda *a: pytest.fail("asked the Hub offline"))
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(FileNotFoundError, match=r"^dataset 'someone/capitals' is not a local path and not in the "):
        load_splits("someone/capitals")
    with pytest.raises(FileNotFoundError, match=r"HF_HUB_OFFLINE is set, so the Hub is not asked$"):
        load_splits("someone/capitals")


def test_the_hub_probe_tells_a_missing_repository_from_one_that_exists(fake_hub):
    """Online, the Hub's 404 is "no such dataset"; a repository it has passes."""
    import trinity_trl.data.loading as loading

    assert "the Hub has no dataset of that id" in loading.hub_repo_problem("tester/absent", "dataset")
    fake_hub.create_repo("tester/present", "dataset", private=False)
    assert loading.hub_repo_problem("tester/present", "dataset") is None


def test_a_silent_hub_is_reported_after_the_probe_time(monkeypatch):
    """A Hub that accepts the connection and never answers: "did not answer" after HUB_PROBE_SECONDS (shortened
    here), not after the HTTP client's own timeouts and retries."""
    import socket

    from huggingface_hub import constants

    import trinity_trl.data.loading as loading

    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(loading, "HUB_PROBE_SECONDS", 0.5)
        problem = loading.hub_repo_problem("someone/capitals", "dataset")
    assert problem.endswith("and the Hub did not answer within 0.5 s"), problem
