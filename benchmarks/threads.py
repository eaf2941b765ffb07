"""Torch threads against step time: the README's CHORD quick start on the bundled model, one torch thread per
process (trinity_trl's CPU default) against more, alone and beside one busy process.

    nice -n 5 python benchmarks/threads.py --threads 1 2 --repeats 1 --steps 2

Each run is a fresh subprocess that builds the README quick start as written (``ChordTrainer`` on the bundled
SmolLM2-135M, LoRA, 8 rollouts + 8 demonstrations a step) with ``max_steps=--steps`` and
``torch_threads=N`` (``0``: torch's own choice, one per core), and records each step's ``step_time``. With
``--busy`` a second set of runs has one CPU-bound Python process (a busy loop, same niceness) beside it. Runs
are interleaved (every setting once, then again), each with the load average before it; a run that passes
``--timeout`` seconds is recorded as such. Writes ``results/threads.json`` and ``results/threads.md``. On a
machine shared with other work the absolute seconds move with the load: read the ratios between settings of
one round, each beside its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import bench_common

RESULTS = bench_common.ROOT / "benchmarks" / "results"

RUN = r"""
import json, sys, time
import torch
from peft import LoraConfig
from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset, arithmetic_reward
from trinity_trl.trainers import ChordConfig, ChordTrainer

steps, threads, out, model = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
trainer = ChordTrainer(
    model=model,
    reward_funcs=arithmetic_reward,
    train_dataset=arithmetic_dataset("train", num_rows=512),
    expert_dataset=arithmetic_expert_dataset(num_rows=256),
    args=ChordConfig(output_dir=out, max_steps=steps, learning_rate=1e-3, per_device_train_batch_size=8,
                     num_generations=4, max_completion_length=40, enable_phi_function=False, mu_peak=0.9,
                     mu_valley=0.05, mu_decay_steps=20, logging_steps=1, save_strategy="no", report_to="none",
                     disable_tqdm=True, torch_threads=threads),
    peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
)
used = torch.get_num_threads()
start = time.perf_counter()
trainer.train()
print("RESULT " + json.dumps({"threads_used": used, "train_s": time.perf_counter() - start,
      "step_times": [e["step_time"] for e in trainer.state.log_history if "step_time" in e]}))
"""


def one_run(threads: int, steps: int, busy: bool, timeout: float, model: str = "bundled") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the config decides
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    record = {"threads": threads, "busy_neighbour": busy, "loadavg_before": bench_common.loadavg()}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", RUN, str(steps), str(threads), f"/tmp/threads_bench_{os.getpid()}", model],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            record["error"] = proc.stderr[-1500:]
        else:
            record.update(json.loads(line[len("RESULT ") :]))
    except subprocess.TimeoutExpired:
        record["timed_out_after_s"] = timeout
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    record["loadavg_after"] = bench_common.loadavg()
    return record


def write_markdown(result: dict) -> None:
    lines = [
        "# Torch threads against step time (README CHORD quick start, bundled SmolLM2-135M)",
        "",
        "Written by `benchmarks/threads.py`. Each row is one fresh run of the README quick start with",
        "`torch_threads` as shown (0: torch's own choice), its steps' `step_time` (generation, scoring and the",
        "update), and the 1-minute load average before -> after. `busy` = one CPU-bound Python process beside it.",
        "The machine was shared with other work throughout: compare rows of one round, with their loads.",
        "",
        "| round | threads asked | threads used | busy | step times s | load |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "step_times" in r:
            times = ", ".join(f"{t:.1f}" for t in r["step_times"])
        elif "timed_out_after_s" in r:
            times = f"> {r['timed_out_after_s']:.0f} s in all (timed out)"
        else:
            times = "failed"
        load = f"{r['loadavg_before'][0]} -> {r['loadavg_after'][0]}"
        lines.append(
            f"| {r['round']} | {r['threads']} | {r.get('threads_used', '?')} | {'yes' if r['busy_neighbour'] else 'no'}"
            f" | {times} | {load} |"
        )
    m = result["machine"]
    lines += ["", f"Machine: {m['cpu']}, {m['os_cpu_count']} cores; torch {m['torch']}; niceness {m['niceness']}."]
    (RESULTS / "threads.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--output", default=str(RESULTS / "threads.json"))
    parser.add_argument("--model", default="bundled", help="model of the quick start (a path: the tests' tiny one)")
    args = parser.parse_args(argv)
    result = {"machine": bench_common.machine_description(), "steps": args.steps, "runs": []}
    for round_ in range(1, args.repeats + 1):
        for busy in (False, True) if args.busy else (False,):
            for threads in args.threads:
                record = one_run(threads, args.steps, busy, args.timeout, args.model) | {"round": round_}
                print(json.dumps(record), flush=True)
                result["runs"].append(record)
                with open(args.output, "w", encoding="utf-8") as f:
                    json.dump(result, f, indent=1)
                if args.output == str(RESULTS / "threads.json"):
                    write_markdown(result)


if __name__ == "__main__":
    main()
