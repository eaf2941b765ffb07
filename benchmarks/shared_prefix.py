#!/usr/bin/env python
"""Benchmark: StepGRPOTrainer training rows, one per step vs one per prefix-preserving run.

``StepGRPOTrainer._step_batch`` turns the runs of a batch into training rows: one row per step
(``shared_prefix=False``), whose prompt is the whole conversation so far, or, for prefix-preserving
runs, ONE row per run (``shared_prefix=True``) whose tokens carry each step's advantage. Both give
the same loss and gradients; this script measures what the shared layout saves.

For each number of steps per run (``--steps``), the script builds ``--runs`` synthetic runs
(``Run``/``Step`` objects with random token ids: an initial prompt, then per step a completion
ending in EOS and an observation appended to the history, so no generation is timed), builds both
layouts with the real ``_step_batch`` of a ``StepGRPOTrainer`` constructed on a saved random Qwen2,
checks (untimed) that both give the same loss, gradients and per-token log-probs, then times,
interleaving the layouts:

* ``train``: ``trainer._compute_loss(model, batch)`` + ``loss.backward()`` over the whole batch
  (one micro-batch; the preset's PPO-clip + k2 KL loss, reference log-probs precomputed by
  ``_step_batch``);
* ``logps``: ``trainer.scoring.logps(model, rows)``, the no-grad forward that computes behaviour /
  reference log-probs (chunked by ``per_device_train_batch_size``, as in training).

It reports medians, per-step / shared ratios, tokens per layout and peak memory (CUDA: peak
allocated bytes; CPU: peak resident set size over the call, from ``/proc/self/status`` VmHWM after
resetting it through ``/proc/self/clear_refs``, after ``malloc_trim``; approximate, skipped where
that file cannot be written).

    .venv/bin/python benchmarks/shared_prefix.py --steps 4 8 --reps 7 --device cpu --out benchmarks/results
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import bench_common as bc  # sets the offline environment and sys.path before torch/trl imports
import torch  # noqa: E402 (after the environment variables and sys.path)

LAYOUTS = ("per_step", "shared")


# ----------------------------------------------------------------------------- memory helpers
def _cpu_peak_supported() -> bool:
    return bc.reset_peak_rss() and bc.read_status_kb("VmHWM") is not None


def peak_memory_mib(fn, device: torch.device, cpu_supported: bool) -> float | None:
    """Peak memory that ``fn()`` adds above what is in use before it, in MiB (None if unmeasurable)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    if not cpu_supported:
        fn()
        return None
    bc.malloc_trim()
    before = bc.read_status_kb("VmRSS")
    bc.reset_peak_rss()  # the peak RSS (VmHWM) restarts from the current RSS
    fn()
    peak = bc.read_status_kb("VmHWM")
    return (peak - before) / 1024


