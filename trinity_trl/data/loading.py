"""Datasets the way users have them: a Hub id, a local folder of data files, one data file, or a ``Dataset`` already
in memory, checked early so that a wrong path, a missing column or an empty split is one clear error instead of a
failure deep inside training.

    splits = load_splits("data/")                    # a folder with train.jsonl / test.jsonl (or .json, .csv, .parquet)
    splits = load_splits("problems.csv")             # one file: its rows are the "train" split
    splits = load_splits("openai/gsm8k", "main")     # a Hub dataset, as datasets.load_dataset reads it
    train = check_prompts(splits["train"], "problems.csv[train]", required=("answer",))

The reading is ``datasets.load_dataset`` with the builder that matches the file (``json``, ``csv``, ``parquet``) or
``datasets.load_from_disk`` for a folder written by ``save_to_disk``. Prompts may be text (TRL's standard format: a
``prompt`` string, given to the model as it is) or conversations (TRL's conversational format: a list of
``{"role", "content"}`` messages, rendered with the chat template).
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

# data file suffix -> the datasets builder that reads it
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def source_name(source: Any) -> str:
    """How errors and the model card name a dataset source: the path or id as given, else ``"the dataset"``."""
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the dataset"


def looks_like_path(text: str) -> bool:
    """A name that can only be meant as a local path: it starts with ``.``, ``/``, ``~`` or ``\\``, ends with a
    slash (``dat/``), has more than one slash, or ends in a file suffix (``capitals.jsnol``; ``data/trian.jsonl``
    and ``owner/name.csv`` too when the suffix is a data file's). A Hub id is ``name`` or ``owner/name``, which
    transformers and datasets also read as a Hub id when no such local path exists."""
    suffix = os.path.splitext(text)[1]
    return (
        text.startswith((".", "/", "~", "\\"))
        or os.path.isabs(text)
        or text.endswith(("/", os.sep))
        or text.count("/") > 1
        or suffix.lower() in DATA_FILE_BUILDERS
        or ("/" not in text and re.fullmatch(r"\.[A-Za-z][A-Za-z0-9]{1,7}", suffix) is not None)
    )


def missing_path_message(text: str, what: str = "file or folder") -> str:
    """``<text>: no such <what> (looked for <absolute path>)``, with the closest name in that folder when one is
    close (``dat/`` -> ``data/``, ``capitals.jsnol`` -> ``capitals.jsonl``)."""
    path = os.path.abspath(os.path.expanduser(text))
    close = close_local_name(text)
    return f"{text}: no such {what} (looked for {path}){f'; did you mean {close}?' if close else ''}"


def close_local_name(text: str) -> str | None:
    """The name of a file or folder beside where ``text`` points whose name is close to it (folders with a trailing
    slash), spelt as ``text`` is; ``None`` when none is."""
    path = os.path.abspath(os.path.expanduser(text))
    parent, name = os.path.split(path.rstrip(os.sep))
    if not os.path.isdir(parent):
        return None
    entries = [e + ("/" if os.path.isdir(os.path.join(parent, e)) else "") for e in os.listdir(parent)]
    wanted = name + ("/" if text.endswith(("/", os.sep)) else "")
    close = difflib.get_close_matches(wanted, [e for e in entries if not e.startswith(".")], n=1, cutoff=0.6)
    return os.path.join(os.path.dirname(text.rstrip("/" + os.sep)), close[0]) if close else None


#: seconds the Hub is given to answer whether a repository exists, before a model or dataset id not in the cache is
#: reported as unreachable
HUB_PROBE_SECONDS = 3.0


def hub_repo_problem(repo_id: str, repo_type: str = "model") -> str | None:
    """Why ``repo_id`` cannot be loaded now, in words that follow its name, or ``None`` when it can (it is in the
    Hugging Face cache, or the Hub has it). Not in the cache with ``HF_HUB_OFFLINE`` set: the Hub is not asked. Else
    the Hub is asked once, in a background thread given `HUB_PROBE_SECONDS`: no such repository (404, or private
    without a login) and no answer in time are both problems. ``repo_type``: ``"model"`` or ``"dataset"``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        return f"is neither a local path nor a Hub {repo_type} id ({' '.join(str(err).split())})"
    if in_hub_cache(repo_id, repo_type):
        return None
    if constants.HF_HUB_OFFLINE:
        return (
            f"is not a local path and not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is "
            "set, so the Hub is not asked"
        )
    answer = _ask_hub(repo_id, repo_type)
    if answer == "missing":
        return f"is not a local path, and the Hub has no {repo_type} of that id (or it is private: `hf auth login`)"
    if answer == "no answer":
        wait = f"{HUB_PROBE_SECONDS:g} s"
        return f"is not a local path and not in the Hugging Face cache, and the Hub did not answer within {wait}"
    if answer is not None:
        return f"is not a local path and not in the Hugging Face cache, and the Hub could not be reached ({answer})"
    return None


def in_hub_cache(repo_id: str, repo_type: str = "model") -> bool:
    """Whether a snapshot of ``repo_id`` is in the Hugging Face hub cache (or, for a dataset, ``datasets``' own)."""
    from huggingface_hub import constants

    folder = os.path.join(constants.HF_HUB_CACHE, f"{repo_type}s--{repo_id.replace('/', '--')}", "snapshots")
    if os.path.isdir(folder) and os.listdir(folder):
        return True
    if repo_type == "dataset":
        import datasets

        return os.path.isdir(os.path.join(datasets.config.HF_DATASETS_CACHE, repo_id.replace("/", "___")))
    return False


def _ask_hub(repo_id: str, repo_type: str) -> str | None:
    """``None``: the Hub has ``repo_id``; ``"missing"``: it answered that it has not; else why it did not answer."""
    import threading

    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    answer: list[str | None] = []

    def ask() -> None:
        try:
            HfApi().repo_info(repo_id, repo_type=repo_type, timeout=HUB_PROBE_SECONDS)
            answer.append(None)
        except GatedRepoError:  # it exists; access is the download's business
            answer.append(None)
        except RepositoryNotFoundError:
            answer.append("missing")
        except Exception as err:  # noqa: BLE001 - any other failure means no usable answer
            answer.append(" ".join(str(err).split())[:120] or type(err).__name__)

    thread = threading.Thread(target=ask, name="trinity-trl-hub-probe", daemon=True)
    thread.start()
    thread.join(HUB_PROBE_SECONDS)
    return answer[0] if answer else "no answer"


def load_splits(source: Any, config: str | None = None):
    """The splits of ``source`` as a ``datasets.DatasetDict``.

    Args:
        source: a ``Dataset`` (becomes the ``"train"`` split) or ``DatasetDict`` (returned as it is); a path to one
            ``.json``/``.jsonl``/``.csv``/``.parquet`` file (its rows are the ``"train"`` split), absolute or
            relative, ``~`` expanded; a folder holding such files, whose names give the splits (``train.jsonl``,
            ``test.jsonl``; see ``datasets``' split naming), or a folder written by ``save_to_disk``; otherwise a
            Hub dataset id for ``datasets.load_dataset``.
        config: the dataset's configuration name (Hub datasets with several, e.g. GSM8K's ``"main"``).

    Raises:
        FileNotFoundError: ``source`` is a path (`looks_like_path`) that does not exist, a folder without data
            files, or a Hub id that cannot be loaded now (`hub_repo_problem`: not cached and the Hub offline,
            unreachable or without it), all before anything is downloaded.
        ValueError: a file with another suffix.
        TypeError: ``source`` is neither a dataset nor a string or path.
    """
    from datasets import Dataset, DatasetDict, IterableDataset, load_dataset, load_from_disk

    if isinstance(source, DatasetDict):
        return source
    if isinstance(source, Dataset):
        return DatasetDict({"train": source})
    if isinstance(source, IterableDataset):
        raise TypeError("an IterableDataset has no length to split or count; pass a Dataset (Dataset.from_list(...))")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"a dataset source is a Hub id, a path or a datasets.Dataset/DatasetDict, got {type(source).__name__}"
        )
    text = os.fspath(source)
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isfile(path):
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in DATA_FILE_BUILDERS:
            raise ValueError(
                f"{text}: a data file must end in {', '.join(DATA_FILE_BUILDERS)} (json lines, csv or parquet), "
                f"got {suffix or 'no suffix'!r}"
            )
        _check_not_blank({path: text})
        with _quiet_local_load():
            return load_dataset(DATA_FILE_BUILDERS[suffix], data_files={"train": path})
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, marker)) for marker in ("dataset_dict.json", "state.json")):
            loaded = load_from_disk(path)
            return DatasetDict({"train": loaded}) if isinstance(loaded, Dataset) else loaded
        files = _data_files(path)
        if not files:
            raise FileNotFoundError(
                f"{text}: the folder holds no data files ({', '.join(DATA_FILE_BUILDERS)}); expected e.g. "
                "train.jsonl and test.jsonl"
            )
        _check_not_blank({file: os.path.join(text, os.path.relpath(file, path)) for file in files})
        from datasets.exceptions import DatasetGenerationError
        from datasets.table import CastError

        try:
            with _quiet_local_load():
                return load_dataset(path, config)
        except DatasetGenerationError as err:
            if not isinstance(err.__cause__, CastError):
                raise
            cast = err.__cause__
            raise ValueError(
                f"{text}: its files do not all have the same columns (one has {sorted(cast.table_column_names)}, "
                f"another {sorted(cast.requested_column_names)}); datasets reads a folder as one dataset: give every "
                "split's file the same columns, or load the splits one file at a time"
            ) from err
    if looks_like_path(text):
        raise FileNotFoundError(missing_path_message(text))
    problem = hub_repo_problem(text, "dataset")
    if problem is not None:
        close = close_local_name(text)
        raise FileNotFoundError(f"dataset {text!r} {problem}{f'; did you mean {close}?' if close else ''}")
    return load_dataset(text, config)


