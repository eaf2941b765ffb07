#!/usr/bin/env python
"""The pre-registered GiGPO study of issue 55 (item 3): GiGPO against step-wise GRPO and against GiGPO with omega = 0.

    python benchmarks/gigpo_study.py pilot --out /work/studies/gigpo-pilot   # tuning seed only: anchor hits and cost
    python benchmarks/gigpo_study.py run --out /work/studies/gigpo          # resumable: a restart skips finished runs
    python benchmarks/gigpo_study.py status --out /work/studies/gigpo       # runs done / planned, CPU time so far
    python benchmarks/gigpo_study.py summarise --out /work/studies/gigpo --to benchmarks/results   # tests over seeds

The plan is ``PLAN`` below, written out in ``benchmarks/results/gigpo_study_plan.md`` and committed before the first
scored run; a runs file made under another plan (its fingerprint, ``plan_key``) is never mixed in. What it compares,
on the bundled number game over 1..16 (``NumberGuessEnv`` with partial credit: higher/lower hints, at most
``max_env_steps`` guesses) with SmolLM2-135M-Instruct + LoRA, 8 runs of one task a step:

* ``gigpo``: ``StepGRPOConfig(algorithm="gigpo")`` as released (omega 1, gamma 1, F none): each turn's advantage is
  its run's episode advantage plus the step advantage among the task's turns that acted from the same range of
  numbers (the game's ``info["env_state_hash"]``);
* ``step_grpo``: the ``multi_step_grpo`` preset: the run's z-scored reward (F std) on every turn;
* ``gigpo_omega0``: GiGPO with omega 0: the episode advantage alone, with GiGPO's normalisation (F none), no step
  term. ``gigpo`` against it isolates the step term; it against ``step_grpo`` the normalisation.

The order of the runs (the tuning seed over the learning-rate grid, then whole scored seeds), the tuning rule and the
pre-registered tests over the seeds: `seeded_study`; ``summarise`` says plainly when the study is partial.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports
import seeded_study
from seeded_study import RUNS_FILE, cell, final, finished, load_runs, mean, spread  # noqa: F401 (for callers)

# The pre-registration (issue 55 item 3). Changing any value changes the fingerprint: runs made under another plan
# are not resumed or summarised with these.
PLAN = {
    "arms": ["gigpo", "step_grpo", "gigpo_omega0"],
    "primary": ["gigpo", "step_grpo"],
    "secondary": [["gigpo", "gigpo_omega0"]],
    "metric": "success rate (target found) of the evaluation games played at temperature 1 after the last step",
    "alpha": 0.05,
    "confidence": 0.95,
    "model": "bundled",
    "lora_r": 16,
    "low": 1,
    "high": 16,
    "partial_credit": True,
    "max_env_steps": 4,
    "completion_len": 12,
    "temperature": 1.0,
    "steps": 30,
    "num_generations": 8,  # one task (a target) played 8 times a step
    "train_tasks": 256,
    "eval_plays": 3,  # evaluation: every target played this many times (48 games), sampling seed eval_seed
    "eval_seed": 55,
    "val_plays": 2,  # validation (tuning seed only): every target this many times, sampling seed val_seed
    "val_seed": 155,
    "probe_steps": [],  # also evaluated after these steps (described, not tested); none: the pilot's cost
    "tune_seed": 0,
    "scored_seeds": [1, 2, 3, 4, 5],
    "grid": [1e-4, 3e-4, 1e-3],
    "grid_factor": 3.0,
    "max_extensions": 1,
    "cpu_budget_h": 16.0,
    "run_timeout_h": 24.0,  # wall time after which a run's process is stopped (a hung run), the study with it
}
LABELS = {"gigpo": "GiGPO", "step_grpo": "step-wise GRPO", "gigpo_omega0": "GiGPO omega 0", "base": "base model"}


# ------------------------------------------------------------------------------------------ the game
def environment(plan: dict):
    from trinity_trl.rollouts import NumberGuessEnv

    return NumberGuessEnv(partial_credit=plan["partial_credit"])


def training_tasks(plan: dict, seed: int):
    """The targets a run trains on (drawn with its seed; the trainer's sampler shuffles them with the same seed)."""
    from trinity_trl.rollouts import number_guess_dataset

    return number_guess_dataset(plan["train_tasks"], low=plan["low"], high=plan["high"], seed=seed)


def games(plan: dict, plays: int) -> list[dict]:
    """Every target of the range, ``plays`` times each: the rows of an evaluation (or validation)."""
    low, high = plan["low"], plan["high"]
    return [{"target": t, "low": low, "high": high} for t in range(low, high + 1) for _ in range(plays)]


class PolicyGenerator:
    """The rollouts' generation interface (`trinity_trl.rollouts.generation.Generator`) over a model: transformers'
    ``generate`` at the plan's temperature (or greedy), left-padded batches, the model's chat template."""

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float | None):
        from trinity_trl.data.loading import prompt_token_ids

        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.eos_token_id = tokenizer.eos_token_id
        self.eos_token_ids = {tokenizer.eos_token_id}
        self._prompt_ids = prompt_token_ids

    def tokenize_conversations(self, conversations):
        return self._prompt_ids(self.tokenizer, conversations)

    def render(self, messages, add_generation_prompt):
        kwargs = {"add_generation_prompt": add_generation_prompt, "tokenize": True, "return_dict": False}
        return list(self.tokenizer.apply_chat_template(messages, **kwargs))

    def generate(self, prompt_ids):
        import torch

        width = max(len(p) for p in prompt_ids)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        sampling = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "top_p": 1.0}
        sampling = sampling if self.temperature else {"do_sample": False}
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=self.max_new_tokens, pad_token_id=pad, **sampling
            )
        completions = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos_token_ids), len(row))
            completions.append(row[:end])
        return completions, None

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def play(model, tokenizer, plan: dict, plays: int, seed: int, temperature: float | None) -> dict:
    """Play every target ``plays`` times with ``model`` (sampling from ``seed``; ``temperature=None``: greedy):
    the success rate, the mean final reward, the mean number of guesses, and each game's outcome."""
    import torch

    from trinity_trl.rollouts import MultiStepRollout

    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    generator = PolicyGenerator(model, tokenizer, plan["completion_len"], temperature)
    rows = games(plan, plays)
    runs = MultiStepRollout(generator, lambda: environment(plan), plan["max_env_steps"], "tokens")(rows)
    if was_training:
        model.train()
    solved = [int(run.reward == 1.0) for run in runs]
    return {
        "n": len(runs),
        "success": sum(solved) / len(runs),
        "reward": statistics.mean(run.reward for run in runs),
        "turns": statistics.mean(len(run.steps) for run in runs),
        "outcomes": solved,
        "targets": [row["target"] for row in rows],
    }


