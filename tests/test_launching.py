"""tests/launching.py: OS-chosen ports, load-scaled timeouts, and a retry only when start-up lost its port."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import launching
import pytest
from launching import free_port, port_was_taken, run_launch, scaled_timeout


def test_free_port_can_be_bound():
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    "output",
    [
        "RuntimeError: The server socket has failed to listen on any local network address. "
        "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use",
        "OSError: [Errno 98] Address already in use",
        "ConnectionError: Tried to launch distributed communication on port `29500`, but another process is using it.",
    ],
)
def test_a_taken_port_is_recognised(output):
    assert port_was_taken(output)


@pytest.mark.parametrize(
    "output", ["AssertionError: the losses differ", "ValueError: bad config", "", "Traceback: SIGABRT in gloo"]
)
def test_other_failures_are_not_a_taken_port(output):
    assert not port_was_taken(output)


def test_the_timeout_grows_with_the_load(monkeypatch):
    monkeypatch.setattr(launching.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(launching.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert scaled_timeout(600) == 600  # an idle machine: the base
    monkeypatch.setattr(launching.os, "getloadavg", lambda: (6.0, 4.0, 2.0))
    assert scaled_timeout(600) == 1800  # 3 runnable processes per core: three times the base


def _command(tmp_path, first_output: str, first_rc: int):
    """A command that prints ``first_output`` and exits ``first_rc`` on its first run, and succeeds afterwards."""
    marker = tmp_path / "ran"
    script = (
        "import pathlib, sys\n"
        f"marker = pathlib.Path({str(marker)!r})\n"
        "first = not marker.exists()\n"
        "marker.write_text('x')\n"
        f"if first:\n    print({first_output!r}, file=sys.stderr)\n    sys.exit({first_rc})\n"
        "print('ok')\n"
    )
    calls = []

    def command():
        calls.append(1)
        return [sys.executable, "-c", script]

    return command, calls


def test_a_launch_whose_port_was_taken_runs_again(tmp_path):
    command, calls = _command(tmp_path, "OSError: [Errno 98] Address already in use", 1)
    proc = run_launch(command, "port taken once", timeout_s=60)
    assert proc.returncode == 0 and "ok" in proc.stdout and len(calls) == 2  # a fresh command for the retry


def test_a_failing_assertion_is_never_retried(tmp_path):
    command, calls = _command(tmp_path, "AssertionError: the gradients differ", 1)
    with pytest.raises(pytest.fail.Exception, match="exited with 1, expected 0"):
        run_launch(command, "assertion", timeout_s=60)
    assert len(calls) == 1


def test_a_launch_past_its_timeout_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(launching, "scaled_timeout", lambda base: 1)
    with pytest.raises(pytest.fail.Exception, match="timed out after 1s"):
        run_launch([sys.executable, "-c", "import time; time.sleep(30)"], "sleeper", timeout_s=1)


def _lock_holder(tmp_path, *, then: str) -> str:  # TORCH_EXTENSIONS_DIR: tmp_path / 'ext'
    """A script that starts a child (in the launch's session) that takes a JIT-build lock of the extension
    cache and sleeps holding it (as a DeepSpeed rank building its op), writes the child's pid, then runs ``then``."""
    child = (
        "import os, pathlib, time\n"
        "root = pathlib.Path(os.environ['TORCH_EXTENSIONS_DIR']) / 'py311_cpu' / 'deepspeed_shm_comm'\n"
        "root.mkdir(parents=True, exist_ok=True)\n"
        "(root / 'lock').touch()\n"
        "time.sleep(120)\n"
    )
    return (
        "import pathlib, subprocess, sys, time\n"
        # its output not on the launch's pipes: a rank the launcher leaves running must not hold them open
        "quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}], **quiet)\n"
        f"pathlib.Path({str(tmp_path / 'child.pid')!r}).write_text(str(child.pid))\n"
        # go on once the child holds the lock
        f"while not list(pathlib.Path({str(tmp_path / 'ext')!r}).glob('*/*/lock')): time.sleep(0.05)\n" + then
    )


def _dead(pid: int) -> bool:
    import os
    import time

    for _ in range(50):  # the kill is delivered at once; the process table may lag a moment
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_launch_past_its_timeout_leaves_no_process_and_no_build_lock(tmp_path, monkeypatch):
    # a rank killed while holding DeepSpeed's JIT-build lock left it behind and every later ZeRO launch waited on it
    # forever (CI hung 13 minutes): the attempt's whole session is killed and the lock it took removed
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(launching, "scaled_timeout", lambda base: 3)
    script = _lock_holder(tmp_path, then="time.sleep(60)\n")
    with pytest.raises(pytest.fail.Exception, match="timed out after 3s"):
        run_launch([sys.executable, "-c", script], "lock holder", timeout_s=3)
    assert _dead(int((tmp_path / "child.pid").read_text()))
    assert list((tmp_path / "ext").glob("*/*/lock")) == []


def test_a_launch_retried_for_its_port_starts_without_the_first_attempts_lock(tmp_path, monkeypatch):
    # the first attempt loses its port while a rank of it holds the build lock; the retry must not find that lock
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    marker = tmp_path / "ran"
    first = _lock_holder(
        tmp_path, then="print('OSError: [Errno 98] Address already in use', file=sys.stderr); sys.exit(1)\n"
    )
    second = (
        "import pathlib, sys\n"
        f"locks = list(pathlib.Path({str(tmp_path / 'ext')!r}).glob('*/*/lock'))\n"
        "print('locks', len(locks)); sys.exit(1 if locks else 0)\n"
    )

    def command():
        script = second if marker.exists() else first
        marker.write_text("x")
        return [sys.executable, "-c", script]

    proc = run_launch(command, "lock holder then retry", timeout_s=60)
    assert proc.returncode == 0 and "locks 0" in proc.stdout
    assert _dead(int((tmp_path / "child.pid").read_text()))


def test_only_locks_of_a_killed_attempt_or_an_earlier_session_are_removed(tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old, fresh = (tmp_path / "py311_cpu" / name / "lock" for name in ("old_op", "fresh_op"))
    for lock in (old, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert launching.clear_build_locks(older_than_s=launching.STALE_BUILD_LOCK_S) == [old]
    assert fresh.exists() and not old.exists()
    assert launching.clear_build_locks(newer_than=time.time() + 60) == [] and fresh.exists()
    assert launching.clear_build_locks(newer_than=time.time() - 60) == [fresh]


def test_each_environment_builds_its_jit_ops_in_a_cache_of_its_own(tmp_path, monkeypatch):
    # an op built by one virtualenv names its paths: two environments sharing one cache rebuilt it in turn (minutes)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours, theirs = (launching.environment_extension_cache(p) for p in ("/work/ci/.venv", "/work/main/.venv"))
    assert ours != theirs and all(Path(c).parent == tmp_path / "torch_extensions" for c in (ours, theirs))
    # torch builds an op at <TORCH_EXTENSIONS_DIR>/<op>; a lock left there is found (and one below the default cache)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", ours)
    lock = Path(ours) / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert launching.clear_build_locks(newer_than=0) == [lock] and not lock.exists()
