#!/usr/bin/env python
"""The whole step a user waits for, at TRL's defaults: ours against TRL's ``GRPOTrainer`` on the same job with
transformers generation, and TRL with its continuous batching, each step split into phases (`phases.PhaseTimer`).
The sides, the job, its departures from TRL's defaults, the protocol and how compilation is charged:
docs/benchmarks.md#whole-step.

    nice -n 5 python benchmarks/whole_step.py                       # the CPU points (bundled SmolLM2-135M)
    python benchmarks/whole_step.py --gpu                           # `make gpu-check-step`: the GPU run (8 minutes)
    python benchmarks/whole_step.py --dry-run                       # tiny shapes on CPU (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import harness

#: parts: model, prompt, completion, repeats; ``--gpu`` runs GPU_PARTS (the issue's "GPU run"), else CPU_PARTS
CPU_PARTS = {"bundled P64 C32": ("bundled", 64, 32)}
GPU_PARTS = {"0.5B P256 C128": ("qwen2.5-0.5b", 256, 128), "1.5B P1024 C128": ("qwen2.5-1.5b", 1024, 128)}
#: the GPU run: 3 repeats of the 0.5B point after a cache-warming process, then one of 1.5B, in `GPU_BUDGET_S`
#: (run.sh's installs before it: about 40 s of the command's 8 minutes); a part starts no repeat after its mark
GPU_REPEATS = {"0.5B P256 C128": 3, "1.5B P1024 C128": 1}
GPU_MARKS = {"0.5B P256 C128": 290.0, "1.5B P1024 C128": 330.0}
GPU_BUDGET_S = 430.0
SIDES = ("ours", "ours_off", "trl", "trl_cb")
GPU_SIDES = ("ours", "trl", "trl_cb")
#: imported once by the server the sides are forked from (`harness.Launcher`)
PRELOAD = ("bench_common", "torch", "transformers", "datasets", "trl", "peft", "trinity_trl.trainers", "prefix_packing")
GENERATIONS = 8  # TRL's default num_generations and per_device_train_batch_size: one prompt a step


# ------------------------------------------------------------------------------------------------- one side
def make_model(spec: dict) -> dict:
    """In a fresh process: the model directory of ``spec["model"]`` (random models are made and saved here; those of
    a real shape in bf16)."""
    import bench_common as bc

    name = spec["model"]
    return bc.random_model(name, os.path.join(spec["work"], name), spec["device"], bf16=name not in ("tiny", "bundled"))


def build_trainer(spec: dict, completions: list):
    """The side's trainer and the departures from TRL's defaults it was given."""
    import torch
    from datasets import Dataset
    from prefix_packing import prompt_texts
    from transformers import AutoConfig, AutoTokenizer

    side, cpu = spec["side"], spec["device"] == "cpu"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    steps = spec["warmup"] + spec["steps"]
    dataset = Dataset.from_dict({"prompt": prompt_texts(tokenizer, spec["prompt"], steps + 2, spec["seed"])})

    def reward(completions, completion_ids, **kwargs):
        completions_per_step.append(sum(len(ids) for ids in completion_ids))
        return [len(ids) / 10.0 for ids in completion_ids]

    completions_per_step = completions
    job = {"output_dir": os.path.join(spec["work"], f"out-{side}-{os.getpid()}"), "max_steps": steps}
    job |= {"max_completion_length": spec["completion"], "seed": spec["seed"], "disable_tqdm": True}
    job |= {"report_to": "none", "save_strategy": "no"}
    departures = [f"max_completion_length={spec['completion']}", f"max_steps={steps}"]
    if cpu:
        job.update(use_cpu=True, bf16=False, activation_checkpointing=False)
        departures.append("CPU: use_cpu, bf16=False, activation_checkpointing=False, float32 weights")
    vocab = AutoConfig.from_pretrained(spec["model_path"]).vocab_size
    if vocab > len(tokenizer):  # a random model of the real vocabulary: sample only ids the tokenizer decodes
        job["generation_kwargs"] = {"suppress_tokens": list(range(len(tokenizer), vocab))}
        departures.append(f"suppress_tokens: the {vocab - len(tokenizer)} ids the tiny tokenizer cannot decode")
    if side.startswith("ours"):
        from trinity_trl.trainers import TrinityConfig, TrinityTrainer

        ours = {"algorithm": "grpo", "loss_normalization": "global", "advantage": {"epsilon": 1e-4}}
        if side == "ours_off":
            ours.update(compile_generation="off", one_prefill_per_group=False)
        args = TrinityConfig(**job, **ours)
        trainer = TrinityTrainer(model=spec["model_path"], reward_funcs=reward, args=args, train_dataset=dataset)
        return trainer, departures + [f"ours: {ours}"]
    from trl import GRPOConfig, GRPOTrainer

    if cpu:  # the same float32 weights as ours (transformers would load the dtype the checkpoint declares)
        job["model_init_kwargs"] = {"dtype": torch.float32}
    if side == "trl_cb":
        job["use_transformers_continuous_batching"] = True
        if cpu:  # sized for the job: TRL's automatic sizing takes the host's memory on a CPU
            pages = -(-(spec["prompt"] + spec["completion"]) // 256)
            job["transformers_continuous_batching_config"] = {
                "num_blocks": GENERATIONS * pages + 2,
                "max_batch_tokens": GENERATIONS * spec["prompt"],
            }
            departures.append(f"continuous batching cache: {job['transformers_continuous_batching_config']}")
    args = GRPOConfig(**job)
    trainer = GRPOTrainer(model=spec["model_path"], reward_funcs=reward, args=args, train_dataset=dataset)
    return trainer, departures


def run_side(spec: dict) -> dict:
    """In a fresh process: build the side's trainer, train ``warmup + steps`` steps under the phase timer."""
    started = time.perf_counter()
    import torch
    from phases import PhaseTimer, summarise_steps

    counters = CompileCounters()
    completions: list[int] = []
    trainer, departures = build_trainer(spec, completions)
    if trainer.args.per_device_train_batch_size != GENERATIONS or trainer.num_generations != GENERATIONS:
        raise RuntimeError("the job is one prompt of 8 completions a step (TRL's default batch)")
    init_s = time.perf_counter() - started
    timer = PhaseTimer(trainer, check=spec.get("check", False))
    trainer.add_callback(counters.callback())
    cuda = trainer.accelerator.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dtype_start = str(next(trainer.model.parameters()).dtype)
    trainer.train()
    steps, warmup = timer.steps, spec["warmup"]
    summary = summarise_steps(steps, skip=warmup)
    first = steps[0]
    generation_config, args = getattr(trainer, "generation_config", None), trainer.args
    ours = {k: getattr(args, k) for k in ("compile_generation", "one_prefill_per_group") if hasattr(args, k)}
    record = {
        "side": spec["side"],
        "trainer": type(trainer).__name__,
        "departures": departures,
        "dtype": {
            "parameters": dtype_start,
            "parameters_after": str(next(trainer.model.parameters()).dtype),
            "autocast": "bf16" if trainer.args.bf16 else "fp16" if trainer.args.fp16 else None,
            "activation_checkpointing": bool(trainer.args.activation_checkpointing),
        },
        "generation": {
            "continuous_batching": bool(getattr(trainer, "use_transformers_continuous_batching", False)),
            "disable_compile": getattr(generation_config, "disable_compile", None),
            "cache_implementation": getattr(generation_config, "cache_implementation", None),
            **ours,
        },
        "init_s": init_s,
        "step_s": summary["step_s"],
        "phases": summary["host"],
        "first_step_s": first["step_s"],
        "first_step_excess_s": first["step_s"] - summary["step_s"],
        "first_generation_excess_s": first["host"]["generation"] - summary["host"]["generation"],
        "completion_tokens": completions,
        "steps": steps,
        "compile": counters.totals(),
        "compile_per_step": counters.per_step,
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else harness.bc.max_rss_mib(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
    }
    if "device" in summary:  # CUDA: the split on the device's clock
        record |= {"device_step_s": summary["device_step_s"], "device_phases": summary["device"]}
    return record | {"run_s": time.perf_counter() - started}


class CompileCounters:
    """Compilations in this process: dynamo frame compilations and CUDA-graph recordings through torch's
    compilation callbacks (`torch._dynamo.callback`, the triggers torch itself reports), and CUDA-graph replays by
    counting ``torch.cuda.CUDAGraph.replay`` (in this benchmark process only); a snapshot after every step."""

    def __init__(self):
        import torch

        self.counts = {"dynamo_compiles": 0, "cudagraph_recordings": 0, "cudagraph_replays": 0}
        self.per_step: list[dict] = []
        try:
            from torch._dynamo.callback import CallbackTrigger, callback_handler
        except ImportError:  # older torch: no triggers, every start counts as a dynamo compilation
            CallbackTrigger, callback_handler = None, torch._dynamo.callback_handler
        recording = getattr(CallbackTrigger, "CUDAGRAPH_RECORDING", None)

        def on_start(args=None):
            key = "cudagraph_recordings" if getattr(args, "callback_trigger", None) == recording else "dynamo_compiles"
            self.counts[key] += 1

        callback_handler.register_start_callback(on_start)
        if torch.cuda.is_available():
            replay = torch.cuda.CUDAGraph.replay

            def counted_replay(graph):
                self.counts["cudagraph_replays"] += 1
                return replay(graph)

            torch.cuda.CUDAGraph.replay = counted_replay

    def totals(self) -> dict:
        return dict(self.counts)

    def callback(self):
        from transformers import TrainerCallback

        class Snapshot(TrainerCallback):
            def on_step_end(snapshot, args, state, control, **kwargs):
                self.per_step.append(self.totals())

        return Snapshot()


# ----------------------------------------------------------------------------------------------------- driver
def sides_of(names, common: dict, env: dict, timeout_s: float) -> list[harness.Side]:
    return [harness.Side(n, "whole_step:run_side", {**common, "side": n}, env, timeout_s) for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_arguments(parser, repeats=3)
    parser.add_argument("--gpu", action="store_true", help="the GPU run: 0.5B then 1.5B on CUDA (make gpu-check-step)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, help="sides to run (default: every side that applies)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results file name (default whole_step[_cuda|_dry])")
    parser.add_argument("--report-only", metavar="JSON", help="recompute the derived figures and rewrite the .md")
    args = parser.parse_args(argv)
    if args.report_only:
        harness.rewrite(args.report_only, markdown, update=finish_parts)
        return 0
    device = "cuda" if args.gpu and not args.dry_run else "cpu"
    parts = GPU_PARTS if args.gpu else CPU_PARTS
    if args.dry_run:  # the same parts and sides with the tiny model on CPU, one repeat, one timed step
        parts = {f"{n}, dry run: tiny P{p // 16} C8": ("tiny", p // 16, 8) for n, (_, p, _) in parts.items()}
        args.steps, args.repeats = 1, 1
    names = args.sides or (GPU_SIDES if args.gpu else SIDES)
    budget = GPU_BUDGET_S if args.gpu and args.budget is None else args.budget
    name = args.name or "whole_step" + ("_cuda" if args.gpu else "") + ("_dry" if args.dry_run else "")
    work = tempfile.mkdtemp(prefix="whole_step-")
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor"), "TRITON_CACHE_DIR": os.path.join(work, "triton")}
    config = {**{k: v for k, v in vars(args).items() if k != "out"}, "device": device, "sides": list(names)}
    options = {"device": device, "render": markdown, "budget_s": budget, "preload": PRELOAD, "log": args.gpu}
    options["title"] = "The whole step at TRL's defaults: ours against TRL's GRPOTrainer"
    bench = harness.Bench(name, harness.out_dir(args), config=config, **options)
    try:
        for index, (part_name, (model, prompt, completion)) in enumerate(parts.items()):
            run_part(bench, part_name, model, prompt, completion, names, env, work, args, device, index == 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return bench.finish()


def run_part(bench, part_name, model, prompt, completion, names, env, work, args, device, first: bool) -> None:
    """One point: its model (made in a process of its own), in the first part the cache-warming run (the later
    parts' time goes to their repeats: their ``ours`` runs compile their new shapes cold), then the repeats."""
    gpu = device == "cuda"
    part = bench.part(
        part_name,
        mark_s=GPU_MARKS.get(part_name) if gpu else None,
        description=f"`{model}`; prompt {prompt}, completion at most {completion}, G {GENERATIONS}, "
        f"{args.warmup} warm-up + {args.steps} timed steps per run, device `{device}`.",
    )
    made = part.run_once(
        harness.Side("model", "whole_step:make_model", {"model": model, "work": work, "device": device}), "model"
    )
    if made is None:
        return
    if not harness.ok(made):
        part.record.update(status="failed", why="its model could not be made")
        return
    part.record["description"] = part.record["description"].replace(f"`{model}`", made["about"])
    common = {"model_path": made["path"], "work": work, "device": device, "prompt": prompt, "completion": completion}
    common |= {"warmup": args.warmup, "steps": args.steps, "seed": args.seed, "check": args.dry_run}
    if "ours" in names and first:  # warms the on-disk compile caches; its first step is the cold compile charge
        part.run_once(sides_of(["ours"], {**common, "steps": 1}, env, args.timeout)[0], "ours, cold caches")
    repeats = GPU_REPEATS[part_name] if gpu else args.repeats
    part.run(sides_of(names, common, env, args.timeout), repeats, reference="trl", ratios=RATIOS)
    finish_part(part.record, args.warmup)
    bench.write()


# ------------------------------------------------------------------------------------------------- reading
#: the figures each side is compared on with TRL's run of the same repeat
RATIOS = ("step_s", "train_s", "phases.generation", "device_step_s")


def finish_part(part: dict, warmup: int) -> None:
    """Derived figures of a finished part: each run's training part (the median over its timed steps of the step
    less its generation), the paired ratios again, and the compilation charge."""
    for repeat in part.get("repeats", []):
        for sample in repeat["samples"].values():
            if harness.ok(sample):
                timed = sample["steps"][warmup:]
                sample["train_s"] = statistics.median(s["step_s"] - s["host"]["generation"] for s in timed)
    if part.get("repeats"):
        part["summary"] = harness.summarise(part["repeats"], "trl", RATIOS)
    part["compilation"] = compilation(part)


def finish_parts(report: dict) -> None:
    for part in report["parts"].values():
        if part.get("repeats") is not None:
            finish_part(part, report["config"]["warmup"])


def compilation(part: dict) -> dict:
    """Seconds of compilation per run, cold and warm: ``ours``' first-step excess over its steady step beyond TRL's
    own (eager) excess, and the steps after which each is repaid by ``ours``' gain per step over the eager side
    (``ours_off`` where it ran, else ``trl``; None: never, no gain). Empty where ``ours`` or ``trl`` did not run;
    ``compiled`` False where ``ours`` compiled nothing (the charge is then noise, and not computed)."""
    runs = {
        side: [r["samples"][side] for r in part.get("repeats", []) if harness.ok(r["samples"].get(side))]
        for side in ("ours", "ours_off", "trl")
    }
    if not runs["ours"] or not runs["trl"]:
        return {}
    if not any(r["compile"]["dynamo_compiles"] for r in runs["ours"]):
        return {"compiled": False}

    def steady(side: str) -> float | None:
        return statistics.median(r["step_s"] for r in runs[side]) if runs[side] else None

    baseline = statistics.median(r["first_step_excess_s"] for r in runs["trl"])
    counted = statistics.median(r["first_step_excess_s"] for r in runs["ours"]) - baseline
    cold_run = (part.get("uncounted") or {}).get("ours, cold caches")
    if cold_run is None:  # no cache-warming run in this part: ours' own runs compiled cold
        warm, cold = None, counted
    else:
        warm, cold = counted, cold_run["first_step_excess_s"] - baseline if harness.ok(cold_run) else None
    eager = "ours_off" if runs["ours_off"] else "trl"
    gain = steady(eager) - steady("ours")

    repaid = {k: None if c is None or gain <= 0 else max(c, 0.0) / gain for k, c in (("cold", cold), ("warm", warm))}
    record = {"compiled": True, "warm_s": warm, "cold_s": cold, "eager_side": eager, "gain_per_step_s": gain}
    return record | {"repaid_after_steps": repaid}


def markdown(report: dict) -> str:
    """The split of every side's step, the dtypes, compilation and departures (after the harness's tables)."""
    lines = ["## The split, per side (median over repeats of each run's median timed step; seconds)", ""]
    from phases import PHASES

    for name, part in report["parts"].items():
        sides = (part.get("summary") or {}).get("sides", {})
        samples = {
            s: next((r["samples"][s] for r in part["repeats"] if harness.ok(r["samples"].get(s))), None) for s in sides
        }
        tables = [
            ("", "phases", "step_s", "| dtype "),
            ("On the device's clock (CUDA events):", "device_phases", "device_step_s", ""),
        ]
        lines += [f"### {name}", ""] if sides else []
        for title, phases, step, dtype in tables:
            if title and not any(f"{phases}.generation" in s for s in sides.values()):
                continue
            extra = " | first step | start-up" if not title else ""
            lines += ([title, ""] if title else []) + [
                f"| side {dtype}| step | " + " | ".join(PHASES) + f"{extra} |",
                "|---|" + "---|" * (len(PHASES) + 1 + (3 if not title else 0)),
            ]
            for side, stats in sides.items():
                if samples[side] is None:
                    continue
                cells = [harness.cell(stats.get(f"{phases}.{p}")) for p in PHASES]
                if not title:
                    cells += [harness.cell(stats.get("first_step_s")), harness.cell(stats.get("init_s"))]
                kind = f"| {dtype_text(samples[side]['dtype'])} " if dtype else ""
                lines.append(f"| {side} {kind}| {harness.cell(stats.get(step))} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += [*_settings(part), ""] if sides else []
    return "\n".join(lines)


def dtype_text(d: dict) -> str:
    text = d["parameters"].replace("torch.", "") + (f" + {d['autocast']} autocast" if d["autocast"] else "")
    after = d["parameters_after"].replace("torch.", "")
    return text + (f", {after} after generating" if d["parameters_after"] != d["parameters"] else "")


def _settings(part: dict) -> list[str]:
    lines = []
    c = part.get("compilation") or {}
    if c.get("compiled") is False:
        lines.append("Compilation: `ours` compiled nothing in its runs (its generation ran eagerly here).")
    elif c:
        repaid = c["repaid_after_steps"]
        lines.append(
            "Compilation per run (first-step excess beyond TRL's): "
            + ", ".join(f"{k} caches {c[f'{k}_s']:.2f} s" for k in ("warm", "cold") if c.get(f"{k}_s") is not None)
            + f"; gain per step against `{c['eager_side']}` "
            + ("n/a" if c["gain_per_step_s"] is None else f"{c['gain_per_step_s']:.3f} s")
            + "; repaid after "
            + ", ".join(
                f"{k} {'never' if v is None else f'{v:.1f} steps'}"
                for k, v in repaid.items()
                if c.get(f"{k}_s") is not None
            )
            + "."
        )
    for side in dict.fromkeys(n for r in part.get("repeats", []) for n in r["samples"]):
        sample = next((r["samples"][side] for r in part["repeats"] if harness.ok(r["samples"].get(side))), None)
        if sample:
            compiled = sample["compile"]
            lines.append(
                f"- `{side}` (`{sample['trainer']}`): generation {sample['generation']}; compilations "
                f"{compiled} (first run); departures from TRL's defaults: {'; '.join(sample['departures'])}."
            )
    return lines


if __name__ == "__main__":
    sys.exit(main())
