"""Fixtures for the reliability tests: one torch thread (as for the trainer tests) and a run helper."""

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
