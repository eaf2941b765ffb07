"""Each asynchronous algorithm trains on the bundled model: CISPO, SAPO, GSPO, CHORD-mu, CHORD-phi and step-wise GRPO
(issue 44).

    nice -n 5 python benchmarks/async_bundled.py                 # all six, 2 optimizer steps each, this CPU
    python benchmarks/async_bundled.py --only cispo --steps 3    # one of them
    python benchmarks/async_bundled.py --dry-run                 # the tiny random model, a quick check of the script

Each algorithm runs in a fresh process on the bundled SmolLM2-135M-Instruct and the bundled arithmetic task with
LoRA (r 16, all linear layers), as the asynchronous quick start (docs/asynchronous.md#quick-start): CISPO and SAPO
through `AsyncCISPOTrainer` / `AsyncSAPOTrainer`, GSPO through `AsyncTrinityTrainer(algorithm="gspo")`, CHORD-mu and
CHORD-phi through `AsyncChordTrainer` with `paper_config` (8 completions a prompt, a fifth of each micro-batch
demonstrations from `arithmetic_expert_dataset`). One prompt's group a micro-batch, completions of at most 32 tokens,
learning rate 1e-3, TRL's other asynchronous defaults. Rewards: `arithmetic_reward` (1 for the exact answer) plus
0.2 for stating an answer at all, so that the first groups differ (the bundled model is rarely right in 2 steps, and a
group of equal rewards has no advantage to train on). Step-wise GRPO (`AsyncStepGRPOTrainer`) plays the bundled
number-guessing environment instead (`NumberGuessEnv` with partial credit, targets 1-20, 4 runs of at most 3 turns a
task, a micro-batch 4 steps; the environment's reward). Per run: optimizer steps reached, wall seconds, the logged loss,
`grad_norm`, reward and `async/staleness` per step, and whether every logged loss is finite. Writes
`results/async_bundled.{json,md}` (`--name` to change).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common  # noqa: E402
import harness  # noqa: E402

RUNS = ("cispo", "sapo", "gspo", "chord_mu", "chord_phi", "step_grpo")


def one_run(name: str, args, work: str) -> dict:
    """Train ``name`` asynchronously in this process; its record."""
    import torch
    from peft import LoraConfig

    import trinity_trl
    from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset, arithmetic_reward

    def states_a_number(completions, **kwargs) -> list[float]:
        """0.2 for a completion that states a numeric final answer, right or wrong: a spread within the first groups
        (the bundled model is rarely right in 2 steps), so the policy loss has advantages to train on."""
        texts = [c if isinstance(c, str) else " ".join(m.get("content") or "" for m in c) for c in completions]
        return [0.2 * float(re.search(r"answer\s+is\s*:?\s*\$?-?\d", t, re.IGNORECASE) is not None) for t in texts]

    common = {
        "output_dir": os.path.join(work, name),
        "max_steps": args.steps,
        "learning_rate": 1e-3,
        "max_completion_length": args.completion,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": 0,
        "use_cpu": True,
    }
    extra = {}
    reward_funcs, train_dataset = [arithmetic_reward, states_a_number], arithmetic_dataset("train", num_rows=128)
    if name == "step_grpo":
        from trinity_trl.rollouts.envs import NumberGuessEnv, number_guess_dataset

        config = trinity_trl.AsyncStepGRPOConfig(
            **common, num_generations=4, per_device_train_batch_size=4, max_env_steps=3
        )
        trainer_class = trinity_trl.AsyncStepGRPOTrainer
        extra = {"environment_factory": lambda: NumberGuessEnv(partial_credit=True)}
        reward_funcs, train_dataset = None, number_guess_dataset(64, low=1, high=20)
    elif name.startswith("chord"):
        config = trinity_trl.AsyncChordConfig(
            **common, paper_config=name, num_generations=8, per_device_train_batch_size=8
        )
        trainer_class, extra = trinity_trl.AsyncChordTrainer, {"expert_dataset": arithmetic_expert_dataset(num_rows=64)}
    else:
        grouping = {"num_generations": 4, "per_device_train_batch_size": 4}
        if name == "gspo":
            config = trinity_trl.AsyncTrinityConfig(**common, **grouping, algorithm="gspo")
            trainer_class = trinity_trl.AsyncTrinityTrainer
        else:
            config = getattr(trinity_trl, f"Async{name.upper()}Config")(**common, **grouping)
            trainer_class = getattr(trinity_trl, f"Async{name.upper()}Trainer")
    model = "bundled"
    if args.dry_run:  # a tiny random Qwen2 with the tests' tokenizer
        model = bench_common.save_random_qwen2(
            os.path.join(work, "tiny"), hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128
        )
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=train_dataset,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
        **extra,
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    steps = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    losses = [e["loss"] for e in steps]
    rewards = [e.get("reward") for e in steps]
    return {
        "run": name,
        "trainer": type(trainer).__name__,
        "algorithm": config.algorithm,
        "steps": trainer.state.global_step,
        "train_s": round(train_s, 1),
        "losses": losses,
        "staleness": [e.get("async/staleness") for e in steps],
        "rewards": rewards,
        "grad_norms": [e.get("grad_norm") for e in steps],
        "mu": [e.get("actor/mu") for e in steps] if name.startswith("chord") else None,
        "finite": bool(losses) and all(math.isfinite(x) for x in losses),
        "torch_threads": torch.get_num_threads(),
    }


def side_sample(spec: dict) -> dict:
    """`one_run` in a `harness` side's fresh process."""
    return one_run(spec["name"], argparse.Namespace(**spec), spec["work"])


