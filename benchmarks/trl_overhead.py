#!/usr/bin/env python
"""Benchmark: step time and peak memory of trinity_trl's trainers against TRL's ``GRPOTrainer``.

The same model, data, seed and settings are trained by TRL's ``GRPOTrainer`` and by ours, for
each algorithm that TRL also implements, with the TRL settings our parity tests prove equivalent
(``tests/trainers/test_parity.py``; the equivalence is re-checked here: both sides must log the
same loss and gradient norm at every step):

========  ======================================================  ===================================================
pair      ours                                                    TRL ``GRPOConfig``
========  ======================================================  ===================================================
cispo     ``CISPOTrainer(CISPOConfig(kl_loss="none"))``           ``loss_type="cispo", epsilon_high=1.28``
sapo      ``SAPOTrainer(SAPOConfig())`` (``form="paper"``)        ``loss_type="sapo"``
gspo      ``TrinityTrainer(algorithm="gspo", kl_loss="none",      ``loss_type="grpo", importance_sampling_level=
          loss_agg_mode="seq-mean-token-mean")``                  "sequence", epsilon=3e-4, epsilon_high=4e-4``
grpo      ``TrinityTrainer(algorithm="grpo", kl_loss="none",      ``loss_type="grpo"`` (PPO-clip 0.2)
          loss_agg_mode="seq-mean-token-mean")``
========  ======================================================  ===================================================

CHORD has no TRL counterpart: ``ChordTrainer`` (``mix_chord``) appends expert rows to every batch
(here a quarter of the rows: ``R`` rollouts + ``R/3`` demonstrations). It is run beside TRL's GRPO
with the same ``R`` rollouts (same prompts and completions: the cost CHORD adds) and TRL's GRPO
with as many rollouts as CHORD has rows (the same number of trained rows and about the same
tokens: what those extra tokens cost in TRL).

Every training run is a fresh subprocess (clean peak-memory figures, no state shared between
runs), and the runs of one comparison are interleaved (A B, B A, A B, ...). Each run trains
``--steps`` optimizer steps; a callback takes the time between consecutive ``on_step_begin``
events (a whole optimizer step: generation, scoring, loss, backward, optimizer, logging), skipping
``--warmup`` steps, and a wrapper around TRL's ``_generate`` measures the generation part, so the
report gives both the whole step and the step without generation ("train": scoring, advantages,
loss, backward, optimizer, logging), which is where the trainers differ. Same seed, same
weights and equal losses give the same completions on both sides, so generation costs the same.

Memory: on CPU, the process's peak resident set size (``getrusage``, MiB) and the peak RSS
reached during ``train()`` above the RSS just before it (``VmHWM`` reset through
``/proc/self/clear_refs``); on CUDA, ``torch.cuda.max_memory_allocated`` during ``train()``.

Run it niced, from the repository root (CPU timings on a shared machine are noisy: compare the
two sides of one run, which are interleaved, not numbers from different runs)::

    nice -n 5 .venv/bin/python benchmarks/trl_overhead.py --out benchmarks/results
    nice -n 5 .venv/bin/python benchmarks/trl_overhead.py --device cuda --model HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports

PAIRS = ("cispo", "sapo", "gspo", "grpo")
# same batches and same updates give the same logged loss and gradient norm up to float32 noise
EQUIVALENCE_GRAD_RTOL, EQUIVALENCE_LOSS_ATOL = 1e-3, 1e-4
GROUPS = (*PAIRS, "chord")


# ------------------------------------------------------------------------------------ run specs
def run_specs(group: str, args) -> list[dict]:
    """The runs of one comparison: ``[{name, side, trainer, config, ...}, ...]`` (first = ours)."""
    rows, gens = args.rollouts, args.num_generations
    if group == "cispo":
        return [
            _spec("ours", "CISPOTrainer", "CISPOConfig", {"kl_loss": "none"}, rows, gens),
            _spec(
                "trl",
                "GRPOTrainer",
                "GRPOConfig",
                {"loss_type": "cispo", "epsilon_high": 1.28, "beta": 0.0},
                rows,
                gens,
            ),
        ]
    if group == "sapo":
        return [
            _spec("ours", "SAPOTrainer", "SAPOConfig", {}, rows, gens),
            _spec("trl", "GRPOTrainer", "GRPOConfig", {"loss_type": "sapo", "beta": 0.0}, rows, gens),
        ]
    if group == "gspo":
        # the preset's aggregation is the global default token-mean (it overrides the gspo loss's own
        # seq-mean-token-mean); TRL's sequence-level GSPO is the seq-mean-token-mean one
        return [
            _spec(
                "ours",
                "TrinityTrainer",
                "TrinityConfig",
                {"algorithm": "gspo", "kl_loss": "none", "loss_agg_mode": "seq-mean-token-mean"},
                rows,
                gens,
            ),
            _spec(
                "trl",
                "GRPOTrainer",
                "GRPOConfig",
                {
                    "loss_type": "grpo",
                    "importance_sampling_level": "sequence",
                    "epsilon": 3e-4,
                    "epsilon_high": 4e-4,
                    "beta": 0.0,
                },
                rows,
                gens,
            ),
        ]
    if group == "grpo":
        return [
            _spec(
                "ours",
                "TrinityTrainer",
                "TrinityConfig",
                {"algorithm": "grpo", "kl_loss": "none", "loss_agg_mode": "seq-mean-token-mean"},
                rows,
                gens,
            ),
            _spec("trl", "GRPOTrainer", "GRPOConfig", {"loss_type": "grpo", "beta": 0.0}, rows, gens),
        ]
    if group == "chord":
        chord_rollouts, chord_gens = args.chord_rollouts, args.chord_generations
        expert = chord_rollouts // 3
        same_rows = chord_rollouts + expert
        chord = _spec(
            "ours",
            "ChordTrainer",
            "ChordConfig",
            {"algorithm": "mix_chord", "kl_loss": "none", "expert_batch_size": expert},
            chord_rollouts,
            chord_gens,
        )
        chord["expert_rows"] = expert
        trl_rollouts = _spec(
            "trl_same_rollouts",
            "GRPOTrainer",
            "GRPOConfig",
            {"loss_type": "grpo", "beta": 0.0},
            chord_rollouts,
            chord_gens,
        )
        trl_rows = _spec(
            "trl_same_rows",
            "GRPOTrainer",
            "GRPOConfig",
            {"loss_type": "grpo", "beta": 0.0},
            same_rows,
            args.num_generations if same_rows % args.num_generations == 0 else chord_gens,
        )
        return [chord, trl_rollouts, trl_rows]
    raise ValueError(group)


def _spec(side: str, trainer: str, config_class: str, config: dict, rows: int, gens: int) -> dict:
    return {
        "side": side,
        "trainer": trainer,
        "config_class": config_class,
        "config": config,
        "rollouts": rows,
        "num_generations": gens,
    }


# --------------------------------------------------------------------------------------- worker
def char_reward(completions, **kwargs) -> list[float]:
    """Reward = completion length in characters / 10: a non-zero group spread from any model."""

    def text(c):
        return c if isinstance(c, str) else "".join(m.get("content") or "" for m in c)

    return [len(text(c)) / 10.0 for c in completions]


def worker(spec_path: str) -> int:
    """Train one run described by the JSON spec and write its measurements to ``spec["result"]``."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    import transformers
    import trl
    from transformers import TrainerCallback

    import trinity_trl.trainers as ours
    from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset

    transformers.logging.set_verbosity_error()
    cuda = spec["device"] == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    module = trl if spec["side"] != "ours" else ours
    config_class = getattr(module, spec["config_class"])
    trainer_class = getattr(module, spec["trainer"])
    steps = spec["steps"]
    config = config_class(
        output_dir=spec["output_dir"],
        use_cpu=not cuda,
        bf16=spec["bf16"],
        activation_checkpointing=False,
        per_device_train_batch_size=spec["rollouts"],
        num_generations=spec["num_generations"],
        max_completion_length=spec["completion_len"],
        max_steps=steps,
        learning_rate=spec["learning_rate"],
        temperature=1.0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=spec["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        **spec["config"],
    )
    prompts_needed = steps * spec["rollouts"] // spec["num_generations"] + 8
    kwargs = {}
    if spec["trainer"] == "ChordTrainer":
        kwargs["expert_dataset"] = arithmetic_expert_dataset(max(64, steps * spec["expert_rows"] + 8), seed=1)
    trainer = trainer_class(
        model=spec["model"],
        reward_funcs=char_reward,
        args=config,
        train_dataset=arithmetic_dataset("train", prompts_needed, seed=0),
        **kwargs,
    )

    marks: list[float] = []
    parts: list[dict] = []  # per step: seconds inside each wrapped method
    rows: list[dict] = []
    in_loss = [False]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            marks.append(time.perf_counter())
            parts.append(dict.fromkeys(("generate", "generate_and_score", "compute_loss", "loss_logps"), 0.0))

    trainer.add_callback(StepTimer())

    def timed(method, key, when=None):
        def wrapper(*a, **kw):
            if when is not None and not when():
                return method(*a, **kw)
            sync()
            start = time.perf_counter()
            out = method(*a, **kw)
            sync()
            parts[-1][key] += time.perf_counter() - start
            return out

        return wrapper

    # TRL's generation (sampling + decoding), identical on both sides
    trainer._generate = timed(trainer._generate, "generate")
    # generation + rewards + advantages (+ CHORD's expert rows): the seam after generation
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "generate_and_score")
    # TRL's log-prob forward inside the loss (the same helper on both sides)
    trainer._get_per_token_logps_and_entropies = timed(
        trainer._get_per_token_logps_and_entropies, "loss_logps", when=lambda: in_loss[0]
    )
    compute_loss = trainer._compute_loss

    def counting_compute_loss(model, inputs):  # tokens of each trained micro-batch
        width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        rows.append(
            {
                "rows": int(inputs["prompt_ids"].shape[0]),
                "padded_tokens": int(inputs["prompt_ids"].shape[0] * width),
                "real_tokens": int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()),
                "loss_tokens": int(inputs["completion_mask"].sum()),
            }
        )
        in_loss[0] = True
        try:
            return compute_loss(model, inputs)
        finally:
            in_loss[0] = False

    trainer._compute_loss = timed(counting_compute_loss, "compute_loss")

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
    cpu = time.process_time() - cpu_start
    result = {
        "spec": {k: v for k, v in spec.items() if k not in ("result", "output_dir")},
        # begin-to-begin: a whole step, logging included; the last step (no next begin) is not timed
        "step_s": [b - a for a, b in itertools.pairwise(marks)],
        "generation_s": [p["generate"] for p in parts],
        "parts_s": parts,
        "train_wall_s": wall,
        "cpu_util": cpu / wall if wall > 0 else None,
        "process_peak_rss_mib": bc.max_rss_mib(),
        "train_peak_rss_above_start_mib": (
            (bc.read_status_kb("VmHWM") - rss_before) / 1024 if hwm_reset and rss_before is not None else None
        ),
        "micro_batches": rows[:1] + rows[-1:],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
        "global_step": trainer.state.global_step,
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "loadavg_end": bc.loadavg(),
    }
    if cuda:
        result["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_peak_above_start_mib"] = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------------ the driver
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
        raise RuntimeError(f"run {spec['group']}/{spec['side']} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(Path(spec["result"]).read_text())


BREAKDOWN = ("generation", "scoring", "loss_logps", "loss_own", "rest")


def run_summary(result: dict, warmup: int) -> dict:
    """Median seconds per step of one run, after ``warmup`` steps: the whole step, generation,
    ``train`` (= step − generation), and the breakdown ``scoring`` (rewards, advantages, expert rows:
    generate_and_score − generate), ``loss_logps`` (TRL's log-prob forward inside the loss),
    ``loss_own`` (the rest of ``_compute_loss``: the trainer's loss maths) and ``rest`` (backward,
    optimizer, logging, data loading). Only ``scoring`` and ``loss_own`` (and logging) run
    different code in the two trainers."""
    n = len(result["step_s"])
    steps = result["step_s"][warmup:]
    parts = result["parts_s"][warmup:n]
    gens = [p["generate"] for p in parts]
    out = {
        "step_s": bc.median(steps),
        "generation_s": bc.median(gens),
        "train_s": bc.median([s - g for s, g in zip(steps, gens)]),
        "timed_steps": len(steps),
    }
    breakdown = {
        "generation": gens,
        "scoring": [p["generate_and_score"] - p["generate"] for p in parts],
        "loss_logps": [p["loss_logps"] for p in parts],
        "loss_own": [p["compute_loss"] - p["loss_logps"] for p in parts],
        "rest": [s - p["generate_and_score"] - p["compute_loss"] for s, p in zip(steps, parts)],
    }
    out["breakdown_s"] = {k: bc.median(v) for k, v in breakdown.items()}
    out["own_code_s"] = bc.median([a + b for a, b in zip(breakdown["scoring"], breakdown["loss_own"])])
    return out


def side_summary(results: list[dict], warmup: int) -> dict:
    per_run = [run_summary(r, warmup) for r in results]
    out = {key: bc.median([p[key] for p in per_run]) for key in ("step_s", "generation_s", "train_s", "own_code_s")}
    out["breakdown_s"] = {k: bc.median([p["breakdown_s"][k] for p in per_run]) for k in BREAKDOWN}
    out["per_run"] = per_run
    for key in (
        "process_peak_rss_mib",
        "train_peak_rss_above_start_mib",
        "cuda_peak_allocated_mib",
        "cuda_peak_above_start_mib",
        "cpu_util",
        "train_wall_s",
    ):
        out[key] = bc.median([r.get(key) for r in results])
    out["micro_batch"] = results[0]["micro_batches"][0] if results[0]["micro_batches"] else None
    out["parameters"] = results[0]["parameters"]
    return out


def paired_ratio(a: list[dict], b: list[dict], key: str, warmup: int) -> float | None:
    """Median over repetitions of (A's run median / B's run median): robust to slow drifts of the load."""
    values = [bc.ratio(run_summary(x, warmup)[key], run_summary(y, warmup)[key]) for x, y in zip(a, b)]
    return bc.median(values)


def equivalence(a: list[dict], b: list[dict]) -> dict:
    """Largest differences of the per-step logged loss (absolute: on-policy losses are ~0, so a
    relative difference is float noise) and gradient norm (relative) between the two sides."""
    loss, grad = [], []
    for x, y in zip(a, b):
        loss += [abs(u - v) for u, v in zip(x["losses"], y["losses"])]
        grad += [abs(u - v) / max(abs(u), abs(v), 1e-12) for u, v in zip(x["grad_norms"], y["grad_norms"])]
    equivalent = bool(grad) and max(grad) < EQUIVALENCE_GRAD_RTOL and max(loss) < EQUIVALENCE_LOSS_ATOL
    return {
        "equivalent": equivalent,
        "loss_max_abs_diff": max(loss) if loss else None,
        "grad_norm_max_rel_diff": max(grad) if grad else None,
        "losses_ours_first_run": a[0]["losses"],
        "losses_trl_first_run": b[0]["losses"],
        "grad_norms_ours_first_run": a[0]["grad_norms"],
        "grad_norms_trl_first_run": b[0]["grad_norms"],
    }


def compare_pair(results: dict, warmup: int, memory_key: str) -> dict:
    ours, trl = results["ours"], results["trl"]
    so, st = side_summary(ours, warmup), side_summary(trl, warmup)
    return {
        "ours": so,
        "trl": st,
        "ratio": {
            "step": bc.ratio(so["step_s"], st["step_s"]),
            "train": bc.ratio(so["train_s"], st["train_s"]),
            "step_paired": paired_ratio(ours, trl, "step_s", warmup),
            "train_paired": paired_ratio(ours, trl, "train_s", warmup),
            "process_peak_rss": bc.ratio(so["process_peak_rss_mib"], st["process_peak_rss_mib"]),
            "train_peak_rss": bc.ratio(so["train_peak_rss_above_start_mib"], st["train_peak_rss_above_start_mib"]),
            "memory": bc.ratio(so[memory_key], st[memory_key]),
            # the time ours spends in its own code (scoring + loss maths) beyond TRL's, per TRL step
            "own_code_extra_over_step": (
                None
                if so["own_code_s"] is None or st["own_code_s"] is None
                else (so["own_code_s"] - st["own_code_s"]) / st["step_s"]
            ),
        },
        "equivalence": equivalence(ours, trl),
    }


def compare_chord(results: dict, warmup: int, memory_key: str) -> dict:
    chord, same_rollouts, same_rows = (
        side_summary(results[k], warmup) for k in ("ours", "trl_same_rollouts", "trl_same_rows")
    )
    extra_train = None
    if same_rows["train_s"] is not None and same_rollouts["train_s"] is not None:
        extra_train = same_rows["train_s"] - same_rollouts["train_s"]
    chord_extra = None if chord["train_s"] is None else chord["train_s"] - same_rollouts["train_s"]
    return {
        "ours": chord,
        "trl_same_rollouts": same_rollouts,
        "trl_same_rows": same_rows,
        "ratio": {
            # the CHORD step against TRL on as many rows (the target: about 1)
            "train_vs_same_rows": bc.ratio(chord["train_s"], same_rows["train_s"]),
            "train_vs_same_rows_paired": paired_ratio(results["ours"], results["trl_same_rows"], "train_s", warmup),
            "step_vs_same_rows": bc.ratio(chord["step_s"], same_rows["step_s"]),
            # the CHORD step against TRL on the same rollouts (what the expert rows add)
            "train_vs_same_rollouts": bc.ratio(chord["train_s"], same_rollouts["train_s"]),
            "step_vs_same_rollouts": bc.ratio(chord["step_s"], same_rollouts["step_s"]),
            # what CHORD adds, in units of what TRL's extra rows cost (1 = exactly the extra tokens' cost)
            "added_train_over_extra_rows_cost": bc.ratio(chord_extra, extra_train),
            "memory_vs_same_rows": bc.ratio(chord[memory_key], same_rows[memory_key]),
            "process_peak_rss_vs_same_rows": bc.ratio(chord["process_peak_rss_mib"], same_rows["process_peak_rss_mib"]),
            "train_peak_rss_vs_same_rows": bc.ratio(
                chord["train_peak_rss_above_start_mib"], same_rows["train_peak_rss_above_start_mib"]
            ),
        },
    }


def resolve_model(args, tmp: Path) -> tuple[str, str]:
    if args.model == "tiny":
        path = bc.save_random_qwen2(
            tmp / "model",
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            seed=args.seed,
        )
        return path, (
            f"random Qwen2 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
            f"{args.kv_heads} KV, intermediate {args.intermediate}) with the tests' tiny BPE tokenizer"
        )
    if args.model == "bundled":
        from trinity_trl.data import bundled_model_dir

        return str(bundled_model_dir()), "SmolLM2-135M-Instruct (bundled, float32)"
    return args.model, args.model


def markdown(report: dict) -> str:
    c, m = report["config"], report["machine"]
    mem_label = "CUDA peak allocated (MiB)" if c["device"] == "cuda" else "process peak RSS (MiB)"
    lines = [
        "# trinity_trl trainers vs TRL's `GRPOTrainer`: step time and peak memory",
        "",
        (
            f"{'**Quick setting** (smoke run, not for conclusions). ' if c['quick'] else ''}"
            f"Command: `{report['command']}`"
        ),
        "",
        bc.machine_line(m),
        (
            f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end "
            f"(on {m['os_cpu_count']} cores; above the core count other processes competed for the CPU)."
        ),
        "",
        (
            f"Model: {c['model_description']}, {report['parameters'] / 1e6:.2f}M parameters, "
            f"{'bf16' if c['bf16'] else 'fp32'}, full fine-tuning. Each run: {c['steps']} optimizer steps "
            f"(first {c['warmup']} untimed), {c['repeats']} runs per side, each a fresh subprocess, interleaved. "
            f"Pairs: {c['rollouts']} rollouts per step ({c['rollouts'] // c['num_generations']} prompts x "
            f"{c['num_generations']}), completions of at most {c['completion_len']} tokens, lr {c['learning_rate']}."
        ),
        "",
        (
            "`step` = one whole optimizer step (generation, scoring, loss, backward, optimizer, logging); `train` = "
            "step minus TRL's generation (where the trainers differ). Medians over runs of each run's median step; "
            "`paired` = median over repetitions of the per-repetition ratio. Ratio = ours / TRL (< 1: ours faster)."
        ),
        "",
        (
            f"| pair | ours step (s) | TRL step (s) | step ratio | step ratio paired | ours train (s) | TRL train (s) "
            f"| train ratio | train ratio paired | ours {mem_label} | TRL {mem_label} "
            f"| memory ratio | train-peak ratio "
            f"| loss max abs. diff / grad-norm max rel. diff |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mem_key = report["memory_key"]
    for name in PAIRS:
        if name not in report["results"]:
            continue
        r = report["results"][name]
        o, t, q, e = r["ours"], r["trl"], r["ratio"], r["equivalence"]
        lines.append(
            f"| {name} | {bc.fmt(o['step_s'])} | {bc.fmt(t['step_s'])} | **{bc.fmt(q['step'])}** "
            f"| {bc.fmt(q['step_paired'])} | {bc.fmt(o['train_s'])} | {bc.fmt(t['train_s'])} "
            f"| **{bc.fmt(q['train'])}** | {bc.fmt(q['train_paired'])} | {bc.fmt(o[mem_key], '.0f')} "
            f"| {bc.fmt(t[mem_key], '.0f')} | **{bc.fmt(q['memory'])}** | {bc.fmt(q['train_peak_rss'])} "
            f"| {bc.fmt(e['loss_max_abs_diff'], '.1e')} / {bc.fmt(e['grad_norm_max_rel_diff'], '.1e')}"
            f"{'' if e['equivalent'] else ' **(not equivalent)**'} |"
        )
    if "chord" in report["results"]:
        r = report["results"]["chord"]
        q = r["ratio"]
        lines += [
            "",
            (
                f"CHORD (`mix_chord`, {c['chord_rollouts']} rollouts + {c['chord_rollouts'] // 3} expert rows "
                f"= a quarter "
                f"expert) beside TRL GRPO on the same {c['chord_rollouts']} rollouts and TRL GRPO on "
                f"{c['chord_rollouts'] + c['chord_rollouts'] // 3} rollouts (as many trained rows as CHORD):"
            ),
            "",
            (
                f"| run | rows trained | padded tokens / micro-batch | loss tokens | step (s) | generation (s) "
                f"| train (s) "
                f"| {mem_label} | train peak RSS above start (MiB) |"
            ),
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, label in (
            ("ours", "CHORD (ours)"),
            ("trl_same_rollouts", "TRL GRPO, same rollouts"),
            ("trl_same_rows", "TRL GRPO, same rows"),
        ):
            s = r[key]
            mb = s["micro_batch"] or {}
            lines.append(
                f"| {label} | {mb.get('rows', 'n/a')} | {mb.get('padded_tokens', 'n/a')} "
                f"| {mb.get('loss_tokens', 'n/a')} | {bc.fmt(s['step_s'])} | {bc.fmt(s['generation_s'])} "
                f"| {bc.fmt(s['train_s'])} | {bc.fmt(s[mem_key], '.0f')} "
                f"| {bc.fmt(s['train_peak_rss_above_start_mib'], '.0f')} |"
            )
        lines += [
            "",
            (
                f"- CHORD train / TRL same rows: **{bc.fmt(q['train_vs_same_rows'])}** "
                f"(paired {bc.fmt(q['train_vs_same_rows_paired'])}); whole step: {bc.fmt(q['step_vs_same_rows'])} "
                "(CHORD generates fewer rollouts)."
            ),
            (
                f"- CHORD train / TRL same rollouts: {bc.fmt(q['train_vs_same_rollouts'])}; whole step: "
                f"{bc.fmt(q['step_vs_same_rollouts'])}."
            ),
            (
                f"- Time CHORD adds to the same rollouts, over what TRL's extra rows cost: "
                f"**{bc.fmt(q['added_train_over_extra_rows_cost'])}** (1 = CHORD's expert rows cost exactly as much as "
                "as many extra rollouts in TRL's training step)."
            ),
            (
                f"- Memory CHORD / TRL same rows: {bc.fmt(q['memory_vs_same_rows'])} ({mem_label}); train-peak ratio "
                f"{bc.fmt(q['train_peak_rss_vs_same_rows'])}."
            ),
        ]
    lines += [
        "",
        (
            "Where a step's time goes (median ms per step): `generation` = TRL's `_generate`; `scoring` = the rest of "
            "`_generate_and_score_completions` (rewards, advantages; CHORD: expert rows); `logps` = TRL's log-prob "
            "forward inside the loss; `loss maths` = the rest of `_compute_loss`; "
            "`rest` = backward, optimizer, logging. "
            "Only `scoring`, `loss maths` and logging run different code in the two trainers; `own extra` = ours' "
            "(scoring + loss maths) minus TRL's, as a share of TRL's step (noise-free, unlike the step ratio):"
        ),
        "",
        "| comparison | run | generation | scoring | logps | loss maths | rest | own extra |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        for key, s in r.items():
            if key in ("ratio", "equivalence"):
                continue
            b = s["breakdown_s"]
            extra = r["ratio"].get("own_code_extra_over_step") if key == "ours" else None
            lines.append(
                f"| {name} | {key} | "
                + " | ".join(bc.fmt(None if b[k] is None else b[k] * 1e3, ".1f") for k in BREAKDOWN)
                + f" | {'' if extra is None else bc.fmt(100 * extra, '+.2f', ' %')} |"
            )
    lines += [
        "",
        (
            "Token counts of the first trained micro-batch and CPU utilisation (process CPU s / wall s, median "
            "over runs; near the thread count when the cores were ours):"
        ),
        "",
    ]
    for name, r in report["results"].items():
        for key, s in r.items():
            if key in ("ratio", "equivalence"):
                continue
            mb = s["micro_batch"] or {}
            lines.append(
                f"- {name} / {key}: {mb.get('rows')} rows, {mb.get('padded_tokens')} padded tokens, "
                f"{mb.get('loss_tokens')} loss tokens; generation {bc.fmt(s['generation_s'])} s of the step; "
                f"cpu {bc.fmt(s['cpu_util'], '.2f')}"
            )
    lines += ["", f"Memory: {report['memory_note']}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (random Qwen2 built here), 'bundled' (SmolLM2-135M-Instruct) or a model id/path",
    )
    parser.add_argument("--pairs", nargs="+", choices=GROUPS, default=list(GROUPS), help="comparisons to run")
    parser.add_argument("--repeats", type=int, default=7, help="runs per side (interleaved)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run not timed")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per step in the pairs")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--chord-rollouts", type=int, default=6, help="CHORD rollouts per step (+ a third as expert)")
    parser.add_argument("--chord-generations", type=int, default=3)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads in each run (1: with 2 threads on 2 shared cores, every small op "
        "waits for a descheduled thread and steps slow down up to 100x)",
    )
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--prefix-packing",
        choices=("off", "on"),
        default="off",
        help="our trainers' prefix-shared packed forward (off: TRL's padded layout on both sides, "
        "which isolates our code's overhead; benchmarks/prefix_packing.py measures packing)",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    parser.add_argument(
        "--quick", action="store_true", help="smoke setting: 1 repeat, 3 steps (1 warm-up), a 2-layer hidden-64 model"
    )
    parser.add_argument("--out", default="benchmarks/results", help="directory for trl_overhead.json / .md")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 3, 1
        args.hidden, args.layers, args.intermediate = 64, 2, 128
    if args.steps < args.warmup + 2:
        parser.error("--steps must be at least --warmup + 2 (the last step's end is not timed)")
    if args.chord_rollouts % 3 or args.chord_rollouts % args.chord_generations:
        parser.error("--chord-rollouts must be a multiple of 3 and of --chord-generations")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch.cuda.is_available() is False")

    started, load_start = time.perf_counter(), bc.loadavg()
    results: dict = {}
    raw: dict = {}
    with tempfile.TemporaryDirectory(prefix="trl_overhead_") as tmp_name:
        tmp = Path(tmp_name)
        model_path, model_description = resolve_model(args, tmp)
        common = {
            "model": model_path,
            "device": args.device,
            "threads": args.threads,
            "bf16": args.bf16,
            "steps": args.steps,
            "completion_len": args.completion_len,
            "learning_rate": args.learning_rate,
            "seed": args.seed,
        }
        index = 0
        for group in args.pairs:
            specs = [dict(common, **s, group=group) for s in run_specs(group, args)]
            for spec in specs:  # our trainers pack prefix-shared rows by default; this benchmark isolates our
                if spec["side"] == "ours":  # overhead in TRL's own padded layout unless asked (prefix_packing.py)
                    spec["config"] = {**spec["config"], "prefix_packing": args.prefix_packing == "on"}
            runs = {s["side"]: [] for s in specs}
            for rep in range(args.repeats):
                shift = rep % len(specs)
                order = specs[shift:] + specs[:shift] if len(specs) > 2 else (specs if rep % 2 == 0 else specs[::-1])
                for spec in order:
                    index += 1
                    result = run_worker(spec, tmp, index, args.timeout)
                    runs[spec["side"]].append(result)
                    s = run_summary(result, args.warmup)
                    print(
                        f"[{group} rep {rep + 1}/{args.repeats}] {spec['side']}: step {bc.fmt(s['step_s'])} s, "
                        f"generation {bc.fmt(s['generation_s'])} s, train {bc.fmt(s['train_s'])} s, peak RSS "
                        f"{result['process_peak_rss_mib']:.0f} MiB, cpu {bc.fmt(result['cpu_util'], '.2f')}, "
                        f"load {bc.loadavg()}",
                        flush=True,
                    )
            raw[group] = runs
    memory_key = "cuda_peak_allocated_mib" if args.device == "cuda" else "process_peak_rss_mib"
    for group, runs in raw.items():
        results[group] = (
            compare_chord(runs, args.warmup, memory_key)
            if group == "chord"
            else compare_pair(runs, args.warmup, memory_key)
        )
    first = next(iter(raw.values()))
    parameters = next(iter(first.values()))[0]["parameters"]
    if args.device == "cuda":
        memory_note = (
            "torch.cuda.max_memory_allocated during train() (weights, optimizer state, activations); "
            "`train-peak` = the same above the memory allocated before train()."
        )
    else:
        memory_note = (
            "process peak RSS = getrusage(RUSAGE_SELF).ru_maxrss of the run's subprocess (libraries, "
            "model, optimizer, data, training); `train-peak` = peak RSS during train() above the RSS just "
            "before it (VmHWM reset through /proc/self/clear_refs after gc + malloc_trim): the part "
            "training adds, small and noisier for a small model (allocator caching)."
        )
    report = {
        "benchmark": "trl_overhead",
        "command": " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])]),
        "machine": bc.machine_description(args.device) | {"torch_threads": args.threads},
        "load_average_start": load_start,
        "load_average_end": bc.loadavg(),
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("worker", "out")},
            "model_description": model_description,
        },
        "parameters": parameters,
        "memory_key": memory_key,
        "memory_note": memory_note,
        "targets": {"step_ratio_max": 1.03, "memory_ratio_max": 1.02},
        "results": results,
        "runs": raw,
        "total_wall_s": time.perf_counter() - started,
    }
    bc.write_report(args.out, "trl_overhead", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
