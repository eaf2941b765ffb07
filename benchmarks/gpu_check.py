#!/usr/bin/env python
"""`make gpu-check`: the whole GPU verification of prefix packing in one command (issue 34), within about 8 minutes
on one H100.

Parts, each in its own process group with its own time budget (a part that overruns is stopped; the others run):

* ``tests``: the CUDA tests, ``python -m pytest -q -m gpu tests/packing`` (junit XML and the log kept);
* ``bench``: ``benchmarks/prefix_packing.py`` in bf16 with activation checkpointing (TRL's default) at the issue's
  points (Qwen2.5-0.5B and 1.5B shapes with the real vocabulary at P1024/C256/G8 and P2048/C512/G8, and 0.5B
  P256/C128/G8): the training part, the whole step, peak memory, ``auto``'s verdicts, and packed-vs-padded
  equivalence within tolerances derived for bf16;
* ``trainers``: every trainer with prefix packing (TrinityTrainer, ChordTrainer, CISPOTrainer, SAPOTrainer,
  PPOTrainer, StepGRPOTrainer) for 2 steps with ``prefix_packing_kernel="auto"`` on CUDA, on the tests' tiny model.

Results go to ``--out`` (default ``$OUT``, where the lent GPU machine sends files back from; else a new temporary
folder), at most 8 files: ``gpu_check.md`` and ``gpu_check.json`` (the summary, rewritten after each part, so a
stopped run keeps what finished), then ``gpu_tests.xml``, ``gpu_tests.log``, ``prefix_packing_cuda.json``,
``prefix_packing_cuda.md``, ``bench.log``, ``trainers.log``. The summary is printed at the end.

``--dry-run`` runs the same parts on CPU with the CUDA parts shrunk to tiny shapes (the CUDA tests skip with their
reason, the benchmark runs its quick point, the trainers run on CPU with ``auto``); ``tests/test_benchmarks.py`` runs
it. ``--parts bench,trainers`` re-runs only some parts (a short second GPU run).

On the lent GPU machine, from the repository root (see ../shared/gpu/README.md)::

    bash .gpu/run.sh make gpu-check
    bash .gpu/run.sh make gpu-check PARTS=bench,trainers
    make gpu-check DRY_RUN=1            # here, on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("tests", "bench", "trainers")
#: seconds per part on one H100 (measured there: see docs/prefix-packing.md); the sum, plus the ~10 s of run.sh's
#: installs, stays under 8 minutes
BUDGETS = {"tests": 180.0, "bench": 210.0, "trainers": 60.0}
#: a dry run's budgets are this many times the GPU ones (they only stop a hung part there)
DRY_RUN_SLACK = 5
#: each benchmark point's worker (both sides and the check, in one process) is stopped after this
BENCH_POINT_TIMEOUT = 100.0
TRAINERS = ("trinity", "chord", "cispo", "sapo", "ppo", "step_grpo")


# ------------------------------------------------------------------------------------------ processes
def run_part(command: list[str], log: Path, budget: float, env: dict | None = None) -> dict:
    """Run ``command`` in its own process group, its output to ``log``; stop the group after ``budget`` seconds."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        timed_out = False
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc)
    return {"returncode": proc.returncode, "timed_out": timed_out, "wall_s": time.perf_counter() - start}


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group that ``proc`` leads, then SIGKILL what is left after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int = 15) -> list[str]:
    if not path.is_file():
        return []
    return path.read_text(errors="replace").splitlines()[-lines:]


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
def part_tests(args, out: Path) -> dict:
    xml, log = out / "gpu_tests.xml", out / "gpu_tests.log"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rA", "-p", "no:cacheprovider"]
    command += [f"--junitxml={xml}", *args.test_paths]
    run = run_part(command, log, args.budget_tests)
    counts = junit_counts(xml)
    failed = [line for line in tail(log, 400) if line.startswith(("FAILED", "ERROR"))]
    if run["timed_out"]:
        status = "timeout"
    elif run["returncode"] == 0 or (run["returncode"] == 5 and counts.get("tests", 0) == 0):
        status = "passed"  # 5: nothing collected
    else:
        status = "failed"
    return {"status": status, **run, "counts": counts, "failures": failed[:20], "log_tail": tail(log)}


