"""What the pre-registered learning studies share (``learning_study.py``, issue 45; ``gigpo_study.py`` and
``m2po_study.py``, issue 55): the plan's fingerprint, the runs file and resuming it, running it (each run a fresh
process through `harness`, the base model first), the tuning rule, the order of the runs, the paired tests over
seeds with Holm's correction, the summary's shared lines and tables and the run set-up (LoRA, training arguments,
validation problems). `Study` gives a study its module-level entry points (the launcher runs ``<study>:run_side``).

The tuning seed runs each arm over the learning-rate grid (validation problems or games, never the held-out ones); an
optimum on the grid's edge extends the grid past that edge (at most ``max_extensions`` times per arm). The scored
seeds then run every arm at its rate, seed after seed, so that an interrupted study leaves whole seeds. ``summarise``
computes the pre-registered tests (a paired t over the scored seeds reached, Holm-corrected, with 95 % intervals)
and the descriptive tables from whatever runs are finished.

A study's plan is a dict with at least ``arms``, ``primary`` (two arms), ``secondary`` (pairs of arms), ``alpha``,
``confidence``, ``tune_seed``, ``scored_seeds``, ``grid``, ``grid_factor`` and ``max_extensions``. Its runs are JSON
lines ``{"plan": fingerprint, "arm", "seed", "lr", "role": "base" | "tune" | "scored", "val", ...}``; a run recorded
under another fingerprint is never resumed or summarised.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import bench_common as bc
import seed_stats

RUNS_FILE = "runs.jsonl"  # a study's runs, in its folder


def plan_key(plan: dict) -> str:
    """The plan's fingerprint: runs are kept under it."""
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()[:12]


def load_runs(path: Path, key: str) -> list[dict]:
    if not path.is_file():
        return []
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if r["plan"] == key]


class RunsFile:
    """The runs of one plan in ``path`` (JSON lines), appended as each finishes."""

    def __init__(self, path: Path, plan: dict):
        self.path, self.key = path, plan_key(plan)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.records = load_runs(path, self.key)

    def append(self, record: dict) -> None:
        record = {"plan": self.key, **record, "load_average": bc.loadavg(), "finished": time.strftime("%Y-%m-%d %H:%M")}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)


def finished(records: list[dict], arm: str, seed: int | None, lr: float | None) -> dict | None:
    return next((r for r in records if (r["arm"], r["seed"], r["lr"]) == (arm, seed, lr)), None)


def tuning(records: list[dict], plan: dict, arm: str) -> dict:
    """The arm's tuning so far: ``{grid, val, lr, next, at_edge}``. ``next`` is the rate still to run (the grid's
    values in order, then an extension past the edge the best value sits on), ``None`` once tuning is done; ``lr``
    is the best validation value's rate (a tie goes to the lower rate)."""
    grid = list(plan["grid"])
    runs = {r["lr"]: r["val"] for r in records if r["arm"] == arm and r["seed"] == plan["tune_seed"]}
    for lr in grid:
        if lr not in runs:
            return {"grid": grid, "val": runs, "lr": None, "next": lr, "at_edge": None}
    extensions = 0
    while True:
        best = max(sorted(grid), key=lambda lr: runs[lr])  # max keeps the first of equals: the lower rate
        low, high = min(grid), max(grid)
        edge = "low" if best == low else "high" if best == high else None
        if edge is None or extensions == plan["max_extensions"]:
            return {"grid": sorted(grid), "val": runs, "lr": best, "next": None, "at_edge": edge}
        beyond = _rate(low / plan["grid_factor"] if edge == "low" else high * plan["grid_factor"])
        grid.append(beyond)
        extensions += 1
        if beyond not in runs:
            return {"grid": sorted(grid), "val": runs, "lr": None, "next": beyond, "at_edge": edge}


def _rate(value: float) -> float:
    return float(f"{value:.6g}")  # 1e-4 / 3 -> 3.33333e-05, the same float on every call


