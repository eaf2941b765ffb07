"""tests/launching.py: OS-chosen ports, load-scaled timeouts, and a retry only when start-up lost its port."""

from __future__ import annotations

import socket
import sys

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