# ------------------------------------------------------------------------------------------ training
def arm_settings(arm: str) -> dict:
    """The ``StepGRPOConfig`` fields that make ``arm``."""
    if arm == "gigpo":
        return {"algorithm": "gigpo"}
    if arm == "gigpo_omega0":
        return {"algorithm": "gigpo", "advantage": {"omega": 0.0}}
    if arm == "step_grpo":
        return {"algorithm": "multi_step_grpo"}
    raise ValueError(f"unknown arm {arm!r}; the arms: gigpo, step_grpo, gigpo_omega0")


def trainer_for(arm: str, model: str, seed: int, lr: float, plan: dict, output_dir: str):
    from trinity_trl.trainers import StepGRPOConfig, StepGRPOTrainer

    config = StepGRPOConfig(
        **seeded_study.common_config(seed, output_dir, plan["steps"], lr),
        **arm_settings(arm),
        per_device_train_batch_size=plan["num_generations"],
        num_generations=plan["num_generations"],
        max_completion_length=plan["completion_len"],
        temperature=plan["temperature"],
        max_env_steps=plan["max_env_steps"],
        kl_loss="none",  # no KL term in any arm, stated (the presets name k2)
    )
    return StepGRPOTrainer(
        model=model,
        args=config,
        train_dataset=training_tasks(plan, seed),
        environment_factory=lambda: environment(plan),
        peft_config=seeded_study.lora_config(plan),
    )


