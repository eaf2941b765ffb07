"""Launching multi-process test scripts so that they survive a busy machine.

* **Ports chosen by the OS.** ``torchrun --standalone`` rendezvous on ``localhost:0``; ``accelerate launch`` is given
  a port the OS found free (:func:`free_port`), never ``--main_process_port 0``: every process would read
  ``MASTER_PORT=0`` and DeepSpeed's ranks would never meet. No test names a port number: two suites on one
  machine never collide on 29500.
* **Timeouts scaled by the measured load.** :func:`scaled_timeout` multiplies a generous base (what the launch takes
  on an idle 2-core machine, times several) by the load average per core when it exceeds one, read when the launch
  starts: on a machine running two busy processes beside the suite, a launch gets the extra time it needs.
* **A retry only around start-up.** Between the OS handing out a free port and the launcher binding it, another
  process may take it. :func:`run_launch` runs the command again (with a fresh port) only when its output says a
  port was taken (:func:`port_was_taken`); any other failure, an assertion included, fails the test at once.

Every launched script meets the other ranks at a barrier before ``destroy_process_group`` (notes/TRL_1_16.md §7).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Callable, Sequence

import pytest

#: what torch (c10d TCPStore, gloo), accelerate and the OS print when a port is already taken
_PORT_TAKEN = re.compile(
    r"address already in use|EADDRINUSE|errno:? ?98\b|server socket has failed to (listen|bind)|"
    r"is already in use\. Please specify a different port|Tried to launch distributed communication on port",
    re.IGNORECASE,
)
#: start-up attempts of one launch when the port it was given is taken
LAUNCH_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, chosen by the OS (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_factor() -> float:
    """The 1-minute load average per CPU core, at least 1 (1 on a platform without ``os.getloadavg``)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled_timeout(base_s: float) -> int:
    """``base_s`` (generous for an idle machine) times :func:`load_factor`, read now."""
    return int(base_s * load_factor())


def port_was_taken(output: str) -> bool:
    """Whether a launch's output says that it could not bind its port (a start-up failure, not a test failure)."""
    return bool(_PORT_TAKEN.search(output or ""))


def run_launch(
    command: Sequence[str] | Callable[[], Sequence[str]],
    label: str,
    *,
    timeout_s: float,
    env: dict[str, str] | None = None,
    cwd=None,
    expect_rc: int | None = 0,
) -> subprocess.CompletedProcess:
    """Run a launch and fail the test with its output's tail when its exit code is not ``expect_rc`` (``None``: any)
    or it runs past ``scaled_timeout(timeout_s)``. ``command`` may be a function building the command, called once
    per attempt so that each attempt gets a fresh port; a launch is retried only when :func:`port_was_taken`."""
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        cmd = list(command() if callable(command) else command)
        timeout = scaled_timeout(timeout_s)
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as err:
            pytest.fail(
                f"{label} timed out after {timeout}s (load factor {load_factor():.1f}): {cmd}\n--- stdout ---\n"
                f"{_text(err.stdout)[-4000:]}\n--- stderr ---\n{_text(err.stderr)[-8000:]}"
            )
        if proc.returncode != 0 and attempt < LAUNCH_ATTEMPTS and port_was_taken(proc.stdout + proc.stderr):
            continue  # start-up lost its port to another process: launch again
        if expect_rc is not None and proc.returncode != expect_rc:
            pytest.fail(
                f"{label} exited with {proc.returncode}, expected {expect_rc}: {cmd}\n--- stdout ---\n"
                f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-10000:]}"
            )
        return proc
    raise AssertionError("unreachable")


def _text(output) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output
