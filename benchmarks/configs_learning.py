"""Does each bundled ``*_cpu`` config learn what it claims? Run it as a user would and record its held-out metric.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/configs_learning.py cispo_cpu
    python benchmarks/configs_learning.py step_grpo_cpu --label calculator -- --environment calculator

Each run is ``trinity-trl <recipe> --config <config> [overrides]`` in a subprocess (into a scratch output folder),
then one line appended to ``results/configs_learning.jsonl``: held-out greedy accuracy before and after training
(arithmetic configs), or the mean episode reward of the first and last quarter of the steps (step_grpo configs,
which have no held-out evaluation), steps, seconds per step, wall time and the load average before and after.
``results/configs_learning.md`` is rewritten from all lines each time. Accuracy does not depend on the load;
seconds do (the machine is shared: compare them only with the load average beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common

RESULTS = bench_common.ROOT / "benchmarks" / "results"
JSONL = RESULTS / "configs_learning.jsonl"
MARKDOWN = RESULTS / "configs_learning.md"


def recipe_of(config: str) -> str:
    sys.path.insert(0, str(bench_common.ROOT))
    from trinity_trl.recipes import config_summary

    return config_summary(config)["recipe"]


def reward_quarters(log_history: list[dict]) -> tuple[float, float, float]:
    """Mean reward of the first and last quarter of the logged steps, and the fraction of steps with any
    reward spread within a group."""
    rewards = [entry["reward"] for entry in log_history if "reward" in entry]
    spread = [entry.get("reward_std", 0.0) for entry in log_history if "reward" in entry]
    quarter = max(1, len(rewards) // 4)
    first = sum(rewards[:quarter]) / quarter
    last = sum(rewards[-quarter:]) / quarter
    return first, last, sum(s > 0 for s in spread) / max(1, len(spread))


def run(config: str, label: str, overrides: list[str], note: str) -> dict:
    recipe = recipe_of(config)
    out = tempfile.mkdtemp(prefix=f"configs_learning_{label}_")
    command = [sys.executable, "-m", "trinity_trl.cli", recipe, "--config", config, "--output_dir", out]
    command += ["--overwrite_output_dir", "true", "--plot", "false", *overrides]
    load_before = bench_common.loadavg()
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    shown = " ".join(["trinity-trl", recipe, "--config", config, *overrides])
    record = {"config": config, "label": label, "command": shown, "returncode": proc.returncode}
    record |= {"wall_s": round(wall, 1), "loadavg_before": load_before, "loadavg_after": bench_common.loadavg()}
    record |= {"omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "niceness": bench_common.niceness()}
    record |= {"cpu": bench_common.cpu_model(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")}
    record["note"] = note
    if proc.returncode != 0:
        record["error"] = proc.stderr[-2000:]
        return record
    with open(os.path.join(out, "training_log.json"), encoding="utf-8") as f:
        log = json.load(f)
    summary, history = log["summary"], log["log_history"]
    steps = summary["global_step"]
    runtime = next((e["train_runtime"] for e in history if "train_runtime" in e), None)
    record.update(steps=steps, s_per_step=round(runtime / steps, 1) if runtime and steps else None)
    if summary.get("accuracy_before") is not None:
        record.update(metric="held-out accuracy", before=summary["accuracy_before"], after=summary["accuracy_after"])
    else:
        first, last, spread = reward_quarters(history)
        record.update(metric="mean reward, first/last quarter of steps", before=round(first, 3), after=round(last, 3))
        record["steps_with_reward_spread"] = round(spread, 3)
    record["closing_lines"] = [line for line in proc.stdout.splitlines() if line.startswith("[trinity-trl]")][-3:]
    return record


def write_markdown(jsonl=JSONL, markdown=MARKDOWN) -> None:
    records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    lines = [
        "# Does each bundled CPU config learn what it claims?",
        "",
        "Written by `benchmarks/configs_learning.py` from `configs_learning.jsonl` (every run, newest last). Each",
        "run is the config as shipped (plus the overrides shown) through `trinity-trl`, with `OMP_NUM_THREADS=1` and",
        "`nice -n 5` on a 2-core machine shared with other work; the load average (1 min, before -> after) is",
        "beside each time. Held-out accuracy: greedy, exact answer; it does not depend on the load, seconds do.",
        "step_grpo configs have no held-out evaluation: their metric is the mean episode reward of the first and",
        "last quarter of the steps (and the share of steps where some group's rewards differed).",
        "",
        "| config | command | metric | before | after | steps | s/step | wall s | load | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("returncode"):
            cells = [r["config"], f"`{r['command']}`", "failed", "", "", "", "", str(r["wall_s"]), "", r["note"]]
        else:
            metric = r["metric"]
            if "steps_with_reward_spread" in r:
                metric += f" (spread in {r['steps_with_reward_spread']:.0%} of steps)"
            load = f"{r['loadavg_before'][0]} -> {r['loadavg_after'][0]}" if r["loadavg_before"] else "?"
            cells = [r["config"], f"`{r['command']}`", metric, f"{r['before']:.3f}", f"{r['after']:.3f}"]
            cells += [str(r["steps"]), str(r["s_per_step"]), str(r["wall_s"]), load, r["note"]]
        lines.append("| " + " | ".join(cells) + " |")
    if records:
        lines += ["", f"Machine: {records[-1]['cpu']}, {records[-1]['cores']} cores."]
    markdown.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a bundled config name, e.g. cispo_cpu")
    parser.add_argument("--label", default=None, help="name of this run in the results (default: the config)")
    parser.add_argument("--note", default="", help="a remark for the results table")
    parser.add_argument("--results", default=str(RESULTS), help="folder of configs_learning.jsonl and .md")
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser.epilog = "Options after -- go to the recipe."
    args = parser.parse_args(argv)
    args.overrides = overrides
    record = run(args.config, args.label or args.config, args.overrides, args.note)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with open(results / JSONL.name, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    write_markdown(results / JSONL.name, results / MARKDOWN.name)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
