"""Synchronous against asynchronous training on the same job: tokens per second, time to a fixed number of optimizer
steps, mean staleness and the reward curve.

    nice -n 5 python benchmarks/async_vs_sync.py --repeats 5 --steps 8          # this CPU, the bundled model
    python benchmarks/async_vs_sync.py --device cuda --model qwen2.5-0.5b        # a GPU (random weights, real shape)
    python benchmarks/async_vs_sync.py --dry-run                                 # tiny shapes, one quick round

The job: the algorithm (default CISPO: `CISPOTrainer` against `AsyncCISPOTrainer`) on the bundled arithmetic task
with the reward `arithmetic_reward`, LoRA (r 16, all linear layers), `num_generations` completions per prompt,
`--prompts` prompts per optimizer step (`per_device_train_batch_size = prompts x generations` on both sides; the
asynchronous side batches a fixed number of samples, `token_budget=0`), learning rate 1e-3, TRL's other defaults
(`max_staleness` 4). Both sides generate with transformers (`model.generate`): the synchronous trainer, then trains;
the asynchronous trainer's worker thread generates the next groups while the trainer trains.

Each run is a fresh process (`harness.Launcher`; on CPU one torch thread, the CPU default); a round runs both sides,
alternating which goes first, so the two sides of a round share the machine's load. Per run: `train_s` (wall seconds
of `trainer.train()` to `--steps` optimizer steps), `generated_tokens` (completion tokens the reward function saw),
`trained_tokens` (completion tokens in the loss: all generated ones synchronously; asynchronously the
`batch/trained_tokens_per_step` TRL logs), `trained_tokens_per_s`, `staleness_mean` (optimizer steps between the
weights that generated a trained sample and the weights it trained; 0 synchronously) and the per-step mean reward.
Writes `results/async_vs_sync*.json|md`: medians (min-max) over rounds and the async/sync ratios of each round, with
the machine and the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import bench_common
import harness

RESULTS = bench_common.ROOT / "benchmarks" / "results"

#: random-weight models of real shapes for a GPU without model weights (../shared/gpu/README.md)
SHAPES = {**bench_common.MODEL_SHAPES, "tiny": bench_common.TINY_SHAPE}
ALGORITHMS = {
    "cispo": ("CISPOConfig", "CISPOTrainer", "AsyncCISPOConfig", "AsyncCISPOTrainer"),
    "sapo": ("SAPOConfig", "SAPOTrainer", "AsyncSAPOConfig", "AsyncSAPOTrainer"),
    "grpo": ("TrinityConfig", "TrinityTrainer", "AsyncTrinityConfig", "AsyncTrinityTrainer"),
}


def model_path(name: str, work: str) -> str:
    """``bundled``, or a random model of a real shape (``SHAPES``) saved with the tests' tiny tokenizer."""
    if name == "bundled":
        return "bundled"
    path = os.path.join(work, name)
    if not os.path.isdir(path):
        bench_common.save_random_qwen2(path, max_positions=2048, **SHAPES[name])
    return path