@contextlib.contextmanager
def _quiet_local_load() -> Iterator[None]:
    """Without ``datasets``' progress bars (and restored after): reading local files takes a moment, and its "Generating
    train split" bars would stand before any one-line error about the data."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _check_not_blank(files: dict[str, str]) -> None:
    """An empty data file would be an empty split (``datasets`` fails on it with "Instruction 'test' corresponds
    to no data"): an error naming the file. ``files``: ``{absolute path: the name to show}``."""
    for file, shown in files.items():
        size = os.path.getsize(file)
        if size == 0 or (size < 4096 and file.endswith((".json", ".jsonl", ".csv")) and not _read(file).strip()):
            raise ValueError(f"{shown} is empty (0 rows)")


def _read(file: str) -> str:
    with open(file, encoding="utf-8", errors="replace") as f:
        return f.read()


def _data_files(folder: str) -> list[str]:
    return [
        os.path.join(root, name)
        for root, _, names in os.walk(folder)
        for name in names
        if os.path.splitext(name)[1].lower() in DATA_FILE_BUILDERS and not name.startswith(".")
    ]


def is_conversation(value: Any) -> bool:
    """Whether ``value`` is a conversation: a list of ``{"role": ..., "content": ...}`` messages."""
    return isinstance(value, list) and len(value) > 0 and all(isinstance(m, dict) and "role" in m for m in value)


def check_split(dataset, name: str) -> None:
    """A split with no rows is an error naming it (TRL would fail later, or train on nothing)."""
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty (0 rows)")


def check_columns(dataset, required: Iterable[str], name: str, expected: str) -> None:
    """Each of ``required`` is a column of ``dataset``; otherwise an error naming the missing column, the columns
    present and ``expected`` (what the rows should hold)."""
    missing = [column for column in required if column not in dataset.column_names]
    if missing:
        listed = ", ".join(repr(c) for c in missing)
        raise ValueError(f"{name} has no column {listed}; its columns are {dataset.column_names}; expected {expected}")


def check_prompts(dataset, name: str, required: Iterable[str] = (), column: str = "prompt"):
    """``dataset`` checked as RL prompts: not empty, a ``prompt`` column of text or conversations (one format for
    the whole split), and the ``required`` columns (e.g. ``answer`` for an exact-answer reward). Returns it."""
    expected = "a 'prompt' column (text, or a list of {'role', 'content'} messages)" + "".join(
        f" and an {c!r} column" if c[0] in "aeiou" else f" and a {c!r} column" for c in required
    )
    check_split(dataset, name)
    check_columns(dataset, [column, *required], name, expected)
    first = dataset[0][column]
    if isinstance(first, str):
        kind = str
    elif is_conversation(first):
        kind = list
    else:
        raise ValueError(
            f"{name}: column {column!r} must hold text or a list of {{'role', 'content'}} messages, got "
            f"{type(first).__name__} {str(first)[:60]!r} in row 0"
        )
    if kind is str and not all(isinstance(p, str) for p in dataset[column]):
        raise ValueError(f"{name}: column {column!r} mixes text and messages; use one format for the whole split")
    return dataset


def check_demonstrations(dataset, name: str):
    """``dataset`` checked as SFT demonstrations in one of TRL's formats: ``prompt`` + ``completion`` (text, or
    messages and an assistant message) or ``messages`` (a conversation ending with the assistant's answer).
    Returns it."""
    check_split(dataset, name)
    columns = set(dataset.column_names)
    if not ({"prompt", "completion"} <= columns or "messages" in columns):
        missing = "'messages'" if "prompt" not in columns else "'completion'"
        raise ValueError(
            f"{name} has no column {missing}; its columns are {dataset.column_names}; expected demonstrations: "
            "'prompt' + 'completion' (text, or messages + an assistant message) or 'messages' (a conversation "
            "ending with the assistant's answer)"
        )
    return dataset


def prompt_token_ids(tokenizer, prompts: list, chat_template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """The token ids the model is given for each prompt, as TRL's GRPOTrainer tokenizes them: a conversation
    rendered with the chat template and its generation prompt (and TRL's ``chat_template_kwargs``), text as it is
    (with the tokenizer's special tokens, e.g. a BOS token)."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt)["input_ids"])
        elif is_conversation(prompt):
            text = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
            )
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            raise ValueError(
                f"a prompt is text or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}"
            )
    return ids


class SeededPasses:
    """An endless stream over ``size`` rows, reshuffled every pass with ``seed``: position ``p`` of the stream is row
    ``order(p // size)[p % size]``, where pass ``e``'s order is ``torch.randperm(size)`` drawn from a generator seeded
    with ``seed + e`` (the same on every process and every resume)."""

    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError(f"a stream needs at least one row, got size={size}")
        self.size, self.seed = size, seed
        self._permutation: tuple[int, Any] | None = None  # (pass, order) of the current pass

    def row(self, position: int) -> int:
        """The row at ``position`` of the stream."""
        import torch

        epoch, offset = divmod(position, self.size)
        if self._permutation is None or self._permutation[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutation = (epoch, torch.randperm(self.size, generator=generator))
        return int(self._permutation[1][offset])