# ------------------------------------------------------------------------------- setup helpers
def make_trainer(model_dir: Path, out_dir: Path, args):
    from trinity_trl.rollouts import NumberGuessEnv, number_guess_dataset
    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    config = StepGRPOConfig(
        output_dir=str(out_dir),
        use_cpu=args.device == "cpu",
        bf16=False,
        activation_checkpointing=False,
        per_device_train_batch_size=args.runs,
        num_generations=args.runs,
        max_completion_length=args.completion_len,
        max_env_steps=max(args.steps),
        max_steps=1,
        learning_rate=0.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = StepGRPOTrainer(
        model=str(model_dir), args=config, train_dataset=number_guess_dataset(8), environment_factory=NumberGuessEnv
    )
    if not hasattr(trainer, "current_gradient_accumulation_steps"):  # set by the training loop otherwise
        trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def make_runs(
    num_runs: int,
    num_steps: int,
    prompt_len: int,
    completion_len: int,
    observation_len: int,
    tokenizer,
    rng: random.Random,
):
    """Prefix-preserving runs (history kept as tokens): step s+1's prompt = step s's prompt +
    completion (ending in EOS) + an observation. Advantages: one value per run, on every step
    (step-wise GRPO broadcasts the run's score), offset from zero so the loss is not ~0."""
    from trinity_trl.rollouts.multi_step import Run, Step

    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    eos = tokenizer.eos_token_id

    def draw(n):
        return [rng.choice(ordinary) for _ in range(n)]

    runs, advantages = [], []
    for _ in range(num_runs):
        prompt, steps = draw(prompt_len), []
        for _ in range(num_steps):
            completion = draw(completion_len - 1) + [eos]
            steps.append(Step(prompt_ids=list(prompt), completion_ids=completion, logprobs=None, reward=0.0, text=""))
            prompt = prompt + completion + draw(observation_len)
        reward = rng.random()
        runs.append(Run(steps=steps, reward=reward, done=True, prefix_preserving=True))
        score = 0.5 + rng.gauss(0.0, 1.0)
        advantages.append([score] * num_steps)
    return runs, advantages


def build_batch(trainer, runs, advantages, shared: bool, device: torch.device) -> dict:
    trainer.args.shared_prefix = shared
    stub = {
        "prompt_ids": torch.zeros(1, 1, dtype=torch.long, device=device),
        "num_items_in_batch": torch.tensor(0, device=device),
    }
    return trainer._step_batch(stub, runs, advantages)


def forward_rows(batch: dict) -> dict:
    return {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}


def token_counts(batch: dict) -> dict:
    rows, prompt_w, completion_w = (
        batch["prompt_ids"].shape[0],
        batch["prompt_ids"].shape[1],
        batch["completion_ids"].shape[1],
    )
    return {
        "rows": rows,
        "width": prompt_w + completion_w,
        "padded_tokens": rows * (prompt_w + completion_w),
        "real_tokens": int(batch["prompt_mask"].sum() + batch["completion_mask"].sum()),
        "trained_tokens": int((batch["completion_mask"] * batch["tool_mask"]).sum()),
        "samples": int(batch["sample_count"].sum()),
    }


# ------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_once(trainer, batch, device) -> tuple[float, float]:
    """Wall seconds and process CPU seconds (all threads) of one ``_compute_loss`` + ``backward``."""
    trainer.model.zero_grad(set_to_none=True)
    sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


def logps_once(trainer, rows, device) -> tuple[float, float]:
    """Wall seconds and process CPU seconds of one no-grad ``trainer.scoring.logps``."""
    sync(device)
    start, cpu = time.perf_counter(), time.process_time()
    trainer.scoring.logps(trainer.model, rows)
    sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


def summary(samples: list[tuple[float, float]]) -> dict:
    """Median / min / max wall time; ``cpu_util`` = process CPU s / wall s per sample (on CPU, close to
    the thread count when the cores are ours, lower when other processes compete for them)."""
    wall = [w for w, _ in samples]
    util = [c / w if w > 0 else float("nan") for w, c in samples]
    return {
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "max_s": max(wall),
        "samples_s": wall,
        "cpu_util_median": statistics.median(util),
        "cpu_util_samples": util,
    }


# ------------------------------------------------------------------------------------- checks
def check_equivalence(trainer, runs, batches, device, cpu_mem: bool, with_logps: bool) -> tuple[dict, dict]:
    """Same loss (asserted, 1e-4 relative), same gradients (asserted, relative norm 1e-3) and same
    per-token log-probs of every step's completion (asserted, 1e-4 absolute) from both layouts.
    The peak memory of each call is measured on the way (these are the first calls on each batch)."""
    losses, grads, logps, memory = {}, {}, {}, {name: {} for name in LAYOUTS}
    for name in LAYOUTS:
        out = {}

        def train(name=name, out=out):
            loss = trainer._compute_loss(trainer.model, batches[name])
            loss.backward()
            out["loss"] = float(loss.detach())

        def forward(name=name, out=out):
            out["logps"] = trainer.scoring.logps(trainer.model, forward_rows(batches[name]))

        trainer.model.zero_grad(set_to_none=True)
        memory[name]["train_mib"] = peak_memory_mib(train, device, cpu_mem)
        losses[name] = out["loss"]
        grads[name] = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        trainer.model.zero_grad(set_to_none=True)
        memory[name]["logps_mib"] = peak_memory_mib(forward, device, cpu_mem) if with_logps else None
        if not with_logps:
            forward()
        logps[name] = out["logps"]
    a, b = losses["per_step"], losses["shared"]
    assert math.isclose(a, b, rel_tol=1e-4), f"losses differ: per-step {a!r} vs shared {b!r}"
    assert grads["per_step"].keys() == grads["shared"].keys()
    diff = math.sqrt(
        sum(float((grads["per_step"][n] - grads["shared"][n]).double().pow(2).sum()) for n in grads["shared"])
    )
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads["per_step"].values()))
    grad_rel = diff / max(norm, 1e-30)
    assert grad_rel < 1e-3, f"gradients differ: relative norm of the difference {grad_rel:.3e}"
    # log-probs of each step's completion tokens: per-step row (run r, step s) vs shared row r
    step_lp, run_lp = logps["per_step"], logps["shared"]
    worst, row = 0.0, 0
    for r, run in enumerate(runs):
        first = len(run.steps[0].prompt_ids)
        for step in run.steps:
            n = len(step.completion_ids)
            start = len(step.prompt_ids) - first
            worst = max(worst, float((step_lp[row, :n] - run_lp[r, start : start + n]).abs().max()))
            row += 1
    assert worst < 1e-4, f"per-token log-probs differ by {worst:.3e}"
    checks = {
        "loss_per_step": a,
        "loss_shared": b,
        "loss_rel_diff": abs(a - b) / max(abs(a), 1e-30),
        "grad_rel_norm_diff": grad_rel,
        "logps_max_abs_diff": worst,
    }
    return checks, memory


