"""Ending a multi-process run cleanly: every process meets the others, then the process group is destroyed.

A process that exits with its ``torch.distributed`` process group still alive leaves the group's threads to the
interpreter's teardown; with gloo (CPU processes) one of them may then abort with ``terminate called without an
active exception`` (SIGABRT), after all the work is done, and ``accelerate launch`` or ``torchrun`` exits 1. The
``trinity-trl`` command and the recipe scripts end their process group through `ending_process_group`; a
script of your own does the same (docs/distributed.md#ending).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager

#: how long a process that failed waits for the others at the final barrier before it ends its group anyway (a
#: process that failed alone must not wait the group's whole timeout, 30 minutes by default, for the others)
ERROR_BARRIER_TIMEOUT_S = 60.0


def end_process_group(*, failed: bool = False) -> bool:
    """Meet every other process at a barrier, then destroy the default ``torch.distributed`` process group.

    Call it once, at the end of a script, on every process. Without an initialised group (one process, no launcher)
    it does nothing. ``failed=True`` is the error path: with gloo the barrier then waits at most
    `ERROR_BARRIER_TIMEOUT_S` seconds (processes that stopped elsewhere never reach it), with another backend
    (NCCL) it is skipped; the group is destroyed either way. Returns whether a group was ended.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        if "gloo" in str(dist.get_backend()):
            # monitored_barrier on both paths, so that a failed process and a finished one meet at the same barrier;
            # None: the group's own timeout
            timeout = datetime.timedelta(seconds=ERROR_BARRIER_TIMEOUT_S) if failed else None
            dist.monitored_barrier(timeout=timeout)
        elif not failed:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer that is gone or failed elsewhere: end this process's group anyway
        if not failed:
            raise
    finally:
        dist.destroy_process_group()
    return True


@contextmanager
def ending_process_group() -> Iterator[None]:
    """``with ending_process_group(): ...`` around a whole script: when the block ends, by returning or by an
    exception (a ``SystemExit`` included), `end_process_group` ends the process group the script started
    (``failed=True`` on an exception, so a process that fails alone does not wait long for the others). On
    Ctrl-C (``KeyboardInterrupt``) the group is destroyed without a barrier."""
    try:
        yield
    except KeyboardInterrupt:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        raise
    except SystemExit as exit_:
        end_process_group(failed=exit_.code not in (None, 0))
        raise
    except BaseException:
        end_process_group(failed=True)
        raise
    end_process_group()