def run_arm(arm: str, model: str, seed: int, lr: float, plan: dict, tmp: Path, validate: bool) -> dict:
    """One run: per-step logs (run reward, anchor hit ratio), the evaluation after each probe step and the last,
    the validation success rate (tuning runs), greedy success on each target once, cost."""
    from transformers import TrainerCallback

    trainer = trainer_for(arm, model, seed, lr, plan, str(tmp / arm))
    tokenizer = trainer.processing_class
    points: list[dict] = []
    eval_cpu = [0.0]

    def evaluate(step: int, keep: bool) -> dict:
        cpu = time.process_time()
        point = {"step": step, **play(trainer.model, tokenizer, plan, plan["eval_plays"], plan["eval_seed"], 1.0)}
        if not keep:
            point.pop("outcomes"), point.pop("targets")
        eval_cpu[0] += time.process_time() - cpu
        print(f"    step {step}: success {point['success']:.3f}, reward {point['reward']:.3f}", flush=True)
        return point

    class Probe(TrainerCallback):
        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in plan["probe_steps"] and state.global_step < plan["steps"]:
                points.append(evaluate(state.global_step, keep=False))

    trainer.add_callback(Probe())
    wall, cpu, logs = seeded_study.train(trainer)
    train_cpu = cpu - eval_cpu[0]
    points.append(evaluate(trainer.state.global_step, keep=True))
    cpu = time.process_time()
    val = None
    if validate:
        val = play(trainer.model, tokenizer, plan, plan["val_plays"], plan["val_seed"], 1.0)["success"]
    greedy = play(trainer.model, tokenizer, plan, 1, plan["eval_seed"], None)
    eval_cpu[0] += time.process_time() - cpu
    return {
        "points": points,
        "val": val,
        "greedy_success": greedy["success"],
        "optimizer_steps": trainer.state.global_step,
        "runs_played": trainer.state.global_step * plan["num_generations"],
        "train_cpu_s": train_cpu,
        "train_wall_s": wall,
        "eval_cpu_s": eval_cpu[0],
        "run_reward": [e.get("multi_step/run_reward") for e in logs],
        "steps_per_run": [e.get("multi_step/steps_per_run") for e in logs],
        "anchor_hit_ratio": [e.get("gigpo/anchor_hit_ratio") for e in logs],
        "loss": [e.get("loss") for e in logs],
    }


def evaluate_base(model, tokenizer, plan: dict) -> dict:
    final = {"step": 0, **play(model, tokenizer, plan, plan["eval_plays"], plan["eval_seed"], 1.0)}
    return {"points": [final], "greedy_success": play(model, tokenizer, plan, 1, plan["eval_seed"], None)["success"]}