# ---------------------------------------------------------------------------------------- main
def bench_steps(trainer, tokenizer, num_steps: int, args, device, cpu_mem: bool) -> dict:
    rng = random.Random(args.seed * 1000 + num_steps)
    runs, advantages = make_runs(
        args.runs, num_steps, args.prompt_len, args.completion_len, args.observation_len, tokenizer, rng
    )
    batches = {
        "per_step": build_batch(trainer, runs, advantages, False, device),
        "shared": build_batch(trainer, runs, advantages, True, device),
    }
    counts = {name: token_counts(batches[name]) for name in LAYOUTS}
    assert counts["per_step"]["rows"] == args.runs * num_steps and counts["shared"]["rows"] == args.runs
    assert counts["per_step"]["samples"] == counts["shared"]["samples"] == args.runs * num_steps
    assert counts["per_step"]["trained_tokens"] == counts["shared"]["trained_tokens"]
    rows = {name: forward_rows(batches[name]) for name in LAYOUTS}

    print(f"[steps={num_steps}] checking equivalence, measuring peak memory ...", flush=True)
    checks, memory = check_equivalence(trainer, runs, batches, device, cpu_mem, not args.no_logps)

    times = {name: {"train": [], "logps": []} for name in LAYOUTS}
    for rep in range(args.warmup + args.reps):
        order = LAYOUTS if rep % 2 == 0 else LAYOUTS[::-1]  # ABBA: no layout always runs first
        last = {name: {} for name in LAYOUTS}
        for name in order:
            last[name]["train"] = train_once(trainer, batches[name], device)
        trainer.model.zero_grad(set_to_none=True)
        if not args.no_logps:
            for name in order:
                last[name]["logps"] = logps_once(trainer, rows[name], device)
        if rep >= args.warmup:
            for name in LAYOUTS:
                for kind, elapsed in last[name].items():
                    times[name][kind].append(elapsed)
        label = f"warm-up {rep + 1}/{args.warmup}" if rep < args.warmup else f"rep {rep - args.warmup + 1}/{args.reps}"
        print(
            f"[steps={num_steps}] {label}: "
            + ", ".join(
                f"{name} {kind} {wall:.3f}s (cpu {cpu / wall:.2f})"
                for name in LAYOUTS
                for kind, (wall, cpu) in last[name].items()
            ),
            flush=True,
        )

    layouts = {}
    for name in LAYOUTS:
        layouts[name] = {
            **counts[name],
            "train": summary(times[name]["train"]),
            "peak_mem_train_mib": memory[name]["train_mib"],
        }
        if not args.no_logps:
            layouts[name]["logps"] = summary(times[name]["logps"])
            layouts[name]["peak_mem_logps_mib"] = memory[name]["logps_mib"]

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    ps, sh = layouts["per_step"], layouts["shared"]
    ratios = {
        "train_median": ratio(ps["train"]["median_s"], sh["train"]["median_s"]),
        "padded_tokens": ratio(ps["padded_tokens"], sh["padded_tokens"]),
        "real_tokens": ratio(ps["real_tokens"], sh["real_tokens"]),
        "peak_mem_train": ratio(ps["peak_mem_train_mib"], sh["peak_mem_train_mib"]),
    }
    if not args.no_logps:
        ratios["logps_median"] = ratio(ps["logps"]["median_s"], sh["logps"]["median_s"])
        ratios["peak_mem_logps"] = ratio(ps["peak_mem_logps_mib"], sh["peak_mem_logps_mib"])
    return {
        "steps_per_run": num_steps,
        "runs": args.runs,
        "layouts": layouts,
        "ratio_per_step_over_shared": ratios,
        "checks": checks,
    }


