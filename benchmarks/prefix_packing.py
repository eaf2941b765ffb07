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

On CUDA (``--device cuda --bf16``): random models of the Qwen2.5-0.5B and Qwen2.5-1.5B shapes with the
real vocabulary (151,936, so TRL's fused LM head does its real work; sampling is kept to the tiny
tokenizer's ids with ``suppress_tokens``), ``K`` prompts x ``G`` completions per micro-batch
(``--prompts-per-step``), both sides trained one after the other in the SAME worker process per
point (order alternating between points); ours with ``prefix_packing_kernel=--kernel`` (``auto``:
the kernel is kept only where it timed faster than padded rows on the first micro-batches, so
``--warmup`` covers those 6 calibration micro-batches). The first step (compilation included) is
reported apart, with the kernel each training forward used. Results go to
``prefix_packing_cuda.{json,md}``.

Run it niced from the repository root (the full CPU grid takes about 40 minutes on 2 cores)::

    nice -n 5 .venv/bin/python benchmarks/prefix_packing.py --out benchmarks/results
    python benchmarks/prefix_packing.py --device cuda --bf16 --out benchmarks/results
    # one point (a lent GPU machine gives 10 minutes a command; --resume adds to an earlier report):
    python benchmarks/prefix_packing.py --device cuda --bf16 --models qwen2.5-1.5b --prompt-lens 1024 \
        --completion-lens 256 --prompts-per-step 1 --out benchmarks/results
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
#: issue 23's targets on one H100 in bf16 (training part of the step, ours / TRL)
CUDA_TARGETS = {
    "1.5b_1024_256_8_train_ratio_max": 0.55,
    "1.5b_2048_512_8_train_ratio_max": 0.45,
    "memory_ratio_max_at_prompt_1024_plus": 0.5,
    "train_ratio_max_everywhere": 1.03,
}
REAL_VOCAB = 151936
#: random models of these shapes (Qwen2.5 configs; tied embeddings) with the real vocabulary
MODEL_SHAPES = {
    "qwen2.5-0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864},
    "qwen2.5-1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960},
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
    """Train the runs described by the JSON spec (one per side in ``spec["sides"]``, in this one process);
    write ``{side: measurements}`` to ``spec["result"]``."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    results = {}
    for side in spec["sides"]:
        results[side] = train_side(dict(spec, side=side, output_dir=f"{spec['output_dir']}_{side}"))
        gc.collect()
        if spec["device"] == "cuda":
            torch.cuda.empty_cache()
    Path(spec["result"]).write_text(json.dumps(results))
    return 0


def train_side(spec: dict) -> dict:
    """Train one side of a point; return its measurements."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer, TrainerCallback

    cuda = spec["device"] == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    per_step = spec.get("prompts_per_step", 1)
    dataset = Dataset.from_dict(
        {"prompt": prompt_texts(tokenizer, spec["prompt_len"], per_step * (spec["steps"] + 2), spec["seed"])}
    )
    vocab = AutoConfig.from_pretrained(spec["model"]).vocab_size
    extra = {}
    if vocab > len(tokenizer):  # the real vocabulary's LM head; sample only ids the tiny tokenizer can decode
        extra["generation_kwargs"] = {"suppress_tokens": list(range(len(tokenizer), vocab))}
    common = dict(
        output_dir=spec["output_dir"],
        use_cpu=not cuda,
        bf16=spec["bf16"],
        activation_checkpointing=False,
        per_device_train_batch_size=spec["generations"] * per_step,
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
        **extra,
    )
    if spec["side"] == "ours":
        from trinity_trl.trainers import TrinityConfig, TrinityTrainer

        config = TrinityConfig(
            algorithm="grpo",
            kl_loss="none",
            loss_agg_mode="seq-mean-token-mean",
            prefix_packing=spec["packing"],
            prefix_packing_kernel=spec.get("kernel", "auto"),
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
    kernels: dict[str, int] = {}
    if spec["side"] == "ours":  # which kernel each training forward ran ("padded": TRL's rows)
        packing = trainer.prefix_packing.logps_and_entropies

        def counting_packing(*a, **kw):
            out = packing(*a, **kw)
            if torch.is_grad_enabled():
                name = "padded" if out is None else out.kernel
                kernels[name] = kernels.get(name, 0) + 1
            return out

        trainer.prefix_packing.logps_and_entropies = counting_packing

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
        "first_step_s": steps[0]["end"] - steps[0]["begin"] if steps and "end" in steps[0] else None,
        "kernels": kernels,
    }
    if cuda:
        result["cuda_peak_above_start_mib"] = (torch.cuda.max_memory_allocated() - cuda_before) / 2**20
        result["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
    del trainer
    return result


# ------------------------------------------------------------------------------------- driver
def run_worker(spec: dict, tmp: Path, index: int, timeout: float) -> dict:
    """Run ``spec["sides"]`` in one worker process; ``{side: measurements}``."""
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
        raise RuntimeError(
            f"run {spec['point']}/{'+'.join(spec['sides'])} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
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
    out["first_step_s"] = bc.median([r.get("first_step_s") for r in results])
    kernels: dict[str, int] = {}
    for r in results:
        for name, n in r.get("kernels", {}).items():
            kernels[name] = kernels.get(name, 0) + n
    out["kernels"] = kernels
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
    if name in MODEL_SHAPES:
        shape = MODEL_SHAPES[name]
        path = save_random_real_vocab_qwen2(tmp / name, args.device, args.seed, **shape)
        return path, (
            f"random Qwen2 of the {name.replace('qwen', 'Qwen')} shape (hidden {shape['hidden']}, {shape['layers']} "
            f"layers, {shape['heads']} heads / {shape['kv_heads']} KV, intermediate {shape['intermediate']}, vocab "
            f"{REAL_VOCAB}) with the tests' tiny BPE tokenizer (sampling kept to its ids)"
        )
    if name == "bundled":
        from trinity_trl.data import bundled_model_dir

        return str(bundled_model_dir()), "SmolLM2-135M-Instruct (bundled, Llama architecture, vocab 49152)"
    return name, name


def save_random_real_vocab_qwen2(path: Path, device: str, seed: int, **shape) -> str:
    """A random Qwen2 of ``shape`` with the real vocabulary (tied embeddings, as Qwen2.5-0.5B/1.5B), initialised on
    ``device`` (fast on a GPU) and saved in float32 with the tests' tiny tokenizer."""
    import torch
    from helpers import build_tiny_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=REAL_VOCAB,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return str(path)


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
            "Models: "
            + "; ".join(
                f"`{name}`: {desc} ({report['parameters_by_model'].get(name, 0) / 1e6:.1f}M parameters)"
                for name, desc in report["model_descriptions"].items()
            )
            + f". {'bf16' if c['bf16'] else 'fp32'}, full fine-tuning, lr {c['learning_rate']}. "
            "One optimizer step = K prompt(s) x G completions in one micro-batch; ours with "
            f"`prefix_packing_kernel={c.get('kernel', 'auto')!r}`. Each run: {c['steps']} steps, the first "
            f"{c['warmup']} untimed "
            f"(prompts of {c['long_prompt']}+ tokens: {c['long_steps']} step(s), {c['long_warmup']} untimed); "
            f"{c['repeats']} run(s) per side per point, {c['focus_repeats']} at the target points (prompt "
            f"{TARGETS['short_prompt']}, and {'/'.join(map(str, TARGETS['headline']))}); sides interleaved. Ours: "
            "`TrinityTrainer(algorithm='grpo', kl_loss='none', loss_agg_mode='seq-mean-token-mean')` with "
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
        "| model | P | C | G | K | tokens fwd | kernel (training forwards) | ours train (s) | TRL train (s) "
        "| **train ratio** | step ratio | first step ours / TRL (s) | ours mem (MiB) | TRL mem (MiB) "
        "| **memory ratio** | process peak ratio | equal loss/grad-norm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mk = report["memory_key"]
    for point in sorted(
        report["results"],
        key=lambda r: (
            r["model"],
            r["prompt_len"],
            r["completion_len"],
            r["generations"],
            r.get("prompts_per_step", 1),
        ),
    ):
        r = point["comparison"]
        o, t, e = r["ours"], r["trl"], r["equivalence"]
        lines.append(
            f"| {point['model']} | {point['prompt_len']} | {point['completion_len']} | {point['generations']} "
            f"| {point.get('prompts_per_step', 1)} | {bc.fmt(o['forwarded_token_ratio'], '.2f')} "
            f"| {', '.join(f'{k} x{n}' for k, n in sorted(o.get('kernels', {}).items())) or '-'} "
            f"| {bc.fmt(o['train_s'])} | {bc.fmt(t['train_s'])} "
            f"| **{bc.fmt(r['train_time_ratio'])}** | {bc.fmt(r['step_time_ratio'])} "
            f"| {bc.fmt(o.get('first_step_s'))} / {bc.fmt(t.get('first_step_s'))} | {bc.fmt(o[mk], '.0f')} "
            f"| {bc.fmt(t[mk], '.0f')} | **{bc.fmt(r['memory_ratio'])}** | {bc.fmt(r['process_peak_memory_ratio'])} "
            f"| {'yes' if e['equivalent'] else 'NO'} ({bc.fmt(e['loss_max_abs_diff'], '.0e')} / "
            f"{bc.fmt(e['grad_norm_max_rel_diff'], '.0e')}) |"
        )
    s = report["summary"]
    if c["device"] == "cuda":
        met = {True: "met", False: "NOT met", None: "not measured"}
        lines += [
            "",
            "Targets (issue 23, one GPU in bf16, training part of the step):",
            "",
            f"- 1.5B, prompt 1024, completion 256, G 8: train ratio {bc.fmt(s['cuda_1.5b_1024_256_8_train_ratio'])} "
            f"(target <= {CUDA_TARGETS['1.5b_1024_256_8_train_ratio_max']}): {met[s['cuda_1.5b_1024_256_8_met']]}",
            f"- 1.5B, prompt 2048, completion 512, G 8: train ratio {bc.fmt(s['cuda_1.5b_2048_512_8_train_ratio'])} "
            f"(target <= {CUDA_TARGETS['1.5b_2048_512_8_train_ratio_max']}): {met[s['cuda_1.5b_2048_512_8_met']]}",
            f"- memory at prompt >= 1024: worst ratio {bc.fmt(s['cuda_worst_memory_ratio_at_prompt_1024_plus'])} "
            f"(target <= {CUDA_TARGETS['memory_ratio_max_at_prompt_1024_plus']}): {met[s['cuda_memory_met']]}",
            f"- every point: worst train ratio {bc.fmt(s['cuda_worst_train_ratio'])} (target <= "
            f"{CUDA_TARGETS['train_ratio_max_everywhere']}): {met[s['cuda_never_loses_met']]}",
            "",
        ]
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
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["tiny", *MODEL_SHAPES],
        help="random models to run (default: tiny on CPU; both Qwen2.5 shapes on CUDA)",
    )
    parser.add_argument("--prompt-lens", type=int, nargs="+", help="default 64 256 1024 (CPU), 256 1024 2048 (CUDA)")
    parser.add_argument("--completion-lens", type=int, nargs="+", help="default 32 128 (CPU), 128 256 512 (CUDA)")
    parser.add_argument("--generations", type=int, nargs="+", help="default 4 8 16 (CPU), 8 (CUDA)")
    parser.add_argument(
        "--prompts-per-step",
        type=int,
        nargs="+",
        help="prompts (groups) per micro-batch: default 1 (CPU), 1 2 4 (CUDA)",
    )
    parser.add_argument(
        "--kernel",
        default="auto",
        choices=["auto", "varlen", "flash_attn", "flex", "sdpa_segments"],
        help="our prefix_packing_kernel",
    )
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
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 2 on CPU, 9 on CUDA)")
    parser.add_argument(
        "--warmup",
        type=int,
        help="first steps of each run not timed (default 1 on CPU; 6 on CUDA: auto's calibration micro-batches)",
    )
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
    cuda = args.device == "cuda"
    defaults = {
        "models": [*MODEL_SHAPES] if cuda else ["tiny"],
        "prompt_lens": [256, 1024, 2048] if cuda else [64, 256, 1024],
        "completion_lens": [128, 256, 512] if cuda else [32, 128],
        "generations": [8] if cuda else [4, 8, 16],
        "prompts_per_step": [1, 2, 4] if cuda else [1],
        "steps": 9 if cuda else 2,
        "warmup": 6 if cuda else 1,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cuda:  # no CPU-style shortening of long prompts, no bundled point (no weights there), sides in one process
        args.long_prompt, args.long_steps, args.long_warmup = 10**9, args.steps, args.warmup
        args.no_bundled = True
        args.focus_repeats = min(args.focus_repeats, args.repeats)
    if args.quick:
        args.prompt_lens, args.completion_lens, args.generations = [32], [8], [4]
        args.models, args.prompts_per_step = ["tiny"], [1]
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
    points = [
        (m, p, c, g, k)
        for m in args.models
        for p in args.prompt_lens
        for c in args.completion_lens
        for g in args.generations
        for k in args.prompts_per_step
    ]
    # the target points first, then the rest from the cheapest: the report is rewritten after every point, so a
    # run cut short still holds whole points
    points.sort(
        key=lambda x: (
            x[1:4] != TARGETS["headline"],
            x[1] != TARGETS["short_prompt"],
            x[4] * x[3] * (x[1] + x[2]) * (MODEL_SHAPES.get(x[0], {}).get("layers", 1)),
        )
    )
    if args.only_bundled:
        points = []
    if not args.no_bundled:
        points.append(("bundled", *args.bundled_point, 1))
    results, parameters, descriptions, commands = [], {}, {}, []
    if args.resume:
        earlier = json.loads(Path(args.resume).read_text())
        results = earlier["results"]
        parameters, descriptions = earlier["parameters_by_model"], earlier["model_descriptions"]
        commands = earlier.get("commands", [earlier["command"]])
        done = {
            (r["model"], r["prompt_len"], r["completion_len"], r["generations"], r.get("prompts_per_step", 1))
            for r in results
        }
        points = [p for p in points if p not in done]
        args.resumed_wall_s = earlier["total_wall_s"]
    index = 0
    with tempfile.TemporaryDirectory(prefix="prefix_packing_") as tmp_name:
        tmp = Path(tmp_name)
        paths = {}
        for model in dict.fromkeys(p[0] for p in points):
            paths[model], descriptions[model] = resolve_model(model, args, tmp)
        args.commands = commands
        for n, (model, p, c, g, k) in enumerate(points):
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
                "point": f"{model}/{p}/{c}/{g}/{k}",
                "packing": True,
                "kernel": args.kernel,
                "prompts_per_step": k,
            }
            runs = {"ours": [], "trl": []}
            for rep in range(repeats):
                order = ("ours", "trl") if (n + rep) % 2 == 0 else ("trl", "ours")
                # CUDA: both sides in one process (one CUDA context, one compilation cache); CPU: one process each
                batches = [list(order)] if cuda else [[side] for side in order]
                for sides in batches:
                    index += 1
                    for side, result in run_worker(dict(base, sides=sides), tmp, index, args.timeout).items():
                        runs[side].append(result)
                        parameters[model] = result["parameters"]
                        s = run_summary(result, warmup)
                        peak = result.get("cuda_peak_above_start_mib" if cuda else "train_peak_rss_above_start_mib")
                        kernels = f", kernels {result['kernels']}" if result.get("kernels") else ""
                        print(
                            f"[{model} P={p} C={c} G={g} K={k} rep {rep + 1}/{repeats}] {side}: step "
                            f"{bc.fmt(s['step_s'])} s, train {bc.fmt(s['train_s'])} s, first step "
                            f"{bc.fmt(result.get('first_step_s'))} s, peak {bc.fmt(peak, '.0f')} MiB{kernels}, "
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
                    "prompts_per_step": k,
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
    if args.device == "cuda":
        summary.update(cuda_summary(results))
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
    name = "prefix_packing_cuda" if args.device == "cuda" else "prefix_packing"
    report["benchmark"] = name
    bc.write_report(args.out, name, report, markdown(report))


def cuda_summary(results: list[dict]) -> dict:
    """Issue 23's CUDA targets against the points measured (``None``: the point was not run)."""

    def ratio(model, p, c, key="train_time_ratio"):
        found = [
            r["comparison"][key]
            for r in results
            if (r["model"], r["prompt_len"], r["completion_len"], r["generations"], r.get("prompts_per_step", 1))
            == (model, p, c, 8, 1)
        ]
        return found[0] if found else None

    train = [r["comparison"]["train_time_ratio"] for r in results]
    memory = [r["comparison"]["memory_ratio"] for r in results if r["prompt_len"] >= 1024]
    a, b = ratio("qwen2.5-1.5b", 1024, 256), ratio("qwen2.5-1.5b", 2048, 512)
    t = CUDA_TARGETS
    return {
        "cuda_1.5b_1024_256_8_train_ratio": a,
        "cuda_1.5b_1024_256_8_met": None if a is None else a <= t["1.5b_1024_256_8_train_ratio_max"],
        "cuda_1.5b_2048_512_8_train_ratio": b,
        "cuda_1.5b_2048_512_8_met": None if b is None else b <= t["1.5b_2048_512_8_train_ratio_max"],
        "cuda_worst_memory_ratio_at_prompt_1024_plus": max(memory) if memory else None,
        "cuda_memory_met": None if not memory else max(memory) <= t["memory_ratio_max_at_prompt_1024_plus"],
        "cuda_worst_train_ratio": max(train) if train else None,
        "cuda_never_loses_met": None if not train else max(train) <= t["train_ratio_max_everywhere"],
    }


if __name__ == "__main__":
    raise SystemExit(main())
