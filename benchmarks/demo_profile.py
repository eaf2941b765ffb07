#!/usr/bin/env python
"""Profile of the main job (`trinity-trl demo`): where one training step and one evaluation batch spend their time.

Builds the demo's trainer from its config (``chord_cpu``, plus ``--set key=value`` overrides), then

* times one held-out evaluation batch (``evaluate_accuracy`` on ``eval_batch_size`` problems), split into chat
  template + tokenisation, the model's forward passes inside ``generate`` (forward hooks), the rest of
  ``generate`` (logits processing, cache, stopping), decoding and scoring;
* runs ``--steps`` training steps (the first is a warm-up and not counted) and splits each into prompt
  tokenisation, generation, reward, the log-prob forward pass (TRL's helper, with gradients), the loss maths,
  backward, gradient clipping, the optimizer step, logging and the rest (TRL's batching, the CHORD expert rows);
* measures the LoRA overhead (the same no-grad forward with and without the adapter layers) and reports
  whether gradient checkpointing is on.

Every phase is reported as wall seconds and process CPU seconds (CPU time is not inflated by other processes
on the machine; with one thread, CPU ~ wall when the core was ours). Results: ``demo_profile.{json,md}``::

    nice -n 5 .venv/bin/python benchmarks/demo_profile.py --threads 1 --out benchmarks/results
    # the settings of the 20-step demo before issue 18 (its evaluation code is gone: the eval table differs)
    nice -n 5 .venv/bin/python benchmarks/demo_profile.py --label old --set max_steps=20 --set mu_decay_steps=20 \
        --set per_device_train_batch_size=8 --set expert_batch_size=4 --set eval_batch_size=50 --set torch_threads=0
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports


class Timer:
    """Wall and process-CPU seconds per phase. Phases nest: a phase's key is its path (``step/generate/forward``)
    and its time excludes the phases nested in it, so the keys of one run add up to the measured total."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []
        self.enabled = True

    def enter(self, name: str) -> None:
        path = "/".join([f[0] for f in self._stack[-1:]] + [name]) if self._stack else name
        self._stack.append([path, time.perf_counter(), time.process_time(), 0.0, 0.0])

    def exit(self) -> None:
        path, wall0, cpu0, child_wall, child_cpu = self._stack.pop()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if self.enabled:
            self.wall[path] += wall - child_wall
            self.cpu[path] += cpu - child_cpu
            self.calls[path] += 1
        if self._stack:
            self._stack[-1][3] += wall
            self._stack[-1][4] += cpu

    @contextmanager
    def phase(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def wrap(self, obj, attr: str, name: str) -> None:
        """Replace ``obj.attr`` (a method) by a wrapper that times it as phase ``name``."""
        original = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(obj, attr, wrapped)

    def hook_forward(self, module, name: str = "forward") -> None:
        """Time every forward call of ``module`` as a phase nested in whatever runs it."""
        module.register_forward_pre_hook(lambda m, a, k: self.enter(name), with_kwargs=True)
        module.register_forward_hook(lambda m, a, k, o: self.exit(), with_kwargs=True)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()

    def rows(self, total_wall: float, total_cpu: float, per: int = 1) -> list[dict]:
        """One row per phase (seconds divided by ``per``) plus ``other`` = total minus the phases."""
        rows = [
            {"phase": k, "wall_s": self.wall[k] / per, "cpu_s": self.cpu[k] / per, "calls": self.calls[k] / per}
            for k in self.wall
        ]
        rows.append(
            {
                "phase": "other",
                "wall_s": total_wall / per - sum(r["wall_s"] for r in rows),
                "cpu_s": total_cpu / per - sum(r["cpu_s"] for r in rows),
                "calls": 0,
            }
        )
        for r in rows:
            r["share"] = r["cpu_s"] / (total_cpu / per) if total_cpu else None
        rows.sort(key=lambda r: -r["cpu_s"])
        return rows


def backbone(model):
    """The decoder stack under the LM head (``LlamaModel`` of SmolLM2), through a PEFT wrapper if any."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model


def build_trainer(overrides: list[str], output_dir: str):
    """The demo's ChordTrainer, task and script arguments, as ``trinity-trl demo`` builds them."""
    from trinity_trl.cli import DEMO_CONFIG
    from trinity_trl.recipes import config_path
    from trinity_trl.recipes.common import (
        RecipeArguments,
        load_task,
        parse,
        peft_config,
        reward_functions,
    )
    from trinity_trl.trainers import ChordConfig, ChordTrainer

    argv = ["--config", config_path(DEMO_CONFIG), "--output_dir", output_dir, "--disable_tqdm", "true"]
    for item in overrides:
        key, _, value = item.partition("=")
        argv += [f"--{key}", value]
    script_args, training_args = parse((RecipeArguments, ChordConfig), argv, "chord")
    task = load_task(script_args, seed=training_args.seed, with_expert=True)
    trainer = ChordTrainer(
        model=script_args.model_name_or_path,  # the trainers resolve "bundled" themselves
        reward_funcs=reward_functions(script_args.reward_funcs),
        args=training_args,
        train_dataset=task.train,
        peft_config=peft_config(script_args),
        expert_dataset=task.expert,
    )
    return trainer, task, script_args


def profile_eval(trainer, task, script_args, timer: Timer) -> dict:
    """One evaluation batch of ``evaluate_accuracy`` (after a small untimed warm-up)."""
    from trinity_trl.data import evaluate_accuracy

    model, tokenizer = trainer.model, trainer.processing_class
    rows = task.test.select(range(min(script_args.eval_batch_size, len(task.test))))
    evaluate_accuracy(model, tokenizer, rows.select(range(2)), batch_size=2, max_new_tokens=4, progress=False)
    timer.reset()
    timer.wrap(tokenizer, "apply_chat_template", "chat template")
    timer.wrap(tokenizer, "batch_decode", "decode")
    timer.wrap(model, "generate", "generate")
    start, cpu = time.perf_counter(), time.process_time()
    with timer.phase("evaluate"):
        accuracy, completions = evaluate_accuracy(
            model,
            tokenizer,
            rows,
            batch_size=len(rows),
            max_new_tokens=script_args.eval_max_new_tokens,
            progress=False,
            return_completions=True,
        )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    del model.generate, tokenizer.apply_chat_template, tokenizer.batch_decode  # back to the class methods
    lengths = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]
    return {
        "rows": len(rows),
        "accuracy": accuracy,
        "wall_s": wall,
        "cpu_s": cpu,
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "max_completion_tokens": max(lengths),
        "phases": timer.rows(wall, cpu),
    }


