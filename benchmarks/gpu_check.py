#!/usr/bin/env python
"""`make gpu-check`: the GPU verification of prefix packing, each command at most 8 minutes on one H200 (issues 34,
42 and 53); its parts, budgets and files: docs/prefix-packing.md#the-gpu-check.

Parts (`PARTS`), each in its own process group with its own time budget (`BUDGETS`: a part that overruns is stopped,
keeping what it wrote; the others run): ``profile`` (``benchmarks/packing_profile.py``) and ``bench``
(``benchmarks/prefix_packing.py`` at its ``target`` points) by default; ``accumulation``, ``small``, ``lora`` (more
point sets, added to the same report), ``tests`` (the CUDA tests) and ``trainers`` (every trainer with prefix packing
for 2 steps) as further commands. Results: at most 8 files in ``--out`` (default ``$OUT``, else a temporary folder),
``gpu_check.{md,json}`` rewritten after each part. ``--dry-run`` runs the same parts on CPU with tiny shapes
(``tests/test_benchmarks.py``)::

    bash .gpu/run.sh make gpu-check
    bash .gpu/run.sh make gpu-check PARTS=accumulation,small
    make gpu-check DRY_RUN=1            # here, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_common import fmt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("profile", "bench", "accumulation", "small", "lora", "tests", "trainers")
DEFAULT_PARTS = ("profile", "bench")
#: seconds per part on one GPU. The default parts' sum (420 s), plus run.sh's installs and the parts' start-up (41 s
#: on the H200 run of 2026-11-28), stays under the 8 minutes a command may take. Sized from that run
#: (benchmarks/results/h200_2026-11-28/): a fresh 1.5B process of ours or TRL's took about 11 s (4 points x 2 sides in
#: about 90 s a repeat), so a repeat of the two target points with three sides takes about 70-80 s, and the compiled
#: side's first (uncounted) run some 60 s more: expect 3-4 of the 5 repeats asked within `bench`'s 330 s, each kept
#: as it finishes. The profile is one process of at most 90 s, its parts skipped once their time marks pass.
BUDGETS = {
    "profile": 90.0,
    "bench": 330.0,
    "accumulation": 240.0,
    "small": 180.0,
    "lora": 180.0,
    "tests": 180.0,
    "trainers": 60.0,
}
#: a dry run's budgets are this many times the GPU ones (they only stop a hung part there)
DRY_RUN_SLACK = 5
#: each benchmark run's process is stopped after this (the first compiled run compiles the layers cold)
BENCH_RUN_TIMEOUT = 120.0
TRAINERS = ("trinity", "chord", "cispo", "sapo", "ppo", "step_grpo")
#: the benchmark parts: their point sets, sides and repeats (``None``: ``--repeats``)
BENCH_SETS = {"bench": "target", "accumulation": "accumulation", "small": "small", "lora": "lora"}
BENCH_SIDES = {"bench": "ours,ours_compiled,trl", "accumulation": "ours,trl", "small": "ours,trl", "lora": "ours,trl"}
BENCH_REPEATS = {"bench": None, "accumulation": 2, "small": 2, "lora": 2}
#: what the summary keeps of each profiled training pass
PASS_KEYS = ("label", "host_enqueue_s", "event_span_s", "gpu_busy_s", "launches", "host_us_per_launch", "aten_ops")
PASS_KEYS += ("sync_calls", "sync_warnings", "error")
STEP_KEYS = ("side", "step_s", "host", "device", "error")


# ------------------------------------------------------------------------------------------ processes
class PartRun:
    """One part's process: ``command`` in its own process group, its output appended to ``gpu_check.log``, the group
    stopped after ``budget`` seconds (`harness.wait_or_stop`); `result` gives the part's status and, unless it
    passed, the end of its own output."""

    def __init__(self, command: list[str], out: Path, budget: float, env: dict | None = None):
        self.log = out / "gpu_check.log"
        self.since = len(self.log.read_text(errors="replace")) if self.log.is_file() else 0
        start = time.perf_counter()
        with open(self.log, "a") as log:
            log.write(f"\n===== {' '.join(command)}\n")
            log.flush()
            env = {**os.environ, **(env or {})}
            proc = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, **harness.OWN_GROUP
            )
            timed_out = harness.wait_or_stop(proc, budget) is None
        self.run = {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": time.perf_counter() - start}

    def tail(self, lines: int = 15) -> list[str]:
        return self.log.read_text(errors="replace")[self.since :].splitlines()[-lines:]

    def result(self, passed: bool, **found) -> dict:
        status = "timeout" if self.run["timed_out"] else "passed" if passed else "failed"
        return {"status": status, **self.run, **found, "log_tail": self.tail() if status != "passed" else []}


def environment() -> dict:
    """The device and versions, from a short child process (the driver itself never touches CUDA)."""
    code = (
        "import json, torch, transformers, trl; "
        "c = torch.cuda.is_available(); "
        "print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, "
        "'trl': trl.__version__, 'cuda': c, 'gpu': torch.cuda.get_device_name() if c else None, "
        "'capability': list(torch.cuda.get_device_capability()) if c else None, "
        "'gpu_memory_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c else None, "
        "'imports': imports}))"
    )
    # what the parts need beyond torch/transformers/trl (carried as wheels to the lent machine): found or why not
    code = (
        "import importlib\nimports = {}\nfor name in ('datasets', 'pyarrow', 'pytest', 'peft', 'accelerate'):\n"
        "    try:\n        imports[name] = getattr(importlib.import_module(name), '__version__', 'found')\n"
        "    except Exception as err:\n        imports[name] = f'MISSING: {err}'\n" + code
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "the torch/CUDA probe took over 120 s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- parts
def part_profile(args, out: Path) -> dict:
    name = "packing_profile" if args.dry_run else "packing_profile_cuda"
    command = [sys.executable, str(ROOT / "benchmarks" / "packing_profile.py")]
    command += ["--dry-run"] if args.dry_run else ["--device", "cuda"]
    run = PartRun(command, out, args.budget_profile, env={"OUT": str(out)})
    path = out / f"{name}.json"
    report = json.loads(path.read_text()) if path.is_file() else None
    parts = (report or {}).get("parts", {})
    measurements = {name: p.get("measurements", []) for name, p in parts.items()}
    launch = next(iter(measurements.get("launch", [])), {})
    errors = [m["label"] for ms in measurements.values() for m in ms if "error" in m]
    return run.result(
        bool(report) and not errors and run.run["returncode"] == 0,
        parts={name: {"status": p.get("status"), "why": p.get("why")} for name, p in parts.items()},
        launch={k: launch.get(k) for k in ("launch_us", "launch_drained_us", "module_call_us")},
        passes=[{k: m.get(k) for k in PASS_KEYS} for m in measurements.get("passes", [])],
        steps=[{k: m.get(k) for k in STEP_KEYS} for m in measurements.get("steps", [])],
    )


def part_tests(args, out: Path) -> dict:
    xml = out / "gpu_tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "-p", "no:cacheprovider"]
    run = PartRun([*command, f"--junitxml={xml}", *args.test_paths], out, args.budget_tests)
    counts = junit_counts(xml)
    failed = [line for line in run.tail(400) if line.startswith(("FAILED", "ERROR"))]
    # 5: nothing collected
    passed = run.run["returncode"] == 0 or (run.run["returncode"] == 5 and counts.get("tests", 0) == 0)
    return {**run.result(passed, counts=counts, failures=failed[:20]), "log_tail": run.tail()}


def junit_counts(path: Path) -> dict:
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    skips = [case.find("skipped") for case in suite.iter("testcase")]
    counts["skip_reasons"] = dict(Counter((s.get("message") or "").strip()[:120] for s in skips if s is not None))
    return counts


def part_bench(args, out: Path, part: str = "bench") -> dict:
    """The benchmark at ``part``'s point set; ``small`` and ``lora`` add their points to the same report."""
    name = "prefix_packing" if args.dry_run else "prefix_packing_cuda"
    report_path = out / f"{name}.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "prefix_packing.py")]
    if args.dry_run:  # the compiled side compiles with inductor: for the GPU (tests/packing/test_compiled.py here)
        command += ["--quick", "--rollout", "fixed", "--repeats", "2", "--timeout", str(args.bench_run_timeout)]
    else:
        repeats = BENCH_REPEATS[part] or args.repeats
        command += ["--device", "cuda", "--bf16", "--timeout", str(args.bench_run_timeout)]
        command += ["--point-set", BENCH_SETS[part], "--repeats", str(repeats), "--sides", BENCH_SIDES[part]]
        if args.bench_points and part == "bench":
            command += ["--points", *args.bench_points]
        if args.optim:
            command += ["--optim", args.optim]
    if part != "bench" and report_path.is_file():
        command += ["--resume", str(report_path)]
    if args.dry_run and part != "bench":
        return {"status": "passed", "wall_s": 0.0, "note": "CUDA point sets: the dry run's bench covers the code"}
    run = PartRun(command, out, getattr(args, f"budget_{part}"), env={"OUT": str(out)})
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    points = [
        bench_point(result, comparison, suffix)
        for result in report.get("results", [])
        for suffix, comparison in (("", result["comparison"]), (" compiled", result.get("compiled")))
        if comparison
    ]
    passed = run.run["returncode"] == 0 and report and not report["failed_points"]
    return run.result(
        bool(passed) and all(p["equivalent"] for p in points),
        points=points,
        **{k: report.get(k, []) for k in ("failed_points", "not_measured", "uncounted_runs")},
        fewer_repeats=report.get("fewer_repeats", {}),
        summary=report.get("summary", {}),
    )


