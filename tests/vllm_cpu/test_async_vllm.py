"""AsyncTrinityTrainer with `generation_backend="vllm"` against a real `vllm serve` on a CPU (`make test-vllm`, in
`.venv-vllm`): TRL's worker generates from the server, and with LoRA each weight sync publishes the adapter, which
the server then serves (its log-probs match the trained policy's). Full-weight sync is NCCL-only (a GPU): not tested
here."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from test_vllm_cpu import vllm_model_dir  # noqa: F401 (the tiny Qwen2 with vLLM's CPU head_dim)

SCRIPT = Path(__file__).with_name("async_with_vllm.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(vllm_model_dir):  # noqa: F811
    """`vllm serve` of the tiny model with runtime LoRA loading (TRL's adapter sync) and the dev endpoints TRL's
    client calls (`/server_info`, `/pause`, `/resume`)."""
    port = free_port()
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
    }
    # (the `vllm` console script reads the version of a distribution named "vllm"; this one is "vllm-cpu")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model_dir]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "256"]
    command += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "4"]
    log = open(Path(vllm_model_dir) / "vllm_serve.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    try:
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited ({server.returncode}): {Path(log.name).read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not ready in 900 s: {Path(log.name).read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def test_async_trainer_generates_with_vllm_and_syncs_its_lora_adapter(vllm_server, vllm_model_dir, tmp_path):  # noqa: F811
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, str(SCRIPT), vllm_model_dir, vllm_server, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])
    assert report["steps"] == 2
    assert report["latest"] in report["models"]  # the last sync's adapter is served
    # vLLM serves the trained adapter: its log-probs are the policy's (float32 both sides), not the base model's
    assert report["gap"] < 1e-3 < report["gap_base"], report
