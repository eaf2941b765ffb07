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

Each run is a fresh process (on CPU one torch thread, the CPU default), on `harness.Bench`: a round runs both sides,
alternating which goes first, so the two sides of a round share the machine's load. Per run: `train_s` (wall seconds
of `trainer.train()` to `--steps` optimizer steps), `generated_tokens` (completion tokens the reward function saw),
`trained_tokens` (completion tokens in the loss: all generated ones synchronously; asynchronously the
`batch/trained_tokens_per_step` TRL logs), `trained_tokens_per_s`, `staleness_mean` (optimizer steps between the
weights that generated a trained sample and the weights it trained; 0 synchronously) and the per-step mean reward.
Writes `results/async_vs_sync*.json|md` (the harness's: every sample, medians (min-max) over rounds, the async/sync
ratios of each round, the machine and the load average before each run).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import bench_common as bc
import harness

#: random-weight models of real shapes for a GPU without model weights (../shared/gpu/README.md)
SHAPES = {**bc.MODEL_SHAPES, "tiny": bc.TINY_SHAPE}
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
        bc.save_random_qwen2(path, max_positions=2048, **SHAPES[name])
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
    common = {"output_dir": os.path.join(work, f"out-{side}"), "max_steps": args.steps, "learning_rate": 1e-3}
    common |= {"per_device_train_batch_size": rows, "num_generations": args.generations, "seed": args.seed}
    common |= {"max_completion_length": args.completion, "logging_steps": 1, "save_strategy": "no"}
    common |= {"report_to": "none", "disable_tqdm": True}
    common |= {"use_cpu": True} if args.device == "cpu" else {"bf16": True}
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
        model_path(args.model, work), reward, config, arithmetic_dataset("train", 256), peft_config=peft
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
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,  # the report's machine line
    }


CONFIG = ("algorithm", "model", "device", "steps", "prompts", "generations", "completion", "lora", "seed")


def side_sample(spec: dict) -> dict:
    """`one_run` in a `harness` side's fresh process."""
    return one_run(spec["side"], argparse.Namespace(**spec), spec["work"])


def render(report: dict) -> str:
    """The study's lines after the harness's tables: the staleness, the tokens generated and the reward curves."""
    lines = []
    for part in report["parts"].values():
        sides, curves = (part.get("summary") or {}).get("sides", {}), []
        for side in sides:  # the median reward of each step over the rounds
            runs = [r["samples"][side]["rewards"] for r in part["repeats"] if harness.ok(r["samples"].get(side))]
            steps = range(max(map(len, runs), default=0))
            curves.append(f"{side} " + ", ".join(bc.fmt(bc.median([r[i] for r in runs if i < len(r)])) for i in steps))
        lines += [
            f"Mean staleness of the asynchronous side: {harness.cell(sides.get('async', {}).get('staleness_mean'))} "
            "optimizer steps. Completion tokens generated: "
            + "; ".join(f"{s} {harness.cell(v.get('generated_tokens'))}" for s, v in sides.items())
            + ".",
            "",
            "Reward per step (median over rounds): " + "; ".join(curves) + ".",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="cispo", choices=sorted(ALGORITHMS))
    parser.add_argument("--model", default="bundled", choices=["bundled", *SHAPES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per optimizer step")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--completion", type=int, default=40, help="max completion tokens")
    parser.add_argument("--no-lora", dest="lora", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--name", default=None, help="results file name (default async_vs_sync[_<device>])")
    parser.add_argument("--report-only", metavar="JSON", help="rewrite the Markdown of a results file")
    harness.add_arguments(parser, repeats=5)  # --repeats, --dry-run (the tiny model, 2 steps, one round), --out
    args = parser.parse_args(argv)
    if args.report_only:
        harness.rewrite(args.report_only, render)
        return 0
    if args.dry_run:
        args.model, args.steps, args.repeats, args.completion = "tiny", 2, 1, 8
    name = args.name or (
        "async_vs_sync" + ("" if args.device == "cpu" else f"_{args.device}") + ("_dry" if args.dry_run else "")
    )
    config = {k: getattr(args, k) for k in CONFIG}
    title = "Synchronous vs asynchronous training on the same job"
    out, budget = harness.out_dir(args), args.budget
    bench = harness.Bench(name, out, config=config, device=args.device, title=title, render=render, budget_s=budget)
    job = (
        f"{args.algorithm} on `{args.model}` ({'LoRA r 16, ' if args.lora else ''}{args.prompts} prompt(s) x "
        f"{args.generations} completions of at most {args.completion} tokens per optimizer step), {args.steps} "
        f"optimizer steps, device `{args.device}`; a round is a fresh process per side, the first side alternating."
    )
    # on CUDA a run keeps the torch threads it would get alone (OMP_NUM_THREADS as set, else one per core)
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))}
    if args.device == "cuda":
        bench.report["machine"]["torch_threads"] = f"{threads['OMP_NUM_THREADS']} per side"
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as work:
        model_path(args.model, work)  # once, before the first run
        spec = {**config, "work": work}
        env = threads if args.device == "cuda" else {}
        run = "async_vs_sync:side_sample"
        sides = [harness.Side(s, run, {**spec, "side": s}, env, args.timeout) for s in ("sync", "async")]
        bench.part("job", description=job).run(
            sides, args.repeats, reference="sync", ratios=("train_s", "trained_tokens_per_s")
        )
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
