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


#: how old a JIT-build lock of torch's extension cache must be to count as left behind (a build takes ~2 minutes)
STALE_BUILD_LOCK_S = 15 * 60


@pytest.fixture(autouse=True, scope="session")
def _no_stale_extension_build_lock():
    """DeepSpeed JIT-builds its CPU op under a lock file in torch's extension cache, which every later launch waits on
    forever (torch's FileBaton polls it). A build killed mid-way (an interrupted test run) leaves the lock behind and
    every ZeRO launch after it hangs; a lock older than any build is removed, with a line saying so."""
    import os
    import time
    from pathlib import Path

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for lock in root.glob("*/*/lock") if root.is_dir() else []:
        if time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
            print(f"removing a stale JIT-build lock left by an interrupted build: {lock}")
            lock.unlink(missing_ok=True)
    yield