def junit_counts(path: Path) -> dict:
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    reasons: dict[str, int] = {}
    for case in suite.iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            reason = (skipped.get("message") or "").strip()[:120]
            reasons[reason] = reasons.get(reason, 0) + 1
    counts["skip_reasons"] = reasons
    return counts


def part_bench(args, out: Path) -> dict:
    name = "prefix_packing" if args.dry_run else "prefix_packing_cuda"
    log = out / "bench.log"
    # the report goes to $OUT, prefix_packing.py's default output (where the lent GPU machine sends files back from)
    command = [sys.executable, str(ROOT / "benchmarks" / "prefix_packing.py")]
    if args.dry_run:
        command += ["--quick", "--rollout", "fixed", "--same-process", "--timeout", str(args.bench_point_timeout)]
    else:
        command += ["--device", "cuda", "--bf16", "--timeout", str(args.bench_point_timeout)]
        if args.bench_points:
            command += ["--points", *args.bench_points]
        if args.optim:
            command += ["--optim", args.optim]
    run = run_part(command, log, args.budget_bench, env={"OUT": str(out)})
    report_path = out / f"{name}.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    points = []
    for r in (report or {}).get("results", []):
        c = r["comparison"]
        direct = c["equivalence"].get("direct") or {}
        points.append(
            {
                "point": f"{r['model']} P{r['prompt_len']}/C{r['completion_len']}/G{r['generations']}",
                "train_part_ratio": c.get("train_part_ratio"),
                "step_ratio": c.get("step_time_ratio"),
                "train_part_memory_ratio": c.get("train_part_memory_ratio"),
                "memory_ratio": c.get("memory_ratio"),
                "ours_train_part_s": c["ours"].get("train_part_s"),
                "trl_train_part_s": c["trl"].get("train_part_s"),
                "ours_step_s": c["ours"].get("step_s"),
                "trl_step_s": c["trl"].get("step_s"),
                "kernels": c["ours"].get("kernels"),
                "auto_verdicts": c["ours"].get("auto_verdicts"),
                "auto_log": c["ours"].get("auto_log", [])[:6],
                "calibration_cost": c.get("calibration_cost"),
                "equivalent": c["equivalence"]["equivalent"],
                "logps_rel_l2": direct.get("logps_rel_l2"),
                "logps_rtol": direct.get("logps_rtol"),
                "grads_rel_l2": direct.get("grads_rel_l2"),
                "grads_rtol": direct.get("grads_rtol"),
                "equivalence_error": direct.get("error"),
            }
        )
    failed = (report or {}).get("failed_points", [])
    missing = (report or {}).get("not_measured", [])
    if run["timed_out"]:
        status = "timeout"
    elif run["returncode"] != 0 or report is None or failed:
        status = "failed"
    elif not all(p["equivalent"] for p in points):
        status = "failed"
    else:
        status = "passed"
    return {
        "status": status,
        **run,
        "points": points,
        "failed_points": failed,
        "not_measured": missing,
        "summary": (report or {}).get("summary", {}),
        "log_tail": tail(log) if status != "passed" else [],
    }


def part_trainers(args, out: Path) -> dict:
    log = out / "trainers.log"
    with tempfile.TemporaryDirectory(prefix="gpu_check_trainers_") as tmp:
        results = Path(tmp) / "results.jsonl"
        command = [sys.executable, os.path.abspath(__file__), "--trainers-worker", str(results), "--work", tmp]
        command += ["--trainers", *args.trainers] + (["--dry-run"] if args.dry_run else [])
        run = run_part(command, log, args.budget_trainers)
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    done = {r["trainer"] for r in rows}
    for name in args.trainers:
        if name not in done:
            rows.append({"trainer": name, "ok": False, "error": "not run (the part was stopped or failed before)"})
    ok = all(r["ok"] for r in rows)
    status = "timeout" if run["timed_out"] else "passed" if ok and run["returncode"] == 0 else "failed"
    return {"status": status, **run, "trainers": rows, "log_tail": tail(log) if status != "passed" else []}


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
    from helpers import length_reward, save_tiny_model, tiny_grpo_kwargs

    from trinity_trl import trainers as t

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    cuda = not dry_run
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run on a CPU")
    model_dir = save_tiny_model(Path(work) / "model")
    system = "You are a careful assistant. Answer with the number only."
    prompts = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "system", "content": system}, {"role": "user", "content": f"What is {a}+{a + 1}?"}]
                for a in range(8)
            ],
            "answer": [str(2 * a + 1) for a in range(8)],
        }
    )
    expert = Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"What is {a}+1?"},
                    {"role": "assistant", "content": f"It is {a + 1}."},
                ]
                for a in range(8)
            ]
        }
    )
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
            config = t.ChordConfig(**kwargs, expert_batch_size=2, mu_peak=0.5, mu_valley=0.5)
            return t.ChordTrainer(**common, expert_dataset=expert, args=config)
        if name == "trinity":
            return t.TrinityTrainer(**common, args=t.TrinityConfig(**kwargs, algorithm="grpo"))
        config_cls, trainer_cls = {
            "cispo": (t.CISPOConfig, t.CISPOTrainer),
            "sapo": (t.SAPOConfig, t.SAPOTrainer),
            "ppo": (t.PPOConfig, t.PPOTrainer),
        }[name]
        return trainer_cls(**common, args=config_cls(**kwargs))

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "prefix packing" in text:
                messages.append(text)

    logging.getLogger("trinity_trl").addHandler(Collect(level=logging.INFO))
    for name in names:
        messages.clear()
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
                packing_log=list(dict.fromkeys(messages))[:6],
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
MET = {True: "PASS", False: "FAIL", None: "not measured"}