def run_one(name: str, args, work: str, launcher: harness.Launcher) -> dict:
    """One algorithm in a fresh process (the machine's load recorded before it)."""
    record = {"run": name, "loadavg_before": bench_common.loadavg()}
    spec = {"name": name, "work": work, "steps": args.steps, "completion": args.completion, "dry_run": args.dry_run}
    sample = launcher.run(harness.Side(name, "async_bundled:side_sample", spec, timeout_s=args.timeout), args.timeout)
    sample.pop("process_wall_s", None)
    if "error" in sample:
        return {**record, "error": f"{sample['error']}\n{sample.get('output_tail', '')}"}
    return {**record, **sample}


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        "# Asynchronous training of each algorithm on the bundled model",
        "",
        f"`benchmarks/async_bundled.py`, {report['date']}. {bench_common.machine_line(report['machine'])}",
        "",
        f"Model: {'the tiny random model (dry run)' if c['dry_run'] else 'the bundled SmolLM2-135M-Instruct'} + LoRA "
        f"(r 16, all linear layers); the bundled arithmetic task; {c['steps']} optimizer steps; completions of at most "
        f"{c['completion']} tokens; CISPO, SAPO, GSPO: one prompt x 4 completions a micro-batch; CHORD-mu and "
        "CHORD-phi: `paper_config` (one prompt x 8 completions and 2 demonstrations a micro-batch, no KL). "
        "Learning rate 1e-3; "
        "TRL's other asynchronous defaults (`max_staleness` 4). Rewards: `arithmetic_reward` plus 0.2 for stating "
        "an answer. step_grpo: the bundled number-guessing environment (partial credit, targets 1-20), 4 runs of at "
        "most 3 turns a task, 4 steps a micro-batch, the environment's reward. Each run a fresh process, one after "
        "the other.",
        "",
        "| run | trainer | steps | wall (s) | loss per step | grad norm per step | reward per step "
        "| staleness per step | finite |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if "error" in r:
            lines.append(
                f"| {r['run']} | error | | | {r['error'].splitlines()[-1][:120] if r['error'] else ''} | | no |"
            )
            continue
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        stale, norms, rewards = (
            ", ".join("-" if v is None else f"{v:{spec}}" for v in r[key])
            for key, spec in (("staleness", ".2f"), ("grad_norms", ".3g"), ("rewards", ".3f"))
        )
        lines.append(
            f"| {r['run']} | `{r['trainer']}` | {r['steps']} | {r['train_s']:.0f} | {losses} | {norms} | {rewards} | "
            f"{stale} | "
            f"{'yes' if r['finite'] else 'no'} |"
        )
    lines += ["", f"Total wall time {report['wall_s']:.0f} s.", ""]
    lines += [f"{note}\n" for note in report.get("notes", [])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=RUNS, action="append", help="run only these (repeatable)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="the tiny random model instead of the bundled one")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    launcher = harness.Launcher()
    start, load_start = time.perf_counter(), bench_common.loadavg()
    with tempfile.TemporaryDirectory() as work:
        runs = []
        for name in args.only or RUNS:
            runs.append(run_one(name, args, work, launcher))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "error"}), flush=True)
            if "error" in runs[-1]:
                print(runs[-1]["error"], file=sys.stderr)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": bench_common.machine_description("cpu"),
        "config": {"steps": args.steps, "completion": args.completion, "dry_run": args.dry_run},
        "runs": runs,
        "wall_s": time.perf_counter() - start,
        "load_average_start": load_start,
        "load_average_end": bench_common.loadavg(),
    }
    name = args.name or ("async_bundled_dry" if args.dry_run else "async_bundled")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))
    sys.exit(0 if all("error" not in r and r["finite"] and r["steps"] >= args.steps for r in runs) else 1)


if __name__ == "__main__":
    main()
