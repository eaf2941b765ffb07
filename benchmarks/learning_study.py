#!/usr/bin/env python
"""The pre-registered study of issue 45: CHORD-phi and CHORD-mu as their paper runs them, against SFT then GRPO.

    python benchmarks/learning_study.py run --out /work/study          # resumable: a restart skips finished runs
    python benchmarks/learning_study.py status --out /work/study       # runs done / planned, rates, CPU time so far
    python benchmarks/learning_study.py summarise --out /work/study --to benchmarks/results   # tests over the seeds
    python benchmarks/learning_study.py measure --out /tmp/study-cost --steps 8                 # cost of each arm

The plan is ``PLAN`` below, written out in ``benchmarks/results/learning_study_plan.md`` and committed before the
first scored run; a runs file made under another plan (its fingerprint, ``plan_key``) is never mixed in. What it
compares, on the bundled arithmetic task (demonstrations for the templates add, sub and mul only; RL prompts and
held-out problems from all five) with SmolLM2-135M-Instruct + LoRA:

* ``chord_phi``: ``ChordConfig(paper_config="chord_phi")``: 8 rollouts (1 prompt x 8) + 2 demonstrations a step
  (the released share 0.2), no KL, phi-weighted SFT term, constant mu 0.1;
* ``chord_mu``: ``paper_config="chord_mu"``: the same rows, plain SFT term, mu 0.9 -> 0.05 over the run;
* ``sft_grpo``: SFT on 8 demonstrations a step for a quarter as many steps, then GRPO (1 prompt x 8, no KL) for as
  many steps as CHORD: the same demonstrations and rollouts in all, more optimizer steps (reported).

The order of the runs (the tuning seed over the learning-rate grid, then whole scored seeds), the tuning rule and the
pre-registered tests over the seeds: `seeded_study`; ``summarise`` says plainly when the study is partial.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports
import seeded_study
from seeded_study import RUNS_FILE, final, finished, load_runs, planned_runs, tuning  # noqa: F401 (tests, callers)
from seeded_study import cell as _cell
from seeded_study import mean as _mean
from seeded_study import spread as _spread

# The pre-registration (issue 45 item 3). Changing any value changes the fingerprint: runs made under another plan
# are not resumed or summarised with these.
PLAN = {
    "arms": ["chord_phi", "chord_mu", "sft_grpo"],
    "primary": ["chord_phi", "sft_grpo"],
    "secondary": [["chord_mu", "sft_grpo"]],
    "metric": "greedy accuracy on the held-out problems after the last step",
    "alpha": 0.05,
    "confidence": 0.95,
    "model": "bundled",
    "lora_r": 16,
    "steps": 56,  # CHORD optimizer steps (the SFT stage of sft_grpo: steps // 4, then GRPO: steps)
    "rollouts_per_step": 8,
    "num_generations": 8,
    "expert_share": 0.2,  # CHORD: 2 demonstrations beside 8 rollouts a step
    "sft_rows_per_step": 8,
    "completion_len": 40,
    "temperature": 0.8,
    "train_rows": 512,
    "expert_pool": 256,
    "covered": ["add", "sub", "mul"],
    "prompt_style": "system",
    "eval_rows": 200,
    "probe_rows": 100,  # the first 100 held-out problems (20 per template) at the intermediate points
    "val_rows": 100,
    "eval_max_new_tokens": 40,
    "tune_seed": 0,
    "scored_seeds": [1, 2, 3, 4, 5, 6, 7, 8],
    "grid": [1e-4, 3e-4, 1e-3],
    "grid_factor": 3.0,
    "max_extensions": 2,
}
LABELS = {"chord_phi": "CHORD-phi", "chord_mu": "CHORD-mu", "sft_grpo": "SFT then GRPO", "base": "base model"}
GROUPS = ("all", "covered", "uncovered")
TEMPLATES = ("add", "sub", "mul", "div", "two_step")


def sft_steps(plan: dict) -> int:
    """SFT steps of ``sft_grpo``: the demonstrations CHORD sees in all, ``sft_rows_per_step`` at a time."""
    demonstrations = plan["steps"] * expert_rows(plan)
    if demonstrations % plan["sft_rows_per_step"]:
        raise ValueError(f"{demonstrations} demonstrations are not whole SFT steps of {plan['sft_rows_per_step']}")
    return demonstrations // plan["sft_rows_per_step"]


def expert_rows(plan: dict) -> int:
    """Demonstrations per CHORD step: ``expert_share`` of the step's rows."""
    share = plan["expert_share"]
    rows = share / (1 - share) * plan["rollouts_per_step"]
    if abs(rows - round(rows)) > 1e-9:
        raise ValueError(f"an expert share of {share} beside {plan['rollouts_per_step']} rollouts is not whole rows")
    return round(rows)