def targets(bench: dict | None) -> list[dict]:
    """Issue 34's targets (item 5) against the benchmark's summary."""
    s = (bench or {}).get("summary", {})
    rows = [
        (
            "training part, 1.5B P1024/C256/G8",
            "cuda_1.5b_1024_256_8_train_ratio",
            "<= 0.55x TRL",
            "cuda_1.5b_1024_256_8_met",
        ),
        (
            "training part, 1.5B P2048/C512/G8",
            "cuda_1.5b_2048_512_8_train_ratio",
            "<= 0.45x TRL",
            "cuda_1.5b_2048_512_8_met",
        ),
        (
            "training part with auto, every point (worst)",
            "cuda_worst_train_ratio",
            "<= 1.03x TRL",
            "cuda_never_loses_met",
        ),
        (
            "peak memory of the training part, P >= 1024 (worst)",
            "cuda_worst_memory_ratio_at_prompt_1024_plus",
            "<= 0.5x TRL",
            "cuda_memory_met",
        ),
    ]
    out = [{"target": a, "value": s.get(b), "bound": c, "met": s.get(d)} for a, b, c, d in rows]
    out.append(
        {
            "target": "auto's calibration, share of a 100-step run (estimate, worst point)",
            "value": s.get("cuda_worst_calibration_share_of_100_steps"),
            "bound": "<= 3%",
            "met": None
            if s.get("cuda_worst_calibration_share_of_100_steps") is None
            else s["cuda_worst_calibration_share_of_100_steps"] <= 0.03,
        }
    )
    return out