def pilot(out: Path, plan: dict = PLAN, model_override: str | None = None, steps: int = 10) -> int:
    """Before the plan is frozen: GiGPO on the tuning seed at the grid's middle rate for ``steps`` steps, reporting
    its anchor hit ratio per step and the cost of a step and of an evaluation (never a scored seed)."""
    seeded_study.quiet_run()
    plan = {**plan, "steps": steps, "probe_steps": []}
    model = model_override or seeded_study.bundled_model()  # in this process: the pilot is one run
    out.mkdir(parents=True, exist_ok=True)
    lr = plan["grid"][len(plan["grid"]) // 2]
    with tempfile.TemporaryDirectory(prefix="gigpo_pilot_") as tmp:
        result = run_arm("gigpo", model, plan["tune_seed"], lr, plan, Path(tmp), validate=False)
    hits = [h for h in result["anchor_hit_ratio"] if h is not None]
    report = {"machine": bc.machine_description("cpu"), "load_average": bc.loadavg(), "arm": "gigpo"}
    report |= {"seed": plan["tune_seed"], "lr": lr, "steps": result["optimizer_steps"]}
    report |= {"anchor_hit_ratio": result["anchor_hit_ratio"], "anchor_hit_ratio_mean": mean(hits)}
    report |= {"steps_per_run": result["steps_per_run"], "run_reward": result["run_reward"]}
    report |= {"train_cpu_s_per_step": result["train_cpu_s"] / max(1, result["optimizer_steps"])}
    report |= {"eval_cpu_s": result["eval_cpu_s"], "eval_games": final(result)["n"]}
    report |= {"success_after": final(result)["success"], "greedy_success_after": result["greedy_success"]}
    (out / "gigpo_pilot.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1), flush=True)
    return 0


# ------------------------------------------------------------------------------------------ summary
def summarise(records: list[dict], plan: dict = PLAN) -> dict:
    """The pre-registered tests and the descriptive tables, from the finished runs."""
    reward = {"reward": lambda run: final(run)["reward"]}
    return seeded_study.summary(records, plan, lambda run: final(run)["success"], reward, _arm, _base)


def _arm(runs: list[dict], base: dict | None) -> dict:
    hits = [h for r in runs for h in r["anchor_hit_ratio"] if h is not None]
    return {
        "runs_played": sorted({r["runs_played"] for r in runs}),
        "success": spread([final(r)["success"] for r in runs]),
        "reward": spread([final(r)["reward"] for r in runs]),
        "turns": spread([final(r)["turns"] for r in runs]),
        "greedy_success": spread([r["greedy_success"] for r in runs]),
        "curve": _curve(runs),
        "anchor_hit_ratio": mean(hits),
        "mean_run_reward": mean([v for r in runs for v in r["run_reward"] if v is not None]),
        "train_cpu_s_per_run": spread([r["train_cpu_s"] for r in runs]),
        "eval_cpu_s_per_run": spread([r["eval_cpu_s"] for r in runs]),
    }


def _base(run: dict) -> dict:
    return {**{k: final(run)[k] for k in ("success", "reward")}, "greedy_success": run.get("greedy_success")}


def _curve(runs: list[dict]) -> list[dict]:
    """Mean success at each evaluated step over the runs."""
    steps = sorted({p["step"] for r in runs for p in r["points"]})
    return [
        {"step": step, "success": spread([p["success"] for r in runs for p in r["points"] if p["step"] == step])}
        for step in steps
    ]


def markdown(summary: dict) -> str:
    plan, tests, arms = summary["plan"], summary["tests"], summary["arms"]
    lines = seeded_study.header_lines(summary, "The pre-registered GiGPO study (issue 55)", "gigpo_study_plan.md")
    heading = "Pre-registered tests (success rate of the evaluation games after the last step, paired t over the seeds)"
    lines += seeded_study.test_lines(heading, tests, LABELS)
    text = "the same differences in the mean final reward (partial credit) of the games."
    lines += seeded_study.descriptive_lines(text, tests, ["reward"]) + ["", "## Arms", ""]
    columns = ["runs played", "success", "final reward", "guesses", "greedy success", "anchor hit ratio"]
    lines += seeded_study.arm_table(arms, LABELS, columns, _cells, rates=True)
    base = summary["base"]
    if base:
        lines += [
            "",
            f"Base model: success {base['success']:.3f}, final reward {base['reward']:.3f}, greedy success "
            f"{bc.fmt(base['greedy_success'])}.",
        ]
    lines += seeded_study.tuning_lines(arms, plan, LABELS, "success")
    lines += ["", "## Curves (mean success over the scored seeds)", ""]
    for arm, s in arms.items():
        points = "; ".join(f"step {c['step']}: {cell(c['success'])}" for c in s["curve"]) or "no run yet"
        lines.append(f"- {LABELS[arm]}: {points}")
    extra = {"mean run reward in training": lambda s: bc.fmt(s["mean_run_reward"])}
    return "\n".join(lines + seeded_study.cost_lines(arms, LABELS, "evaluating", extra)) + "\n"


def _cells(s: dict) -> list:
    return [s["runs_played"], cell(s["success"]), cell(s["reward"]), cell(s["turns"], ".2f")] + [
        cell(s["greedy_success"]),
        bc.fmt(s["anchor_hit_ratio"], ".3f"),
    ]


def _outcome(result: dict) -> str:
    return f"success {result['points'][-1]['success']:.3f}"


STUDY = seeded_study.Study(
    "gigpo_study", __doc__, PLAN, summarise, markdown, run_arm, evaluate_base, pilot, outcome=_outcome
)
plan_key, run_side, run_study, status, write_summary, main = STUDY.entry_points()

if __name__ == "__main__":
    raise SystemExit(main())
