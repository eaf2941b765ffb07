"""Helpers of the engine tests: launching scripts in fresh processes (fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launching import free_port, run_launch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ACCELERATE_CONFIGS = REPO_ROOT / "recipes" / "accelerate"
# variables a launcher (torchrun, accelerate) sets; a launch must not inherit the test process's
_DIST_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_MIXED_PRECISION",
)


def script_env(**extra: str) -> dict[str, str]:
    """The environment of a launched script: offline, one OpenMP thread, this checkout first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def run_script(
    command: list[str], label: str, timeout: int = 900, expect_rc: int | None = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root; fail the test with the output's tail when its exit code is not
    ``expect_rc`` (``None``: any) or it runs past ``timeout`` seconds scaled by the machine's load; a launch whose
    port was taken at start-up is run again (tests/launching.py), nothing else is."""

    def fresh_port() -> list[str]:  # each attempt asks the OS for a port again
        if "--main_process_port" not in command:
            return command
        at = command.index("--main_process_port") + 1
        return [*command[:at], str(free_port()), *command[at + 1 :]]

    return run_launch(fresh_port, label, timeout_s=timeout, env=env or script_env(), cwd=REPO_ROOT, expect_rc=expect_rc)


def accelerate_launch(
    config: str, script: str | Path, *args: str, processes: int = 2, mixed_precision: str | None = "no"
) -> list[str]:
    """``accelerate launch`` with a shipped config of recipes/accelerate/, on CPU: 2 processes, no mixed precision
    unless asked (``None``: the config's own, bf16), each script sets ``use_cpu=True``, which gives gloo. ``script``:
    a name in tests/engines/scripts/, or a path."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    precision = ["--mixed_precision", mixed_precision] if mixed_precision else []
    return [
        accelerate,
        "launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / f"{config}.yaml"),
        # a port the OS found free (never the fixed 29500 another suite may hold). Not "0": every process would then
        # read MASTER_PORT=0 and DeepSpeed's ranks never meet (ZeRO launches hung); run_launch retries a taken port
        "--main_process_port",
        str(free_port()),
        "--num_processes",
        str(processes),
        *precision,
        str(SCRIPTS / script),
        *args,
    ]