def profile_steps(trainer, timer: Timer, warmup: int, measured: int) -> dict:
    """``warmup`` untimed then ``measured`` timed optimizer steps, split into phases."""
    from transformers import PrinterCallback, TrainerCallback

    trainer.args.max_steps = warmup + measured
    trainer.remove_callback(PrinterCallback)
    window: dict = {}
    for attr, name in (
        ("_tokenize_prompts", "tokenise prompts"),
        ("_generate_single_turn", "generate"),
        ("_calculate_rewards", "reward"),
        ("_generate_and_score_completions", "batch (TRL + CHORD rows)"),
        ("_tokenize_expert", "tokenise expert rows"),
        ("_get_per_token_logps_and_entropies", "log-prob helper"),
        ("_compute_loss", "loss"),
        ("_clip_grad_norm", "grad clip"),
    ):
        timer.wrap(trainer, attr, name)
    timer.wrap(trainer.accelerator, "backward", "backward")
    original_log = trainer.log

    def log(logs, *args, **kwargs):
        with timer.phase("logging"):
            original_log(logs, *args, **kwargs)
        if "loss" in logs and trainer.state.global_step == warmup + measured and "end" not in window:
            window["end"] = (time.perf_counter(), time.process_time())
            timer.enabled = False

    trainer.log = log

    class Window(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == warmup and "start" not in window:
                timer.reset()
                timer.enabled = True
                window["start"] = (time.perf_counter(), time.process_time())

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            timer.enter("optimizer step")

        def on_optimizer_step(self, args, state, control, **kwargs):
            timer.exit()

    timer.enabled = False
    trainer.add_callback(Window())
    trainer.train()
    wall = window["end"][0] - window["start"][0]
    cpu = window["end"][1] - window["start"][1]
    logs = [e for e in trainer.state.log_history if "loss" in e][warmup:]
    return {
        "steps": measured,
        "wall_s_per_step": wall / measured,
        "cpu_s_per_step": cpu / measured,
        "completion_tokens_mean": [e.get("completions/mean_length") for e in logs],
        "phases": timer.rows(wall, cpu, per=measured),
    }


def lora_overhead(trainer, task, script_args, reps: int = 3) -> dict:
    """No-grad forward of the same inputs through the PEFT model and through the base model without adapters."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer, peft_model = trainer.processing_class, trainer.model
    plain = AutoModelForCausalLM.from_pretrained(resolve(script_args)).eval()
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in task.test[:12]["prompt"]
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = len(texts)  # 12, or the whole held-out set when smaller
    ids = torch.cat([batch["input_ids"], torch.full((rows, 40), 42)], dim=1)  # training shape: prompt + 40 tokens
    mask = torch.ones_like(ids)
    decode = ids[:, -1:].repeat(5, 1)[:50]

    def timed(model, **inputs):
        samples = []
        with torch.no_grad():
            model(**inputs)
            for _ in range(reps):
                cpu = time.process_time()
                model(**inputs)
                samples.append(time.process_time() - cpu)
        return min(samples)

    peft_model.eval()
    result = {}
    for label, inputs in (
        (f"train shape ({rows} x prompt+40)", {"input_ids": ids, "attention_mask": mask}),
        (f"decode shape ({len(decode)} x 1 token)", {"input_ids": decode}),
    ):
        with_lora, without = timed(peft_model, **inputs), timed(plain, **inputs)
        result[label] = {"lora_cpu_s": with_lora, "plain_cpu_s": without, "overhead": with_lora / without - 1}
    peft_model.train()
    return result


def resolve(script_args) -> str:
    from trinity_trl.data.model import resolve_model

    return resolve_model(script_args.model_name_or_path)


def _phase_table(rows: list[dict]) -> list[str]:
    lines = ["| phase | calls | wall s | CPU s | share of CPU |", "|---|---|---|---|---|"]
    return lines + [
        f"| {r['phase']} | {r['calls']:.1f} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['share']:.1%} |" for r in rows
    ]


def markdown(report: dict) -> str:
    ev, st = report["eval"], report["step"]
    lines = [
        f"# Demo profile ({report['label']})",
        "",
        f"Command: `{report['command']}`",
        "",
        bc.machine_line(report["machine"]),
        (f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end."),
        "",
        (
            f"Overrides of the demo config: {report['overrides'] or 'none'}; gradient checkpointing on the model: "
            f"{report['gradient_checkpointing']}."
        ),
        "",
        f"## One evaluation batch ({ev['rows']} problems): {ev['wall_s']:.1f} s wall, {ev['cpu_s']:.1f} s CPU",
        "",
        (
            f"Mean completion {ev['mean_completion_tokens']:.1f} tokens (max {ev['max_completion_tokens']}); "
            f"accuracy of the batch {ev['accuracy']:.3f}."
        ),
        "",
        *_phase_table(ev["phases"]),
        "",
        (
            f"## One training step (mean of {st['steps']}): {st['wall_s_per_step']:.1f} s wall, "
            f"{st['cpu_s_per_step']:.1f} s CPU"
        ),
        "",
        f"Mean completion lengths: {st['completion_tokens_mean']}.",
        "",
        *_phase_table(st["phases"]),
    ]
    if report.get("lora"):
        lines += [
            "",
            "## LoRA overhead (no-grad forward, CPU s, best of 3)",
            "",
            "| shape | with LoRA | plain | overhead |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['lora_cpu_s']:.3f} | {v['plain_cpu_s']:.3f} | {v['overhead']:+.0%} |"
            for k, v in report["lora"].items()
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a demo option")
    parser.add_argument("--warmup", type=int, default=1, help="untimed training steps")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-lora-overhead", action="store_true")
    parser.add_argument("--label", default="current")
    parser.add_argument("--out", default=None, help="directory for demo_profile[-LABEL].json/.md (default: print)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    load_start = bc.loadavg()
    timer = Timer()
    with tempfile.TemporaryDirectory(prefix="demo_profile_") as tmp:
        trainer, task, script_args = build_trainer(args.set, tmp)
        timer.hook_forward(backbone(trainer.model))
        checkpointing = bool(
            getattr(trainer.accelerator.unwrap_model(trainer.model), "is_gradient_checkpointing", False)
        )
        evaluation = profile_eval(trainer, task, script_args, timer)
        print(json.dumps(evaluation, indent=1), flush=True)
        step = profile_steps(trainer, timer, args.warmup, args.steps)
        print(json.dumps(step, indent=1), flush=True)
        lora = None if args.no_lora_overhead else lora_overhead(trainer, task, script_args)
    report = {
        "label": args.label,
        "command": " ".join([bc.interpreter(), *(sys.argv if argv is None else argv)]),
        "machine": bc.machine_description(),
        "load_average_start": load_start,
        "load_average_end": bc.loadavg(),
        "overrides": args.set,
        "gradient_checkpointing": checkpointing,
        "eval": evaluation,
        "step": step,
        "lora": lora,
    }
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "demo_profile" if args.label == "current" else f"demo_profile-{args.label}"
        (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