def planned_runs(plan: dict) -> int:
    """Runs of the plan, its grid not extended (each extension adds one)."""
    return len(plan["arms"]) * (len(plan["grid"]) + len(plan["scored_seeds"]))


def run_in_order(records: list[dict], plan: dict, run: Callable[[str, int, float, str], bool]) -> bool:
    """Run what is missing, in the pre-registered order: the tuning seed (arm after arm at each grid value, then the
    extensions past an edge), then the scored seeds one after the other, every arm of a seed before the next seed, so
    that an interrupted study leaves whole seeds. ``run(arm, seed, lr, role)`` runs one and records it in
    ``records``; it returns False to stop the study (e.g. a spent budget). Returns whether the study is complete."""
    while True:
        pending = [(arm, t["next"]) for arm in plan["arms"] if (t := tuning(records, plan, arm))["next"] is not None]
        if not pending:
            break
        arm, lr = min(pending, key=lambda p: plan["grid"].index(p[1]) if p[1] in plan["grid"] else 99)
        if not run(arm, plan["tune_seed"], lr, "tune"):
            return False
    rates = {arm: tuning(records, plan, arm)["lr"] for arm in plan["arms"]}
    print(f"rates: {rates}", flush=True)
    for seed in plan["scored_seeds"]:
        for arm in plan["arms"]:
            if finished(records, arm, seed, rates[arm]) is None and not run(arm, seed, rates[arm], "scored"):
                return False
    return True


