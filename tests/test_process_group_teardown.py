"""trinity_trl/distributed.py: every entry point ends the process group it runs in (a barrier, then
``destroy_process_group``), on success and on a user error, on a real 2-process gloo group.

Without it a process may abort in gloo's teardown at exit (``terminate called without an active exception``,
SIGABRT) after its work is done. That abort is rare, so these tests check the cause instead: the group is still
alive when the entry point returns. The abort itself is counted by tests/engines/test_teardown_stress.py
(`make test-stress`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launching import scaled_timeout

SCRIPT = Path(__file__).resolve().parent / "scripts" / "entry_point_teardown.py"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def entry_points(tmp_path_factory):
    """What each of the 2 processes saw in each scenario of tests/scripts/entry_point_teardown.py."""
    tmp = tmp_path_factory.mktemp("teardown")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), str(tmp), str(tmp / f"rank{rank}.json")],
            env=env,
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    timeout = scaled_timeout(180)
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{output[-6000:]}"
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize(
    "scenario, exit_codes",
    [
        ("command_success", (0, 0)),  # trinity-trl configs
        ("command_user_error", (2, 2)),  # trinity-trl chord --no_such_option 1
        ("demo_user_error", (2, 2)),  # trinity-trl demo --no_such_option 1
        ("script_user_error", (2, 2)),  # python recipes/chord.py --no_such_option 1
        ("one_process_fails", (0, 2)),  # rank 0 succeeds, rank 1 has a user error
    ],
)
def test_entry_point_meets_the_other_process_then_ends_the_group(entry_points, scenario, exit_codes):
    for rank in (0, 1):
        seen = entry_points[rank][scenario]
        assert seen["exit"] == exit_codes[rank], (rank, seen)
        assert not seen["alive_after"], f"rank {rank} left its process group alive ({scenario}): {seen}"
        calls = seen["calls"]
        assert calls[-1] == "destroy_process_group" and calls.count("destroy_process_group") == 1, (rank, calls)
        assert any("barrier" in call for call in calls[:-1]), f"no barrier before destroy on rank {rank}: {calls}"
        if exit_codes[rank] == 2:  # still the one-line user error, not a traceback or an abort
            errors = [line for line in seen["stderr"].splitlines() if "error: " in line]
            assert len(errors) == 1 and "--no_such_option" in errors[0], seen["stderr"]
            assert "Traceback" not in seen["stderr"], seen["stderr"]


def test_without_a_process_group_nothing_happens():
    from trinity_trl import end_process_group, ending_process_group

    with ending_process_group():
        pass
    assert end_process_group() is False
