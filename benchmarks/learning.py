#!/usr/bin/env python
"""Benchmark: does CHORD-mu beat SFT then GRPO? Held-out accuracy of the methods at the same budget.

The setting of the CHORD paper (arXiv 2508.11408) on the bundled arithmetic word problems: expert
demonstrations exist for some problem templates only (``--covered``, default ``add sub mul``), while
the RL prompts and the held-out problems come from all five templates (``div`` and ``two_step`` are
"uncovered": only on-policy RL can learn them from reward). Every method trains a LoRA adapter on the
bundled SmolLM2-135M-Instruct with the same budget of training rows per optimizer step (``--rows``)
and the same number of steps:

* ``grpo``: ``TrinityTrainer`` (preset ``grpo``), ``--rows`` rollouts per step, no KL;
* ``sft``: ``TrinitySFTTrainer`` on the demonstrations, ``--rows`` per step;
* ``sft_grpo``: SFT for the first ``--sft-steps`` steps (default half), then GRPO on the SFT adapter
  (a new optimizer), the usual two-stage pipeline;
* ``chord_mu``: ``ChordTrainer`` (``mix_chord``, CHORD-mu: plain SFT term, mu 0.9 -> 0.05 over the
  whole run, however long), ``--rows - --expert-rows`` rollouts plus ``--expert-rows`` demonstrations;
* ``chord_phi``: the same rows, CHORD-phi (SFT tokens weighted by p(1-p), constant mu 0.1);
* ``mix``: the same rows, MIX (plain SFT term, constant mu 0.1).

Tuning budget, the same for every method: the learning-rate grid ``--learning-rates``, each value
trained once on the tuning seed (the first of ``--seeds``); the value with the best final accuracy on
``--val-rows`` validation problems (training-split problems that are neither RL prompts nor
demonstrations; never the held-out ones) is that method's rate, and the other seeds run at it (without
validation). Every run's held-out score is recorded, so the tuning seed's run at the chosen rate is also
its first seed.

Rollouts: ``--num-generations`` per prompt, at most ``--completion-len`` tokens, temperature 0.8,
reward = exact final answer. Prompts carry the answer format as the system message. A callback
measures greedy accuracy (``evaluate_accuracy``) on ``--eval-rows`` held-out problems (the templates take
turns, so each has the same count) after the last step, and every ``--eval-every`` steps if that is not 0,
overall and on the covered and uncovered templates; the final evaluation keeps each problem's outcome
and template, for a paired comparison of CHORD-mu with SFT then GRPO (per seed, and pooled over problems
and seeds: an exact sign test on the problems one method solves and the other does not, overall and per
template group, covered and uncovered). Step 0 (the base model: a fresh LoRA adapter is the identity) is
measured once and shared. Cost per method: CPU seconds per training step and the share of them spent
generating rollouts.

Default setting (issue 38: the paper's central question, sized for about two hours of one core):
CHORD-mu against SFT then GRPO, 3 seeds, 60 steps of 8 rows (CHORD-mu 4 rollouts + 4 demonstrations;
SFT then GRPO 30 steps of 8 demonstrations, then 30 of 8 rollouts), completions of at most 40 tokens,
the grid 1e-4, 3e-4 chosen on 100 validation problems, 200 held-out problems scored once, after the last
step. Runs: 2 methods x (2 grid values on seed 0 + seeds 1 and 2) = 8. The budget, from CPU seconds of
the process (one thread, this 2-core machine under load 7-12): a 6-step run of these settings on 2026-11-26
measured CHORD-mu 7.1 and SFT then GRPO 8.7 CPU s per step and 0.36 CPU s per scored problem; the 30-step
study's runs (``benchmarks/results/learning_runs.jsonl``) measured CHORD-mu 7.9-10.6, SFT 5.5-6.1 and GRPO
12.7-13.7 per step (so SFT then GRPO about 9.9 on average) and up to 0.45 CPU s per problem (the base
model's longer answers). With the upper values:

    training     4 x 60 x 10.6 (CHORD-mu) + 4 x 60 x 9.9 (SFT then GRPO)  = 4920 s
    held-out     8 runs x 200 problems x 0.45                              =  720 s
    validation   4 tuning runs x 100 problems x 0.45                       =  180 s
    step 0       200 problems x 0.45                                       =   90 s
    total                                                                  = 5910 s (98 min of one core)

which leaves about 20 % of the 7200 s for contention. GRPO alone and SFT alone do not fit beside them
(with the same tuning, another 4 x 60 x (13.7 + 6.1) = 4750 s of training); since the runs are keyed by
(method, seed, rate), ``--methods chord_mu sft_grpo grpo sft`` later adds them under the same fingerprint.

Full setting (``--full``: 6 methods, 3 seeds, 100 steps of 8 rows, 200 held-out problems every 25 steps,
100 validation problems, grid of 3 learning rates 3e-4, 1e-4, 1e-3: 6 methods x (3 + 2) = 30 runs, an
estimated 10-13 hours of one core). Quick setting (``--quick``: 1 seed, 6 steps, 20 problems, one rate; a
smoke run, too short to rank anything).

Each finished run (method, seed, learning rate) is appended to ``learning_runs.jsonl`` in ``--out``
with a fingerprint of the settings (``RUN_KEYS``: every option that changes what a run measures); at
start, the records of ``--resume-from`` (default: the committed ``benchmarks/results/learning_runs.jsonl``,
all settings) that ``--out``'s file lacks are copied into it, and the runs of the current fingerprint
already there are skipped, so an interrupted study continues where it stopped (losing at most the run in
flight), also over several sittings; runs made with other settings are never mixed in, and ``--out``'s
file can be copied back over the committed one without losing its earlier studies.
``learning.json``, ``learning.md`` and ``learning.png`` are rewritten after every run. Run it in the
background at low priority with one thread, writing to a folder outside the repository (a ``git
checkout`` of ``benchmarks/results/`` would lose finished runs)::

    OMP_NUM_THREADS=1 nohup nice -n 19 .venv/bin/python benchmarks/learning.py --out ~/learning-study \\
        > ~/learning-study.log 2>&1 &

and copy the four result files into ``benchmarks/results/`` when done (or to carry finished runs over to a
later sitting). Smoke run: ``nice -n 5 .venv/bin/python benchmarks/learning.py --quick --out /tmp/learning``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports
import seed_stats

METHODS = ("grpo", "sft", "sft_grpo", "chord_mu", "chord_phi", "mix")
LABELS = {
    "grpo": "GRPO",
    "sft": "SFT only",
    "sft_grpo": "SFT then GRPO",
    "chord_mu": "CHORD-mu",
    "chord_phi": "CHORD-phi",
    "mix": "MIX",
}
# the default setting: the paired question of issue 38 (CHORD-mu against SFT then GRPO), sized to fit about two
# hours of one core (the arithmetic is in the module docstring and benchmarks/README.md)
PAIR_SETTING = {
    "methods": ["chord_mu", "sft_grpo"],
    "seeds": [0, 1, 2],
    "steps": 60,
    "eval_every": 0,
    "eval_rows": 200,
    "val_rows": 100,
    "learning_rates": [1e-4, 3e-4],
}
FULL = {
    "methods": list(METHODS),
    "seeds": [0, 1, 2],
    "steps": 100,
    "eval_every": 25,
    "eval_rows": 200,
    "val_rows": 100,
    "learning_rates": [3e-4, 1e-4, 1e-3],
}
QUICK = {
    "methods": list(METHODS),
    "seeds": [0],
    "steps": 6,
    "eval_every": 3,
    "eval_rows": 20,
    "val_rows": 10,
    "learning_rates": [2e-4],
}
TEMPERATURE = 0.8
# the pair of the paired comparison: CHORD-mu against the two-stage pipeline
PAIR = ("chord_mu", "sft_grpo")
GROUPS = ("all", "covered", "uncovered")
RUNS_FILE = "learning_runs.jsonl"
COMMITTED_RUNS = Path(__file__).resolve().parent / "results" / RUNS_FILE
# options that change what a run measures: a results file made with other values is not resumed
RUN_KEYS = (
    "model",
    "steps",
    "eval_every",
    "eval_rows",
    "eval_max_new_tokens",
    "rows",
    "expert_rows",
    "sft_steps",
    "num_generations",
    "completion_len",
    "val_rows",
    "lora_r",
    "train_rows",
    "expert_pool",
    "covered",
    "prompt_style",
    "bf16",
    "device",
    "temperature",
)
# options added later: in the fingerprint only when set, so the runs recorded before they existed keep theirs
OPTIONAL_RUN_KEYS = ("expert_ratio",)


# ------------------------------------------------------------------------------------------ set-up
def lora_config(args):
    from peft import LoraConfig

    return LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear", task_type="CAUSAL_LM")


def common_config(args, seed: int, output_dir: str, steps: int, lr: float) -> dict:
    return {
        "output_dir": output_dir,
        "use_cpu": args.device == "cpu",
        "bf16": args.bf16,
        "activation_checkpointing": False,
        "max_steps": steps,
        "learning_rate": lr,
        "lr_scheduler_type": "constant",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "seed": seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def sft_trainer(model, seed: int, lr: float, args, data: dict, output_dir: str, steps: int):
    from trinity_trl.trainers import TrinitySFTConfig, TrinitySFTTrainer

    config = TrinitySFTConfig(**common_config(args, seed, output_dir, steps, lr), per_device_train_batch_size=args.rows)
    return TrinitySFTTrainer(model=model, args=config, train_dataset=data["expert"], peft_config=lora_config(args))


def rl_trainer(method: str, model, seed: int, lr: float, args, data: dict, output_dir: str, steps: int, tokenizer=None):
    """GRPO (``model`` may be an SFT-trained PEFT model, then its adapter is trained on), CHORD-mu/phi or MIX."""
    from trinity_trl.data import arithmetic_reward
    from trinity_trl.trainers import (
        ChordConfig,
        ChordTrainer,
        TrinityConfig,
        TrinityTrainer,
    )

    with_expert = method != "grpo"
    rollouts = args.rows - args.expert_rows if with_expert else args.rows
    rl = {
        **common_config(args, seed, output_dir, steps, lr),
        "per_device_train_batch_size": rollouts,
        "num_generations": args.num_generations,
        "max_completion_length": args.completion_len,
        "temperature": args.temperature,
        "kl_loss": "none",
    }
    extra: dict = {}
    if method == "grpo":
        trainer_class, config = TrinityTrainer, TrinityConfig(**rl, algorithm="grpo")
    else:
        trainer_class = ChordTrainer
        extra["expert_dataset"] = data["expert"]
        # the demonstrations' share as ChordConfig's ratio (--expert-ratio), or their count per step
        share = (
            {"expert_data_ratio": args.expert_ratio}
            if args.expert_ratio is not None
            else {"expert_batch_size": args.expert_rows}
        )
        if method == "chord_mu":  # the paper's CHORD-mu: plain SFT term, mu decays over the run
            config = ChordConfig(
                **rl,
                algorithm="mix_chord",
                enable_phi_function=False,
                mu_peak=0.9,
                mu_valley=0.05,
                mu_warmup_steps=0,
                mu_decay_steps=steps,
                **share,
            )
        elif method == "chord_phi":  # the paper's CHORD-phi: p(1-p)-weighted SFT tokens, constant mu 0.1
            config = ChordConfig(
                **rl,
                algorithm="mix_chord",
                enable_phi_function=True,
                mu_peak=0.1,
                mu_valley=0.1,
                **share,
            )
        elif method == "mix":
            config = ChordConfig(**rl, algorithm="mix", **share)
        else:
            raise ValueError(method)
    if not isinstance(model, str):  # continue training an existing adapter: no new one
        extra["processing_class"] = tokenizer
    return trainer_class(
        model=model,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=data["train"],
        peft_config=lora_config(args) if isinstance(model, str) else None,
        **extra,
    )


def validation_set(args, data: dict):
    """``args.val_rows`` training-split problems that are neither RL prompts nor demonstrations, the templates
    taking turns (for choosing the learning rate; the held-out split is never used for it)."""
    from datasets import Dataset

    from trinity_trl.data.arithmetic import TEMPLATES, make_problems

    def text(prompt) -> str:
        return prompt[-1]["content"]

    used = {text(p) for p in data["train"]["prompt"]} | {text(p) for p in data["expert"]["prompt"]}
    pool = make_problems("train", 4 * args.val_rows + 40, 2, prompt_style=args.prompt_style)
    by_kind = {k: [r for r in pool if r["kind"] == k and text(r["prompt"]) not in used] for k in TEMPLATES}
    rows = [by_kind[k][i] for i in range(4 * args.val_rows) for k in TEMPLATES if i < len(by_kind[k])]
    if len(rows) < args.val_rows:
        raise ValueError(f"only {len(rows)} validation problems apart from the training rows")
    return Dataset.from_list(rows[: args.val_rows])


# ------------------------------------------------------------------------------------- evaluation
def evaluate(model, tokenizer, data: dict, args, split: str = "test", outcomes: bool = False) -> dict:
    """Accuracy on ``data[split]`` overall, on the covered and uncovered templates, and per template (with
    ``outcomes``, also each problem's 0/1 outcome, in dataset order)."""
    from trinity_trl.data import accuracy_by_kind, arithmetic_reward, evaluate_accuracy

    _, completions = evaluate_accuracy(
        model,
        tokenizer,
        data[split],
        batch_size=args.eval_batch_size,
        max_new_tokens=args.eval_max_new_tokens,
        progress=False,
        return_completions=True,
    )
    by_kind = accuracy_by_kind(completions, data[split])
    kinds = data[split]["kind"]

    def group(names) -> float:
        rows = [k for k in kinds if k in names]
        return sum(by_kind[k] * kinds.count(k) for k in set(rows)) / len(rows)

    uncovered = [k for k in set(kinds) if k not in args.covered]
    point = {
        "all": by_kind["all"],
        "covered": group(args.covered),
        "uncovered": group(uncovered) if uncovered else None,
        "by_kind": {k: v for k, v in by_kind.items() if k != "all"},
    }
    if outcomes:
        point["outcomes"] = [int(r) for r in arithmetic_reward(completions, list(data[split]["answer"]))]
        point["kinds"] = list(kinds)  # each problem's template, for the sign test per template group
    return point


def timed_generation(trainer, seconds: list[float]) -> None:
    """Add the CPU seconds of each of ``trainer``'s rollout generations (TRL's single-turn generation) to
    ``seconds[0]`` (the trainer's own method, wrapped on this instance only)."""
    generate = trainer._generate_single_turn

    def timed(*a, **kw):
        cpu = time.process_time()
        try:
            return generate(*a, **kw)
        finally:
            seconds[0] += time.process_time() - cpu

    trainer._generate_single_turn = timed


def train_with_evaluation(
    trainer, data: dict, args, step_offset: int = 0, evaluate_last: bool = True, validate: bool = True
) -> dict:
    """Train; every ``eval_every`` (global) steps (0: none but the last) record the held-out accuracy (each
    problem's outcome at the last step), then, with ``validate``, the validation accuracy; CPU/wall seconds of
    training (and of its rollout generation) and of the evaluations."""
    from transformers import PrinterCallback, TrainerCallback

    trainer.remove_callback(PrinterCallback)  # the log dict of every step (kept in log_history)
    curve: list[dict] = []
    eval_wall, eval_cpu, generation_cpu = [0.0], [0.0], [0.0]
    if hasattr(trainer, "_generate_single_turn"):
        timed_generation(trainer, generation_cpu)

    class AccuracyCallback(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            step = state.global_step + step_offset
            last = evaluate_last and state.global_step == targs.max_steps
            if (args.eval_every and step % args.eval_every == 0) or last:
                start, cpu = time.perf_counter(), time.process_time()
                point = {
                    "step": step,
                    **evaluate(trainer.model, trainer.processing_class, data, args, outcomes=last),
                }
                eval_wall[0] += time.perf_counter() - start
                eval_cpu[0] += time.process_time() - cpu
                curve.append(point)
                print(
                    f"    step {step}: accuracy {point['all']:.3f} (covered {point['covered']:.3f}, uncovered "
                    f"{bc.fmt(point['uncovered'])})",
                    flush=True,
                )

    trainer.add_callback(AccuracyCallback())
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    reward_key = next((k for k in (logs[0] if logs else {}) if k.startswith("rewards/") and k.endswith("/mean")), None)
    result = {
        "curve": curve,
        "steps": trainer.state.global_step,
        "train_wall_s": wall - eval_wall[0],
        "train_cpu_s": cpu - eval_cpu[0],
        "generation_cpu_s": generation_cpu[0],
        "eval_wall_s": eval_wall[0],
        "eval_cpu_s": eval_cpu[0],
        "train_reward": [e.get(reward_key) for e in logs] if reward_key else [],
        # share of rollout groups whose rewards all agree (no advantage, no RL gradient from them)
        "frac_reward_zero_std": [e["frac_reward_zero_std"] for e in logs if "frac_reward_zero_std" in e],
        "loss": [e.get("loss") for e in logs],
        "mu": [e["actor/mu"] for e in logs if "actor/mu" in e],
    }
    if validate:
        cpu = time.process_time()
        result["val"] = evaluate(trainer.model, trainer.processing_class, data, args, split="val")["all"]
        result["eval_cpu_s"] += time.process_time() - cpu
    return result


def run_method(
    method: str, model: str, seed: int, lr: float, args, data: dict, tmp: Path, validate: bool = True
) -> dict:
    """One (method, seed, learning rate) run: its curve, validation accuracy (with ``validate``: the tuning
    seed's runs; otherwise ``None``), timings and per-step logs (both stages for ``sft_grpo``)."""
    if method == "sft":
        trainer = sft_trainer(model, seed, lr, args, data, str(tmp / "sft"), args.steps)
        return {"val": None, **train_with_evaluation(trainer, data, args, validate=validate)}
    if method != "sft_grpo":
        trainer = rl_trainer(method, model, seed, lr, args, data, str(tmp / method), args.steps)
        return {"val": None, **train_with_evaluation(trainer, data, args, validate=validate)}
    sft_steps = args.sft_steps if args.sft_steps is not None else args.steps // 2
    first = sft_trainer(model, seed, lr, args, data, str(tmp / "sft_stage"), sft_steps)
    stage1 = train_with_evaluation(first, data, args, evaluate_last=False, validate=False)
    second = rl_trainer(
        "grpo",
        first.model,
        seed,
        lr,
        args,
        data,
        str(tmp / "grpo_stage"),
        args.steps - sft_steps,
        tokenizer=first.processing_class,
    )
    stage2 = train_with_evaluation(second, data, args, step_offset=sft_steps, validate=validate)
    merged = {
        "curve": stage1["curve"] + stage2["curve"],
        "steps": sft_steps + stage2["steps"],
        "sft_steps": sft_steps,
        "val": stage2.get("val"),
    }
    for key in ("train_wall_s", "train_cpu_s", "generation_cpu_s", "eval_wall_s", "eval_cpu_s"):
        merged[key] = stage1[key] + stage2[key]
    for key in ("train_reward", "frac_reward_zero_std", "loss", "mu"):
        merged[key] = stage1[key] + stage2[key]
    return merged


# ----------------------------------------------------------------------------------------- results
def settings_key(args) -> str:
    """A fingerprint of the options that change what a run measures (see ``RUN_KEYS``)."""
    values = {k: getattr(args, k) for k in RUN_KEYS}
    values.update({k: getattr(args, k) for k in OPTIONAL_RUN_KEYS if getattr(args, k, None) is not None})
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:12]


def load_runs(path: Path, key: str) -> list[dict]:
    """Finished runs (and the base-model evaluation) recorded with the same settings."""
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("settings") == key:
                runs.append(record)
    return runs


def run_id(record: dict) -> tuple:
    """What a record is a run of: (settings fingerprint, method, seed, learning rate); the method is ``"base"``
    for step 0."""
    return (record.get("settings"), record["method"], record.get("seed"), record.get("lr"))


def _all_runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def merge_runs(target: Path, sources: list[Path]) -> int:
    """Append to ``target`` the records of ``sources`` (e.g. the committed ``benchmarks/results`` runs file) that
    it does not hold yet, whatever their settings (``load_runs`` reads only those of the current fingerprint;
    keeping the others makes ``target`` a superset that can be copied back over the committed file). The same run
    is never recorded twice; missing sources and ``target`` itself are skipped. Returns how many were added."""
    have = {run_id(r) for r in _all_runs(target)}
    added = []
    for source in sources:
        if not source.is_file() or (target.exists() and source.resolve() == target.resolve()):
            continue
        for record in _all_runs(source):
            if run_id(record) not in have:
                have.add(run_id(record))
                added.append(record)
    if added:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as f:
            for record in added:
                f.write(json.dumps(record) + "\n")
    return len(added)


def _stats(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def chosen_rates(records: list[dict], methods: list[str], grid: list[float], tune_seed: int) -> dict:
    """Per method: the grid's validation accuracies on the tuning seed, the chosen rate (best validation accuracy;
    a tie goes to the value listed first) and whether the whole grid has run (``complete``)."""
    out = {}
    for method in methods:
        val = {}
        for lr in grid:
            run = next((r for r in records if (r["method"], r["seed"], r.get("lr")) == (method, tune_seed, lr)), None)
            if run is not None:
                val[lr] = run["val"]
        if val:
            best = max(val, key=lambda lr: (val[lr], -grid.index(lr)))
            out[method] = {"val": val, "lr": best, "complete": len(val) == len(grid)}
    return out


def _final(run: dict) -> dict:
    return max(run["curve"], key=lambda p: p["step"])


def _sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of ``wins`` against ``losses`` (ties left out) under p = 1/2."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def sign_counts(pairs: list[tuple[list[int], list[int], list[str]]], covered: list[str] | None) -> dict:
    """Pooled over ``pairs`` (one per seed: ``a``'s and ``b``'s 0/1 outcome per problem and each problem's
    template), the problems only ``a`` solves, only ``b`` solves and the exact two-sided sign test, for all
    problems and, with ``covered``, for the covered and the uncovered templates apart."""
    groups = {"all": lambda kind: True}
    if covered is not None:
        groups["covered"] = lambda kind: kind in covered
        groups["uncovered"] = lambda kind: kind not in covered
    out = {}
    for group, member in groups.items():
        wins = losses = 0
        for xs, ys, kinds in pairs:
            for x, y, kind in zip(xs, ys, kinds, strict=True):
                if member(kind):
                    wins += x > y
                    losses += y > x
        out[group] = {"only_a": wins, "only_b": losses, "sign_test_p": _sign_test(wins, losses)}
    return out


def paired(records: list[dict], rates: dict, a: str, b: str, covered: list[str] | None = None) -> dict | None:
    """CHORD-mu (``a``) against ``b`` at their chosen rates, on the seeds both have: per-seed differences of the
    final accuracy (mean, std, paired t), and pooled over seeds and problems, the problems only one solves with an
    exact sign test (``problems``; with ``covered``, also per template group: ``problems_by_group``)."""
    if a not in rates or b not in rates:
        return None
    runs = {m: {r["seed"]: r for r in records if r["method"] == m and r.get("lr") == rates[m]["lr"]} for m in (a, b)}
    seeds = sorted(set(runs[a]) & set(runs[b]))
    if not seeds:
        return None
    out: dict = {"seeds": seeds, "methods": [a, b]}
    for group in GROUPS:
        diffs = [_final(runs[a][s])[group] - _final(runs[b][s])[group] for s in seeds]
        if None in diffs:
            continue
        test = seed_stats.paired_t(diffs)  # the seed is the unit of replication
        stats = {k: test[k] for k in ("mean", "t", "p", "low", "high")}
        out[group] = {"diffs": diffs, "std": test["std"] or 0.0, **stats}
    pairs = []
    for seed in seeds:
        fa, fb = _final(runs[a][seed]), _final(runs[b][seed])
        kinds = fa.get("kinds") or [""] * len(fa["outcomes"])  # runs recorded before kinds were kept
        pairs.append((fa["outcomes"], fb["outcomes"], kinds))
    with_kinds = covered is not None and all(_final(runs[a][s]).get("kinds") for s in seeds)
    counts = sign_counts(pairs, covered if with_kinds else None)
    out["problems"] = counts["all"]
    if with_kinds:
        out["problems_by_group"] = counts
    return out


def summarise(records: list[dict], methods: list[str], rates: dict) -> dict:
    """Per method, at its chosen rate: mean / std / min / max over seeds at each evaluated step (step 0 = base
    model), cost, train reward and the share of rollout groups that gave an RL signal (a reward spread)."""
    base = next((r for r in records if r["method"] == "base"), None)
    out = {}
    for method in methods:
        if method not in rates:
            continue
        runs = [r for r in records if r["method"] == method and r.get("lr") == rates[method]["lr"]]
        steps = sorted({p["step"] for r in runs for p in r["curve"]})
        table: dict = {}
        for group in GROUPS:
            rows = {}
            if base is not None and base["point"].get(group) is not None:
                rows[0] = _stats([base["point"][group]] * len(runs))
            for step in steps:
                values = [p[group] for r in runs for p in r["curve"] if p["step"] == step and p[group] is not None]
                if values:
                    rows[step] = _stats(values)
            table[group] = rows
        rewards = [v for r in runs for v in r["train_reward"] if v is not None]
        zero_std = [v for r in runs for v in r.get("frac_reward_zero_std", [])]
        train_cpu = sum(r["train_cpu_s"] for r in runs)
        out[method] = {
            "lr": rates[method]["lr"],
            "seeds": sorted(r["seed"] for r in runs),
            "accuracy": table,
            "final": {g: table[g][max(table[g])] for g in GROUPS if table[g]},
            "train_cpu_s_per_step": train_cpu / sum(r["steps"] for r in runs),
            "generation_share": sum(r.get("generation_cpu_s", 0.0) for r in runs) / train_cpu if train_cpu else None,
            "train_wall_s_per_step": statistics.mean(r["train_wall_s"] / r["steps"] for r in runs),
            "eval_cpu_s": statistics.mean(r["eval_cpu_s"] for r in runs),
            "mean_train_reward": statistics.mean(rewards) if rewards else None,
            # each step's share of rollout groups whose rewards differ (an RL signal), averaged over steps: a share
            # of groups, comparable between methods with different numbers of groups per step
            "rl_groups_with_signal": sum(1.0 - v for v in zero_std) / len(zero_std) if zero_std else None,
        }
    return out


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    styles = {
        "grpo": ("o", "-"),
        "sft": ("^", "-"),
        "sft_grpo": ("v", "--"),
        "chord_mu": ("s", "-"),
        "chord_phi": ("D", "-"),
        "mix": ("x", ":"),
    }
    c = report["config"]
    titles = {
        "all": f"all templates ({c['eval_rows']} problems)",
        "covered": f"covered by demonstrations ({', '.join(c['covered'])})",
        "uncovered": "uncovered (RL prompts only)",
    }
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.3), sharey=True)
    for ax, group in zip(axes, GROUPS):
        for method, s in report["summary"].items():
            rows = s["accuracy"].get(group, {})
            if not rows:
                continue
            steps = sorted(int(k) for k in rows)
            mean = [rows[str(k)]["mean"] for k in steps]
            std = [rows[str(k)]["std"] for k in steps]
            marker, line = styles.get(method, ("o", "-"))
            label = f"{LABELS.get(method, method)} (lr {_lr(s['lr'])})"
            ax.plot(steps, mean, marker=marker, linestyle=line, label=label)
            ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], alpha=0.12)
        ax.set_title(titles[group], fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy held-out accuracy (mean ± std over seeds)")
    axes[0].legend(fontsize=8)
    seeds = sorted({seed for s in report["summary"].values() for seed in s["seeds"]})
    fig.suptitle(
        f"{'QUICK: ' if c['quick'] else ''}{report['model_description']}, LoRA r{c['lora_r']}, "
        f"{c['rows']} rows/step, {c['steps']} steps, lr per method from {c['learning_rates']}, seeds {seeds}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    return f"{row['mean']:.3f} ± {row['std']:.3f}" if row["n"] > 1 else f"{row['mean']:.3f}"


def _lr(value: float) -> str:
    return f"{value:g}"


def markdown(report: dict) -> str:
    lines = markdown_header(report) + accuracy_lines(report) + paired_lines(report.get("paired")) + cost_lines(report)
    if report.get("notes"):
        lines += ["Notes:", ""] + [f"- {note}" for note in report["notes"]] + [""]
    return "\n".join(lines)


def _uncovered(config: dict) -> list[str]:
    return [k for k in ("add", "sub", "mul", "div", "two_step") if k not in config["covered"]]


def markdown_header(report: dict) -> list[str]:
    """The setting, the task, the model and the tuning budget, then the tuning table."""
    c, m = report["config"], report["machine"]
    uncovered = _uncovered(c)
    grid = ", ".join(_lr(x) for x in c["learning_rates"])
    lines = [
        "# Learning benchmark: " + ", ".join(LABELS.get(m, m) for m in c["methods"]),
        "",
        ("**Quick setting**: a smoke run, too short to rank anything. " if c["quick"] else "")
        + f"Command: `{report['command']}`",
        "",
        bc.machine_line(m),
        f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end.",
        f"Settings fingerprint `{report['settings']}` (the options that change what a run measures: "
        + ", ".join(f"{k} {c.get(k)}" for k in RUN_KEYS if k not in ("model",))
        + ").",
        "",
        (
            f"Task: bundled arithmetic word problems. Demonstrations (worked solutions) exist for the templates "
            f"{', '.join(c['covered'])} only ({c['expert_pool']} of them); RL prompts ({c['train_rows']}) and held-out "
            f"problems ({c['eval_rows']}, the templates in equal numbers) cover all five, so "
            f"{' and '.join(uncovered)} can only be learned from reward. Validation: {c['val_rows']} other "
            "training-split problems (neither RL prompts nor demonstrations). Prompts: answer format as the system "
            "message."
        ),
        "",
        (
            f"Model: {report['model_description']} + LoRA (r {c['lora_r']}, alpha {2 * c['lora_r']}, all linear "
            f"layers), AdamW, constant learning rate, {c['steps']} optimizer steps, {c['rows']} training rows per "
            f"step for every method: GRPO {c['rows']} rollouts ({c['rows'] // c['num_generations']} prompts x "
            f"{c['num_generations']}); SFT {c['rows']} demonstrations; SFT then GRPO: SFT for {report['sft_steps']} "
            f"steps, then GRPO; CHORD/MIX {c['rows'] - c['expert_rows']} rollouts + {c['expert_rows']} "
            f"demonstrations (CHORD-mu: plain SFT term, mu 0.9 -> 0.05 cosine over all {c['steps']} steps; "
            f"CHORD-phi: p(1-p)-weighted SFT term, mu 0.1; MIX: plain SFT term, mu 0.1). Rollouts: temperature "
            f"{c['temperature']}, at most {c['completion_len']} tokens, reward 1 for the exact final answer, no KL. "
            f"Accuracy: greedy, {c['eval_max_new_tokens']} new tokens, "
            + (f"every {c['eval_every']} steps" if c["eval_every"] else f"once, after step {c['steps']}")
            + "; step 0 = the base model (measured once, shared)."
        ),
        "",
        (
            f"Tuning budget, the same for every method: the learning rates {grid}, each trained once on seed "
            f"{report['tune_seed']}; the rate with the best final validation accuracy is the method's (a tie goes to "
            "the value listed first), and its other seeds run at that rate. The tables below are at each method's "
            "chosen rate."
        ),
        "",
        "## Tuning (validation accuracy after the last step, seed " + str(report["tune_seed"]) + ")",
        "",
        "| method | " + " | ".join(f"lr {_lr(x)}" for x in c["learning_rates"]) + " | chosen |",
        "|---|" + "---|" * (len(c["learning_rates"]) + 1),
    ]
    for method, rate in report["rates"].items():
        cells = [bc.fmt(rate["val"].get(str(x), rate["val"].get(x))) for x in c["learning_rates"]]
        chosen = _lr(rate["lr"]) + ("" if rate["complete"] else " (grid not finished)")
        lines.append(f"| {LABELS.get(method, method)} | " + " | ".join(cells) + f" | {chosen} |")
    return lines + [""]


def accuracy_lines(report: dict) -> list[str]:
    c, summary, lines = report["config"], report["summary"], []
    steps = sorted({int(k) for s in summary.values() for k in s["accuracy"]["all"]})
    for group, title in (
        ("all", "all templates"),
        ("covered", f"covered templates ({', '.join(c['covered'])})"),
        ("uncovered", f"uncovered templates ({', '.join(_uncovered(c))})"),
    ):
        lines += [
            f"## Accuracy, {title} (mean ± std over seeds)",
            "",
            "| method | lr | seeds | " + " | ".join(f"step {s}" for s in steps) + " |",
            "|---|---|---|" + "---|" * len(steps),
        ]
        for method, s in summary.items():
            rows = s["accuracy"].get(group, {})
            lines.append(
                f"| {LABELS.get(method, method)} | {_lr(s['lr'])} | {len(s['seeds'])} | "
                + " | ".join(_cell(rows.get(str(k))) for k in steps)
                + " |"
            )
        lines.append("")
    return lines


def paired_lines(pair: dict | None) -> list[str]:
    lines = []
    if pair:
        a, b = (LABELS[x] for x in pair["methods"])
        lines += [
            f"## Paired comparison: {a} minus {b} (final step, seeds {pair['seeds']})",
            "",
            "The seed is the unit of replication: every problem of a seed is scored by the same trained adapter and "
            "the same problems recur in every seed, so the test is a paired t over the per-seed differences "
            f"({len(pair['seeds']) - 1} degrees of freedom).",
            "",
            "| group | per-seed differences | mean | std | 95 % interval | paired t | two-sided p |",
            "|---|---|---|---|---|---|---|",
        ]
        for group in GROUPS:
            if group in pair:
                d = pair[group]
                interval = "n/a" if d.get("low") is None else f"[{d['low']:+.3f}, {d['high']:+.3f}]"
                lines.append(
                    f"| {group} | {', '.join(f'{x:+.3f}' for x in d['diffs'])} | {d['mean']:+.3f} | {d['std']:.3f} | "
                    f"{interval} | {bc.fmt(d['t'], '.2f')} | {bc.fmt(d.get('p'), '.2f')} |"
                )
        p = pair["problems"]
        lines += [
            "",
            f"Descriptive only (not a test of the methods: it counts each problem of each seed as independent, which "
            f"they are not): pooled over seeds and held-out problems, {p['only_a']} solved by {a} only, "
            f"{p['only_b']} by {b} only (an exact sign test on these counts would give p = {p['sign_test_p']:.3g}).",
            "",
        ]
        if pair.get("problems_by_group"):
            lines += [
                "The same counts per template group (descriptive, as above):",
                "",
                f"| group | solved by {a} only | solved by {b} only | two-sided p |",
                "|---|---|---|---|",
            ]
            for group, g in pair["problems_by_group"].items():
                lines.append(f"| {group} | {g['only_a']} | {g['only_b']} | {g['sign_test_p']:.3g} |")
            lines.append("")
    return lines


def cost_lines(report: dict) -> list[str]:
    lines = [
        "## Cost and rollouts",
        "",
        "| method | CPU s / step (train) | generation share | wall s / step (train) | eval CPU s / run | "
        "mean train reward | rollout groups with a reward spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, s in report["summary"].items():
        share = s.get("generation_share")
        signal = s.get("rl_groups_with_signal")
        lines.append(
            f"| {LABELS.get(method, method)} | {s['train_cpu_s_per_step']:.1f} | "
            f"{'n/a' if not share else f'{100 * share:.0f} %'} | {s['train_wall_s_per_step']:.1f} | "
            f"{s['eval_cpu_s']:.0f} | {bc.fmt(s['mean_train_reward'])} | "
            f"{'n/a' if signal is None else f'{100 * signal:.0f} %'} |"
        )
    lines += [
        "",
        (
            f"Plot: `learning.png`. Runs: {report['num_runs']} of {report['planned_runs']} planned in `{RUNS_FILE}` "
            f"(settings `{report['settings']}`); CPU time of all runs {report['total_cpu_s'] / 60:.1f} min (one "
            "thread)."
        ),
        "",
    ]
    return lines


def write_report(
    args, records: list[dict], out: Path, description: str, load_start, command: str, measured: dict | None = None
) -> dict:
    measured = measured or {}
    rates = chosen_rates(records, args.methods, args.learning_rates, args.seeds[0])
    report = {
        "benchmark": "learning",
        "command": measured.get("command", command),
        "machine": measured.get("machine", bc.machine_description(args.device)),
        "load_average_start": measured.get("load_average_start", load_start),
        "load_average_end": measured.get("load_average_end", bc.loadavg()),
        "model_description": description,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "note", "from_runs", "resume_from")},
        "settings": settings_key(args),
        "sft_steps": args.sft_steps if args.sft_steps is not None else args.steps // 2,
        "tune_seed": args.seeds[0],
        "rates": rates,
        "summary": summarise(records, args.methods, rates),
        "paired": paired(records, rates, *PAIR, covered=args.covered),
        "num_runs": sum(r["method"] != "base" for r in records),
        "planned_runs": len(args.methods) * (len(args.learning_rates) + len(args.seeds) - 1),
        "total_cpu_s": sum(r.get("train_cpu_s", 0) + r.get("eval_cpu_s", 0) for r in records),
        "records": records,
        "notes": args.note,
    }
    report = json.loads(json.dumps(report))  # step and rate keys become strings, as in the file
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot(report, out / "learning.png")
    (out / "learning.md").write_text(markdown(report))
    print(
        f"wrote {out / 'learning.json'}, {out / 'learning.md'}" + (f", {out / 'learning.png'}" if plotted else ""),
        flush=True,
    )
    return report


# -------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument(
        "--full",
        action="store_true",
        help=f"the full six-method setting {FULL} (10-13 CPU hours; explicit options below still override it)",
    )
    preset.add_argument(
        "--quick", action="store_true", help=f"quick setting {QUICK} (explicit options below still override it)"
    )

    def default(key: str) -> str:
        return f"default {PAIR_SETTING[key]} ({FULL[key]} --full, {QUICK[key]} --quick)"

    parser.add_argument("--methods", nargs="+", choices=METHODS, help=default("methods"))
    parser.add_argument("--seeds", type=int, nargs="+", help=default("seeds"))
    parser.add_argument("--steps", type=int, help="optimizer steps, " + default("steps"))
    parser.add_argument(
        "--eval-every",
        type=int,
        help="held-out accuracy every so many steps (0: only after the last step), " + default("eval_every"),
    )
    parser.add_argument("--eval-rows", type=int, help="held-out problems, " + default("eval_rows"))
    parser.add_argument("--eval-max-new-tokens", type=int, default=40)
    parser.add_argument("--eval-batch-size", type=int, default=50)
    parser.add_argument(
        "--model",
        default="bundled",
        help="'bundled' (SmolLM2-135M-Instruct), 'tiny' (random 2-layer Qwen2, smoke tests) or a path/id",
    )
    parser.add_argument("--rows", type=int, default=8, help="training rows per optimizer step, for every method")
    parser.add_argument("--expert-rows", type=int, default=4, help="CHORD/MIX: demonstrations among the rows")
    parser.add_argument(
        "--expert-ratio",
        type=float,
        default=None,
        help="CHORD/MIX: the demonstrations' share of the rows instead of --expert-rows (ChordConfig's "
        "expert_data_ratio; e.g. 0.2 with --rows 10: 2 demonstrations beside 8 rollouts)",
    )
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT then GRPO: SFT steps (default: half)")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--completion-len", type=int, default=40)
    parser.add_argument(
        "--learning-rates",
        type=float,
        nargs="+",
        help="the tuning grid, the same for every method, each value run on the first seed, the best on validation "
        "runs on the rest; " + default("learning_rates"),
    )
    parser.add_argument("--val-rows", type=int, help="validation problems, " + default("val_rows"))
    parser.add_argument("--temperature", type=float, default=TEMPERATURE, help="rollout sampling temperature")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--train-rows", type=int, default=512, help="RL prompts (all templates)")
    parser.add_argument("--expert-pool", type=int, default=256, help="demonstrations (covered templates)")
    parser.add_argument(
        "--covered",
        nargs="+",
        default=["add", "sub", "mul"],
        help="templates with demonstrations (the others only appear as RL prompts and held out)",
    )
    parser.add_argument("--prompt-style", choices=("user", "system"), default="system")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (1: on 2 shared cores, 2 threads made steps up to 25x slower)",
    )
    parser.add_argument("--out", default="benchmarks/results", help="directory for learning.* and the runs file")
    parser.add_argument(
        "--resume-from",
        nargs="*",
        default=[str(COMMITTED_RUNS)],
        help="runs files whose runs of the same settings fingerprint are copied into --out's runs file at start "
        "(not run again); default the committed benchmarks/results/learning_runs.jsonl",
    )
    parser.add_argument("--note", action="append", default=[], help="a remark to record in the report (repeatable)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rewrite learning.json/.md/.png from the runs file (adding --note)",
    )
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL if args.full else PAIR_SETTING
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    uses_expert = {"chord_mu", "chord_phi", "mix"} & set(args.methods)
    if args.expert_ratio is not None:
        if not 0 < args.expert_ratio < 1:
            parser.error("--expert-ratio must be in (0, 1)")
        expert_rows = round(args.expert_ratio * args.rows)
        rollouts = args.rows - expert_rows
        # ChordConfig derives the expert rows from the ratio and the rollouts: they must come out the same
        if rollouts < 1 or round(args.expert_ratio / (1 - args.expert_ratio) * rollouts) != expert_rows:
            parser.error(f"--expert-ratio {args.expert_ratio} of --rows {args.rows} is not a whole number of rows")
        args.expert_rows = expert_rows
    uses_rows_as_rollouts = {"grpo", "sft_grpo"} & set(args.methods)
    if (uses_rows_as_rollouts and args.rows % args.num_generations) or (
        uses_expert and (args.rows - args.expert_rows) % args.num_generations
    ):
        parser.error(
            "--rows (GRPO) and --rows minus the demonstrations (CHORD/MIX) must be multiples of --num-generations"
        )
    if not 0 < args.expert_rows < args.rows:
        parser.error("--expert-rows must be in (0, --rows)")
    if args.eval_every < 0:
        parser.error("--eval-every must be 0 (only after the last step) or positive")
    from trinity_trl.data.arithmetic import TEMPLATES

    unknown = sorted(set(args.covered) - set(TEMPLATES))
    if unknown:
        parser.error(f"unknown templates {unknown}; choose from {sorted(TEMPLATES)}")
    args.covered = [k for k in TEMPLATES if k in args.covered]  # canonical order (part of the settings key)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    runs_path = out / RUNS_FILE
    key = settings_key(args)
    command = " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])])
    description = {"bundled": "SmolLM2-135M-Instruct (bundled, fp32)", "tiny": "random tiny Qwen2 (smoke run)"}.get(
        args.model, args.model
    )
    load_start = bc.loadavg()
    added = merge_runs(runs_path, [Path(p) for p in args.resume_from])
    if added:
        print(f"copied {added} recorded runs (of any settings) from {', '.join(args.resume_from)}", flush=True)
    records = load_runs(runs_path, key)
    if args.report_only:
        # re-rendering trains nothing: keep the machine, load and command recorded by the process that trained
        previous = out / "learning.json"
        measured = json.loads(previous.read_text()) if previous.exists() else {}
        write_report(args, records, out, description, load_start, command, measured)
        return 0

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset

    done = {(r["method"], r["seed"], r.get("lr")) for r in records if r["method"] != "base"}
    tune_seed = args.seeds[0]
    # first the grid on the tuning seed (every method at one rate, then the next rate), then the other seeds
    tuning = [(m, tune_seed, lr) for lr in args.learning_rates for m in args.methods if (m, tune_seed, lr) not in done]
    later = len(args.methods) * (len(args.seeds) - 1)
    later -= sum(1 for m, seed, _ in done if seed != tune_seed and seed in args.seeds and m in args.methods)
    print(
        f"settings {key}: {len(done)} runs recorded in {runs_path}, {len(tuning)} tuning runs and about {later} "
        "runs of the other seeds to do",
        flush=True,
    )
    out.mkdir(parents=True, exist_ok=True)

    def append(record: dict) -> None:
        record = {"settings": key, **record}
        with runs_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(json.loads(json.dumps(record)))

    with tempfile.TemporaryDirectory(prefix="learning_bench_") as tmp_name:
        tmp = Path(tmp_name)
        if args.model == "bundled":
            from trinity_trl.data import bundled_model_dir

            model = str(bundled_model_dir())
        elif args.model == "tiny":
            model = bc.save_random_qwen2(tmp / "model", hidden=64, layers=2, intermediate=128)
        else:
            model = args.model
        data = {
            "train": arithmetic_dataset("train", args.train_rows, seed=0, prompt_style=args.prompt_style),
            "test": arithmetic_dataset("test", args.eval_rows, seed=0, prompt_style=args.prompt_style),
            "expert": arithmetic_expert_dataset(
                args.expert_pool, seed=1, kinds=args.covered, prompt_style=args.prompt_style
            ),
        }
        data["val"] = validation_set(args, data)
        if not any(r["method"] == "base" for r in records) and (tuning or later > 0):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            start, cpu = time.perf_counter(), time.process_time()
            base_model = AutoModelForCausalLM.from_pretrained(model)
            point = evaluate(base_model, AutoTokenizer.from_pretrained(model), data, args)
            append(
                {
                    "method": "base",
                    "seed": None,
                    "point": {"step": 0, **point},
                    "eval_wall_s": time.perf_counter() - start,
                    "eval_cpu_s": time.process_time() - cpu,
                }
            )
            print(
                f"step 0 (base model): accuracy {point['all']:.3f} (covered {point['covered']:.3f}, uncovered "
                f"{bc.fmt(point['uncovered'])})",
                flush=True,
            )
            del base_model

        def run(method: str, seed: int, lr: float) -> None:
            print(f"[seed {seed}] {method} lr {_lr(lr)}: training ...", flush=True)
            # validation only chooses the rate: the other seeds' runs skip it
            result = run_method(
                method, model, seed, lr, args, data, tmp / f"{method}-{seed}-{_lr(lr)}", validate=seed == tune_seed
            )
            append({"method": method, "seed": seed, "lr": lr, **result, "load_average": bc.loadavg()})
            print(
                f"[seed {seed}] {method} lr {_lr(lr)}: validation {bc.fmt(result['val'])}, "
                f"{result['train_cpu_s'] / result['steps']:.1f} CPU s/step, eval {result['eval_cpu_s']:.0f} CPU s, "
                f"load {bc.loadavg()}",
                flush=True,
            )
            write_report(args, records, out, description, load_start, command)
            gc.collect()

        for method, seed, lr in tuning:
            run(method, seed, lr)
        rates = chosen_rates(records, args.methods, args.learning_rates, tune_seed)
        for seed in args.seeds[1:]:
            for method in args.methods:
                if (method, seed, rates[method]["lr"]) not in done:
                    run(method, seed, rates[method]["lr"])
    write_report(args, records, out, description, load_start, command)
    print(markdown(json.loads((out / "learning.json").read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
