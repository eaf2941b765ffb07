"""Fixtures for the engine tests: one torch thread, a teacher model. Launch helpers: engine_helpers.py."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread(one_torch_thread):
    """tests/conftest.py's `one_torch_thread`: intra-op threads only slow the tiny model down on this shared machine
    (a `threads_N` CPU path of `TRINITY_TEST_CPU_PATH` sets N instead)."""
    yield


@pytest.fixture(scope="session")
def teacher_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: str) -> str:
    """A second tiny model (other random weights, same tokenizer): the teacher of on-policy distillation."""
    from helpers import save_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_teacher"), tokenizer=tokenizer, seed=1)
