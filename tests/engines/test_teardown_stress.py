"""Teardown under load (`make test-stress`, marker `stress`): the shortest recipe runs under DDP, DeepSpeed ZeRO-3 and
FSDP2, launched again and again beside busy processes; none may abort when its work is done.

A process that exits with its gloo process group alive may abort in the interpreter's teardown (`terminate called
without an active exception`, SIGABRT), and `accelerate launch` then exits 1 after a run that trained and saved
(issue 33). The entry points end their group (trinity_trl/distributed.py); this counts aborts in the launches a user
makes: `trinity-trl cispo ...` under DDP, `python recipes/cispo.py ...` under ZeRO-3 and under FSDP2 (on CPU
processes through tests/engines/scripts/recipe_on_cpu_fsdp.py, see cpu_fsdp.py). One optimizer step of the tiny
model, no held-out evaluation: most of a launch is start-up and teardown.

TRINITY_STRESS_REPEATS (default 10) launches per engine; TRINITY_STRESS_BUSY (default 2) busy processes
(`while True: pass`, pinned to one CPU each) that the test starts beside the launches (tests/stress.sh, which starts
its own, sets 0). The abort is rare: `tests/test_process_group_teardown.py` checks its cause (a group left
alive) in `make test`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import ACCELERATE_CONFIGS, REPO_ROOT, SCRIPTS, run_script
from launching import free_port

pytestmark = pytest.mark.stress

REPEATS = int(os.environ.get("TRINITY_STRESS_REPEATS", "10"))
BUSY = int(os.environ.get("TRINITY_STRESS_BUSY", "2"))
ABORT_SIGNS = ("terminate called without an active exception", "SIGABRT", "Signal 6 (SIGABRT)")
RECIPE = REPO_ROOT / "recipes" / "cispo.py"
# engine -> what `accelerate launch --config_file recipes/accelerate/<engine>.yaml` runs
ENTRY_POINTS = {
    "ddp": ["-m", "trinity_trl.cli", "cispo"],  # the trinity-trl command
    "zero3": [str(RECIPE)],  # the recipe script
    "fsdp": [str(SCRIPTS / "recipe_on_cpu_fsdp.py"), str(RECIPE)],  # the recipe script, FSDP on CPU processes
}


@pytest.fixture(scope="module")
def busy_processes():
    """BUSY processes spinning on CPUs 0, 1, ... (one each), killed when the module's tests end."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    procs = []
    for i in range(BUSY):
        pin = functools.partial(os.sched_setaffinity, 0, {cpus[i % len(cpus)]}) if cpus else None
        procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin))
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def launch_command(engine: str, output_dir: Path, model_dir: str) -> list[str]:
    options = {
        "config": "cispo_cpu",
        "model_name_or_path": model_dir,
        "output_dir": str(output_dir),
        "max_steps": "1",
        "num_train_rows": "8",
        "eval_accuracy": "false",
        "max_completion_length": "4",
        "per_device_train_batch_size": "4",
        "num_generations": "4",
        "lora_r": "4",
        "lora_alpha": "8",
        "save_strategy": "no",
        "report_to": "none",
    }
    return [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(ACCELERATE_CONFIGS / f"{engine}.yaml"),
        "--main_process_port",
        str(free_port()),  # run_script gives each retry a fresh one
        "--num_processes",
        "2",
        "--mixed_precision",
        "no",
        *ENTRY_POINTS[engine],
        *[item for key, value in options.items() for item in (f"--{key}", value)],
    ]


@pytest.mark.parametrize("engine", list(ENTRY_POINTS))
def test_finished_runs_exit_0_every_time(engine, busy_processes, tiny_model_dir, tmp_path):
    if engine == "zero3" and importlib.util.find_spec("deepspeed") is None:  # a broken set-up, not a skip
        pytest.fail("deepspeed is not installed (it comes with the test extra: pip install -e '.[test]')")
    assert all(proc.poll() is None for proc in busy_processes), "a busy process died"
    aborts, failures = [], []
    start = time.monotonic()
    for i in range(REPEATS):
        output_dir = tmp_path / f"run{i}"
        proc = run_script(launch_command(engine, output_dir, tiny_model_dir), f"{engine} run {i}", 600, expect_rc=None)
        output = proc.stdout + proc.stderr
        trained = (output_dir / "training_log.json").is_file()
        if any(sign in output for sign in ABORT_SIGNS):
            aborts.append((i, proc.returncode, trained, output[-3000:]))
        elif proc.returncode != 0 or not trained:
            failures.append((i, proc.returncode, trained, output[-3000:]))
    elapsed = time.monotonic() - start
    print(
        f"\nteardown stress, {engine}: {len(aborts)} aborts and {len(failures)} other failures in {REPEATS} launches "
        f"beside {BUSY} busy processes, {elapsed:.0f} s, load average {os.getloadavg()[0]:.1f}"
    )
    assert not aborts, f"{len(aborts)} of {REPEATS} {engine} launches aborted at exit; the first: {aborts[0]}"
    assert not failures, f"{len(failures)} of {REPEATS} {engine} launches failed; the first: {failures[0]}"
