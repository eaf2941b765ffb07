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

On CUDA (``--device cuda --bf16``): by default the five points of issue 34 (:data:`CUDA_POINTS`; the whole grid
does not fit a lent GPU machine's 10-minute command), random models of the Qwen2.5-0.5B and Qwen2.5-1.5B shapes
with the real vocabulary (151,936, so TRL's fused LM head does its real work) saved in bf16 (the real checkpoints'
dtype), both sides trained one after the other in the SAME worker process per point (order alternating between
points), with activation checkpointing on (TRL's default), the optimizer of TRL's default (``--optim sgd``: one
without state on both sides), and completions of exactly ``C`` random tokens from a ``rollout_func``
(``--rollout fixed``: sampling ``C`` tokens would take most of the time and is the same on both sides). Ours with
``prefix_packing_kernel=--kernel`` (``auto``: the kernel is kept only where it timed faster than padded rows on the
first micro-batches, so ``--warmup`` covers the calibration). Besides the step, each step's **training part** (the
loss's forward and backward, between syncs) and, on CUDA, its peak memory above its start are recorded, with
``auto``'s verdict per shape class. The first step (compilation included) is reported apart, with the kernel each
training forward used.

Equivalence: on every device, the first micro-batch is run again on the trained model, packed through a forced
kernel and padded (:func:`check_equivalence`), and the relative L2 differences of its log-probs and gradient are
held to tolerances derived for the dtype (:func:`equivalence_tolerances`); on CPU in float32 the two sides' logged
losses and gradient norms must also agree at every step (in bf16 the trajectories part by rounding).

Results go to ``--out``: ``$OUT`` where set (the lent GPU machine sends back what is written there), else
``benchmarks/results``; ``prefix_packing_cuda.{json,md}`` on CUDA. ``make gpu-check`` (``benchmarks/gpu_check.py``)
runs it with the GPU tests and the trainers.

Run it niced from the repository root (the full CPU grid takes about 40 minutes on 2 cores)::

    nice -n 5 .venv/bin/python benchmarks/prefix_packing.py --out benchmarks/results
    python benchmarks/prefix_packing.py --device cuda --bf16
    # one point (--resume adds to an earlier report):
    python benchmarks/prefix_packing.py --device cuda --bf16 --points qwen2.5-1.5b:1024:256:8
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
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
#: issue 34's targets on one H100 in bf16 (training part: the loss's forward and backward, ours / TRL; memory: its
#: peak above its start at the two long points)
CUDA_TARGETS = {
    "1.5b_1024_256_8_train_ratio_max": 0.55,
    "1.5b_2048_512_8_train_ratio_max": 0.45,
    "memory_ratio_max_at_prompt_1024_plus": 0.5,
    "train_ratio_max_everywhere": 1.03,
}
#: the points of issue 34 on a GPU (model, P, C, G, K), the target points first
CUDA_POINTS = [
    ("qwen2.5-1.5b", 1024, 256, 8, 1),
    ("qwen2.5-1.5b", 2048, 512, 8, 1),
    ("qwen2.5-0.5b", 256, 128, 8, 1),
    ("qwen2.5-0.5b", 1024, 256, 8, 1),
    ("qwen2.5-0.5b", 2048, 512, 8, 1),
]
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


def fixed_rollout(spec: dict, tokenizer):
    """TRL's ``rollout_func`` without generation (``--rollout fixed``): each row gets its prompt's tokens and exactly
    ``completion_len`` random tokens (never EOS or another special token), the same on both sides (seeded by the
    call's index), so the step times the training and not sampling."""
    special = set(tokenizer.all_special_ids)
    vocabulary = [i for i in range(len(tokenizer)) if i not in special]
    calls = [0]

    def rollout(prompts, trainer):
        rng = random.Random(spec["seed"] * 100003 + calls[0])
        calls[0] += 1
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completion_ids = [[rng.choice(vocabulary) for _ in range(spec["completion_len"])] for _ in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


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
        activation_checkpointing=spec.get("activation_checkpointing", False),
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
    if spec.get("optim"):
        common["optim"] = spec["optim"]
    rollout = fixed_rollout(spec, tokenizer) if spec.get("rollout") == "fixed" else None
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
            rollout_func=rollout,
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
            rollout_func=rollout,
        )

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            steps.append({"begin": time.perf_counter(), "generation": 0.0, "train_part": 0.0})

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
    # the training part: the loss's forward (compute_loss) and its backward, each between two syncs; on CUDA also
    # the peak allocated during them above what was allocated when the forward began (activations and gradients)
    first_inputs: list[dict] = []
    memory = {"base": 0, "peak": 0, "overall": 0}
    compute_loss_public = trainer.compute_loss

    def timed_compute_loss(model, inputs, *a, **kw):
        if not first_inputs:
            first_inputs.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        sync()
        if cuda:
            memory["overall"] = max(memory["overall"], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            memory["base"] = torch.cuda.memory_allocated()
        start = time.perf_counter()
        out = compute_loss_public(model, inputs, *a, **kw)
        sync()
        steps[-1]["train_part"] += time.perf_counter() - start
        return out

    trainer.compute_loss = timed_compute_loss
    backward = trainer.accelerator.backward

    def timed_backward(loss, **kw):
        sync()
        start = time.perf_counter()
        backward(loss, **kw)
        sync()
        steps[-1]["train_part"] += time.perf_counter() - start
        if cuda:
            peak = torch.cuda.max_memory_allocated() - memory["base"]
            steps[-1]["train_part_peak_mib"] = max(steps[-1].get("train_part_peak_mib", 0.0), peak / 2**20)

    trainer.accelerator.backward = timed_backward
    verdicts: list[str] = []  # auto's log lines (one per shape class decided, and fall-backs)

    class Verdicts(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "prefix packing" in message:
                verdicts.append(message)

    handler = Verdicts(level=logging.INFO)
    logging.getLogger("trinity_trl").addHandler(handler)
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
    logging.getLogger("trinity_trl").removeHandler(handler)
    if cuda:
        memory["overall"] = max(memory["overall"], torch.cuda.max_memory_allocated())
    logs = trainer.state.log_history
    result = {
        "step_s": [s["end"] - s["begin"] for s in steps if "end" in s],
        "train_part_s": [s["train_part"] for s in steps if "end" in s],
        "train_part_peak_mib": [s.get("train_part_peak_mib") for s in steps if "end" in s],
        "auto_log": verdicts,
        "auto_verdicts": auto_verdicts(trainer) if spec["side"] == "ours" else None,  # never raises
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
        result["cuda_peak_above_start_mib"] = (memory["overall"] - cuda_before) / 2**20
        result["cuda_peak_allocated_mib"] = memory["overall"] / 2**20
    if spec["side"] == "ours" and first_inputs and spec.get("equivalence", True):
        try:
            result["equivalence_check"] = check_equivalence(trainer, first_inputs[0], spec)
        except Exception as err:  # the timings stand; the check reports what broke it
            result["equivalence_check"] = {"equivalent": False, "error": f"{type(err).__name__}: {err}"[-2000:]}
    del trainer
    return result


def auto_verdicts(trainer) -> dict | None:
    """``auto``'s verdict per shape class (``True``: packed kept), read from its calibration where it has one."""
    calibration = getattr(getattr(trainer, "prefix_packing", None), "calibration", None)
    classes = getattr(calibration, "classes", None)
    if not isinstance(classes, dict):
        return None
    # a class key starts with the model's id, which means nothing in a report: (grad, rows, width) are kept
    try:
        return {
            str(key[1:] if isinstance(key, tuple) else key): getattr(trials, "verdict", None)
            for key, trials in classes.items()
        }
    except Exception:  # another calibration layout: its log lines (auto_log) still say what it decided
        return None


# -------------------------------------------------------------------------------- equivalence
#: bf16 roundings on one value's path per decoder layer (two norms, q, k, v, the attention output, its projection,
#: gate, up, their product, down, two residual additions): matmuls and attention accumulate in float32 on a GPU
#: and round once, to bf16, on output
BF16_ROUNDINGS_PER_LAYER = 13
#: and after the layers: the final norm, the logits, the log-softmax
BF16_HEAD_ROUNDINGS = 3


def equivalence_tolerances(dtype, config, rows: int, width: int) -> dict:
    """Relative tolerances (tests/tolerance.py) on the packed-vs-padded differences of one micro-batch.

    float32 (CPU: every addition rounds): a log-prob sums, per layer, the MLP (intermediate), the hidden
    projections and an attention row (keys x head dim), plus the vocabulary softmax (``LOGP_TERMS`` of
    tests/packing/packing_helpers.py at this shape), at tolerance()'s default ulps; a gradient element adds the sum
    over the micro-batch's tokens. bf16/fp16 (GPU: float32 accumulation, one rounding per op output): the
    roundings on the value's path (:data:`BF16_ROUNDINGS_PER_LAYER` per layer and :data:`BF16_HEAD_ROUNDINGS`),
    one ulp each; the backward doubles them.
    """
    import torch
    from tolerance import tolerance

    if dtype in (torch.bfloat16, torch.float16):
        roundings = BF16_ROUNDINGS_PER_LAYER * config.num_hidden_layers + BF16_HEAD_ROUNDINGS
        return {
            "logps_rtol": tolerance(dtype, terms=roundings, ulps=1)["rtol"],
            "grads_rtol": tolerance(dtype, terms=2 * roundings, ulps=1)["rtol"],
            "model": f"{roundings} bf16 roundings on a log-prob's path, 1 ulp each (2x for a gradient)",
        }
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    logp_terms = 2 * (config.intermediate_size + config.hidden_size + width * head_dim) + config.vocab_size
    return {
        "logps_rtol": tolerance(dtype, terms=logp_terms)["rtol"],
        "grads_rtol": tolerance(dtype, terms=logp_terms * rows * width)["rtol"],
        "model": f"{logp_terms} float32 additions behind a log-prob (x {rows * width} tokens for a gradient)",
    }


def check_equivalence(trainer, inputs: dict, spec: dict) -> dict:
    """The first training micro-batch's log-probs (no grad) and loss gradients, packed through one forced kernel
    vs TRL's padded rows, on the trained model: relative L2 differences against :func:`equivalence_tolerances`
    (log-probs of the completion tokens about their mean; the whole gradient vector).
    ``spec["break_packed"]``: swap two completion tokens of the packed side's first row (a self-test: the check
    must then fail)."""
    import torch

    from trinity_trl.packing import KERNELS, PrefixPacking

    device = trainer.accelerator.device
    if device.type == "cuda":
        kernel = next((k for k in ("varlen", "flash_attn", "flex") if KERNELS[k].unavailable(device) is None), None)
    else:
        kernel = "sdpa_segments"
    if kernel is None:
        return {"equivalent": None, "reason": "no fused kernel available"}
    model, original = trainer.model, trainer.prefix_packing
    params = [p for p in model.parameters() if p.requires_grad]
    ran: list[str | None] = []

    def run(packing, batch):
        forward = packing.logps_and_entropies

        def counting(*a, **kw):
            out = forward(*a, **kw)
            ran.append(None if out is None else out.kernel)
            return out

        packing.logps_and_entropies = counting
        trainer.prefix_packing = packing
        model.zero_grad(set_to_none=True)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        keep = batch["completion_ids"].shape[1]
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, None)[0]
        loss = trainer.compute_loss(model, batch)
        trainer.accelerator.backward(loss)
        grads = torch.cat([p.grad.detach().float().flatten() for p in params if p.grad is not None])
        model.zero_grad(set_to_none=True)
        scored = batch["completion_mask"].bool()
        return logps.detach().float()[scored], float(loss.detach()), grads

    unwrap, autocast = trainer.accelerator.unwrap_model, trainer.accelerator.autocast
    packed_batch = dict(inputs)
    if spec.get("break_packed"):
        ids = packed_batch["completion_ids"].clone()
        ids[0, [1, 2]] = ids[0, [2, 1]]
        packed_batch["completion_ids"] = ids
    try:
        settings = {"max_token_ratio": 1.0, "unwrap": unwrap, "autocast": autocast, "kernel": kernel, "device": device}
        packed = run(PrefixPacking(enabled=True, **settings), packed_batch)
        packed_ran = list(ran)
        ran.clear()
        padded = run(PrefixPacking(enabled=False, **settings), inputs)
    finally:
        trainer.prefix_packing = original
    rows, width = inputs["prompt_ids"].shape[0], inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
    dtype = next(p.dtype for p in params) if not trainer.args.bf16 else torch.bfloat16
    tol = equivalence_tolerances(dtype, trainer.model.config, rows, width)
    lp_packed, lp_padded = packed[0], padded[0]
    centred = lp_padded - lp_padded.mean()
    logps_rel = float((lp_packed - lp_padded).norm() / centred.norm().clamp_min(1e-30))
    grads_rel = float((packed[2] - padded[2]).norm() / padded[2].norm().clamp_min(1e-30))
    was_packed = bool(packed_ran) and all(k == kernel for k in packed_ran)
    return {
        "kernel": kernel,
        "dtype": str(dtype).removeprefix("torch."),
        "packed_forwards": packed_ran,
        "logps_rel_l2": logps_rel,
        "logps_max_abs_diff": float((lp_packed - lp_padded).abs().max()),
        "grads_rel_l2": grads_rel,
        "loss_abs_diff": abs(packed[1] - padded[1]),
        **tol,
        "equivalent": was_packed and logps_rel <= tol["logps_rtol"] and grads_rel <= tol["grads_rtol"],
    }


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
    peaks = [x for x in result.get("train_part_peak_mib", [])[warmup:] if x is not None]
    return {
        "step_s": bc.median(steps),
        "generation_s": bc.median(gens),
        "train_s": bc.median([s - g for s, g in zip(steps, gens)]),
        "train_part_s": bc.median(result.get("train_part_s", [])[warmup:]),
        "train_part_peak_mib": max(peaks) if peaks else None,
    }


def side_summary(results: list[dict], warmup: int) -> dict:
    per_run = [run_summary(r, warmup) for r in results]
    out = {
        key: bc.median([p[key] for p in per_run])
        for key in ("step_s", "generation_s", "train_s", "train_part_s", "train_part_peak_mib")
    }
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
    out["auto_verdicts"] = results[0].get("auto_verdicts")
    out["auto_log"] = results[0].get("auto_log", [])
    return out


def calibration_cost(ours: list[dict], trl: list[dict], warmup: int) -> dict | None:
    """What ``auto``'s calibration steps cost (an estimate): the training part of our first ``warmup`` steps above
    our steady step, minus the same excess on TRL's side (start-up costs both pay), as a share of a 100-step
    run's training part at our steady speed."""
    if not warmup or not ours or not trl:
        return None

    def excess(result):
        parts = result.get("train_part_s", [])
        steady = bc.median(parts[warmup:])
        if steady is None:
            return None, None
        return sum(max(0.0, t - steady) for t in parts[:warmup]), steady

    (ours_excess, ours_steady), (trl_excess, _) = excess(ours[0]), excess(trl[0])
    if ours_excess is None or trl_excess is None or not ours_steady:
        return None
    cost = max(0.0, ours_excess - trl_excess)
    return {"seconds": cost, "share_of_100_steps": cost / (100 * ours_steady)}


def compare(ours: list[dict], trl: list[dict], warmup: int, memory_key: str) -> dict:
    so, st = side_summary(ours, warmup), side_summary(trl, warmup)
    loss, grad = [], []
    for x, y in zip(ours, trl):
        loss += [abs(u - v) for u, v in zip(x["losses"], y["losses"])]
        grad += [abs(u - v) / max(abs(u), abs(v), 1e-12) for u, v in zip(x["grad_norms"], y["grad_norms"])]
    paired = [bc.ratio(run_summary(x, warmup)["train_s"], run_summary(y, warmup)["train_s"]) for x, y in zip(ours, trl)]
    checks = [r["equivalence_check"] for r in ours if r.get("equivalence_check")]
    trajectory = bool(grad) and max(grad) < EQUIVALENCE_GRAD_RTOL and max(loss) < EQUIVALENCE_LOSS_ATOL
    bf16 = any(c.get("dtype") in ("bfloat16", "float16") for c in checks)
    # bf16: the two sides' trajectories part by rounding from the first step on, so only the direct check judges
    equivalent = all(c.get("equivalent") for c in checks) and (bf16 or trajectory) if checks else trajectory
    return {
        "ours": so,
        "trl": st,
        "train_part_ratio": bc.ratio(so["train_part_s"], st["train_part_s"]),
        "train_part_memory_ratio": bc.ratio(so["train_part_peak_mib"], st["train_part_peak_mib"]),
        "calibration_cost": calibration_cost(ours, trl, warmup),
        "train_time_ratio": bc.ratio(so["train_s"], st["train_s"]),
        "train_time_ratio_paired": bc.median(paired),
        "step_time_ratio": bc.ratio(so["step_s"], st["step_s"]),
        "memory_ratio": bc.ratio(so[memory_key], st[memory_key]),
        "process_peak_memory_ratio": bc.ratio(so["process_peak_rss_mib"], st["process_peak_rss_mib"]),
        "equivalence": {
            "equivalent": bool(equivalent),
            "loss_max_abs_diff": max(loss) if loss else None,
            "grad_norm_max_rel_diff": max(grad) if grad else None,
            "trajectory_within_fp32_tolerances": trajectory,
            "direct": checks[0] if checks else None,
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
        path = save_random_real_vocab_qwen2(tmp / name, args.device, args.seed, args.bf16, **shape)
        return path, (
            f"random Qwen2 of the {name.replace('qwen', 'Qwen')} shape (hidden {shape['hidden']}, {shape['layers']} "
            f"layers, {shape['heads']} heads / {shape['kv_heads']} KV, intermediate {shape['intermediate']}, vocab "
            f"{REAL_VOCAB}) with the tests' tiny BPE tokenizer (sampling kept to its ids)"
        )
    if name == "bundled":
        from trinity_trl.data import bundled_model_dir

        return str(bundled_model_dir()), "SmolLM2-135M-Instruct (bundled, Llama architecture, vocab 49152)"
    return name, name


def save_random_real_vocab_qwen2(path: Path, device: str, seed: int, bf16: bool = False, **shape) -> str:
    """A random Qwen2 of ``shape`` with the real vocabulary (tied embeddings, as Qwen2.5-0.5B/1.5B), initialised on
    ``device`` (fast on a GPU) and saved with the tests' tiny tokenizer: in bf16 with ``bf16`` (the dtype of the
    real checkpoints, which the trainers then load), else in float32."""
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
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers need the memory, not this process
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
            + f". {'bf16' if c['bf16'] else 'fp32'}, full fine-tuning, lr {c['learning_rate']}, optimizer "
            f"{c.get('optim') or 'TRL default'}, activation checkpointing "
            f"{'on' if c.get('activation_checkpointing') else 'off'}, completions "
            f"{'of exactly C random tokens (no sampling)' if c.get('rollout') == 'fixed' else 'sampled'}. "
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
    part_lines = [
        "",
        "Training part (the loss's forward and backward, between syncs), its peak memory above its start, `auto`'s "
        "verdicts, and the direct check (the first micro-batch packed through a forced kernel vs padded, on the "
        "trained model: relative L2 differences of the completion log-probs about their mean and of the whole "
        "gradient, against tolerances derived for the dtype):",
        "",
        "| model | P | C | G | ours part (s) | TRL part (s) | **part ratio** | ours part peak (MiB) | TRL part peak "
        "(MiB) | **part memory ratio** | auto verdicts | calibration (share of 100 steps) | kernel, dtype "
        "| log-probs rel. L2 (tol) | grads rel. L2 (tol) | **equivalent** |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
        d = e.get("direct") or {}
        verdicts = o.get("auto_verdicts")
        cost = r.get("calibration_cost")
        part_lines.append(
            f"| {point['model']} | {point['prompt_len']} | {point['completion_len']} | {point['generations']} "
            f"| {bc.fmt(o.get('train_part_s'))} | {bc.fmt(t.get('train_part_s'))} "
            f"| **{bc.fmt(r.get('train_part_ratio'))}** | {bc.fmt(o.get('train_part_peak_mib'), '.0f')} "
            f"| {bc.fmt(t.get('train_part_peak_mib'), '.0f')} | **{bc.fmt(r.get('train_part_memory_ratio'))}** "
            f"| {', '.join(f'{k}: {v}' for k, v in verdicts.items()) if verdicts else '-'} "
            f"| {bc.fmt(cost and cost['share_of_100_steps'], '.1%')} "
            f"| {d.get('kernel', '-')}, {d.get('dtype', '-')} "
            f"| {bc.fmt(d.get('logps_rel_l2'), '.1e')} ({bc.fmt(d.get('logps_rtol'), '.1e')}) "
            f"| {bc.fmt(d.get('grads_rel_l2'), '.1e')} ({bc.fmt(d.get('grads_rtol'), '.1e')}) "
            f"| **{'yes' if e['equivalent'] else 'NO'}** |"
        )
    lines += part_lines
    s = report["summary"]
    if c["device"] == "cuda":
        met = {True: "met", False: "NOT met", None: "not measured"}
        lines += [
            "",
            "Targets (issue 34, one GPU in bf16; training part = the loss's forward and backward, memory = its "
            "peak above its start):",
            "",
            f"- 1.5B, prompt 1024, completion 256, G 8: train ratio {bc.fmt(s['cuda_1.5b_1024_256_8_train_ratio'])} "
            f"(target <= {CUDA_TARGETS['1.5b_1024_256_8_train_ratio_max']}): {met[s['cuda_1.5b_1024_256_8_met']]}",
            f"- 1.5B, prompt 2048, completion 512, G 8: train ratio {bc.fmt(s['cuda_1.5b_2048_512_8_train_ratio'])} "
            f"(target <= {CUDA_TARGETS['1.5b_2048_512_8_train_ratio_max']}): {met[s['cuda_1.5b_2048_512_8_met']]}",
            f"- memory at prompt >= 1024: worst ratio {bc.fmt(s['cuda_worst_memory_ratio_at_prompt_1024_plus'])} "
            f"(target <= {CUDA_TARGETS['memory_ratio_max_at_prompt_1024_plus']}): {met[s['cuda_memory_met']]}",
            f"- every point: worst train ratio {bc.fmt(s['cuda_worst_train_ratio'])} (target <= "
            f"{CUDA_TARGETS['train_ratio_max_everywhere']}): {met[s['cuda_never_loses_met']]}",
            f"- auto's calibration (estimate): at most {bc.fmt(s['cuda_worst_calibration_share_of_100_steps'], '.1%')} "
            "of a 100-step run's training part",
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
    parser.add_argument(
        "--rollout",
        choices=("generate", "fixed"),
        help="generate: TRL samples the completions (default on CPU); fixed: a rollout_func gives each row exactly "
        "C random tokens, no sampling (default on CUDA, where sampling C tokens would take most of the time)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="both sides (default: on for CUDA, as TRL's GRPOConfig; off on CPU, as our CPU default)",
    )
    parser.add_argument(
        "--optim",
        help="the optimizer of both sides (TrainingArguments.optim, e.g. sgd: no optimizer state); default TRL's",
    )
    parser.add_argument(
        "--points",
        nargs="+",
        metavar="MODEL:P:C:G",
        help="run exactly these points (K 1) instead of the grid, e.g. qwen2.5-1.5b:1024:256:8",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="on CPU too, both sides of a point in one worker process (faster; the RSS peaks then overlap)",
    )
    parser.add_argument("--no-equivalence", action="store_true", help="skip the direct packed-vs-padded check")
    parser.add_argument("--break-packed", action="store_true", help=argparse.SUPPRESS)  # self-test of the check
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "benchmarks/results",
        help="directory for the report (default $OUT where set, as on the lent GPU machine, else benchmarks/results)",
    )
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
    if args.rollout is None:
        args.rollout = "fixed" if cuda else "generate"
    if args.activation_checkpointing is None:
        args.activation_checkpointing = cuda
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
    grid_given = any(x is not None for x in (argv_value(argv, "--models"), argv_value(argv, "--prompt-lens")))
    if args.points:
        points = [parse_point(text, parser) for text in args.points]
    elif cuda and not grid_given and not args.quick:
        points = list(CUDA_POINTS)  # the issue's points: the whole grid does not fit a lent machine's command
    else:
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
            x not in CUDA_POINTS,
            CUDA_POINTS.index(x) if x in CUDA_POINTS else 0,
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
    args.failed_points = []
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
                "point_tuple": [model, p, c, g, k],
                "packing": True,
                "kernel": args.kernel,
                "prompts_per_step": k,
                "rollout": args.rollout,
                "activation_checkpointing": args.activation_checkpointing,
                "optim": args.optim,
                "equivalence": not args.no_equivalence,
                "break_packed": args.break_packed,
            }
            runs = {"ours": [], "trl": []}
            index += 2 * repeats
            try:
                measure_point(args, base, runs, repeats, n, warmup, tmp, index - 2 * repeats)
            except (RuntimeError, subprocess.TimeoutExpired) as err:  # reported; the next point runs
                print(f"[{model} P={p} C={c} G={g} K={k}] FAILED: {err}", flush=True)
                args.failed_points.append({"point": base["point"], "error": str(err)[-3000:]})
                write(args, argv, results, points[n + 1 :], parameters, descriptions, started, load_start)
                continue
            for side_runs in runs.values():
                for result in side_runs:
                    parameters[model] = result["parameters"]
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
    return 1 if args.failed_points else 0


def argv_value(argv, flag: str):
    """``flag``'s presence on the command line (``None``: absent)."""
    given = sys.argv[1:] if argv is None else argv
    return True if any(a == flag or a.startswith(flag + "=") for a in given) else None


def parse_point(text: str, parser) -> tuple:
    """``MODEL:P:C:G`` as a grid point (K 1)."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in ("tiny", *MODEL_SHAPES) or not all(x.isdigit() for x in parts[1:]):
        parser.error(f"--points takes MODEL:P:C:G (MODEL one of tiny, {', '.join(MODEL_SHAPES)}), got {text!r}")
    return (parts[0], int(parts[1]), int(parts[2]), int(parts[3]), 1)


def measure_point(args, base: dict, runs: dict, repeats: int, n: int, warmup: int, tmp: Path, index: int) -> None:
    """Run one point's repetitions into ``runs`` (``{side: [measurements]}``); raise where a worker fails."""
    cuda = args.device == "cuda"
    model, p, c, g, k = base["point_tuple"]
    for rep in range(repeats):
        order = ("ours", "trl") if (n + rep) % 2 == 0 else ("trl", "ours")
        # CUDA: both sides in one process (one CUDA context, one compilation cache); CPU: one process each
        batches = [list(order)] if cuda or args.same_process else [[side] for side in order]
        for sides in batches:
            index += 1
            for side, result in run_worker(dict(base, sides=sides), tmp, index, args.timeout).items():
                runs[side].append(result)
                s = run_summary(result, warmup)
                peak = result.get("cuda_peak_above_start_mib" if cuda else "train_peak_rss_above_start_mib")
                kernels = f", kernels {result['kernels']}" if result.get("kernels") else ""
                print(
                    f"[{model} P={p} C={c} G={g} K={k} rep {rep + 1}/{repeats}] {side}: step "
                    f"{bc.fmt(s['step_s'])} s, train {bc.fmt(s['train_s'])} s, part {bc.fmt(s['train_part_s'])} s "
                    f"(peak {bc.fmt(s['train_part_peak_mib'], '.0f')} MiB), first step "
                    f"{bc.fmt(result.get('first_step_s'))} s, peak {bc.fmt(peak, '.0f')} MiB{kernels}, "
                    f"load {bc.loadavg()}",
                    flush=True,
                )


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
        "config": {
            k: v
            for k, v in vars(args).items()
            if k not in ("worker", "out", "commands", "resumed_wall_s", "failed_points")
        },
        "model_description": descriptions.get("tiny") or next(iter(descriptions.values())),
        "model_descriptions": descriptions,
        "parameters": parameters.get("tiny") or next(iter(parameters.values())),
        "parameters_by_model": parameters,
        "memory_key": memory_key,
        "targets": {k: list(v) if isinstance(v, tuple) else v for k, v in TARGETS.items()},
        "summary": summary,
        "results": results,
        "not_measured": [list(p) for p in missing],
        "failed_points": getattr(args, "failed_points", []),
        "total_wall_s": time.perf_counter() - started + getattr(args, "resumed_wall_s", 0.0),
    }
    name = "prefix_packing_cuda" if args.device == "cuda" else "prefix_packing"
    report["benchmark"] = name
    bc.write_report(args.out, name, report, markdown(report))


def cuda_summary(results: list[dict]) -> dict:
    """Issue 34's CUDA targets against the points measured (``None``: the point was not run). The training part is
    the loss's forward and backward (``train_part_ratio``); memory is the peak during it above its start."""

    def part(r, key="train_part_ratio"):
        value = r["comparison"].get(key)
        return value if value is not None or key != "train_part_ratio" else r["comparison"]["train_time_ratio"]

    def ratio(model, p, c, key="train_part_ratio"):
        found = [
            part(r, key)
            for r in results
            if (r["model"], r["prompt_len"], r["completion_len"], r["generations"], r.get("prompts_per_step", 1))
            == (model, p, c, 8, 1)
        ]
        return found[0] if found else None

    train = [part(r) for r in results if part(r) is not None]
    memory = [
        part(r, "train_part_memory_ratio")
        for r in results
        if r["prompt_len"] >= 1024 and part(r, "train_part_memory_ratio") is not None
    ]
    shares = [
        r["comparison"]["calibration_cost"]["share_of_100_steps"]
        for r in results
        if r["comparison"].get("calibration_cost")
    ]
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
        "cuda_worst_calibration_share_of_100_steps": max(shares) if shares else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