def markdown(report: dict) -> str:
    m, c = report["machine"], report["config"]
    lines = [
        "# Shared-prefix rows vs one row per step (`StepGRPOTrainer`)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {m['platform']}; CPU: {m['cpu']} ({m['os_cpu_count']} visible cores); device `{m['device']}`"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f"; Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}, trl {m['trl']}; torch threads: {m['torch_threads']}; load average "
        f"(1/5/15 min) {m['load_average_start']} at start, {m['load_average_end']} at end.",
        "",
        f"Model: random Qwen2, hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads ({c['kv_heads']} KV), "
        f"intermediate {c['intermediate']}, vocab {c['vocab']}, {c['parameters'] / 1e6:.2f}M parameters, fp32. "
        f"Runs: {c['runs']} per setting; initial prompt {c['prompt_len']} tokens, completion {c['completion_len']} "
        f"(ending in EOS), observation {c['observation_len']}. Loss: preset `{c['algorithm']}` "
        f"(`{c['policy_loss_fn']}` policy loss, `{c['loss_agg_mode']}`, KL `{c['kl_loss_fn']}`), whole batch as one "
        f"micro-batch. Timings: median of {c['reps']} reps after {c['warmup']} warm-ups, layouts interleaved.",
        "",
        "`train` = `_compute_loss` + `backward()`; `logps` = no-grad `scoring.logps` (behaviour / reference "
        "log-probs, chunks of `per_device_train_batch_size` rows). Tokens: `padded` = rows x padded width (what "
        "the model processes), `real` = non-padding tokens, `trained` = tokens carrying loss.",
        "",
        "| steps/run | layout | rows | width | padded tokens | real tokens | trained tokens | train median (s) "
        "| logps median (s) | peak mem train (MiB) | peak mem logps (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in report["results"]:
        for name in LAYOUTS:
            lay = res["layouts"][name]
            lines.append(
                f"| {res['steps_per_run']} | {name.replace('_', '-')} | {lay['rows']} | {lay['width']} "
                f"| {lay['padded_tokens']} "
                f"| {lay['real_tokens']} | {lay['trained_tokens']} | {bc.fmt(lay['train']['median_s'])} "
                f"| {bc.fmt(lay.get('logps', {}).get('median_s'))} | {bc.fmt(lay['peak_mem_train_mib'], '.0f')} "
                f"| {bc.fmt(lay.get('peak_mem_logps_mib'), '.0f')} |"
            )
        r = res["ratio_per_step_over_shared"]
        lines.append(
            f"| {res['steps_per_run']} | **per-step / shared** | | | {bc.fmt(r['padded_tokens'], '.2f', 'x')} "
            f"| {bc.fmt(r['real_tokens'], '.2f', 'x')} | | **{bc.fmt(r['train_median'], '.2f', 'x')}** "
            f"| **{bc.fmt(r.get('logps_median'), '.2f', 'x')}** | {bc.fmt(r['peak_mem_train'], '.2f', 'x')} "
            f"| {bc.fmt(r.get('peak_mem_logps'), '.2f', 'x')} |"
        )
    lines += [
        "",
        "Equivalence checks (untimed, asserted): same loss to 1e-4 relative, gradients to 1e-3 relative "
        "norm, per-token log-probs of every step's completion to 1e-4.",
        "",
        "| steps/run | loss per-step | loss shared | loss rel. diff | grad rel. norm diff | logps max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for res in report["results"]:
        k = res["checks"]
        lines.append(
            f"| {res['steps_per_run']} | {k['loss_per_step']:.6f} | {k['loss_shared']:.6f} "
            f"| {k['loss_rel_diff']:.1e} | {k['grad_rel_norm_diff']:.1e} | {k['logps_max_abs_diff']:.1e} |"
        )
    lines += ["", f"Memory: {report['memory_note']}", ""]
    lines += [
        "Timing spread: min / max wall seconds of the timed reps, and median CPU utilisation (process CPU "
        "seconds / wall seconds; near the thread count when the cores were ours, lower when other processes "
        "competed for them):",
        "",
    ]
    for res in report["results"]:
        for name in LAYOUTS:
            lay = res["layouts"][name]
            parts = [
                f"{kind} {lay[kind]['min_s']:.3f} / {lay[kind]['max_s']:.3f} s, cpu {lay[kind]['cpu_util_median']:.2f}"
                for kind in ("train", "logps")
                if kind in lay
            ]
            lines.append(f"- {res['steps_per_run']} steps, {name.replace('_', '-')}: " + "; ".join(parts))
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 8], help="steps per run (one setting each)")
    parser.add_argument("--runs", type=int, default=8, help="runs per setting (also per_device_train_batch_size)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--observation-len", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-logps", action="store_true", help="skip timing scoring.logps")
    parser.add_argument("--out", default="benchmarks/results", help="directory for shared_prefix.json / .md")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be >= 2 (GRPO groups need 2 generations)")
    if args.completion_len < 1 or min(args.steps) < 1:
        parser.error("--completion-len and --steps must be >= 1")

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    cpu_mem = device.type == "cpu" and _cpu_peak_supported()
    started = time.perf_counter()
    load_start = bc.loadavg()

    longest = args.prompt_len + max(args.steps) * (args.completion_len + args.observation_len)
    with tempfile.TemporaryDirectory(prefix="shared_prefix_bench_") as tmp:
        model_dir = Path(tmp) / "model"
        bc.save_random_qwen2(
            model_dir,
            args.hidden,
            args.layers,
            args.heads,
            args.kv_heads,
            args.intermediate,
            max_positions=max(512, longest),
            seed=args.seed,
        )
        trainer = make_trainer(model_dir, Path(tmp) / "out", args)
        tokenizer = trainer._tokenizer
        model_device = next(trainer.model.parameters()).device
        assert model_device.type == device.type, f"model on {model_device}, wanted {device}"
        algo = trainer.algorithm
        config = {
            "runs": args.runs,
            "prompt_len": args.prompt_len,
            "completion_len": args.completion_len,
            "observation_len": args.observation_len,
            "reps": args.reps,
            "warmup": args.warmup,
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "intermediate": args.intermediate,
            "vocab": len(tokenizer),
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "algorithm": trainer.args.algorithm,
            "policy_loss_fn": algo.policy_loss.name,
            "loss_agg_mode": algo.loss_agg_mode,
            "kl_loss_fn": trainer.kl_loss.name,
            "entropy_loss_fn": trainer.entropy_loss.name,
            "per_device_train_batch_size": args.runs,
            "attn_implementation": trainer.model.config._attn_implementation,
            "dtype": "float32",
            "seed": args.seed,
        }
        results = [bench_steps(trainer, tokenizer, n, args, device, cpu_mem) for n in args.steps]

    if device.type == "cuda":
        memory_note = (
            "CUDA peak allocated bytes (torch.cuda.max_memory_allocated) above the bytes allocated "
            "before the call (model, optimizer-free, batch tensors already resident)."
        )
    elif cpu_mem:
        memory_note = (
            "CPU peak resident set size during one untimed call, above the RSS before it (VmHWM reset "
            "through /proc/self/clear_refs after gc + malloc_trim). Approximate: allocator caching and "
            "other process activity blur it; compare the layouts, not absolute values."
        )
    else:
        memory_note = "not measured (CPU, and /proc/self/clear_refs is not writable here)."
    report = {
        "benchmark": "shared_prefix",
        "command": " ".join([bc.interpreter(), *sys.argv]),
        "machine": {
            **bc.machine_description(str(device)),
            "load_average_start": load_start,
            "load_average_end": bc.loadavg(),
        },
        "config": config,
        "memory_note": memory_note,
        "results": results,
        "total_wall_s": time.perf_counter() - started,
    }
    bc.write_report(args.out, "shared_prefix", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
