"""Fixtures for the engine tests: one torch thread, a teacher model. Launch helpers: engine_helpers.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """See tests/trainers/conftest.py: intra-op threads only slow the tiny model down on this shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def teacher_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: str) -> str:
    """A second tiny model (other random weights, same tokenizer): the teacher of on-policy distillation."""
    from helpers import save_tiny_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    return save_tiny_model(tmp_path_factory.mktemp("tiny_teacher"), tokenizer=tokenizer, seed=1)
