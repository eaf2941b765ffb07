"""One harness for the benchmarks and studies: sides run in fresh processes, alternating, repeated; medians and
min-max; the machine and its load; result files rewritten after every finished sample.

A study is a short script on it::

    bench = harness.Bench("whole_step", out, config=vars(args), device="cpu", render=markdown_of_my_study)
    part = bench.part("0.5b", mark_s=300, description="prompt 256, completion 128, G 8")
    part.run([harness.Side("ours", "whole_step:run_side", {...}), harness.Side("trl", ...)], repeats=3,
             reference="trl", ratios=("step_s",))
    return bench.finish()

* **A side** names a function ``module:function`` of ``benchmarks/`` that takes a JSON-able spec and returns a
  JSON-able dict (its sample). Each call runs in a fresh process (its own allocator, in-memory compile caches and
  CUDA context) in its own process group, stopped (the group killed) at its timeout: spawned, or with
  ``preload=("torch", ...)`` forked from a server that imported those modules once (`Launcher`).
* **Repeats alternate**: the sides run in the given order on even repeats and reversed on odd ones (ABC, CBA, ...),
  so slow drifts of the machine's load fall on every side alike.
* **Time marks**: a part is given ``mark_s`` (seconds since the bench started). A part that starts after its mark
  skips itself; one that reaches its mark between repeats stops there; both are recorded with why. ``budget_s``
  (the whole bench) caps every process's timeout, so a GPU command cannot run past its limit.
* **Results**: ``<out>/<name>.json`` (configuration, machine, load average at the start, at the end and before every
  sample, every sample, per-side medians and min-max, paired ratios) and ``<out>/<name>.md`` (tables), both
  rewritten after every finished sample, so a run stopped by its budget keeps what finished.

The offline environment, machine description and memory helpers are `bench_common`'s.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import bench_common as bc  # sets the offline environment before torch/trl are imported

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
#: what every side's process gets unless the side says otherwise: one torch thread (see benchmarks/README.md)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
#: `subprocess.Popen` arguments that start a child leading its own process group (so `stop_group` reaches whatever it
#: starts) in this process's session: on Linux a new session is a new scheduler autogroup, weighted as nice 0 whatever
#: the nice of its processes, so a sample started by a study under ``nice -n 19`` would take a full core's share
OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


@dataclass(frozen=True)
class Side:
    """One side of a comparison: ``run`` (``"module:function"`` in ``benchmarks/``) called with ``spec`` in a fresh
    process with ``env`` added to the environment."""

    name: str
    run: str
    spec: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    timeout_s: float = 1800.0


# ------------------------------------------------------------------------------------------------- processes
class Launcher:
    """Starts each side in a fresh process leading its own process group (stopped at its timeout), in this session.

    Without ``preload``: ``python benchmarks/harness.py --child ...`` (everything imported afresh). With ``preload``
    (module names): forked from ``multiprocessing``'s forkserver, a server process that imported those modules once
    and never touched a device (``PYTORCH_NVML_BASED_CUDA_CHECK``: torch asks NVML whether CUDA exists, so a forked
    child still gets its own CUDA context): each sample is still a new process (its own allocator, caches and
    context) without paying the imports again, several seconds a process. If the first forked sample fails before
    any succeeded, forking does not work there and every later sample is spawned."""

    def __init__(self, preload: tuple[str, ...] = ()):
        self.context, self.forked_once = None, False
        if preload:
            import multiprocessing

            os.environ.update(CHILD_ENV)  # the server's imports read these (torch's thread count)
            os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
            self.context = multiprocessing.get_context("forkserver")
            self.context.set_forkserver_preload(list(preload))

    def run(self, side: Side, timeout_s: float, log: Path | None = None) -> dict:
        """``side``'s sample, or ``{"error": ...}`` (the timeout, or the exit status and the end of its output). The
        child's output is appended to ``log`` (else kept in a temporary file)."""
        with tempfile.TemporaryDirectory(prefix="harness-") as work:
            result, output = Path(work) / "result.json", log or Path(work) / "output.log"
            since = output.stat().st_size if output.is_file() else 0
            with open(output, "a") as out:
                out.write(f"\n===== {side.name}: {side.run} {json.dumps(side.spec)}\n")
            env = {**CHILD_ENV, **side.env, "HARNESS_RESULT": str(result)}
            start = time.perf_counter()
            forked = self.context is not None
            proc = self._fork(side, env, output) if forked else self._spawn(side, env, output)
            returncode = wait_or_stop(proc, timeout_s)
            if returncode is None:
                error = f"timed out after {timeout_s:.0f} s"
                return {"error": error, "timed_out": True, "output_tail": tail(output, since)}
            if returncode != 0 or not result.is_file():
                if forked and not self.forked_once:
                    print("[harness] a forked sample failed before any succeeded; spawning from now on", flush=True)
                    self.context = None
                return {"error": f"exit status {returncode}", "output_tail": tail(output, since)}
            self.forked_once = self.forked_once or forked
            return {**json.loads(result.read_text()), "process_wall_s": time.perf_counter() - start}

    def _spawn(self, side: Side, env: dict, output: Path):
        command = [sys.executable, str(Path(__file__).resolve()), "--child", side.run, "--spec", json.dumps(side.spec)]
        with open(output, "a") as out:
            return subprocess.Popen(
                command,
                cwd=bc.ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                **OWN_GROUP,
            )

    def _fork(self, side: Side, env: dict, output: Path):
        proc = self.context.Process(target=forked_child, args=(side.run, side.spec, env, str(output)))
        proc.start()
        return proc