def eval_points(plan: dict, arm: str) -> list[int]:
    """The (global) steps whose per-template accuracy is measured, the last on all held-out problems: CHORD after a
    quarter, half and all of its steps; SFT then GRPO at the end of SFT, halfway through GRPO and at the end."""
    steps = plan["steps"]
    if arm == "sft_grpo":
        first = sft_steps(plan)
        return [first, first + steps // 2, first + steps]
    return [steps // 4, steps // 2, steps]


# ------------------------------------------------------------------------------------------ training
def task_data(plan: dict) -> dict:
    from trinity_trl.data import arithmetic_dataset, arithmetic_expert_dataset

    style = plan["prompt_style"]
    data = {
        "train": arithmetic_dataset("train", plan["train_rows"], seed=0, prompt_style=style),
        "test": arithmetic_dataset("test", plan["eval_rows"], seed=0, prompt_style=style),
        "expert": arithmetic_expert_dataset(plan["expert_pool"], seed=1, kinds=plan["covered"], prompt_style=style),
    }
    data["probe"] = data["test"].select(range(plan["probe_rows"]))  # the templates take turns: 20 of each
    data["val"] = seeded_study.validation_set(plan, data)
    return data


def score(model, tokenizer, dataset, plan: dict, keep: bool = False) -> dict:
    """Greedy accuracy overall, on the covered and uncovered templates and per template; with ``keep``, each
    problem's outcome, template and completion."""
    from trinity_trl.data import accuracy_by_kind, arithmetic_reward

    completions = seeded_study.greedy_completions(model, tokenizer, dataset, plan)
    kinds = list(dataset["kind"])
    outcomes = [int(r) for r in arithmetic_reward(completions, list(dataset["answer"]))]

    def share(member) -> float | None:
        chosen = [o for o, k in zip(outcomes, kinds) if member(k)]
        return sum(chosen) / len(chosen) if chosen else None

    by_kind = accuracy_by_kind(completions, dataset)
    point = {
        "n": len(outcomes),
        "all": share(lambda k: True),
        "covered": share(lambda k: k in plan["covered"]),
        "uncovered": share(lambda k: k not in plan["covered"]),
        "by_kind": {k: v for k, v in by_kind.items() if k != "all"},
    }
    if keep:
        point.update(outcomes=outcomes, kinds=kinds, completions=[_text(c) for c in completions])
    return point


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _rl(plan: dict) -> dict:
    return {
        "per_device_train_batch_size": plan["rollouts_per_step"],
        "num_generations": plan["num_generations"],
        "max_completion_length": plan["completion_len"],
        "temperature": plan["temperature"],
        "kl_loss": "none",  # no KL in every arm, stated (CHORD's paper_config implies it)
    }


def chord_trainer(arm: str, model: str, seed: int, lr: float, plan: dict, data: dict, output_dir: str):
    from trinity_trl.data import arithmetic_reward
    from trinity_trl.trainers import ChordConfig, ChordTrainer

    config = ChordConfig(
        **seeded_study.common_config(seed, output_dir, plan["steps"], lr), **_rl(plan), paper_config=arm
    )
    if config.local_expert_rows() != expert_rows(plan):
        raise RuntimeError(f"{arm}: {config.local_expert_rows()} demonstrations a step, planned {expert_rows(plan)}")
    lora = seeded_study.lora_config(plan)
    return ChordTrainer(
        model, arithmetic_reward, config, data["train"], expert_dataset=data["expert"], peft_config=lora
    )


def sft_trainer(model: str, seed: int, lr: float, plan: dict, data: dict, output_dir: str):
    from trinity_trl.trainers import TrinitySFTConfig, TrinitySFTTrainer

    config = TrinitySFTConfig(
        **seeded_study.common_config(seed, output_dir, sft_steps(plan), lr),
        per_device_train_batch_size=plan["sft_rows_per_step"],
    )
    return TrinitySFTTrainer(
        model=model, args=config, train_dataset=data["expert"], peft_config=seeded_study.lora_config(plan)
    )


def grpo_trainer(model, tokenizer, seed: int, lr: float, plan: dict, data: dict, output_dir: str):
    """GRPO on the SFT stage's adapter (a new optimizer), no KL."""
    from trinity_trl.data import arithmetic_reward
    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    config = TrinityConfig(
        **seeded_study.common_config(seed, output_dir, plan["steps"], lr), **_rl(plan), algorithm="grpo"
    )
    return TrinityTrainer(model, arithmetic_reward, config, data["train"], processing_class=tokenizer)


def train_stage(trainer, data: dict, plan: dict, probes: dict[int, int], offset: int = 0) -> dict:
    """Train, scoring the probe problems after each stage step in ``probes`` (stage step -> global step); CPU and
    wall seconds of training (without the probes) and of generation, per-step logs."""
    from transformers import TrainerCallback

    points: list[dict] = []
    eval_cpu, generation_cpu = [0.0], [0.0]
    if hasattr(trainer, "_generate_single_turn"):
        seeded_study.timed_generation(trainer, generation_cpu)

    class Probe(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in probes:
                cpu = time.process_time()
                step = probes[state.global_step]
                point = {"step": step, **score(trainer.model, trainer.processing_class, data["probe"], plan)}
                eval_cpu[0] += time.process_time() - cpu
                points.append(point)
                print(f"    step {point['step']}: probe accuracy {point['all']:.3f} {point['by_kind']}", flush=True)

    trainer.add_callback(Probe())
    wall, cpu, logs = seeded_study.train(trainer)
    reward_key = next((k for k in (logs[0] if logs else {}) if k.startswith("rewards/") and k.endswith("/mean")), None)
    return {
        "points": points,
        "steps": trainer.state.global_step,
        "train_cpu_s": cpu - eval_cpu[0],
        "train_wall_s": wall,
        "generation_cpu_s": generation_cpu[0],
        "probe_cpu_s": eval_cpu[0],
        "train_reward": [e.get(reward_key) for e in logs] if reward_key else [],
        "frac_reward_zero_std": [e["frac_reward_zero_std"] for e in logs if "frac_reward_zero_std" in e],
        "mu": [e["actor/mu"] for e in logs if "actor/mu" in e],
        "loss": [e.get("loss") for e in logs],
    }


def run_arm(arm: str, model: str, seed: int, lr: float, plan: dict, data: dict, tmp: Path, validate: bool) -> dict:
    """One run: its probes, final held-out score (outcomes, templates and greedy completions kept), validation
    accuracy (tuning runs), optimizer steps, the demonstrations and rollouts it trained on, cost."""
    points = eval_points(plan, arm)
    if arm == "sft_grpo":
        first = sft_trainer(model, seed, lr, plan, data, str(tmp / "sft"))
        stage1 = train_stage(first, data, plan, {points[0]: points[0]})
        second = grpo_trainer(first.model, first.processing_class, seed, lr, plan, data, str(tmp / "grpo"))
        stage2 = train_stage(second, data, plan, {points[1] - points[0]: points[1]})
        trainer, stages = second, [stage1, stage2]
        demonstrations = stage1["steps"] * plan["sft_rows_per_step"]
        rollouts = stage2["steps"] * plan["rollouts_per_step"]
    else:
        trainer = chord_trainer(arm, model, seed, lr, plan, data, str(tmp / arm))
        stage = train_stage(trainer, data, plan, {points[0]: points[0], points[1]: points[1]})
        stages = [stage]
        demonstrations = stage["steps"] * expert_rows(plan)
        rollouts = stage["steps"] * plan["rollouts_per_step"]
    cpu = time.process_time()
    final = {"step": points[2], **score(trainer.model, trainer.processing_class, data["test"], plan, keep=True)}
    val = score(trainer.model, trainer.processing_class, data["val"], plan)["all"] if validate else None
    eval_cpu = time.process_time() - cpu
    result = {
        "points": [p for s in stages for p in s["points"]] + [final],
        "val": val,
        "optimizer_steps": sum(s["steps"] for s in stages),
        "sft_steps": stages[0]["steps"] if arm == "sft_grpo" else 0,
        "demonstrations": demonstrations,
        "rollouts": rollouts,
        "eval_cpu_s": eval_cpu + sum(s["probe_cpu_s"] for s in stages),
    }
    for key in ("train_cpu_s", "train_wall_s", "generation_cpu_s"):
        result[key] = sum(s[key] for s in stages)
    for key in ("train_reward", "frac_reward_zero_std", "mu", "loss"):
        result[key] = [v for s in stages for v in s[key]]
    return result


def evaluate_base(model, tokenizer, plan: dict, data: dict) -> dict:
    return {"points": [{"step": 0, **score(model, tokenizer, data["test"], plan, keep=True)}]}


# ------------------------------------------------------------------------------------------ summary
def summarise(records: list[dict], plan: dict = PLAN) -> dict:
    """The pre-registered tests and the descriptive tables, from the finished runs."""
    groups = {group: (lambda run, group=group: final(run)[group]) for group in ("covered", "uncovered")}
    return seeded_study.summary(records, plan, lambda run: final(run)["all"], groups, _arm, _base)


def _arm(runs: list[dict], base: dict | None) -> dict:
    return {
        "demonstrations": sorted({r["demonstrations"] for r in runs}),
        "rollouts": sorted({r["rollouts"] for r in runs}),
        "final": {g: _spread([final(r)[g] for r in runs]) for g in GROUPS},
        "by_kind": {k: _spread([final(r)["by_kind"][k] for r in runs]) for k in TEMPLATES},
        "curve": _curve(runs),
        "templates": _learned(runs, base),
        "train_cpu_s_per_run": _spread([r["train_cpu_s"] for r in runs]),
        "eval_cpu_s_per_run": _spread([r["eval_cpu_s"] for r in runs]),
        "rollout_groups_with_spread": _mean([1.0 - v for r in runs for v in r["frac_reward_zero_std"]]),
        "mean_train_reward": _mean([v for r in runs for v in r["train_reward"] if v is not None]),
    }


def _base(run: dict) -> dict:
    return {k: final(run)[k] for k in (*GROUPS, "by_kind")}


def _curve(runs: list[dict]) -> list[dict]:
    """Mean accuracy (and per template) at each evaluated step over the runs."""
    steps = sorted({p["step"] for r in runs for p in r["points"]})
    out = []
    for step in steps:
        points = [p for r in runs for p in r["points"] if p["step"] == step]
        out.append(
            {
                "step": step,
                "n_problems": points[0]["n"],
                "all": _spread([p["all"] for p in points]),
                "by_kind": {k: _spread([p["by_kind"].get(k) for p in points]) for k in TEMPLATES},
            }
        )
    return out


def _learned(runs: list[dict], base: dict | None) -> dict:
    """Per template, how many runs never learned it (every point at most the base model's accuracy + 0.1), learned
    and kept it, or forgot it (a point at least base + 0.2, and the last step at least 0.2 below that peak): the
    pre-registered description (benchmarks/results/learning_study_plan.md)."""
    out = {}
    for kind in TEMPLATES:
        floor = final(base)["by_kind"][kind] if base else 0.0
        counts = {"never learned": 0, "kept": 0, "forgot": 0, "other": 0}
        for run in runs:
            values = [p["by_kind"][kind] for p in run["points"]]
            peak, last = max(values), values[-1]
            if peak <= floor + 0.1:
                counts["never learned"] += 1
            elif peak >= floor + 0.2 and last <= peak - 0.2:
                counts["forgot"] += 1
            elif last >= floor + 0.2:
                counts["kept"] += 1
            else:
                counts["other"] += 1
        out[kind] = counts
    return out


def markdown(summary: dict) -> str:
    plan, tests, arms = summary["plan"], summary["tests"], summary["arms"]
    lines = seeded_study.header_lines(summary, "The pre-registered CHORD study (issue 45)", "learning_study_plan.md")
    heading = "Pre-registered tests (held-out accuracy after the last step, paired t over the scored seeds)"
    lines += seeded_study.test_lines(heading, tests, LABELS)
    text = "the same differences on the covered and uncovered templates."
    lines += seeded_study.descriptive_lines(text, tests, ["covered", "uncovered"]) + ["", "## Arms", ""]
    columns = ["demonstrations", "rollouts", *GROUPS]
    lines += seeded_study.arm_table(arms, LABELS, columns, _cells, rates=True)
    base = summary["base"]
    if base:
        lines += [
            "",
            f"Base model: {base['all']:.3f} ({', '.join(f'{k} {v:.3f}' for k, v in base['by_kind'].items())}).",
        ]
    lines += seeded_study.tuning_lines(arms, plan, LABELS, "accuracy")
    lines += ["", "## Per template: final accuracy and what each run did with the template", ""]
    lines += seeded_study.arm_table(
        arms, LABELS, list(TEMPLATES), lambda s: [_cell(s["by_kind"][k]) for k in TEMPLATES]
    )
    lines += ["", "Runs that never learned / learned and kept / forgot each template (definitions in the plan):", ""]
    lines += seeded_study.arm_table(arms, LABELS, list(TEMPLATES), _template_cells)
    lines += [
        "",
        "## Curves (mean over the scored seeds; intermediate points on the first "
        f"{plan['probe_rows']} held-out problems)",
        "",
    ]
    for arm, s in arms.items():
        points = "; ".join(f"step {c['step']}: {_cell(c['all'])}" for c in s["curve"])
        lines.append(f"- {LABELS[arm]}: {points}")
    extra = {
        "rollout groups with a reward spread": lambda s: bc.fmt(s["rollout_groups_with_spread"], ".2f"),
        "mean train reward": lambda s: bc.fmt(s["mean_train_reward"]),
    }
    return "\n".join(lines + seeded_study.cost_lines(arms, LABELS, extra=extra)) + "\n"


def _cells(s: dict) -> list:
    return [s["demonstrations"], s["rollouts"]] + [_cell(s["final"][g]) for g in GROUPS]


def _template_cells(s: dict) -> list:
    return [f"{c['never learned']} / {c['kept']} / {c['forgot']}" for c in s["templates"].values()]


def measure(out: Path, plan: dict = PLAN, model_override: str | None = None, steps: int = 8) -> int:
    """The cost of one run of each arm (``steps`` CHORD steps, a quarter of them SFT then ``steps`` GRPO), for sizing
    the plan: CPU seconds per step and per scored problem."""
    seeded_study.quiet_run()
    plan = {**plan, "steps": steps, "eval_rows": 50, "probe_rows": 25, "val_rows": 25}  # per-problem cost suffices
    data = task_data(plan)
    model = model_override or seeded_study.bundled_model()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in plan["arms"]:
        with tempfile.TemporaryDirectory(prefix="learning_study_cost_") as tmp:
            result = run_arm(arm, model, 99, 3e-4, plan, data, Path(tmp), validate=True)
        scored = plan["eval_rows"] + plan["val_rows"] + 2 * plan["probe_rows"]
        train, evaluate, optimizer_steps = result["train_cpu_s"], result["eval_cpu_s"], result["optimizer_steps"]
        results[arm] = {"optimizer_steps": optimizer_steps, "train_cpu_s": train}
        results[arm] |= {"train_cpu_s_per_step": train / optimizer_steps, "eval_cpu_s": evaluate}
        results[arm] |= {"eval_cpu_s_per_problem": evaluate / scored, "generation_cpu_s": result["generation_cpu_s"]}
        results[arm]["load_average"] = bc.loadavg()
        print(arm, results[arm], flush=True)
    report = {"machine": bc.machine_description("cpu"), "steps": steps, "results": results}
    (out / "learning_study_cost.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


STUDY = seeded_study.Study(
    "learning_study", __doc__, PLAN, summarise, markdown, run_arm, evaluate_base, measure, task_data=task_data, steps=8
)
plan_key, run_side, run_study, status, write_summary, main = STUDY.entry_points()

if __name__ == "__main__":
    raise SystemExit(main())
