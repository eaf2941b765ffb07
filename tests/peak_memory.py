"""Per-test peak resident memory (a pytest plugin, loaded by tests/conftest.py).

While each test runs (setup, call and teardown), a thread samples the resident memory (RSS) of the test's process
and of every process it started (torchrun ranks, recipe subprocesses) every `INTERVAL_S` seconds, with psutil. A
test's record is its peak and how far that peak rose above the process's memory when the test started: a worker's
memory is cumulative over the tests it ran (a module-scoped model stays loaded), so the rise says what the test
itself needed, and the peak what the machine had to hold while it ran.

At the end of the session the worst tests are printed (`--peak-memory-top`, default 10) and every record is written
to the pytest cache (``.pytest_cache/d/peak_memory/last.json``; ``pytest --cache-show 'peak_memory/*'`` prints it).
Each process also appends every record as it is made to ``.pytest_cache/d/peak_memory/<process>.jsonl``, so a run
the kernel ends for lack of memory still says which tests its memory grew in.
Under pytest-xdist each worker samples its own tests and hands its records to the controller, which reports them.
``--peak-memory-top 0`` turns the sampling off.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

#: seconds between two samples (a test shorter than that still gets the samples at its start and end)
INTERVAL_S = 0.05
#: the cache key of the last session's records
CACHE_KEY = "peak_memory/last"
_GIB = 1024**3


def _rss(process: Any) -> int:
    """Resident bytes of ``process`` and of every process it started (those that end while counted count 0)."""
    import psutil

    total = 0
    for proc in [process, *process.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total


class Sampler:
    """Samples `_rss` of this process (with its children) on a thread, between `start` and `stop`."""

    def __init__(self, interval_s: float = INTERVAL_S):
        import psutil

        self.process = psutil.Process()
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_bytes = self.peak_bytes = 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, _rss(self.process))

    def start(self) -> None:
        self.start_bytes = self.peak_bytes = _rss(self.process)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="peak-memory-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> tuple[int, int]:
        """``(bytes at start, peak bytes)`` of the sampled span."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, _rss(self.process))
        return self.start_bytes, self.peak_bytes


def add_option(parser: pytest.Parser) -> None:
    """``--peak-memory-top N`` (tests/conftest.py's ``pytest_addoption``)."""
    parser.addoption(
        "--peak-memory-top",
        type=int,
        default=10,
        help="print the N tests with the highest peak resident memory (sampled per test, child processes "
        "included); 0: do not sample",
    )


class PeakMemory:
    """The plugin's state in one process: this process's records, and (controller or single process) everyone's."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.top = config.getoption("--peak-memory-top")
        self.records: list[dict[str, Any]] = []
        self.sampler = Sampler()
        self.stream = None  # opened at the first record: only processes that run tests write one

    def _write(self, record: dict[str, Any]) -> None:
        if self.stream is None:
            if getattr(self.config, "cache", None) is None:
                return
            worker = getattr(self.config, "workerinput", {}).get("workerid", "main")
            self.stream = open(self.config.cache.mkdir("peak_memory") / f"{worker}.jsonl", "w", encoding="utf-8")
        self.stream.write(json.dumps(record) + "\n")
        self.stream.flush()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        started = time.monotonic()
        self.sampler.start()
        try:
            yield
        finally:
            start_bytes, peak_bytes = self.sampler.stop()
            record = {
                "test": item.nodeid,
                "peak_gib": round(peak_bytes / _GIB, 3),
                "rise_gib": round((peak_bytes - start_bytes) / _GIB, 3),
                "seconds": round(time.monotonic() - started, 2),
            }
            self.records.append(record)
            self._write(record)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller reports
            workeroutput["peak_memory"] = self.records

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self.records.extend(getattr(node, "workeroutput", {}).get("peak_memory", []))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.records or hasattr(self.config, "workeroutput"):
            return
        ranked = sorted(self.records, key=lambda r: -r["peak_gib"])
        if getattr(self.config, "cache", None) is not None:
            self.config.cache.set(CACHE_KEY, ranked)
        worst = ranked[: self.top]
        terminalreporter.write_sep("-", f"peak resident memory: the {len(worst)} highest of {len(self.records)} tests")
        for record in worst:
            terminalreporter.write_line(
                f"{record['peak_gib']:6.2f} GiB peak ({record['rise_gib']:+.2f} during the test, "
                f"{record['seconds']:.0f} s)  {record['test']}"
            )
        rises = sorted(self.records, key=lambda r: -r["rise_gib"])[:3]
        terminalreporter.write_line(
            "largest rises: " + "; ".join(f"{r['rise_gib']:+.2f} GiB {r['test']}" for r in rises)
        )


def register(config: pytest.Config) -> None:
    """Sample every test of this session unless ``--peak-memory-top 0`` (tests/conftest.py's ``pytest_configure``)."""
    if config.getoption("--peak-memory-top") > 0:
        config.pluginmanager.register(PeakMemory(config), "trinity-peak-memory")