def autogroup_as_niced() -> None:
    """Give this session's scheduler autogroup this process's nice, where it leads the session (Linux). A study started
    as ``setsid nohup nice -n 19 python ...`` (benchmarks/README.md) is a new autogroup, and the kernel shares CPU
    between autogroups by their own nice (0 when made), not their processes': without this its runs would take a full
    share from everything else on the machine. A process that does not lead its session (run from a terminal) leaves
    the terminal's autogroup alone; without autogroups (other systems, the file read-only, or init's session, which has
    none of its own and shows an empty file) it does nothing."""
    if os.getsid(0) == os.getpid():
        try:
            Path("/proc/self/autogroup").write_text(str(os.nice(0)))
        except OSError:
            pass


def wait_or_stop(proc, timeout_s: float) -> int | None:
    """The exit status of ``proc`` (a ``Popen`` or a ``multiprocessing.Process``, each leading its own process
    group), or None after stopping its group at the timeout. Interrupted (Ctrl-C, or SIGTERM, which raises
    ``SystemExit`` meanwhile), it stops the group too before passing the interruption on: no sample outlives the
    bench."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        if isinstance(proc, subprocess.Popen):
            try:
                return proc.wait(timeout=max(timeout_s, 1.0))
            except subprocess.TimeoutExpired:
                pass
        else:
            proc.join(max(timeout_s, 1.0))
            if not proc.is_alive():
                return proc.exitcode
        stop_group(proc)
        return None
    except BaseException:
        stop_group(proc)
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def stop_group(proc) -> None:
    """SIGTERM the process group that ``proc`` leads, then SIGKILL what is left after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if isinstance(proc, subprocess.Popen):
            try:
                proc.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.join(5)
        if not proc.is_alive():
            return


def tail(path: Path, since: int = 0, chars: int = 3000) -> str:
    """The last ``chars`` characters of ``path`` after its first ``since`` bytes (one side's own output)."""
    with open(path, "rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace")[-chars:]


