"""Fixtures for the trainer tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and on this shared 2-core machine OpenMP threads that
    spin-wait against other processes make a 0.4 s training run take several seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
