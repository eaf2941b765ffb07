#!/usr/bin/env python
"""Benchmark: the prefix-shared packed training forward against TRL's ``GRPOTrainer`` (padded rows).

For every point of the grid (prompt length ``P`` x completion length ``C`` x group size ``G``) the
same model, data, seed and settings are trained by TRL's ``GRPOTrainer`` (``loss_type="grpo"``,
``beta=0``) and by ``TrinityTrainer`` (``algorithm="grpo"``, no KL, ``seq-mean-token-mean``: the pair
``trl_overhead.py`` and the parity tests prove equivalent), whose default ``prefix_packing=True``
forwards each group's prompt once and no padding. One optimizer step = one prompt x ``G``
completions in one micro-batch (``per_device_train_batch_size = num_generations = G``,
``gradient_accumulation_steps=1``). Prompts are exactly ``P`` tokens of random words; the random
model rarely samples EOS, so completions are mostly ``C`` tokens.

Every run is a fresh subprocess training ``--steps`` optimizer steps; the two sides of a point run
one after the other, the first side alternating between repetitions and points. A callback times
each optimizer step (``on_step_begin`` to ``on_step_end``: generation, scoring, loss, backward,
optimizer) and a wrapper around TRL's ``_generate`` times generation, so the report gives the whole
``step`` and its ``train`` part (step minus generation: where the layouts differ), medians over the
steps after ``--warmup``, then over repetitions. Ratios are ours / TRL (< 1: ours faster or smaller).

Memory: on CPU, the peak resident set size during ``train()`` above the RSS just before it
(``VmHWM`` reset through ``/proc/self/clear_refs``: activations, gradients, optimizer state; the
``memory_ratio``) and the process's peak RSS (libraries and weights included); on CUDA,
``torch.cuda.max_memory_allocated`` during ``train()`` above what was allocated before it.

Both sides must log the same loss and gradient norm at every step (checked, reported).

Run it niced from the repository root (the full CPU grid takes about 40 minutes on 2 cores)::

    nice -n 5 .venv/bin/python benchmarks/prefix_packing.py --out benchmarks/results
    nice -n 5 .venv/bin/python benchmarks/prefix_packing.py --device cuda --bf16 --out /tmp/cuda_results
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports

EQUIVALENCE_GRAD_RTOL, EQUIVALENCE_LOSS_ATOL = 1e-3, 1e-4
TARGETS = {
    "headline": (1024, 128, 8),
    "headline_train_time_ratio_max": 0.5,
    "headline_memory_ratio_max": 0.6,
    "short_prompt": 64,
    "short_prompt_train_time_ratio_max": 1.03,
}


# --------------------------------------------------------------------------------------- data
def prompt_texts(tokenizer, length: int, count: int, seed: int) -> list[str]:
    """``count`` plain-text prompts of exactly ``length`` tokens: words that are one token each with
    their leading space (the tokenizer splits words apart, so the count is exact)."""
    words = []
    for token in sorted(tokenizer.get_vocab()):
        text = tokenizer.convert_tokens_to_string([token])
        if (
            text.startswith(" ")
            and text[1:].isalpha()
            and len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1
        ):
            words.append(text)
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(words) for _ in range(length)) for _ in range(count)]
    for p in prompts:
        n = len(tokenizer(p, add_special_tokens=False)["input_ids"])
        if n != length:
            raise RuntimeError(f"a prompt has {n} tokens, wanted {length}")
    return prompts


def char_reward(completions, **kwargs) -> list[float]:
    """Completion length in characters / 10: a non-zero group spread from any model."""
    return [len(c if isinstance(c, str) else str(c)) / 10.0 for c in completions]


# ------------------------------------------------------------------------------------- worker
def worker(spec_path: str) -> int:
    """Train one run described by the JSON spec; write its measurements to ``spec["result"]``."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    transformers.logging.set_verbosity_error()
    cuda = spec["device"] == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    dataset = Dataset.from_dict(
        {"prompt": prompt_texts(tokenizer, spec["prompt_len"], spec["steps"] + 2, spec["seed"])}
    )
    common = dict(
        output_dir=spec["output_dir"],
        use_cpu=not cuda,
        bf16=spec["bf16"],
        activation_checkpointing=False,
        per_device_train_batch_size=spec["generations"],
        num_generations=spec["generations"],
        max_completion_length=spec["completion_len"],
        max_steps=spec["steps"],
        learning_rate=spec["learning_rate"],
        temperature=1.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        shuffle_dataset=False,
        max_grad_norm=1e9,
    )
    if spec["side"] == "ours":
        from trinity_trl.trainers import TrinityConfig, TrinityTrainer

        config = TrinityConfig(
            algorithm="grpo",
            kl_loss_fn="none",
            loss_agg_mode="seq-mean-token-mean",
            prefix_packing=spec["packing"],
            **common,
        )
        trainer = TrinityTrainer(
            model=spec["model"],
            reward_funcs=char_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    else:
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(loss_type="grpo", beta=0.0, **common)
        trainer = GRPOTrainer(
            model=spec["model"],
            reward_funcs=char_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            steps.append({"begin": time.perf_counter(), "generation": 0.0})

        def on_step_end(self, args, state, control, **kw):
            sync()
            steps[-1]["end"] = time.perf_counter()

    trainer.add_callback(StepTimer())
    generate = trainer._generate

    def timed_generate(*a, **kw):
        sync()
        start = time.perf_counter()
        out = generate(*a, **kw)
        sync()
        steps[-1]["generation"] += time.perf_counter() - start
        return out

    trainer._generate = timed_generate
    compute_loss = trainer._compute_loss
    batches: list[dict] = []

    def counting_compute_loss(model, inputs):
        batches.append(
            {
                "rows": int(inputs["prompt_ids"].shape[0]),
                "padded_tokens": int(inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()),
                "real_tokens": int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()),
            }
        )
        return compute_loss(model, inputs)

    trainer._compute_loss = counting_compute_loss

    gc.collect()
    bc.malloc_trim()
    rss_before = bc.read_status_kb("VmRSS")
    hwm_reset = (not cuda) and bc.reset_peak_rss()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    trainer.train()
    sync()
    wall = time.perf_counter() - wall_start
    logs = trainer.state.log_history
    result = {
        "step_s": [s["end"] - s["begin"] for s in steps if "end" in s],
        "generation_s": [s["generation"] for s in steps if "end" in s],
        "train_wall_s": wall,
        "cpu_util": (time.process_time() - cpu_start) / wall if wall > 0 else None,
        "process_peak_rss_mib": bc.max_rss_mib(),
        "train_peak_rss_above_start_mib": (
            (bc.read_status_kb("VmHWM") - rss_before) / 1024 if hwm_reset and rss_before is not None else None
        ),
        "micro_batch": batches[0] if batches else None,
        "losses": [e["loss"] for e in logs if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in logs if "grad_norm" in e],
        "forwarded_token_ratio": [
            e["packing/forwarded_token_ratio"] for e in logs if "packing/forwarded_token_ratio" in e
        ],
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "loadavg_end": bc.loadavg(),
    }
    if cuda:
        result["cuda_peak_above_start_mib"] = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20
        result["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------- driver
def run_worker(spec: dict, tmp: Path, index: int, timeout: float) -> dict:
    spec = dict(spec, output_dir=str(tmp / f"out{index}"), result=str(tmp / f"result{index}.json"))
    path = tmp / f"spec{index}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run {spec['point']}/{spec['side']} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(Path(spec["result"]).read_text())


def run_summary(result: dict, warmup: int) -> dict:
    steps, gens = result["step_s"][warmup:], result["generation_s"][warmup:]
    return {
        "step_s": bc.median(steps),
        "generation_s": bc.median(gens),
        "train_s": bc.median([s - g for s, g in zip(steps, gens)]),
    }


def side_summary(results: list[dict], warmup: int) -> dict:
    per_run = [run_summary(r, warmup) for r in results]
    out = {key: bc.median([p[key] for p in per_run]) for key in ("step_s", "generation_s", "train_s")}
    for key in (
        "process_peak_rss_mib",
        "train_peak_rss_above_start_mib",
        "cuda_peak_above_start_mib",
        "cuda_peak_allocated_mib",
        "cpu_util",
    ):
        out[key] = bc.median([r.get(key) for r in results])
    out["micro_batch"] = results[0]["micro_batch"]
    ratios = [x for r in results for x in r["forwarded_token_ratio"]]
    out["forwarded_token_ratio"] = bc.median(ratios) if ratios else None
    out["per_run"] = per_run
    return out


def compare(ours: list[dict], trl: list[dict], warmup: int, memory_key: str) -> dict:
    so, st = side_summary(ours, warmup), side_summary(trl, warmup)
    loss, grad = [], []
    for x, y in zip(ours, trl):
        loss += [abs(u - v) for u, v in zip(x["losses"], y["losses"])]
        grad += [abs(u - v) / max(abs(u), abs(v), 1e-12) for u, v in zip(x["grad_norms"], y["grad_norms"])]
    paired = [bc.ratio(run_summary(x, warmup)["train_s"], run_summary(y, warmup)["train_s"]) for x, y in zip(ours, trl)]
    return {
        "ours": so,
        "trl": st,
        "train_time_ratio": bc.ratio(so["train_s"], st["train_s"]),
        "train_time_ratio_paired": bc.median(paired),
        "step_time_ratio": bc.ratio(so["step_s"], st["step_s"]),
        "memory_ratio": bc.ratio(so[memory_key], st[memory_key]),
        "process_peak_memory_ratio": bc.ratio(so["process_peak_rss_mib"], st["process_peak_rss_mib"]),
        "equivalence": {
            "equivalent": bool(grad) and max(grad) < EQUIVALENCE_GRAD_RTOL and max(loss) < EQUIVALENCE_LOSS_ATOL,
            "loss_max_abs_diff": max(loss) if loss else None,
            "grad_norm_max_rel_diff": max(grad) if grad else None,
        },
    }


def resolve_model(name: str, args, tmp: Path) -> tuple[str, str]:
    if name == "tiny":
        path = bc.save_random_qwen2(
            tmp / "model",
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            max_positions=4096,
            seed=args.seed,
        )
        return path, (
            f"random Qwen2 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} "
            f"KV, intermediate {args.intermediate}, vocab 489) with the tests' tiny BPE tokenizer"
        )
    if name == "bundled":
        from trinity_trl.data import bundled_model_dir

        return str(bundled_model_dir()), "SmolLM2-135M-Instruct (bundled, Llama architecture, vocab 49152)"
    return name, name


def markdown(report: dict) -> str:
    c, m = report["config"], report["machine"]
    mem = "CUDA peak allocated above start" if c["device"] == "cuda" else "peak RSS during train() above start"
    lines = [
        "# Prefix-shared packed training forward vs TRL's `GRPOTrainer`",
        "",
        f"{'**Quick setting** (smoke run, not for conclusions). ' if c['quick'] else ''}Command: "
        + "; then ".join(f"`{x}`" for x in report["commands"]),
        "",
        bc.machine_line(m),
        f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end.",
        "",
        (
            f"Model: {report['model_description']} ({report['parameters'] / 1e6:.1f}M parameters), "
            f"{'bf16' if c['bf16'] else 'fp32'}, full fine-tuning, lr {c['learning_rate']}. "
            f"One optimizer step = 1 prompt "
            f"x G completions in one micro-batch. Each run: {c['steps']} steps, the first {c['warmup']} untimed "
            f"(prompts of {c['long_prompt']}+ tokens: {c['long_steps']} step(s), {c['long_warmup']} untimed); "
            f"{c['repeats']} run(s) per side per point, {c['focus_repeats']} at the target points (prompt "
            f"{TARGETS['short_prompt']}, and {'/'.join(map(str, TARGETS['headline']))}); sides interleaved. Ours: "
            "`TrinityTrainer(algorithm='grpo', kl_loss_fn='none', loss_agg_mode='seq-mean-token-mean')` with "
            "`prefix_packing=True` (the default); TRL: `GRPOConfig(loss_type='grpo', beta=0)`."
        ),
        "",
        (
            "`train` = step minus TRL's generation (scoring, log-prob forward, loss, backward, optimizer); "
            "`step` = the "
            f"whole optimizer step; memory = {mem}. Ratios ours / TRL (< 1: ours faster / smaller). `tokens fwd` = "
            "tokens the packed forward processes / tokens of TRL's padded micro-batch."
        ),
        "",
        "| model | P | C | G | tokens fwd | ours train (s) | TRL train (s) | **train ratio** | step ratio "
        "| ours mem (MiB) | TRL mem (MiB) | **memory ratio** | process peak ratio | equal loss/grad-norm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mk = report["memory_key"]
    for point in sorted(
        report["results"], key=lambda r: (r["model"] != "tiny", r["prompt_len"], r["completion_len"], r["generations"])
    ):
        r = point["comparison"]
        o, t, e = r["ours"], r["trl"], r["equivalence"]
        lines.append(
            f"| {point['model']} | {point['prompt_len']} | {point['completion_len']} | {point['generations']} "
            f"| {bc.fmt(o['forwarded_token_ratio'], '.2f')} | {bc.fmt(o['train_s'])} | {bc.fmt(t['train_s'])} "
            f"| **{bc.fmt(r['train_time_ratio'])}** | {bc.fmt(r['step_time_ratio'])} | {bc.fmt(o[mk], '.0f')} "
            f"| {bc.fmt(t[mk], '.0f')} | **{bc.fmt(r['memory_ratio'])}** | {bc.fmt(r['process_peak_memory_ratio'])} "
            f"| {'yes' if e['equivalent'] else 'NO'} ({bc.fmt(e['loss_max_abs_diff'], '.0e')} / "
            f"{bc.fmt(e['grad_norm_max_rel_diff'], '.0e')}) |"
        )
    s = report["summary"]
    lines += [
        "",
        "Targets (CPU, training part of the step):",
        "",
        f"- prompt 1024, completion 128, G 8: train ratio {bc.fmt(s['headline_train_time_ratio'])} (target <= "
        f"{TARGETS['headline_train_time_ratio_max']}), memory ratio {bc.fmt(s['headline_memory_ratio'])} "
        f"(target <= {TARGETS['headline_memory_ratio_max']}): "
        f"{'met' if s['headline_met'] else 'NOT met' if s['headline_met'] is not None else 'not measured'}",
        f"- prompt 64: worst train ratio {bc.fmt(s['short_prompt_worst_train_time_ratio'])} (target <= "
        f"{TARGETS['short_prompt_train_time_ratio_max']}): "
        f"{'met' if s['short_prompt_met'] else 'NOT met' if s['short_prompt_met'] is not None else 'not measured'}",
        "",
    ]
    if report["not_measured"]:
        lines += [
            f"Not measured (run cut short): {', '.join('/'.join(map(str, p)) for p in report['not_measured'])}.",
            "",
        ]
    lines += [f"Total wall time {report['total_wall_s'] / 60:.1f} min.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--completion-lens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--generations", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument(
        "--bundled-point",
        type=int,
        nargs=3,
        metavar=("P", "C", "G"),
        default=[256, 32, 8],
        help="one point on the bundled SmolLM2-135M-Instruct ('none' with --no-bundled)",
    )
    parser.add_argument("--no-bundled", action="store_true", help="skip the bundled-model point")
    parser.add_argument("--only-bundled", action="store_true", help="run the bundled-model point only")
    parser.add_argument(
        "--resume",
        metavar="JSON",
        help="a prefix_packing.json from an earlier (cut short) run: keep its points, run the others",
    )
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run not timed")
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=1024,
        help="points with at least this prompt length run --long-steps / --long-warmup instead",
    )
    parser.add_argument("--long-steps", type=int, default=1, help="optimizer steps per run at long-prompt points")
    parser.add_argument("--long-warmup", type=int, default=0, help="untimed first steps at long-prompt points")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side per point")
    parser.add_argument(
        "--focus-repeats", type=int, default=2, help="runs per side at the target points (prompt 64, and 1024/128/8)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1 on a shared 2-core machine)")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke setting: one small point, 2 steps, a 2-layer hidden-64 model, no bundled model",
    )
    parser.add_argument("--out", default="benchmarks/results", help="directory for prefix_packing.json / .md")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.quick:
        args.prompt_lens, args.completion_lens, args.generations = [32], [8], [4]
        args.steps, args.warmup, args.repeats, args.focus_repeats, args.no_bundled = 2, 1, 1, 1, True
        args.long_steps, args.long_warmup = 2, 1
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 4, 2, 128
    if args.steps <= args.warmup or args.long_steps <= args.long_warmup:
        parser.error("--steps must be larger than --warmup (and --long-steps than --long-warmup)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch.cuda.is_available() is False")

    started, load_start = time.perf_counter(), bc.loadavg()
    points = [("tiny", p, c, g) for p in args.prompt_lens for c in args.completion_lens for g in args.generations]
    # the target points first, then the rest from the cheapest: the report is rewritten after every point, so a
    # run cut short still holds whole points
    points.sort(key=lambda x: (x[1:] != TARGETS["headline"], x[1] != TARGETS["short_prompt"], x[3] * (x[1] + x[2])))
    if args.only_bundled:
        points = []
    if not args.no_bundled:
        points.append(("bundled", *args.bundled_point))
    results, parameters, descriptions, commands = [], {}, {}, []
    if args.resume:
        earlier = json.loads(Path(args.resume).read_text())
        results = earlier["results"]
        parameters, descriptions = earlier["parameters_by_model"], earlier["model_descriptions"]
        commands = earlier.get("commands", [earlier["command"]])
        done = {(r["model"], r["prompt_len"], r["completion_len"], r["generations"]) for r in results}
        points = [p for p in points if p not in done]
        args.resumed_wall_s = earlier["total_wall_s"]
    index = 0
    with tempfile.TemporaryDirectory(prefix="prefix_packing_") as tmp_name:
        tmp = Path(tmp_name)
        paths = {}
        for model in dict.fromkeys(p[0] for p in points):
            paths[model], descriptions[model] = resolve_model(model, args, tmp)
        args.commands = commands
        for n, (model, p, c, g) in enumerate(points):
            focus = p == TARGETS["short_prompt"] or (p, c, g) == TARGETS["headline"]
            repeats = args.focus_repeats if focus and model == "tiny" else args.repeats
            long = p >= args.long_prompt
            steps, warmup = (args.long_steps, args.long_warmup) if long else (args.steps, args.warmup)
            base = {
                "model": paths[model],
                "device": args.device,
                "threads": args.threads,
                "bf16": args.bf16,
                "steps": steps,
                "prompt_len": p,
                "completion_len": c,
                "generations": g,
                "learning_rate": args.learning_rate,
                "seed": args.seed,
                "point": f"{model}/{p}/{c}/{g}",
                "packing": True,
            }
            runs = {"ours": [], "trl": []}
            for rep in range(repeats):
                order = ("ours", "trl") if (n + rep) % 2 == 0 else ("trl", "ours")
                for side in order:
                    index += 1
                    result = run_worker(dict(base, side=side), tmp, index, args.timeout)
                    runs[side].append(result)
                    parameters[model] = result["parameters"]
                    s = run_summary(result, warmup)
                    print(
                        f"[{model} P={p} C={c} G={g} rep {rep + 1}/{repeats}] {side}: step {bc.fmt(s['step_s'])} s, "
                        f"train {bc.fmt(s['train_s'])} s, train peak "
                        f"{bc.fmt(result.get('train_peak_rss_above_start_mib'), '.0f')} MiB, "
                        f"load {bc.loadavg()}",
                        flush=True,
                    )
            memory_key = "cuda_peak_above_start_mib" if args.device == "cuda" else "train_peak_rss_above_start_mib"
            results.append(
                {
                    "model": model,
                    "prompt_len": p,
                    "completion_len": c,
                    "generations": g,
                    "repeats": repeats,
                    "steps": steps,
                    "warmup": warmup,
                    "comparison": compare(runs["ours"], runs["trl"], warmup, memory_key),
                    "runs": runs,
                }
            )
            write(args, argv, results, points[n + 1 :], parameters, descriptions, started, load_start)
    if not points:  # a resumed run with nothing left to measure: rewrite the report as it is
        write(args, argv, results, [], parameters, descriptions, started, load_start)
    return 0


def write(args, argv, results, missing, parameters, descriptions, started, load_start) -> None:
    """Write the report of the points measured so far (``missing``: the points not run yet)."""
    memory_key = "cuda_peak_above_start_mib" if args.device == "cuda" else "train_peak_rss_above_start_mib"
    headline = next(
        (
            r
            for r in results
            if r["model"] == "tiny" and (r["prompt_len"], r["completion_len"], r["generations"]) == TARGETS["headline"]
        ),
        None,
    )
    short = [
        r["comparison"]["train_time_ratio"]
        for r in results
        if r["model"] == "tiny" and r["prompt_len"] == TARGETS["short_prompt"]
    ]
    summary = {
        "headline_train_time_ratio": headline and headline["comparison"]["train_time_ratio"],
        "headline_memory_ratio": headline and headline["comparison"]["memory_ratio"],
        "headline_met": None
        if headline is None
        else bool(
            headline["comparison"]["train_time_ratio"] <= TARGETS["headline_train_time_ratio_max"]
            and headline["comparison"]["memory_ratio"] <= TARGETS["headline_memory_ratio_max"]
        ),
        "short_prompt_worst_train_time_ratio": max(short) if short else None,
        "short_prompt_met": None if not short else max(short) <= TARGETS["short_prompt_train_time_ratio_max"],
        "all_equivalent": all(r["comparison"]["equivalence"]["equivalent"] for r in results),
    }
    command = " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])])
    report = {
        "benchmark": "prefix_packing",
        "command": command,
        "commands": [*getattr(args, "commands", []), command],  # a resumed report: every run that made it
        "machine": bc.machine_description(args.device) | {"torch_threads": args.threads},
        "load_average_start": load_start,
        "load_average_end": bc.loadavg(),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "commands", "resumed_wall_s")},
        "model_description": descriptions.get("tiny") or next(iter(descriptions.values())),
        "model_descriptions": descriptions,
        "parameters": parameters.get("tiny") or next(iter(parameters.values())),
        "parameters_by_model": parameters,
        "memory_key": memory_key,
        "targets": {k: list(v) if isinstance(v, tuple) else v for k, v in TARGETS.items()},
        "summary": summary,
        "results": results,
        "not_measured": [list(p) for p in missing],
        "total_wall_s": time.perf_counter() - started + getattr(args, "resumed_wall_s", 0.0),
    }
    bc.write_report(args.out, "prefix_packing", report, markdown(report))


if __name__ == "__main__":
    raise SystemExit(main())