def forked_child(target: str, spec: dict, env: dict, output: str) -> None:
    """A forked sample: its own process group (`OWN_GROUP`), its output to ``output``, the side's environment, then
    `child_main`."""
    os.setpgid(0, 0)
    fd = os.open(output, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if "torch" in sys.modules:  # imported by the server before this side's thread count was known
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = child_main(target, spec)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def child_main(target: str, spec: dict) -> int:
    """In the fresh process: call ``target`` with ``spec`` and hand its sample back through the result pipe."""
    module_name, _, function = target.partition(":")
    sys.path.insert(0, str(BENCHMARKS))
    sample = getattr(importlib.import_module(module_name), function)(spec)
    Path(os.environ["HARNESS_RESULT"]).write_text(json.dumps(sample))
    return 0


# ------------------------------------------------------------------------------------------------ statistics
def numeric_leaves(sample: dict, prefix: str = "") -> dict[str, float]:
    """``{"a.b": 1.0}`` for every int/float leaf of nested dicts (lists and strings left out)."""
    leaves = {}
    for key, value in sample.items():
        if isinstance(value, dict):
            leaves.update(numeric_leaves(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            leaves[prefix + key] = float(value)
    return leaves


def spread(values: list[float]) -> dict | None:
    """Median, min, max and count of ``values`` (None when empty)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": bc.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(repeats: list[dict], reference: str | None, ratios: tuple[str, ...]) -> dict:
    """Per side and numeric metric, the spread over repeats; per side, the spread of its ratio to ``reference`` in
    the same repeat (paired) for each metric of ``ratios``."""
    sides = list(dict.fromkeys(name for r in repeats for name in r["samples"]))
    per_side = {}
    for name in sides:
        leaves = [numeric_leaves(r["samples"][name]) for r in repeats if ok(r["samples"].get(name))]
        keys = list(dict.fromkeys(k for leaf in leaves for k in leaf))
        per_side[name] = {k: spread([leaf.get(k) for leaf in leaves]) for k in keys}
    paired = {}
    if reference:
        for name in sides:
            if name == reference:
                continue
            paired[name] = {}
            for metric in ratios:
                values = []
                for r in repeats:
                    a, b = r["samples"].get(name), r["samples"].get(reference)
                    if ok(a) and ok(b):
                        values.append(bc.ratio(numeric_leaves(a).get(metric), numeric_leaves(b).get(metric)))
                paired[name][metric] = spread(values)
    return {"sides": per_side, "ratios": paired, "reference": reference}


def ok(sample: dict | None) -> bool:
    return sample is not None and "error" not in sample


# ----------------------------------------------------------------------------------------------------- bench
class Bench:
    """A benchmark run: its parts, result files and time marks. ``render(report) -> str`` adds the study's own
    Markdown after the harness's tables; ``update(report)`` adds derived figures before every write. ``resume``: an
    earlier report (its parts and keys kept, its commands listed under ``commands``), to which new parts are added."""

    def __init__(
        self,
        name: str,
        out: str | os.PathLike,
        *,
        config: dict,
        device: str = "cpu",
        title: str | None = None,
        render=None,
        budget_s: float | None = None,
        log: bool = False,
        preload: tuple[str, ...] = (),
        update=None,
        resume: str | os.PathLike | None = None,
    ):
        self.name, self.out, self.render, self.budget_s, self.update = name, Path(out), render, budget_s, update
        self.launcher = Launcher(preload)
        self.start = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = self.out / f"{name}.log" if log else None
        self.report = {
            "name": name,
            "title": title or name,
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join([bc.interpreter(), *sys.argv]),
            "config": config,
            # without importing torch here: the sides report the device's name (``gpu``), added when first seen
            "machine": {**bc.machine_basics(device), "torch_threads": f"{CHILD_ENV['OMP_NUM_THREADS']} per side"},
            "load_average_start": bc.loadavg(),
            "load_average_end": None,
            "total_wall_s": 0.0,
            "parts": {},
        }
        self.resumed_wall_s = 0.0
        if resume:
            earlier = json.loads(Path(resume).read_text())
            commands = [*earlier.get("commands", [earlier["command"]]), self.report["command"]]
            self.report = {**earlier, **self.report, "parts": earlier["parts"], "commands": commands}
            self.resumed_wall_s = earlier["total_wall_s"]
        self.write()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def remaining(self) -> float:
        return float("inf") if self.budget_s is None else self.budget_s - self.elapsed()

    def part(self, name: str, *, mark_s: float | None = None, description: str = "") -> Part:
        """A new part; it skips itself at once (recorded) when its time mark has passed."""
        record = {"description": description, "mark_s": mark_s, "status": "running", "why": None}
        self.report["parts"][name] = record
        part = Part(self, name, record)
        part.check_mark("before it started")
        self.write()
        return part

    def write(self) -> None:
        self.report["load_average_end"] = bc.loadavg()
        self.report["total_wall_s"] = self.elapsed() + self.resumed_wall_s
        if self.update is not None:
            self.update(self.report)
        (self.out / f"{self.name}.json").write_text(json.dumps(self.report, indent=1) + "\n")
        (self.out / f"{self.name}.md").write_text(self.markdown())

    def markdown(self) -> str:
        return report_markdown(self.report, self.render)

    def finish(self) -> int:
        """Write the files a last time and print where they are; 0 when every part finished without error."""
        self.write()
        print((self.out / f"{self.name}.md").read_text())
        print(f"wrote {self.out / (self.name + '.json')} and .md ({self.elapsed():.0f} s)")
        return 0 if all(p["status"] == "done" for p in self.report["parts"].values()) else 1


def report_markdown(report: dict, render=None) -> str:
    """The Markdown of a bench's report: the machine and load, each part's tables, then ``render(report)``."""
    r = report
    lines = [
        f"# {r['title']}",
        "",
        "; then ".join(f"`{c}`" for c in r.get("commands", [r["command"]]))
        + f", {r['date']}, {r['total_wall_s']:.0f} s. {bc.machine_line(r['machine'])}",
        f"Load average (1/5/15 min): {r['load_average_start']} at the start, {r['load_average_end']} at the end.",
        "",
    ]
    for name, part in r["parts"].items():
        lines += part_markdown(name, part)
    if render is not None:
        lines.append(render(r))
    return "\n".join(lines).rstrip() + "\n"


def rewrite(path: str | os.PathLike, render=None, update=None) -> None:
    """Re-read a bench's ``.json``, apply ``update(report)`` (derived figures), write it and its ``.md`` again."""
    path = Path(path)
    report = json.loads(path.read_text())
    if update is not None:
        update(report)
    path.write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(report_markdown(report, render))


class Part:
    """One part of a bench: repeats of its sides, with its time mark."""

    def __init__(self, bench: Bench, name: str, record: dict):
        self.bench, self.name, self.record = bench, name, record

    @property
    def skipped(self) -> bool:
        return self.record["status"] in ("skipped", "cut")

    def check_mark(self, when: str) -> bool:
        """True (and the part marked skipped, or cut when something already ran) once its time mark has passed."""
        mark = self.record["mark_s"]
        if self.skipped:
            return True
        if mark is not None and self.bench.elapsed() > mark:
            ran = any(self.record.get(k) for k in ("repeats", "uncounted", "measurements"))
            self.record["status"] = "cut" if ran else "skipped"
            self.record["why"] = f"its time mark ({mark:.0f} s) had passed {when} ({self.bench.elapsed():.0f} s)"
            self.bench.write()
            return True
        return False

    def timeout(self, side: Side) -> float:
        return min(side.timeout_s, self.bench.remaining())

    def run_once(self, side: Side, label: str) -> dict | None:
        """One uncounted process (e.g. the one that warms the on-disk compile caches), kept under ``uncounted``."""
        if self.check_mark(f"before {label}"):
            return None
        sample = self._sample(side)
        self.record.setdefault("uncounted", {})[label] = sample
        self.bench.write()
        return sample

    def run(self, sides: list[Side], repeats: int, *, reference: str | None = None, ratios: tuple[str, ...] = ()):
        """``repeats`` rounds of every side, alternating the order; the files are rewritten after every sample."""
        self.record.setdefault("repeats", [])
        self.record["reference"] = reference
        for index in range(repeats):
            if self.check_mark(f"before repeat {index + 1}"):
                break
            order = sides if index % 2 == 0 else sides[::-1]
            repeat = {"order": [s.name for s in order], "samples": {}}
            self.record["repeats"].append(repeat)
            for side in order:  # the child reads its repeat's index in HARNESS_REPEAT
                side = replace(side, env={**side.env, "HARNESS_REPEAT": str(index)})
                repeat["samples"][side.name] = self._sample(side)
                self.record["summary"] = summarise(self.record["repeats"], reference, ratios)
                self.bench.write()
                if repeat["samples"][side.name].get("timed_out"):
                    self.record["status"], self.record["why"] = "cut", f"{side.name} timed out"
                    return
        if self.record["status"] == "running":
            failed = [n for r in self.record["repeats"] for n, s in r["samples"].items() if not ok(s)]
            self.record["status"] = "failed" if failed else "done"
            self.record["why"] = f"failed samples: {', '.join(failed)}" if failed else None
        self.bench.write()

    def _sample(self, side: Side) -> dict:
        load = bc.loadavg()
        started = self.bench.elapsed()
        sample = self.bench.launcher.run(side, self.timeout(side), self.bench.log)
        print(f"[{self.bench.name}/{self.name}] {side.name}: {summary_line(sample)}", flush=True)
        if sample.get("gpu") and not self.bench.report["machine"].get("gpu"):
            self.bench.report["machine"]["gpu"] = sample["gpu"]
        return {**sample, "loadavg_before": load, "started_s": started}


def summary_line(sample: dict) -> str:
    if not ok(sample):
        return "ERROR " + sample["error"]
    return ", ".join(f"{k} {v:.3g}" for k, v in list(numeric_leaves(sample).items())[:6])


# -------------------------------------------------------------------------------------------------- machine
# ------------------------------------------------------------------------------------------------- markdown
def cell(stat: dict | None, spec: str = ".3g") -> str:
    """``median (min-max)`` of a `spread`, or ``n/a``."""
    if not stat:
        return "n/a"
    if stat["n"] == 1:
        return f"{stat['median']:{spec}}"
    return f"{stat['median']:{spec}} ({stat['min']:{spec}}-{stat['max']:{spec}})"


def part_markdown(name: str, part: dict, metrics: tuple[str, ...] | None = None) -> list[str]:
    """The part's status, its per-side table of ``metrics`` (default: the ratios' metrics) and its repeats."""
    lines = [f"## {name}", ""]
    if part.get("description"):
        lines += [part["description"], ""]
    status = f"Status: **{part['status']}**" + (f" ({part['why']})" if part.get("why") else "") + "."
    lines += [status, ""]
    summary = part.get("summary")
    if not summary:
        return lines
    ratios = summary["ratios"]
    metrics = metrics or tuple(dict.fromkeys(m for side in ratios.values() for m in side))
    if metrics:
        ref = summary["reference"]
        lines += [
            "| side | " + " | ".join(f"{m}, median (min-max) | / {ref} (paired)" for m in metrics) + " |",
            "|---|" + "---|---|" * len(metrics),
        ]
        for side, stats in summary["sides"].items():
            cells = [f"{cell(stats.get(m))} | {cell(ratios.get(side, {}).get(m))}" for m in metrics]
            lines.append(f"| {side} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["| repeat | order | load before each side |", "|---|---|---|"]
    for i, repeat in enumerate(part.get("repeats", []), start=1):
        loads = "; ".join(f"{n} {s.get('loadavg_before')}" for n, s in repeat["samples"].items())
        errors = [f"{n}: {s['error']}" for n, s in repeat["samples"].items() if not ok(s)]
        lines.append(
            f"| {i} | {' '.join(repeat['order'])} | {loads}{' ERRORS ' + '; '.join(errors) if errors else ''} |"
        )
    return lines + [""]


# ---------------------------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """The options every study on the harness takes."""
    parser.add_argument("--repeats", type=int, default=repeats, help=f"repeats per part (default {repeats})")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one repeat: checks that it runs")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (caps every process)")
    parser.add_argument(
        "--out", default=None, help="results folder (default $OUT, else benchmarks/results; --dry-run: a temporary one)"
    )


def out_dir(args) -> str:
    out = args.out or os.environ.get("OUT")
    return out or (tempfile.mkdtemp(prefix="bench-dry-") if args.dry_run else str(RESULTS))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the harness's child process (run by Part.run)")
    parser.add_argument("--child", required=True, metavar="MODULE:FUNCTION")
    parser.add_argument("--spec", required=True, help="the side's spec, JSON")
    cli = parser.parse_args()
    sys.exit(child_main(cli.child, json.loads(cli.spec)))
