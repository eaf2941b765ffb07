"""The benchmarks' harness (`benchmarks/harness.py`): fresh processes, alternation, time marks, result files written
after every sample, paired ratios. The sides here are tiny functions of a module written to a temporary folder."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

SIDES = '''
import json, os, subprocess, sys, time
from pathlib import Path


def value(spec):
    time.sleep(spec.get("sleep", 0))
    return {"step_s": spec["value"], "phases": {"generation": spec["value"] * 2}, "pid": os.getpid()}


def files_so_far(spec):
    """The samples the bench's JSON file held when this side started (it is rewritten after every sample)."""
    report = json.loads(Path(spec["json"]).read_text())
    repeats = report["parts"]["p"].get("repeats", [])
    return {"step_s": 1.0, "seen": sum(len(r["samples"]) for r in repeats)}


def hang(spec):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(spec["pid_file"]).write_text(str(child.pid))
    time.sleep(120)


def fail(spec):
    raise ValueError("this side fails")
'''


@pytest.fixture
def sides_env(tmp_path):
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "toy_sides.py").write_text(SIDES)
    return {"PYTHONPATH": str(tmp_path / "mod")}


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within 5 s."""
    for _ in range(50):
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            return True
        time.sleep(0.1)
    return False


def _side(name, function, env, **spec):
    return harness.Side(name, f"toy_sides:{function}", spec, env)


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["spawned", "forked"])
def test_sides_alternate_in_fresh_processes_with_paired_ratios(tmp_path, sides_env, preload):
    bench = harness.Bench("toy", tmp_path / "out", config={"k": 1}, preload=preload)
    part = bench.part("p", description="three sides")
    sides = [
        _side("a", "value", sides_env, value=1.0),
        _side("b", "files_so_far", sides_env, json=str(tmp_path / "out" / "toy.json")),
        _side("c", "value", sides_env, value=4.0),
    ]
    part.run(sides, repeats=3, reference="c", ratios=("step_s", "phases.generation"))
    assert bench.finish() == 0
    report = json.loads((tmp_path / "out" / "toy.json").read_text())
    record = report["parts"]["p"]
    assert record["status"] == "done" and record["why"] is None
    assert [r["order"] for r in record["repeats"]] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # the file is rewritten after every sample: side b saw every sample that finished before it
    assert [r["samples"]["b"]["seen"] for r in record["repeats"]] == [1, 4, 7]
    pids = [r["samples"][s]["pid"] for r in record["repeats"] for s in ("a", "c")]
    assert len(set(pids)) == 6 and os.getpid() not in pids  # a fresh process per sample
    assert all(r["samples"][s]["process_wall_s"] > 0 for r in record["repeats"] for s in "abc")
    summary = record["summary"]
    assert summary["sides"]["a"]["phases.generation"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}
    assert summary["ratios"]["a"]["step_s"]["median"] == pytest.approx(0.25)
    assert summary["ratios"]["b"]["step_s"]["median"] == pytest.approx(0.25)
    assert all(isinstance(r["samples"]["a"]["loadavg_before"], list) for r in record["repeats"])
    assert {"cpu", "os_cpu_count", "torch", "trl", "transformers", "torch_threads"} <= set(report["machine"])
    assert report["load_average_start"] and report["load_average_end"]
    text = (tmp_path / "out" / "toy.md").read_text()
    assert "| a | 1 (1-1) | 0.25 (0.25-0.25) |" in text and "| 2 | c b a |" in text


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["spawned", "forked"])
def test_a_part_past_its_time_mark_skips_itself_and_a_hung_side_is_stopped(tmp_path, sides_env, preload):
    bench = harness.Bench("toy", tmp_path, config={}, budget_s=60, preload=preload)
    late = bench.part("late", mark_s=0.0)
    assert late.skipped
    late.run([_side("a", "value", sides_env, value=1.0)], repeats=2)  # runs nothing
    pid_file = tmp_path / "grandchild.pid"
    hung = bench.part("hung", mark_s=60)
    side = harness.Side("h", "toy_sides:hang", {"pid_file": str(pid_file)}, sides_env, timeout_s=3)
    start = time.monotonic()
    hung.run([side, _side("f", "fail", sides_env)], repeats=2)
    assert time.monotonic() - start < 30
    assert bench.finish() == 1
    parts = json.loads((tmp_path / "toy.json").read_text())["parts"]
    assert parts["late"]["status"] == "skipped"
    assert "time mark (0 s) had passed before it started" in parts["late"]["why"]
    assert "repeats" not in parts["late"] or parts["late"]["repeats"] == []
    assert parts["hung"]["status"] == "cut" and parts["hung"]["why"] == "h timed out"
    (repeat,) = parts["hung"]["repeats"]
    assert repeat["samples"]["h"]["timed_out"] and list(repeat["samples"]) == ["h"]
    assert _stopped(int(pid_file.read_text())), "the side's child process survived its timeout"  # the whole group


def test_a_part_reaching_its_mark_between_repeats_keeps_what_finished(tmp_path, sides_env):
    bench = harness.Bench("toy", tmp_path, config={})
    part = bench.part("p", mark_s=bench.elapsed() + 1.0)
    part.run([_side("a", "value", sides_env, value=1.0, sleep=1.5), _side("f", "fail", sides_env)], repeats=3)
    record = json.loads((tmp_path / "toy.json").read_text())["parts"]["p"]
    assert record["status"] == "cut" and "before repeat 2" in record["why"]
    (repeat,) = record["repeats"]
    assert repeat["samples"]["a"]["step_s"] == 1.0
    assert "this side fails" in repeat["samples"]["f"]["output_tail"]  # a failing side's own output is kept
    assert record["summary"]["sides"]["a"]["step_s"]["n"] == 1 and record["summary"]["sides"]["f"] == {}


def test_a_stopped_bench_stops_the_sample_it_runs(tmp_path, sides_env):
    """SIGTERM to the driver (a device command at its limit, `kill`): the running sample's whole group stops too."""
    import signal
    import subprocess

    pid_file = tmp_path / "grandchild.pid"
    driver = (
        "import sys; sys.path.insert(0, sys.argv[1]); import harness\n"
        "bench = harness.Bench('toy', sys.argv[2], config={})\n"
        "side = harness.Side('h', 'toy_sides:hang', {'pid_file': sys.argv[3]}, {'PYTHONPATH': sys.argv[4]})\n"
        "bench.part('p').run([side], repeats=1)\n"
    )
    args = [str(ROOT / "benchmarks"), str(tmp_path), str(pid_file), sides_env["PYTHONPATH"]]
    proc = subprocess.Popen([sys.executable, "-c", driver, *args])
    for _ in range(300):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert _stopped(int(pid_file.read_text())), "the running sample survived its stopped bench"
