"""Session fixtures shared by every test: a tiny tokenizer and model built offline, tiny datasets.

Helpers (config kwargs, rewards, builders) live in `tests/helpers.py`; this file puts `tests/` on `sys.path` so
tests import them with `from helpers import tiny_grpo_kwargs, length_reward, answer_reward`.
"""

from __future__ import annotations

import os
import sys

# Offline and quiet, before anything imports transformers or trl. `setdefault` lets a developer override them.
for _name, _value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
}.items():
    os.environ.setdefault(_name, _value)

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import pytest

# FutureWarnings raised by TRL's own helpers (`trl/models/utils.py`) calling deprecated transformers aliases during
# generation; user code cannot avoid them (notes/TRL_1_16.md §6.3, items 2 and 3).
HARMLESS_WARNING_FILTERS = (
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
    "ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning",
    "ignore:`gradient_checkpointing_disable` is deprecated:FutureWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in HARMLESS_WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Directory holding only the tiny BPE tokenizer (vocab 512, ChatML, eos `<|im_end|>`, pad `<|endoftext|>`)."""
    from helpers import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: str
) -> str:
    """Directory holding the tiny random Qwen2 and its tokenizer; pass it as `model=` (and to `from_pretrained`)."""
    from helpers import save_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), tokenizer=tokenizer)


@pytest.fixture
def tiny_tokenizer(tiny_tokenizer_dir: str):
    """A fresh `PreTrainedTokenizerFast` loaded from `tiny_tokenizer_dir` (per test, so tests may mutate it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_dataset():
    """32 conversational rows: `{"prompt": [{"role": "user", "content": "What is 3+4?"}], "answer": "7"}`."""
    from helpers import tiny_conversational_dataset

    return tiny_conversational_dataset(32)


@pytest.fixture(scope="session")
def tiny_text_dataset():
    """32 plain-text rows: `{"prompt": "Question: what is 3+4? Answer:", "answer": "7"}`."""
    from helpers import tiny_plain_text_dataset

    return tiny_plain_text_dataset(32)