def bench_point(r: dict, c: dict, suffix: str) -> dict:
    """What the summary keeps of a benchmark point ``r``: ``c``, ours (or ours compiled: ``suffix``) against TRL (the
    rest is in the benchmark's own report, whose table gpu_check.md repeats)."""
    direct = c["equivalence"].get("direct") or {}
    point = {"point": r["name"] + suffix, "repeats": r["repeats"], "equivalent": c["equivalence"]["equivalent"]}
    point |= {k: c.get(k) for k in ("train_ratio", "train_ratio_per_repeat", "part_memory_ratio")}
    return point | {k: direct.get(k) for k in ("logps_rel_l2", "logps_rtol", "grads_rel_l2", "grads_rtol", "error")}


def part_trainers(args, out: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu_check_trainers_") as tmp:
        results = Path(tmp) / "results.jsonl"
        command = [sys.executable, os.path.abspath(__file__), "--trainers-worker", str(results), "--work", tmp]
        command += ["--trainers", *args.trainers] + (["--dry-run"] if args.dry_run else [])
        run = PartRun(command, out, args.budget_trainers)
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    done = {r["trainer"] for r in rows}
    for name in args.trainers:
        if name not in done:
            rows.append({"trainer": name, "ok": False, "error": "not run (the part was stopped or failed before)"})
    return run.result(all(r["ok"] for r in rows) and run.run["returncode"] == 0, trainers=rows)


def trainers_worker(results: str, work: str, names: list[str], dry_run: bool) -> int:
    """Train each trainer for 2 steps with packing ``auto`` (CUDA and bf16, or CPU in a dry run); one JSON line per
    trainer to ``results`` as it finishes."""
    import logging
    import traceback
    import warnings

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_common  # noqa: F401  (the offline environment)
    import torch
    import transformers
    from datasets import Dataset
    from helpers import length_reward, save_tiny_model, tiny_conversational_dataset, tiny_grpo_kwargs
    from prefix_packing import PackingLog

    from trinity_trl import trainers as t

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    cuda = not dry_run
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    model_dir = save_tiny_model(Path(work) / "model")
    prompts = tiny_conversational_dataset(8)
    turns = [
        [{"role": "user", "content": f"What is {a}+1?"}, {"role": "assistant", "content": f"It is {a + 1}."}]
        for a in range(8)
    ]
    expert = Dataset.from_dict({"messages": turns})
    device = {
        "use_cpu": not cuda,
        "bf16": cuda,
        "activation_checkpointing": cuda,  # TRL's default on a GPU
        "prefix_packing_kernel": "auto",
    }

    def build(name, out):
        kwargs = tiny_grpo_kwargs(output_dir=out, **device)
        if name == "step_grpo":
            from trinity_trl.rollouts import CalculatorEnv, calculator_dataset

            return t.StepGRPOTrainer(
                model=model_dir,
                args=t.StepGRPOConfig(**kwargs, max_env_steps=2),
                train_dataset=calculator_dataset(8),
                environment_factory=CalculatorEnv,
            )
        common = {"model": model_dir, "reward_funcs": length_reward, "train_dataset": prompts}
        if name == "chord":
            common["expert_dataset"] = expert
            kwargs |= {"expert_batch_size": 2, "mu_peak": 0.5, "mu_valley": 0.5}
        elif name == "trinity":
            kwargs["algorithm"] = "grpo"
        prefix = {"trinity": "Trinity", "chord": "Chord", "cispo": "CISPO", "sapo": "SAPO", "ppo": "PPO"}[name]
        return getattr(t, f"{prefix}Trainer")(**common, args=getattr(t, f"{prefix}Config")(**kwargs))

    logging.getLogger("trinity_trl").addHandler(log := PackingLog())
    for name in names:
        log.lines.clear()
        start = time.perf_counter()
        row: dict = {"trainer": name}
        try:
            trainer = build(name, str(Path(work) / name))
            trainer.train()
            logs = trainer.state.log_history
            losses = [e["loss"] for e in logs if "loss" in e]
            ratios = [e["packing/forwarded_token_ratio"] for e in logs if "packing/forwarded_token_ratio" in e]
            finite = len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
            row.update(
                ok=bool(finite),
                steps=trainer.state.global_step,
                losses=losses,
                forwarded_token_ratio=ratios,
                packing_log=list(dict.fromkeys(log.lines))[:6],
                error=None if finite else f"expected 2 finite losses, got {losses}",
            )
            del trainer
        except Exception as err:  # recorded; the next trainer runs
            row.update(ok=False, error=f"{type(err).__name__}: {err}"[:2000])
            traceback.print_exc()
        row["wall_s"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        if cuda:
            torch.cuda.empty_cache()
    return 0


# ----------------------------------------------------------------------------------------- summary
def markdown(summary: dict) -> str:
    env, parts = summary["environment"], summary["parts"]
    lines = [
        f"# gpu-check{' (DRY RUN on CPU: tiny shapes, CUDA parts skipped)' if summary['dry_run'] else ''}",
        "",
        f"Device: {env.get('gpu') or 'CPU'}"
        + (f" ({env['gpu_memory_gib']} GiB, capability {env.get('capability')})" if env.get("gpu") else "")
        + f"; torch {env.get('torch')}, transformers {env.get('transformers')}, trl {env.get('trl')}. "
        f"Date {summary['date']}, commit {summary.get('commit') or 'unknown'}. Command: `{summary['command']}`. "
        f"Total {summary['total_wall_s']:.0f} s.",
        "",
        "Imports: " + ", ".join(f"{k} {v}" for k, v in (env.get("imports") or {}).items()),
        "",
        "| part | status | wall (s) | budget (s) |",
        "|---|---|---|---|",
    ]
    for name in summary["requested_parts"]:
        p = parts.get(name, {"status": "not run yet"})
        lines.append(f"| {name} | {p['status']} | {fmt(p.get('wall_s'), '.0f')} | {fmt(p.get('budget_s'), '.0f')} |")
    lines += profile_lines(summary) + tests_lines(parts.get("tests")) + bench_lines(summary)
    trainers = parts.get("trainers")
    if trainers:
        lines += ["", "Trainers, 2 steps with packing auto:", ""]
        for r in trainers["trainers"]:
            ratios = r.get("forwarded_token_ratio") or []
            lines.append(
                f"- {r['trainer']}: {'ok' if r['ok'] else 'FAILED'}"
                + (f", losses {[round(x, 4) for x in r.get('losses', [])]}" if r.get("losses") else "")
                + (f", forwarded-token ratios {[round(x, 2) for x in ratios][:4]}" if ratios else "")
                + (f": {r['error'][:200]}" if r.get("error") else "")
            )
    for name in summary["requested_parts"]:
        p = parts.get(name, {})
        if p.get("log_tail") and p["status"] != "passed":
            lines += ["", f"Last lines of {name}'s log:", "", "```", *p["log_tail"][-8:], "```"]
    return "\n".join(lines) + "\n"


def profile_lines(summary: dict) -> list[str]:
    """The profile's own Markdown (``packing_profile[_cuda].md``: its launch costs, passes and steps)."""
    import packing_profile

    path = Path(summary["out"]) / ("packing_profile.json" if summary["dry_run"] else "packing_profile_cuda.json")
    if "profile" not in summary["parts"] or not path.is_file():
        return []
    report = json.loads(path.read_text())
    parts = [
        f"- part {n}: {p['status']}" + (f" ({p['why']})" if p.get("why") else "") for n, p in report["parts"].items()
    ]
    return ["", f"Profile (`{path.stem}.md`):", "", *parts, "", *packing_profile.markdown(report).splitlines()]


def tests_lines(tests: dict | None) -> list[str]:
    lines = []
    if tests:
        c = tests.get("counts", {})
        lines += [
            "",
            f"Tests: {c.get('passed', 0)} passed, {c.get('failures', 0)} failed, {c.get('errors', 0)} "
            f"errors, {c.get('skipped', 0)} skipped.",
        ]
        lines += [f"- {f}" for f in tests.get("failures", [])[:10]]
        for reason, n in list(c.get("skip_reasons", {}).items())[:3]:
            lines.append(f"- skipped x{n}: {reason}")
    return lines


def bench_lines(summary: dict) -> list[str]:
    """The benchmark's own Markdown (its report covers every benchmark part: its table, notes, targets and what
    failed or was cut)."""
    import prefix_packing

    path = Path(summary["out"]) / ("prefix_packing.json" if summary["dry_run"] else "prefix_packing_cuda.json")
    if not any(summary["parts"].get(n, {}).get("points") for n in BENCH_SETS) or not path.is_file():
        return []
    return ["", "Benchmark (`" + path.name.replace(".json", ".md") + "` from here on):", ""] + prefix_packing.markdown(
        json.loads(path.read_text())
    ).splitlines()


def write_summary(out: Path, summary: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(summary))


# -------------------------------------------------------------------------------------------- main
def commit() -> str | None:
    """The checkout's commit (``git``), where there is one; ``None`` on a copy without ``.git``."""

    def git(*args: str):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+local changes" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="on CPU: tiny shapes, the CUDA tests skip")
    parts, default = ",".join(PARTS), ",".join(DEFAULT_PARTS)
    parser.add_argument("--parts", default=default, help=f"comma-separated subset of {parts} (default {default})")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT, else a temp one)")
    for name in PARTS:
        slack = f"{DRY_RUN_SLACK}x that in a dry run, on a shared CPU"
        parser.add_argument(f"--budget-{name}", type=float, help=f"seconds (default {BUDGETS[name]:.0f}; {slack})")
    parser.add_argument("--bench-run-timeout", type=float, help=f"per process, default {BENCH_RUN_TIMEOUT:.0f} s")
    parser.add_argument("--repeats", type=int, default=5, help="benchmark repeats (fresh processes per side)")
    parser.add_argument("--bench-points", nargs="+", metavar="MODEL:P:C:G", help="bench part: instead of its set")
    parser.add_argument("--optim", help="both benchmark sides' optimizer (e.g. sgd: no state); default TRL's")
    parser.add_argument("--test-paths", nargs="+", default=["tests/packing"])
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    parser.add_argument("--trainers-worker", metavar="RESULTS", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainers_worker:
        return trainers_worker(args.trainers_worker, args.work, args.trainers, args.dry_run)
    for name in PARTS:  # a dry run's budgets only stop a hung part: a loaded CPU machine is slow
        if getattr(args, f"budget_{name}") is None:
            setattr(args, f"budget_{name}", BUDGETS[name] * (DRY_RUN_SLACK if args.dry_run else 1))
    if args.bench_run_timeout is None:
        args.bench_run_timeout = BENCH_RUN_TIMEOUT * (DRY_RUN_SLACK if args.dry_run else 1)
    requested = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(requested) - set(PARTS))
    if unknown or not requested:
        parser.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}, got {args.parts!r}")
    requested = [p for p in PARTS if p in requested]  # in the documented order
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    env = environment()
    command = " ".join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    summary = {"command": command, "dry_run": args.dry_run, "date": time.strftime("%Y-%m-%d"), "commit": commit()}
    summary |= {"environment": env, "requested_parts": requested, "parts": {}, "targets": [], "out": str(out)}
    summary["total_wall_s"] = 0.0
    write_summary(out, summary)
    runners = {"profile": part_profile, "tests": part_tests, "trainers": part_trainers}  # the others: BENCH_SETS
    for name in requested:
        budget = getattr(args, f"budget_{name}")
        if not args.dry_run and not env.get("cuda"):
            reason = env.get("error", "torch.cuda.is_available() is False")[-300:]
            result = {"status": "no CUDA", "reason": f"no CUDA device: {reason}", "wall_s": 0.0}
        else:
            print(f"[gpu-check] {name}: budget {budget:.0f} s", flush=True)
            try:
                result = runners[name](args, out) if name in runners else part_bench(args, out, name)
            except Exception as err:  # a broken part is reported; the next part runs
                result = {"status": "failed", "error": f"{type(err).__name__}: {err}", "wall_s": None}
        result["budget_s"] = budget
        summary["parts"][name] = result
        if result.get("summary"):
            summary["targets"] = result["summary"]["cuda_targets"]  # issue 42's, from the benchmark's report
        summary["total_wall_s"] = time.perf_counter() - started
        write_summary(out, summary)
        print(f"[gpu-check] {name}: {result['status']} ({fmt(result.get('wall_s'), '.0f')} s)", flush=True)
    print(markdown(summary))
    print(f"[gpu-check] results in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0 if all(p["status"] == "passed" for p in summary["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