def fmt(value, spec=".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(summary: dict) -> str:
    env, parts = summary["environment"], summary["parts"]
    lines = [
        f"# gpu-check{' (DRY RUN on CPU: tiny shapes, CUDA parts skipped)' if summary['dry_run'] else ''}",
        "",
        f"Device: {env.get('gpu') or 'CPU'}"
        + (f" ({env['gpu_memory_gib']} GiB, capability {env.get('capability')})" if env.get("gpu") else "")
        + f"; torch {env.get('torch')}, transformers {env.get('transformers')}, trl {env.get('trl')}. "
        f"Command: `{summary['command']}`. Total {summary['total_wall_s']:.0f} s.",
        "",
        "Imports: " + ", ".join(f"{k} {v}" for k, v in (env.get("imports") or {}).items()),
        "",
        "| part | status | wall (s) | budget (s) |",
        "|---|---|---|---|",
    ]
    for name in summary["requested_parts"]:
        p = parts.get(name, {"status": "not run yet"})
        lines.append(f"| {name} | {p['status']} | {fmt(p.get('wall_s'), '.0f')} | {fmt(p.get('budget_s'), '.0f')} |")
    tests = parts.get("tests")
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
    bench = parts.get("bench")
    if bench:
        lines += [
            "",
            "Benchmark (ours / TRL; part = the loss's forward+backward; step = the whole optimizer step):",
            "",
            "| point | part ratio | step ratio | part memory ratio | kernels | auto verdicts | equivalent "
            "(logps / grads rel. L2, tol) |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in bench["points"]:
            verdicts = p.get("auto_verdicts")
            lines.append(
                f"| {p['point']} | {fmt(p['train_part_ratio'])} | {fmt(p['step_ratio'])} "
                f"| {fmt(p['train_part_memory_ratio'])} "
                f"| {', '.join(f'{k} x{n}' for k, n in (p.get('kernels') or {}).items()) or '-'} "
                f"| {'; '.join(f'{k}: {v}' for k, v in verdicts.items()) if verdicts else auto_log(p)} "
                f"| {'yes' if p['equivalent'] else 'NO'} ({fmt(p['logps_rel_l2'], '.1e')} / "
                f"{fmt(p['grads_rel_l2'], '.1e')}, {fmt(p['logps_rtol'], '.1e')} / {fmt(p['grads_rtol'], '.1e')}) |"
            )
        for p in bench["points"]:
            if p.get("equivalence_error"):
                lines.append(f"- {p['point']}: the equivalence check broke: {p['equivalence_error'][-300:]}")
        for f in bench.get("failed_points", []):
            lines.append(f"- FAILED {f['point']}: {f['error'][-300:]}")
        if bench.get("not_measured"):
            lines.append(f"- not measured: {bench['not_measured']}")
        lines += ["", "Targets (issue 34 item 5):", ""]
        for t in summary["targets"]:
            lines.append(f"- {t['target']}: {fmt(t['value'])} ({t['bound']}): {MET[t['met']]}")
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


def auto_log(point: dict) -> str:
    """``auto``'s log lines of a point, where its calibration could not be read (a report cell)."""
    lines = [line.replace("|", "/") for line in point.get("auto_log") or []]
    return "; ".join(lines)[:300] or "-"


def write_summary(out: Path, summary: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "gpu_check.md").write_text(markdown(summary))


# -------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="on CPU: tiny shapes, the CUDA tests skip")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT, else a temp one)")
    for name in PARTS:
        parser.add_argument(
            f"--budget-{name}",
            type=float,
            help=f"seconds (default {BUDGETS[name]:.0f}; {DRY_RUN_SLACK}x that in a dry run, on a shared CPU)",
        )
    parser.add_argument("--bench-point-timeout", type=float, help=f"default {BENCH_POINT_TIMEOUT:.0f} s (5x dry)")
    parser.add_argument("--bench-points", nargs="+", metavar="MODEL:P:C:G", help="instead of the issue's points")
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
    if args.bench_point_timeout is None:
        args.bench_point_timeout = BENCH_POINT_TIMEOUT * (DRY_RUN_SLACK if args.dry_run else 1)
    requested = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(requested) - set(PARTS))
    if unknown or not requested:
        parser.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}, got {args.parts!r}")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    env = environment()
    command = " ".join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    summary = {
        "command": command,
        "dry_run": args.dry_run,
        "environment": env,
        "requested_parts": requested,
        "parts": {},
        "targets": targets(None),
        "out": str(out),
        "total_wall_s": 0.0,
    }
    write_summary(out, summary)
    runners = {"tests": part_tests, "bench": part_bench, "trainers": part_trainers}
    budgets = {"tests": args.budget_tests, "bench": args.budget_bench, "trainers": args.budget_trainers}
    for name in requested:
        if not args.dry_run and not env.get("cuda"):
            reason = env.get("error", "torch.cuda.is_available() is False")[-300:]
            result = {"status": "no CUDA", "reason": f"no CUDA device: {reason}", "wall_s": 0.0}
        else:
            print(f"[gpu-check] {name}: budget {budgets[name]:.0f} s", flush=True)
            try:
                result = runners[name](args, out)
            except Exception as err:  # a broken part is reported; the next part runs
                result = {"status": "failed", "error": f"{type(err).__name__}: {err}", "wall_s": None}
        result["budget_s"] = budgets[name]
        summary["parts"][name] = result
        if name == "bench":
            summary["targets"] = targets(result)
        summary["total_wall_s"] = time.perf_counter() - started
        write_summary(out, summary)
        print(f"[gpu-check] {name}: {result['status']} ({fmt(result.get('wall_s'), '.0f')} s)", flush=True)
    print(markdown(summary))
    print(f"[gpu-check] results in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0 if all(p["status"] == "passed" for p in summary["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