class Study:
    """A study's module-level entry points (`entry_points`) over its ``plan``, ``summarise(records, plan)`` and
    ``markdown(summary)``: ``name`` is its module and its results' file name (``<name>.{json,md}``); `run_side` calls
    ``run_arm`` and ``evaluate_base`` (with ``task_data(plan)`` where given); ``probe(out, plan, model, steps)`` is its
    last subcommand (e.g. ``measure``, ``--steps`` default ``steps``); ``outcome``: see `run_study`."""

    def __init__(
        self,
        name: str,
        doc: str,
        plan: dict,
        summarise: Callable,
        markdown: Callable,
        run_arm: Callable,
        evaluate_base: Callable,
        probe: Callable,
        *,
        task_data: Callable | None = None,
        outcome: Callable | None = None,
        steps: int = 10,
    ):
        self.name, self.description, self.plan = name, doc.split("\n\n")[0], plan
        self.summarise, self.markdown, self.run_arm, self.evaluate_base = summarise, markdown, run_arm, evaluate_base
        self.probe, self.task_data, self.outcome, self.steps = probe, task_data, outcome, steps

    def entry_points(self) -> tuple:
        """``plan_key, run_side, run_study, status, write_summary, main`` (the launcher runs ``<name>:run_side``)."""
        return self.plan_key, self.run_side, self.run_study, self.status, self.write_summary, self.main

    def plan_key(self, plan: dict | None = None) -> str:
        """The plan's fingerprint: runs are kept under it."""
        return plan_key(self.plan if plan is None else plan)

    def run_side(self, spec: dict) -> dict:
        """One run in its own process (a `harness.Side` of `run_study`): ``run_arm(arm, model, seed, lr, plan,
        [data,] tmp, validate=...)``, or, for the arm ``"base"``, ``evaluate_base(model, tokenizer, plan[, data])`` on
        the untrained model (its CPU time added as ``eval_cpu_s``); ``data``: ``task_data(plan)`` where the study has
        one."""
        import tempfile

        quiet_run()
        plan, model = spec["plan"], spec["model"]
        data = () if self.task_data is None else (self.task_data(plan),)
        if spec["arm"] == "base":
            from transformers import AutoModelForCausalLM, AutoTokenizer

            cpu = time.process_time()
            loaded = AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
            return {**self.evaluate_base(*loaded, plan, *data), "eval_cpu_s": time.process_time() - cpu}
        with tempfile.TemporaryDirectory(prefix="seeded_study_") as tmp:
            arm, validate = spec["arm"], spec["role"] == "tune"
            return self.run_arm(arm, model, spec["seed"], spec["lr"], plan, *data, Path(tmp), validate=validate)

    def run_study(self, out: Path, plan: dict | None = None, model_override: str | None = None, launcher=None) -> int:
        """Run what is missing of the plan (`run_in_order`, the base model first), each run in a fresh process through
        ``launcher`` (`harness.Launcher`; tests give one that runs in-process) calling `run_side` with ``{arm, seed,
        lr, role, plan, model}``, until the study is complete or its CPU budget (``cpu_budget_h``, where the plan has
        one) is spent; a run that fails or passes ``run_timeout_h`` stops the study (a restart tries it again).
        ``outcome(result)``: the run's figure for the progress line (default: the held-out accuracy)."""
        import harness

        plan, model = self.plan if plan is None else plan, model_override or bundled_model()
        runs_file = RunsFile(out / RUNS_FILE, plan)
        records = runs_file.records
        print(f"plan {runs_file.key}: {len(records)} records in {runs_file.path}; load {bc.loadavg()}", flush=True)
        launcher = launcher or harness.Launcher(preload=("torch", "transformers", "trl"))
        budget_h = plan.get("cpu_budget_h")
        outcome = self.outcome or (lambda result: f"held-out {result['points'][-1]['all']:.3f}")

        def run(arm: str, seed: int | None, lr: float | None, role: str) -> bool:
            spent_h = sum(r.get("train_cpu_s", 0) + r.get("eval_cpu_s", 0) for r in records) / 3600
            if budget_h is not None and spent_h >= budget_h:
                print(f"CPU budget of {budget_h} h spent ({spent_h:.2f} h): stopping", flush=True)
                return False
            name = f"{role} seed {seed} {arm} lr {lr if lr is None else f'{lr:g}'}"
            print(f"[{name}]: started {time.strftime('%H:%M')}", flush=True)
            spec = {"arm": arm, "seed": seed, "lr": lr, "role": role, "plan": plan, "model": model}
            timeout_s = plan.get("run_timeout_h", 24.0) * 3600
            result = launcher.run(harness.Side(name, f"{self.name}:run_side", spec), timeout_s, out / "runs.log")
            if "error" in result:
                print(f"[{name}]: {result['error']}; stopping (output in {out / 'runs.log'})", flush=True)
                return False
            result.pop("process_wall_s", None)
            runs_file.append({"arm": arm, "seed": seed, "lr": lr, "role": role, **result})
            cost = f"{result.get('train_cpu_s', 0):.0f} CPU s training + {result['eval_cpu_s']:.0f} evaluating"
            validation = bc.fmt(result.get("val"))
            print(f"[{name}]: {outcome(result)}, validation {validation}, {cost}, load {bc.loadavg()}", flush=True)
            return True

        if finished(records, "base", None, None) is None and not run("base", None, None, "base"):
            return 0
        if run_in_order(records, plan, run):
            print("study complete", flush=True)
        return 0

    def status(self, out: Path, plan: dict | None = None) -> str:
        """What ``status`` prints for the study's folder ``out``."""
        plan = self.plan if plan is None else plan
        records = load_runs(out / RUNS_FILE, plan_key(plan))
        budget = f" of the {plan['cpu_budget_h']} h budget" if "cpu_budget_h" in plan else ""
        return "\n".join(status_lines(records, self.summarise(records, plan), plan, budget))

    def write_summary(self, runs_path: Path, to: Path, plan: dict | None = None) -> dict:
        """``<name>.json`` / ``.md`` in ``to`` from ``runs_path``, and the runs file copied beside them as
        ``<name>_runs.jsonl``."""
        plan = self.plan if plan is None else plan
        records = load_runs(runs_path, plan_key(plan))
        summary = self.summarise(records, plan)
        to.mkdir(parents=True, exist_ok=True)
        target = to / f"{self.name}_runs.jsonl"
        if runs_path.resolve() != target.resolve():
            shutil.copyfile(runs_path, target)
        (to / f"{self.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
        (to / f"{self.name}.md").write_text(self.markdown(summary))
        return summary

    def main(self, argv: list[str] | None = None) -> int:
        """The ``run`` / ``status`` / ``summarise`` / probe subcommands."""
        import argparse
        import os

        import harness

        probe = self.probe.__name__
        parser = argparse.ArgumentParser(description=self.description)
        sub = parser.add_subparsers(dest="command", required=True)
        for command_name in ("run", "status", "summarise", probe):
            command = sub.add_parser(command_name)
            command.add_argument("--out", required=True, help="the study's folder (runs.jsonl), outside the repository")
            if command_name == "summarise":
                command.add_argument("--to", required=True, help=f"where {self.name}.{{json,md}} and the runs file go")
            if command_name == probe:
                command.add_argument("--steps", type=int, default=self.steps)
            if command_name in ("run", probe):
                command.add_argument("--model", default=None, help="a model folder instead of the bundled one (tests)")
        args = parser.parse_args(argv)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        out = Path(args.out)
        if args.command == "run":
            harness.autogroup_as_niced()
            return self.run_study(out, self.plan, args.model)
        if args.command in ("status", "summarise"):
            summarise = args.command == "summarise"
            print(self.markdown(self.write_summary(out / RUNS_FILE, Path(args.to))) if summarise else self.status(out))
            return 0
        return self.probe(out, self.plan, args.model, args.steps)


# ------------------------------------------------------------------------------------------ summary
def scored_runs(records: list[dict], plan: dict) -> tuple[dict, dict, list[int]]:
    """``(tuning per arm, {arm: {seed: scored run at the arm's rate}}, the scored seeds every arm finished)``."""
    rates = {arm: tuning(records, plan, arm) for arm in plan["arms"]}
    scored = {
        arm: {
            r["seed"]: r for r in records if r["arm"] == arm and r["role"] == "scored" and r["lr"] == rates[arm]["lr"]
        }
        for arm in plan["arms"]
    }
    complete = [s for s in plan["scored_seeds"] if all(s in scored[arm] for arm in plan["arms"])]
    return rates, scored, complete


def summary(records: list[dict], plan: dict, outcome: Callable, extra: dict, arm_fields: Callable, base: Callable):
    """A study's summary of its finished runs: the fingerprint, the complete seeds, whether the study is partial (a
    seed missing or tuning unfinished), runs done and planned (the grid's extensions counted), the pre-registered
    tests (`paired_tests` of ``outcome`` and ``extra``), per arm its rate, tuning, seeds, optimizer steps and
    ``arm_fields(runs, base_run)`` of its scored runs, ``base(run)`` of the base model's run, the CPU seconds of every
    run and, where the plan has a CPU budget, whether it is spent."""
    rates, scored, complete = scored_runs(records, plan)
    base_run = next((r for r in records if r["arm"] == "base"), None)
    arms = {}
    for arm in plan["arms"]:
        runs = [scored[arm][s] for s in sorted(scored[arm])]
        arms[arm] = {"lr": rates[arm]["lr"], "tuning": rates[arm], "seeds": sorted(scored[arm])}
        arms[arm] |= {"optimizer_steps": sorted({r["optimizer_steps"] for r in runs}), **arm_fields(runs, base_run)}
    total = sum(r.get("train_cpu_s", 0) + r.get("eval_cpu_s", 0) for r in records)
    out = {
        "plan": plan,
        "plan_key": plan_key(plan),
        "complete_seeds": complete,
        "partial": len(complete) < len(plan["scored_seeds"]) or any(t["next"] is not None for t in rates.values()),
        "runs_done": sum(r["arm"] != "base" for r in records),
        "runs_planned": planned_runs(plan) + sum(len(t["grid"]) - len(plan["grid"]) for t in rates.values()),
        "tests": paired_tests(plan, scored, outcome, extra),
        "arms": arms,
        "base": None if base_run is None else base(base_run),
        "cpu_s": total,
    }
    if "cpu_budget_h" in plan:
        out["budget_spent"] = total / 3600 >= plan["cpu_budget_h"]
    return out


def final(run: dict) -> dict:
    """A run's last evaluation point."""
    return run["points"][-1]


def header_lines(summary: dict, title: str, plan_file: str) -> list[str]:
    """The summary's title, the PARTIAL banner while the study is partial, and the plan line."""
    plan, seeds = summary["plan"], summary["complete_seeds"]
    lines, arms = [f"# {title}", ""], {2: "both arms", 3: "all three arms"}[len(plan["arms"])]
    if summary["partial"]:
        lines += [
            f"**PARTIAL: {len(seeds)} of {len(plan['scored_seeds'])} scored seeds complete** ({arms}), "
            f"{summary['runs_done']} of about {summary['runs_planned']} runs. The study is not finished; these are the "
            "intervals over the seeds reached, not its result.",
            "",
        ]
        if summary.get("budget_spent"):
            lines += [f"The CPU budget ({plan['cpu_budget_h']} h of one core) is spent: the study stops here.", ""]
    return lines + [
        f"Plan `{summary['plan_key']}` (`{plan_file}`, committed before the first scored run). CPU time of "
        f"the finished runs: {summary['cpu_s'] / 3600:.1f} h of one core.",
        "",
    ]


def paired_tests(plan: dict, scored: dict, outcome: Callable[[dict], float], extra: dict | None = None) -> dict:
    """The pre-registered tests: per comparison (``primary``, ``secondary 1``, ...), the per-seed differences of
    ``outcome(run)`` over the seeds both arms reached, a paired t with its interval, Holm's adjusted p over the
    comparisons and whether it is below ``alpha``. ``extra``: ``{name: value(run)}`` of descriptive differences
    (the same seeds, a paired t each, not in the family)."""
    tests = {}
    comparisons = {"primary": plan["primary"], **{f"secondary {i + 1}": c for i, c in enumerate(plan["secondary"])}}
    for name, (a, b) in comparisons.items():
        seeds = [s for s in plan["scored_seeds"] if s in scored[a] and s in scored[b]]
        diffs = [outcome(scored[a][s]) - outcome(scored[b][s]) for s in seeds]
        tests[name] = {"arms": [a, b], "seeds": seeds, "diffs": diffs, **seed_stats.paired_t(diffs, plan["confidence"])}
        for label, value in (extra or {}).items():
            more = [value(scored[a][s]) - value(scored[b][s]) for s in seeds]
            tests[name][label] = {"diffs": more, **seed_stats.paired_t(more, plan["confidence"])}
    adjusted = seed_stats.holm({name: t["p"] for name, t in tests.items()})
    for name, test in tests.items():
        test["p_holm"] = adjusted[name]
        test["significant"] = None if test["p_holm"] is None else test["p_holm"] < plan["alpha"]
    return tests


def spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def cell(row: dict | None, spec: str = ".3f") -> str:
    if row is None:
        return "n/a"
    return f"{row['mean']:{spec}} ± {row['std']:{spec}}" if row["n"] > 1 else f"{row['mean']:{spec}}"


def interval(t: dict) -> str:
    return "n/a" if t["low"] is None else f"[{t['low']:+.3f}, {t['high']:+.3f}]"


def test_lines(heading: str, tests: dict, labels: dict) -> list[str]:
    """The pre-registered tests' section: its ``heading`` and a table row per test."""
    lines = [f"## {heading}", "", "| test | seeds | per-seed differences | mean | 95 % interval | p | p (Holm) |"]
    lines.append("|---|---|---|---|---|---|---|")
    for name, t in tests.items():
        a, b = (labels[x] for x in t["arms"])
        lines.append(
            f"| {name}: {a} minus {b} | {len(t['seeds'])} | {', '.join(f'{d:+.3f}' for d in t['diffs'])} | "
            f"{bc.fmt(t['mean'], '+.3f')} | {interval(t)} | {bc.fmt(t['p'], '.3f')} | {bc.fmt(t['p_holm'], '.3f')} |"
        )
    return lines


def descriptive_lines(text: str, tests: dict, keys: list[str]) -> list[str]:
    """The descriptive differences ``keys`` of each test (`paired_tests`'s ``extra``): a table after ``text``, with a
    column naming the key when there are several."""
    grouped = len(keys) > 1
    lines = ["", f"Descriptive, not tested: {text}", ""]
    lines += ["| comparison | group | mean | 95 % interval |" if grouped else "| comparison | mean | 95 % interval |"]
    lines += ["|---|---|---|---|" if grouped else "|---|---|---|"]
    for name, t in tests.items():
        for key in keys:
            group = f" {key} |" if grouped else ""
            lines.append(f"| {name} |{group} {bc.fmt(t[key]['mean'], '+.3f')} | {interval(t[key])} |")
    return lines


def arm_table(arms: dict, labels: dict, columns: list[str], cells: Callable[[dict], list], rates=False) -> list[str]:
    """A table with a row per arm: its label, then ``cells(arm's summary)`` under ``columns`` (with ``rates``, first
    its rate, scored seeds and optimizer steps)."""
    lead = ["rate", "seeds", "optimizer steps"] if rates else []
    lines = ["| arm | " + " | ".join(lead + columns) + " |", "|---|" + "---|" * len(lead + columns)]
    for arm, s in arms.items():
        row = ([bc.fmt(s["lr"], "g"), len(s["seeds"]), s["optimizer_steps"]] if rates else []) + cells(s)
        lines.append(f"| {labels[arm]} | " + " | ".join(map(str, row)) + " |")
    return lines


def cost_lines(arms: dict, labels: dict, evaluating: str = "scoring", extra: dict | None = None) -> list[str]:
    """The Cost section: training and evaluating CPU seconds per run of each arm, then ``extra`` columns (``{column:
    cell(arm's summary)}``)."""
    extra = extra or {}
    columns = ["training CPU s / run", f"{evaluating} CPU s / run", *extra]

    cells = [lambda s: cell(s["train_cpu_s_per_run"], ".0f"), lambda s: cell(s["eval_cpu_s_per_run"], ".0f")]
    cells += extra.values()
    return ["", "## Cost", ""] + arm_table(arms, labels, columns, lambda s: [value(s) for value in cells])


def tuning_lines(arms: dict, plan: dict, labels: dict, what: str) -> list[str]:
    """The Tuning section: per arm its validation ``what`` at each rate and the rate chosen (or that tuning is
    unfinished)."""
    lines = ["", f"## Tuning (validation {what} on the tuning seed)", ""]
    for arm, s in arms.items():
        t = s["tuning"]
        values = ", ".join(f"{lr:g}: {bc.fmt(t['val'].get(lr))}" for lr in t["grid"])
        state = (
            "unfinished"
            if t["next"] is not None
            else f"chose {t['lr']:g}"
            + (f" (still on the {t['at_edge']} edge after {plan['max_extensions']} extensions)" if t["at_edge"] else "")
        )
        lines.append(f"- {labels[arm]}: {values}; {state}.")
    return lines


def status_lines(records: list[dict], summary: dict, plan: dict, budget: str = "") -> list[str]:
    """What ``status`` prints: runs done and planned, complete seeds, CPU time, each arm's tuning and seeds, the last
    run and the time the rest takes at the pace so far."""
    runs = [r for r in records if r["arm"] != "base"]
    cpu = sum(r["train_cpu_s"] + r["eval_cpu_s"] for r in runs)
    lines = [
        f"plan {summary['plan_key']}: {summary['runs_done']} of about {summary['runs_planned']} runs done; "
        f"{len(summary['complete_seeds'])} of {len(plan['scored_seeds'])} scored seeds complete",
        f"CPU time of the finished runs: {cpu / 3600:.2f} h{budget} ({cpu / max(1, len(runs)):.0f} s a run)",
    ]
    for arm, s in summary["arms"].items():
        t = s["tuning"]
        lines.append(f"  {arm}: tuning {t['val']} -> {t['lr']}; scored seeds {s['seeds']}")
    if runs:
        last = runs[-1]
        lines.append(f"last finished: {last['arm']} seed {last['seed']} lr {last['lr']:g} at {last.get('finished')}")
        # runs left and the wall time they take at the pace so far (the median time between finished runs)
        stamps = [datetime.datetime.strptime(r["finished"], "%Y-%m-%d %H:%M") for r in records if r.get("finished")]
        gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
        if gaps:
            left, pace = summary["runs_planned"] - summary["runs_done"], statistics.median(gaps)
            wall = f"about {left * pace / 3600:.1f} h of wall time"
            lines.append(f"{left} runs left; at the median {pace / 60:.0f} min a run so far, {wall}")
    return lines


def bundled_model() -> str:
    """The bundled SmolLM2-135M-Instruct's directory (the studies' model)."""
    from trinity_trl.data import bundled_model_dir

    return str(bundled_model_dir())


def quiet_run() -> None:
    """A study run's process: one torch thread, no warnings, transformers' errors only."""
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


# ------------------------------------------------------------------------------------------ run set-up
# (on the CPU, in float32; from the plan's ``lora_r``, ``val_rows`` and ``prompt_style``)
def lora_config(plan: dict):
    from peft import LoraConfig

    r = plan["lora_r"]
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", task_type="CAUSAL_LM")


def common_config(seed: int, output_dir: str, steps: int, lr: float) -> dict:
    """The training arguments every study run shares."""
    config = {"output_dir": output_dir, "use_cpu": True, "bf16": False, "activation_checkpointing": False}
    config |= {"max_steps": steps, "learning_rate": lr, "lr_scheduler_type": "constant", "report_to": "none"}
    config |= {"save_strategy": "no", "logging_steps": 1, "seed": seed, "dataloader_num_workers": 0}
    return config | {"disable_tqdm": True}


def validation_set(plan: dict, data: dict):
    """``plan["val_rows"]`` training-split problems that are neither RL prompts nor demonstrations, the templates
    taking turns (for choosing the learning rate; the held-out split is never used for it)."""
    from datasets import Dataset

    from trinity_trl.data.arithmetic import TEMPLATES, make_problems

    def text(prompt) -> str:
        return prompt[-1]["content"]

    used = {text(p) for p in data["train"]["prompt"]} | {text(p) for p in data["expert"]["prompt"]}
    val_rows = plan["val_rows"]
    pool = make_problems("train", 4 * val_rows + 40, 2, prompt_style=plan["prompt_style"])
    by_kind = {k: [r for r in pool if r["kind"] == k and text(r["prompt"]) not in used] for k in TEMPLATES}
    rows = [by_kind[k][i] for i in range(4 * val_rows) for k in TEMPLATES if i < len(by_kind[k])]
    if len(rows) < val_rows:
        raise ValueError(f"only {len(rows)} validation problems apart from the training rows")
    return Dataset.from_list(rows[:val_rows])


def timed_generation(trainer, seconds: list[float]) -> None:
    """Add the CPU seconds of each of ``trainer``'s rollout generations (TRL's single-turn generation) to
    ``seconds[0]`` (the trainer's own method, wrapped on this instance only)."""
    generate = trainer._generate_single_turn

    def timed(*a, **kw):
        cpu = time.process_time()
        try:
            return generate(*a, **kw)
        finally:
            seconds[0] += time.process_time() - cpu

    trainer._generate_single_turn = timed


def train(trainer) -> tuple[float, float, list[dict]]:
    """``trainer.train()`` without its printed logs: its wall and CPU seconds and its per-step logs."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]


def greedy_completions(model, tokenizer, dataset, plan: dict) -> list:
    """The greedy completions of ``dataset``'s problems (``plan["eval_max_new_tokens"]`` tokens at most)."""
    from trinity_trl.data import evaluate_accuracy

    max_new_tokens = plan["eval_max_new_tokens"]
    kwargs = {"batch_size": 50, "max_new_tokens": max_new_tokens, "progress": False, "return_completions": True}
    return evaluate_accuracy(model, tokenizer, dataset, **kwargs)[1]