def one_run(side: str, args, work: str) -> dict:
    """One side of the job, in this process; returns its record."""
    import torch
    from peft import LoraConfig

    import trinity_trl
    from trinity_trl.data import arithmetic_dataset, arithmetic_reward

    generated = []

    def reward(completions, completion_ids, **kwargs):
        generated.append(sum(len(ids) for ids in completion_ids))
        return arithmetic_reward(completions=completions, **kwargs)

    reward.__name__ = "arithmetic_reward"
    sync_config, sync_trainer, async_config, async_trainer = ALGORITHMS[args.algorithm]
    rows = args.prompts * args.generations
    common = {
        "output_dir": os.path.join(work, f"out-{side}"),
        "max_steps": args.steps,
        "learning_rate": 1e-3,
        "per_device_train_batch_size": rows,
        "num_generations": args.generations,
        "max_completion_length": args.completion,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": args.seed,
    }
    if args.device == "cpu":
        common["use_cpu"] = True
    else:
        common.update(bf16=True)
    if args.algorithm == "grpo":
        common["algorithm"] = "grpo"
    if side == "async":
        config = getattr(trinity_trl, async_config)(**common, token_budget=0, dtype="auto")
        trainer_class = getattr(trinity_trl, async_trainer)
    else:
        config = getattr(trinity_trl, sync_config)(**common)
        trainer_class = getattr(trinity_trl, sync_trainer)
    peft = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM") if args.lora else None
    trainer = trainer_class(
        model_path(args.model, work),
        reward,
        config,
        arithmetic_dataset("train", num_rows=256),
        peft_config=peft,
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    log = trainer.state.log_history
    steps = [entry for entry in log if "loss" in entry and "train_runtime" not in entry]
    if side == "async":
        trained = sum(entry.get("batch/trained_tokens_per_step", 0.0) for entry in steps)
        staleness = [entry["async/staleness"] for entry in steps if "async/staleness" in entry]
    else:
        trained, staleness = float(sum(generated)), [0.0] * len(steps)
    return {
        "side": side,
        "steps": trainer.state.global_step,
        "train_s": train_s,
        "generated_tokens": float(sum(generated)),
        "trained_tokens": trained,
        "trained_tokens_per_s": trained / train_s,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "rewards": [entry.get("reward") for entry in steps],
        "torch_threads": torch.get_num_threads(),
    }


CONFIG = ("algorithm", "model", "device", "steps", "prompts", "generations", "completion", "lora", "seed")


def side_sample(spec: dict) -> dict:
    """`one_run` in a `harness` side's fresh process."""
    return one_run(spec["side"], argparse.Namespace(**spec), spec["work"])


def run_side(side: str, args, work: str, launcher: harness.Launcher) -> dict:
    """One side in a fresh process (the machine's load recorded before it). On CUDA the process keeps the torch
    threads it would get alone (``OMP_NUM_THREADS`` as set, else one per core)."""
    record = {"side": side, "loadavg_before": bench_common.loadavg()}
    spec = {**{k: getattr(args, k) for k in CONFIG}, "side": side, "work": work}
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    run = harness.Side(side, "async_vs_sync:side_sample", spec, threads if args.device == "cuda" else {}, args.timeout)
    sample = launcher.run(run, args.timeout)
    sample.pop("process_wall_s", None)
    if "error" in sample:
        return {**record, "error": f"{sample['error']}\n{sample.get('output_tail', '')}"}
    return {**record, **sample}


def summarise(rounds: list[dict]) -> dict:
    def values(side, key):
        return [r[side][key] for r in rounds if key in r[side] and r[side][key] is not None]

    summary = {}
    for key in ("train_s", "trained_tokens_per_s", "staleness_mean", "generated_tokens", "trained_tokens"):
        for side in ("sync", "async"):
            vals = values(side, key)
            if vals:
                summary[f"{side}_{key}"] = {"median": bench_common.median(vals), "min": min(vals), "max": max(vals)}
    ratios = {
        "time_to_steps": [r["async"]["train_s"] / r["sync"]["train_s"] for r in rounds if _ok(r)],
        "tokens_per_s": [
            r["async"]["trained_tokens_per_s"] / r["sync"]["trained_tokens_per_s"] for r in rounds if _ok(r)
        ],
    }
    for key, vals in ratios.items():
        if vals:
            summary[f"ratio_{key}"] = {"median": bench_common.median(vals), "min": min(vals), "max": max(vals)}
    for side in ("sync", "async"):
        curves = [r[side]["rewards"] for r in rounds if "rewards" in r[side]]
        if curves:
            summary[f"{side}_reward_curve_median"] = [
                bench_common.median([c[i] for c in curves if i < len(c)]) for i in range(max(map(len, curves)))
            ]
    return summary


def _ok(record: dict) -> bool:
    return "train_s" in record["sync"] and "train_s" in record["async"]


def fmt(stat: dict | None, spec: str = ".3g") -> str:
    return bench_common.range_cell(stat, spec)


def markdown(report: dict) -> str:
    s, c = report["summary"], report["config"]
    lines = [
        "# Synchronous vs asynchronous training on the same job",
        "",
        f"`benchmarks/async_vs_sync.py`, {report['date']}. {bench_common.machine_line(report['machine'])}",
        "",
        f"Job: {c['algorithm']} on `{c['model']}` ({'LoRA r 16, ' if c['lora'] else ''}{c['prompts']} prompt(s) x "
        f"{c['generations']} completions of at most {c['completion']} tokens per optimizer step), {c['steps']} "
        f"optimizer steps, device `{c['device']}`; {len(report['rounds'])} rounds, each a fresh process per side, "
        "the side that goes first alternating; torch threads per run: "
        + ", ".join(sorted({str(r[side].get("torch_threads")) for r in report["rounds"] for side in ("sync", "async")}))
        + ". Medians (min-max) over rounds.",
        "",
        "| | synchronous | asynchronous | async / sync (per round) |",
        "|---|---|---|---|",
        f"| time to {c['steps']} steps (s) | {fmt(s.get('sync_train_s'))} | {fmt(s.get('async_train_s'))} | "
        f"{fmt(s.get('ratio_time_to_steps'))} |",
        f"| trained completion tokens / s | {fmt(s.get('sync_trained_tokens_per_s'))} | "
        f"{fmt(s.get('async_trained_tokens_per_s'))} | {fmt(s.get('ratio_tokens_per_s'))} |",
        f"| mean staleness (optimizer steps) | 0 | {fmt(s.get('async_staleness_mean'))} | |",
        f"| completion tokens generated | {fmt(s.get('sync_generated_tokens'))} | "
        f"{fmt(s.get('async_generated_tokens'))} | |",
        "",
        "Reward per step (median over rounds): synchronous "
        + ", ".join(f"{v:.3f}" for v in s.get("sync_reward_curve_median", []) if v is not None)
        + "; asynchronous "
        + ", ".join(f"{v:.3f}" for v in s.get("async_reward_curve_median", []) if v is not None)
        + ".",
        "",
        "| round | first | load before (sync / async) | sync s | async s | ratio | async staleness |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(report["rounds"], start=1):
        sync, asyn = r["sync"], r["async"]
        ratio = f"{asyn['train_s'] / sync['train_s']:.3f}" if _ok(r) else "n/a"
        times = [f"{side['train_s']:.1f}" if "train_s" in side else "failed" for side in (sync, asyn)]
        lines.append(
            f"| {i} | {r['first']} | {sync['loadavg_before']} / {asyn['loadavg_before']} | {times[0]} | {times[1]} | "
            f"{ratio} | {asyn.get('staleness_mean')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="cispo", choices=sorted(ALGORITHMS))
    parser.add_argument("--model", default="bundled", choices=["bundled", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion", type=int, default=40, help="max completion tokens")
    parser.add_argument("--no-lora", dest="lora", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, 2 steps, one round")
    parser.add_argument(
        "--out", default=None, help="results folder (default $OUT, else benchmarks/results; --dry-run: a temporary one)"
    )
    parser.add_argument("--name", default=None, help="results file name (default async_vs_sync[_<device>])")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the Markdown of a results file")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.model, args.steps, args.repeats, args.completion = "tiny", 2, 1, 8
    if args.report_only:
        with open(args.report_only) as f:
            report = json.load(f)
        with open(os.path.splitext(args.report_only)[0] + ".md", "w") as f:
            f.write(markdown(report))
        return 0
    launcher = harness.Launcher()
    started, load_start = time.time(), bench_common.loadavg()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as work:
        model_path(args.model, work)  # once, before the first run
        for i in range(args.repeats):
            order = ("sync", "async") if i % 2 == 0 else ("async", "sync")
            record = {"first": order[0]}
            for side in order:
                record[side] = run_side(side, args, work, launcher)
                print(f"round {i + 1} {side}: {record[side].get('train_s', record[side].get('error'))}", flush=True)
            rounds.append(record)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "config": {k: getattr(args, k) for k in CONFIG},
        "machine": bench_common.machine_description(args.device),
        "rounds": rounds,
        "summary": summarise(rounds),
        "total_wall_s": time.time() - started,
        "load_average_start": load_start,
        "load_average_end": bench_common.loadavg(),
    }
    name = args.name or (
        "async_vs_sync" + ("" if args.device == "cpu" else f"_{args.device}") + ("_dry" if args.dry_run else "")
    )
    out = args.out or os.environ.get("OUT")
    out = out or (tempfile.mkdtemp(prefix="async_vs_sync-dry-") if args.dry_run else RESULTS)
    bench_common.write_report(out, name, report, markdown(report))
    return 0 if all(_ok(r) for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
