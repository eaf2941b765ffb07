#!/usr/bin/env python
"""Benchmark: held-out accuracy against training steps for GRPO, CHORD, SFT-only, CISPO and SAPO.

Each method trains a LoRA adapter on the bundled SmolLM2-135M-Instruct with the bundled arithmetic
word problems (``trinity_trl.data``), with the same seed, learning rate, LoRA and number of
optimizer steps, and the settings of the CPU recipes (``trinity_trl/recipes/configs/*_cpu.yaml``):

* ``grpo``: ``TrinityTrainer`` (preset ``grpo``: PPO-clip, group-normalised rewards), no KL;
* ``chord``: ``ChordTrainer`` (``mix_chord``, CHORD-mu: SFT weight mu decaying from 0.9 to 0.05 over
  the run, no phi), ``--expert-rows`` demonstrations appended to the rollouts of every step;
* ``sft``: ``TrinitySFTTrainer`` on the demonstrations only (``--rollouts`` rows per step, no
  generation, no reward);
* ``cispo``: ``CISPOTrainer`` (cap 1.28), no KL;
* ``sapo``: ``SAPOTrainer`` (paper form).

The RL methods sample ``--rollouts`` completions per step (``--rollouts / --num-generations``
prompts) at temperature 0.8, rewarded by the exact final-answer check ``arithmetic_reward``.
Every ``--eval-every`` steps a callback measures the greedy accuracy (``evaluate_accuracy``) on
``--eval-rows`` held-out problems (the test split never shares a problem with training). Step 0 is
the base model (a fresh LoRA adapter is the identity), measured once and shared by all methods.

Quick setting (what fits on a 2-core CPU in about 15 minutes; a smoke run, too short to rank the
methods)::

    nice -n 5 .venv/bin/python benchmarks/learning.py --quick --out benchmarks/results

Full setting (3 seeds, 100 steps, accuracy every 10 steps on 100 problems; about 9 hours on 2 CPU
cores with one thread, far less on a GPU with ``--device cuda``)::

    nice -n 5 .venv/bin/python benchmarks/learning.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports

METHODS = ("grpo", "chord", "sft", "cispo", "sapo")
LABELS = {"grpo": "GRPO", "chord": "CHORD", "sft": "SFT only", "cispo": "CISPO", "sapo": "SAPO"}
FULL = {"seeds": [0, 1, 2], "steps": 100, "eval_every": 10, "eval_rows": 100}
QUICK = {"seeds": [0], "steps": 8, "eval_every": 4, "eval_rows": 30}


def lora_config(args):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", task_type="CAUSAL_LM")


def common_config(args, seed: int, output_dir: str) -> dict:
    return {
        "output_dir": output_dir, "use_cpu": args.device == "cpu", "bf16": args.bf16,
        "activation_checkpointing": False, "max_steps": args.steps, "learning_rate": args.learning_rate,
        "lr_scheduler_type": "constant", "report_to": "none", "save_strategy": "no", "logging_steps": 1,
        "seed": seed, "dataloader_num_workers": 0, "disable_tqdm": True,
    }


def build_trainer(method: str, model: str, seed: int, args, data: dict, output_dir: str):
    from trinity_trl.data import arithmetic_reward
    from trinity_trl.trainers import (
        ChordConfig,
        ChordTrainer,
        CISPOConfig,
        CISPOTrainer,
        SAPOConfig,
        SAPOTrainer,
        TrinityConfig,
        TrinitySFTConfig,
        TrinitySFTTrainer,
        TrinityTrainer,
    )

    common = common_config(args, seed, output_dir)
    if method == "sft":
        config = TrinitySFTConfig(**common, per_device_train_batch_size=args.rollouts)
        return TrinitySFTTrainer(model=model, args=config, train_dataset=data["expert"], peft_config=lora_config(args))
    rl = {**common, "per_device_train_batch_size": args.rollouts, "num_generations": args.num_generations,
          "max_completion_length": args.completion_len, "temperature": 0.8}
    if method == "grpo":
        trainer_class, config = TrinityTrainer, TrinityConfig(**rl, algorithm="grpo", kl_loss_fn="none")
    elif method == "cispo":
        trainer_class, config = CISPOTrainer, CISPOConfig(**rl, kl_loss_fn="none")
    elif method == "sapo":
        trainer_class, config = SAPOTrainer, SAPOConfig(**rl, sapo_form="paper")
    elif method == "chord":
        trainer_class = ChordTrainer
        config = ChordConfig(**rl, algorithm="mix_chord", enable_phi_function=False, mu_peak=0.9, mu_valley=0.05,
                             mu_warmup_steps=0, mu_decay_steps=args.steps, expert_batch_size=args.expert_rows,
                             kl_loss_fn="none")
    else:
        raise ValueError(method)
    extra = {"expert_dataset": data["expert"]} if method == "chord" else {}
    return trainer_class(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=data["train"],
                         peft_config=lora_config(args), **extra)


def accuracy(trainer, data: dict, args) -> float:
    from trinity_trl.data import evaluate_accuracy

    return evaluate_accuracy(trainer.model, trainer.processing_class, data["test"], batch_size=args.eval_batch_size,
                             max_new_tokens=args.eval_max_new_tokens, progress=False)


def train_with_evaluation(trainer, data: dict, args) -> dict:
    """Train; every ``eval_every`` steps (and after the last) record the held-out accuracy."""
    from transformers import PrinterCallback, TrainerCallback

    trainer.remove_callback(PrinterCallback)  # the log dict of every step (kept in log_history)
    curve: list[dict] = []
    eval_seconds, eval_cpu = [0.0], [0.0]

    class AccuracyCallback(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                start, cpu = time.perf_counter(), time.process_time()
                acc = accuracy(trainer, data, args)
                eval_seconds[0] += time.perf_counter() - start
                eval_cpu[0] += time.process_time() - cpu
                curve.append({"step": state.global_step, "accuracy": acc})
                print(f"    step {state.global_step}: accuracy {acc:.3f}", flush=True)

    trainer.add_callback(AccuracyCallback())
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    steps = max(1, trainer.state.global_step)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    reward_key = next((k for k in (logs[0] if logs else {}) if k.startswith("rewards/") and k.endswith("/mean")), None)
    return {
        "curve": curve,
        "train_seconds": wall - eval_seconds[0],
        "eval_seconds": eval_seconds[0],
        "seconds_per_step": (wall - eval_seconds[0]) / steps,
        # process CPU seconds: unlike wall time, not inflated when other processes take the cores (or
        # when the process is paused)
        "cpu_seconds_per_step": (cpu - eval_cpu[0]) / steps,
        "train_reward": [e.get(reward_key) for e in logs] if reward_key else None,
        "loss": [e.get("loss") for e in logs],
    }


def summarise(runs: dict, base: float, methods: list[str]) -> dict:
    """Per method: mean (min, max) accuracy over seeds at each evaluated step, step 0 = the base model."""
    out = {}
    for method in methods:
        per_seed = [r["curve"] for r in runs[method]]
        steps = sorted({p["step"] for curve in per_seed for p in curve})
        table = {0: {"mean": base, "min": base, "max": base, "n": len(per_seed)}}
        for step in steps:
            values = [p["accuracy"] for curve in per_seed for p in curve if p["step"] == step]
            table[step] = {"mean": statistics.mean(values), "min": min(values), "max": max(values), "n": len(values)}
        rewards = [r["train_reward"] for r in runs[method] if r["train_reward"]]
        out[method] = {
            "accuracy": table,
            "final_mean": table[max(table)]["mean"],
            "seconds_per_step": statistics.mean(r["seconds_per_step"] for r in runs[method]),
            "cpu_seconds_per_step": (statistics.mean(r["cpu_seconds_per_step"] for r in runs[method])
                                     if all("cpu_seconds_per_step" in r for r in runs[method]) else None),
            "mean_train_reward": statistics.mean(v for rs in rewards for v in rs if v is not None) if rewards else None,
        }
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"grpo": ("o", "-"), "chord": ("s", "-"), "sft": ("^", "-"), "cispo": ("x", "--"), "sapo": ("D", ":")}
    for method, s in report["summary"].items():
        steps = sorted(int(k) for k in s["accuracy"])
        rows = [s["accuracy"][str(k)] for k in steps]
        marker, line = styles.get(method, ("o", "-"))
        ax.plot(steps, [r["mean"] for r in rows], marker=marker, linestyle=line, label=LABELS.get(method, method))
        if any(r["n"] > 1 for r in rows):
            ax.fill_between(steps, [r["min"] for r in rows], [r["max"] for r in rows], alpha=0.15)
    c = report["config"]
    title = (f"{'QUICK: ' if c['quick'] else ''}held-out accuracy, {report['model_description']}, LoRA r{c['lora_r']}, "
             f"{len(c['seeds'])} seed(s)")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"greedy accuracy ({c['eval_rows']} held-out problems)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown(report: dict) -> str:
    c, m = report["config"], report["machine"]
    steps = sorted({int(k) for s in report["summary"].values() for k in s["accuracy"]})
    seeds = len(c["seeds"])
    lines = [
        "# Learning curves: held-out accuracy against training steps",
        "",
        ("**Quick setting**: a smoke run, far too short (and one seed) to rank the methods; the full setting is "
         "`nice -n 5 .venv/bin/python benchmarks/learning.py` (see benchmarks/README.md). " if c["quick"] else "")
        + f"Command: `{report['command']}`",
        "",
        bc.machine_line(m),
        f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end.",
        "",
        (f"Model: {report['model_description']} with a LoRA adapter (r {c['lora_r']}, alpha {2 * c['lora_r']}, all "
        f"linear layers), lr {c['learning_rate']} constant, {c['steps']} optimizer steps, seeds {c['seeds']}. RL "
        f"methods: {c['rollouts']} rollouts per step ({c['rollouts'] // c['num_generations']} prompts x "
        f"{c['num_generations']}), at most {c['completion_len']} tokens, temperature 0.8, reward = exact final answer; "
        f"CHORD adds {c['expert_rows']} demonstrations per step (mu 0.9 -> 0.05); SFT trains on {c['rollouts']} "
        f"demonstrations per step. Accuracy: greedy, {c['eval_rows']} held-out problems, {c['eval_max_new_tokens']} "
        "new tokens; step 0 = the base model."),
        "",
        f"Accuracy (mean over {seeds} seed{'s' if seeds > 1 else ''}"
        + (", min-max in brackets" if seeds > 1 else "") + "):",
        "",
        "| method | " + " | ".join(f"step {s}" for s in steps)
        + " | s/step (train, wall) | CPU s/step (train) | mean train reward |",
        "|---|" + "---|" * len(steps) + "---|---|---|",
    ]
    for method, s in report["summary"].items():
        cells = []
        for step in steps:
            r = s["accuracy"].get(str(step))
            if r is None:
                cells.append("")
            elif r["n"] > 1:
                cells.append(f"{r['mean']:.3f} [{r['min']:.2f}-{r['max']:.2f}]")
            else:
                cells.append(f"{r['mean']:.3f}")
        lines.append(f"| {LABELS.get(method, method)} | " + " | ".join(cells)
                     + f" | {s['seconds_per_step']:.1f} | {bc.fmt(s.get('cpu_seconds_per_step'), '.1f')} "
                     f"| {bc.fmt(s['mean_train_reward'])} |")
    lines += ["", ("`s/step` excludes the accuracy evaluations. Methods with identical updates have identical "
              "curves: on-policy (one update per generation batch), PPO-clip (GRPO) and CISPO both reduce to "
              "`-A * grad log p` with the same token-mean, so GRPO and CISPO coincide here."),
              "", (f"Plot: `learning.png`. Wall time: {report['total_wall_s'] / 60:.1f} min "
              f"(base-model evaluation {report['base_eval_seconds']:.0f} s)."), ""]
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {note}" for note in report["notes"]] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"quick setting {QUICK} (explicit options below still override it)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", type=int, nargs="+", help=f"default {FULL['seeds']} ({QUICK['seeds']} quick)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {FULL['steps']}, {QUICK['steps']} quick)")
    parser.add_argument("--eval-every", type=int, help=f"default {FULL['eval_every']} ({QUICK['eval_every']} quick)")
    parser.add_argument("--eval-rows", type=int, help=f"default {FULL['eval_rows']} ({QUICK['eval_rows']} quick)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=40)
    parser.add_argument("--eval-batch-size", type=int, default=50)
    parser.add_argument("--model", default="bundled",
                        help="'bundled' (SmolLM2-135M-Instruct), 'tiny' (random 2-layer Qwen2, smoke tests) or a path/id")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per step (SFT: demonstrations per step)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--expert-rows", type=int, default=4, help="CHORD demonstrations per step")
    parser.add_argument("--completion-len", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--train-rows", type=int, default=512)
    parser.add_argument("--expert-pool", type=int, default=256, help="demonstrations available (CHORD, SFT)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads (1: on 2 shared cores, 2 threads made steps up to 25x slower)")
    parser.add_argument("--out", default="benchmarks/results", help="directory for learning.json / .md / .png")
    parser.add_argument("--note", action="append", default=[], help="a remark to record in the report (repeatable)")
    parser.add_argument("--from-json", metavar="PATH",
                        help="train nothing: re-render the .md and .png of an earlier learning.json (adding --note)")
    args = parser.parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        report["notes"] = report.get("notes", []) + args.note
        return write_report(report, Path(args.out))
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset

    started, load_start = time.perf_counter(), bc.loadavg()
    with tempfile.TemporaryDirectory(prefix="learning_bench_") as tmp_name:
        tmp = Path(tmp_name)
        if args.model == "bundled":
            from trinity_trl.data import bundled_model_dir

            model, description = str(bundled_model_dir()), "SmolLM2-135M-Instruct (bundled, fp32)"
        elif args.model == "tiny":
            model = bc.save_random_qwen2(tmp / "model", hidden=64, layers=2, intermediate=128)
            description = "random tiny Qwen2 (smoke run)"
        else:
            model, description = args.model, args.model
        data = {"train": arithmetic_dataset("train", args.train_rows, seed=0),
                "test": arithmetic_dataset("test", args.eval_rows, seed=0),
                "expert": arithmetic_expert_dataset(args.expert_pool, seed=1)}
        runs: dict = {method: [] for method in args.methods}
        base = None
        base_eval_seconds = 0.0
        for seed in args.seeds:
            for method in args.methods:
                print(f"[seed {seed}] {method}: building ...", flush=True)
                trainer = build_trainer(method, model, seed, args, data, str(tmp / f"{method}-{seed}"))
                if base is None:  # the fresh adapter is the identity: the base model's accuracy, for everyone
                    start = time.perf_counter()
                    base = accuracy(trainer, data, args)
                    base_eval_seconds = time.perf_counter() - start
                    print(f"    step 0 (base model): accuracy {base:.3f} ({base_eval_seconds:.0f} s)", flush=True)
                result = train_with_evaluation(trainer, data, args)
                result["seed"] = seed
                runs[method].append(result)
                print(f"[seed {seed}] {method}: {result['seconds_per_step']:.1f} s/step, load {bc.loadavg()}",
                      flush=True)
                del trainer
                gc.collect()

    report = {
        "benchmark": "learning",
        "command": " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])]),
        "machine": bc.machine_description(args.device),
        "load_average_start": load_start,
        "load_average_end": bc.loadavg(),
        "model_description": description,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "base_accuracy": base,
        "base_eval_seconds": base_eval_seconds,
        "summary": summarise(runs, base, args.methods),
        "runs": runs,
        "notes": args.note,
        "total_wall_s": time.perf_counter() - started,
    }
    return write_report(json.loads(json.dumps(report)), Path(args.out))  # step keys become strings, as in the file


def write_report(report: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot(report, out / "learning.png")
    text = markdown(report)
    (out / "learning.md").write_text(text)
    print(text)
    print(f"wrote {out / 'learning.json'}, {out / 'learning.md'}" + (f", {out / 'learning.png'}" if plotted else "")
          + f" ({report['total_wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
