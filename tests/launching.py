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
* **Nothing left behind.** Each attempt runs in its own process session; when it is retried or runs past its timeout,
  the whole session is killed (the launcher's ranks too, which would otherwise live on as orphans), and a JIT-build
  lock of torch's extension cache that the attempt left (:func:`clear_build_locks`) is removed. DeepSpeed's CPU ranks
  take that lock at start-up to build or check their ``shm_comm`` op; a rank killed while holding it leaves a lock
  that every later DeepSpeed launch waits on forever (torch's ``FileBaton`` has no timeout). That is how a launch
  retried after losing its port once hung CI for 13 minutes.
* **One JIT-build cache per environment.** The op DeepSpeed builds records the absolute paths of the environment that
  built it (its build file names that virtualenv's torch and DeepSpeed), so environments sharing torch's default
  cache (CI's checkout, a developer's, worktrees) rebuild it in turn, about 3 minutes on 2 busy cores each time, and
  wait on each other's lock. tests/conftest.py sets ``TORCH_EXTENSIONS_DIR`` to :func:`environment_extension_cache`
  unless it is set already; every launched process inherits it.

Every launched script meets the other ranks at a barrier before ``destroy_process_group`` (notes/TRL_1_16.md §7).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

#: what torch (c10d TCPStore, gloo), accelerate and the OS print when a port is already taken
_PORT_TAKEN = re.compile(
    r"address already in use|EADDRINUSE|errno:? ?98\b|server socket has failed to (listen|bind)|"
    r"is already in use\. Please specify a different port|Tried to launch distributed communication on port",
    re.IGNORECASE,
)
#: start-up attempts of one launch when the port it was given is taken
LAUNCH_ATTEMPTS = 3
#: how old a JIT-build lock must be to count as left behind by an earlier session (a build takes about 2 minutes)
STALE_BUILD_LOCK_S = 15 * 60


def _default_extension_root() -> Path:
    """torch's default JIT extension cache (torch adds a folder per accelerator, ``py311_cpu``, below it)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def environment_extension_cache(prefix: str | None = None) -> str:
    """This environment's own JIT extension cache: ``env-<its path>`` in torch's default one (``prefix``: the
    environment, ``sys.prefix`` unless given)."""
    import sys

    name = re.sub(r"[^\w.-]", "_", (prefix or sys.prefix).strip(os.sep))
    return str(_default_extension_root() / f"env-{name}")


def extension_cache() -> Path:
    """torch's JIT extension cache, where DeepSpeed builds its CPU ops (``TORCH_EXTENSIONS_DIR`` or its default)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _default_extension_root())


def clear_build_locks(*, newer_than: float | None = None, older_than_s: float | None = None) -> list[Path]:
    """Remove the JIT-build locks of :func:`extension_cache` whose modification time is at or after ``newer_than``
    (a timestamp: those a killed attempt left) or more than ``older_than_s`` seconds ago (those an interrupted session
    left); return the removed paths, each announced in one line."""
    root, now, removed = extension_cache(), time.time(), []
    # <op>/lock below TORCH_EXTENSIONS_DIR; <accelerator>/<op>/lock below torch's default cache
    for lock in sorted({*root.glob("*/lock"), *root.glob("*/*/lock")}) if root.is_dir() else []:
        try:
            mtime = lock.stat().st_mtime
        except FileNotFoundError:
            continue  # released meanwhile
        if (newer_than is not None and mtime >= newer_than) or (
            older_than_s is not None and now - mtime > older_than_s
        ):
            print(f"removing a JIT-build lock left by a killed or interrupted build: {lock}")
            lock.unlink(missing_ok=True)
            removed.append(lock)
    return removed


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
    per attempt so that each attempt gets a fresh port; a launch is retried only when :func:`port_was_taken`. An
    attempt that is retried or times out is killed with every process it started, and its build lock removed."""
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        cmd = list(command() if callable(command) else command)
        timeout = scaled_timeout(timeout_s)
        started = time.time() - 1  # file times may be a little coarser than the clock
        with subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as popen:
            try:
                stdout, stderr = popen.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_session(popen)
                stdout, stderr = popen.communicate()
                clear_build_locks(newer_than=started)
                pytest.fail(
                    f"{label} timed out after {timeout}s (load factor {load_factor():.1f}): {cmd}\n--- stdout ---\n"
                    f"{_text(stdout)[-4000:]}\n--- stderr ---\n{_text(stderr)[-8000:]}"
                )
        proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
        if proc.returncode != 0 and attempt < LAUNCH_ATTEMPTS and port_was_taken(proc.stdout + proc.stderr):
            # start-up lost its port to another process: a rank may live on, or have died holding the build lock
            _kill_session(popen)
            clear_build_locks(newer_than=started)
            continue  # launch again
        if expect_rc is not None and proc.returncode != expect_rc:
            pytest.fail(
                f"{label} exited with {proc.returncode}, expected {expect_rc}: {cmd}\n--- stdout ---\n"
                f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-10000:]}"
            )
        return proc
    raise AssertionError("unreachable")


def _kill_session(popen: subprocess.Popen) -> None:
    """SIGKILL every process of ``popen``'s session (it was started with ``start_new_session``)."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the session has ended


def _text(output) -> str:
    if output is None:
        return ""
    return output.decode(errors="replace") if isinstance(output, bytes) else output
