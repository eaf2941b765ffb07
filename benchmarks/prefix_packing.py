#!/usr/bin/env python
"""Benchmark: the prefix-shared packed training step against TRL's ``GRPOTrainer`` (padded rows).

Each point (:class:`Point`: a model, prompt length ``P``, completion length ``C``, group size ``G``, ``K`` prompts per
micro-batch, gradient accumulation ``GA``, full fine-tuning or LoRA) is trained by TRL's ``GRPOTrainer`` and by
``TrinityTrainer(algorithm="grpo", kl_loss="none", loss_agg_mode="seq-mean-token-mean")``, each repeat a fresh
process per side on ``harness.Bench``, sides alternating; the figure is the ``train`` column (the optimizer
step minus TRL's generation). The protocol, the point sets and the direct packed-vs-padded check:
benchmarks/README.md (`prefix_packing.py`). ``make gpu-check`` (``benchmarks/gpu_check.py``) runs it on CUDA; on CPU
it runs the ``--points`` named (the CPU grid is retired: benchmarks/README.md).

    python benchmarks/prefix_packing.py --device cuda --bf16 --sides ours,ours_compiled,trl  # the target points
    python benchmarks/prefix_packing.py --quick --repeats 2                                   # one tiny point, CPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports
import harness

EQUIVALENCE_GRAD_RTOL, EQUIVALENCE_LOSS_ATOL = 1e-3, 1e-4
MODEL_SHAPES, REAL_VOCAB = bc.MODEL_SHAPES, bc.REAL_VOCAB
#: the sides a point can run (``--sides``): ours at its defaults, ours with compiled layers (``prefix_packing_compile``,
#: CUDA), TRL's ``GRPOTrainer``
SIDES = ("ours", "ours_compiled", "trl")
OURS = ("ours", "ours_compiled")
#: what the forkserver imports once (`harness.Launcher`): on CUDA it saves each run the imports
WORK = "prefix_packing:work"  # the harness's child: a side's run, or a model saved
PRELOAD = ("bench_common", "torch", "transformers", "datasets", "trl", "peft", "trinity_trl.trainers")
#: LoRA of the ``lora`` points (both sides): a common setting, written beside the figures
#: the run's logged figures (``trainer.state.log_history``) a result keeps
LOGGED = {
    "losses": "loss",
    "grad_norms": "grad_norm",
    "forwarded_token_ratio": "packing/forwarded_token_ratio",
    "forwards_per_step": "packing/forwards_per_step",
}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}


@dataclasses.dataclass(frozen=True)
class Point:
    """One benchmark point: ``model`` (a key of `MODEL_SHAPES`, ``tiny`` or ``bundled``), prompt and completion
    lengths, group size, ``prompts`` per micro-batch, gradient ``accumulation`` steps, ``lora``."""

    model: str
    prompt_len: int
    completion_len: int
    generations: int
    prompts: int = 1
    accumulation: int = 1
    lora: bool = False

    @property
    def name(self) -> str:
        extra = [f"K{self.prompts}"] + ([f"GA{self.accumulation}"] if self.accumulation > 1 else [])
        extra += ["LoRA"] if self.lora else []
        return f"{self.model} P{self.prompt_len}/C{self.completion_len}/G{self.generations} {' '.join(extra)}"

    @property
    def key(self) -> str:
        parts = [self.model, str(self.prompt_len), str(self.completion_len), str(self.generations)]
        parts += [f"k{self.prompts}"] if self.prompts != 1 else []
        parts += [f"ga{self.accumulation}"] if self.accumulation != 1 else []
        return ":".join(parts + (["lora"] if self.lora else []))


def parse_point(text: str) -> Point:
    """``MODEL:P:C:G[:kN][:gaN][:lora]``, e.g. ``qwen2.5-1.5b:2048:512:8:ga4``."""
    parts = text.split(":")
    if len(parts) < 4 or parts[0] not in ("tiny", "bundled", *MODEL_SHAPES) or not all(x.isdigit() for x in parts[1:4]):
        raise ValueError(
            f"a point is MODEL:P:C:G[:kN][:gaN][:lora] (MODEL one of tiny, {', '.join(MODEL_SHAPES)}), got {text!r}"
        )
    options = {"prompts": 1, "accumulation": 1, "lora": False}
    for option in parts[4:]:
        if option == "lora":
            options["lora"] = True
        elif option.startswith("ga") and option[2:].isdigit():
            options["accumulation"] = int(option[2:])
        elif option.startswith("k") and option[1:].isdigit():
            options["prompts"] = int(option[1:])
        else:
            raise ValueError(f"unknown point option {option!r} in {text!r} (kN, gaN, lora)")
    return Point(parts[0], int(parts[1]), int(parts[2]), int(parts[3]), **options)


#: the CUDA point sets (`make gpu-check`'s parts): ``target`` first (issue 42's points), then the others
POINT_SETS = {
    "target": [
        Point("qwen2.5-1.5b", 1024, 256, 8),
        Point("qwen2.5-1.5b", 2048, 512, 8),
    ],
    "accumulation": [
        Point("qwen2.5-1.5b", 1024, 256, 8, accumulation=4),
        Point("qwen2.5-1.5b", 2048, 512, 8, accumulation=4),
    ],
    "small": [
        Point("qwen2.5-0.5b", 256, 128, 8),
        Point("qwen2.5-0.5b", 1024, 256, 8),
        Point("qwen2.5-0.5b", 2048, 512, 8),
    ],
    "lora": [
        Point("qwen2.5-1.5b", 1024, 256, 8, lora=True),
        Point("qwen2.5-1.5b", 2048, 512, 8, lora=True),
    ],
}
#: issue 42's targets on one GPU (ours / TRL, the ``train`` column; memory: the training part's peak)
CUDA_TARGETS = [
    ("qwen2.5-1.5b:1024:256:8", "train_ratio", 0.65),
    ("qwen2.5-1.5b:2048:512:8", "train_ratio", 0.42),
    ("qwen2.5-1.5b:1024:256:8:ga4", "train_ratio", 0.50),
    ("qwen2.5-1.5b:2048:512:8:ga4", "train_ratio", 0.40),
    ("qwen2.5-0.5b:256:128:8", "train_ratio", 1.03),
    ("qwen2.5-0.5b:1024:256:8", "train_ratio", 1.03),
    ("qwen2.5-1.5b:1024:256:8", "part_memory_ratio", 1.0),
    ("qwen2.5-1.5b:2048:512:8", "part_memory_ratio", 1.0),
    ("qwen2.5-1.5b:2048:512:8:lora", "part_memory_ratio", 0.6),
]


# --------------------------------------------------------------------------------------- data
def prompt_texts(tokenizer, length: int, count: int, seed: int) -> list[str]:
    """``count`` plain-text prompts of exactly ``length`` tokens: words that are one token each with
    their leading space (the tokenizer splits words apart, so the count is exact)."""

    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    texts = (tokenizer.convert_tokens_to_string([token]) for token in sorted(tokenizer.get_vocab()))
    words = [text for text in texts if text.startswith(" ") and text[1:].isalpha() and tokens(text) == 1]
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(words) for _ in range(length)) for _ in range(count)]
    if any(tokens(p) != length for p in prompts):
        raise RuntimeError(f"a prompt is not {length} tokens long")
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
def work(spec: dict) -> dict:
    """In a fresh process (a `harness` side): make the model of ``spec["make_model"]`` (`bench_common.random_model`:
    its ``path`` and ``about``), or train ``spec["side"]``'s run (its measurements)."""
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    if spec.get("make_model"):
        return bc.random_model(spec["make_model"], spec["model_dir"], spec["device"], spec["seed"], spec["bf16"])
    # the direct packed-vs-padded check in a point's first repeat only
    own = dict(spec, equivalence=spec.get("equivalence") and os.environ.get("HARNESS_REPEAT", "0") == "0")
    if spec["side"] == "trl":  # TRL's runs skip only their start-up steps; the same timed steps follow
        own.update(warmup=spec["trl_warmup"], steps=spec["trl_warmup"] + spec["steps"] - spec["warmup"])
    elif spec["side"] == "ours_compiled":  # its first packed passes compile (auto's trial starts after them)
        own.update(warmup=spec["warmup"] + 2, steps=spec["steps"] + 2)
    gpu = torch.cuda.get_device_name() if spec["device"] == "cuda" else None
    return {**train_side(own), "departures": departures(spec), "gpu": gpu}


def departures(spec: dict) -> list[str]:
    """What each side sets beyond its trainer's defaults (besides the point itself), for the report."""
    common = [
        "loss_type='grpo' on TRL's side (its default 'dapo'; 'grpo' is the objective ours trains)",
        "logging_steps=1, max_steps, save_strategy='no', report_to='none' (both)",
    ]
    cpu, get = spec["device"] == "cpu", spec.get
    optional = {
        f"completions of exactly C={get('completion_len')} random tokens from a rollout_func (both)": (
            get("rollout") == "fixed"
        ),
        f"use_cpu=True, bf16=False, activation checkpointing {'on' if get('ac') else 'off'}": cpu,
        "activation checkpointing off (both; TRL's default is on)": not cpu and get("ac") is False,
        f"optim={get('optim')!r} (both)": bool(get("optim")),
        f"learning_rate={get('learning_rate')} (both)": get("learning_rate") is not None,
        f"LoRA {LORA} (both)": bool(get("lora")),
        "ours: prefix_packing_token_budget=None (its default: the tokens of TRL's padded micro-batch)": (
            get("accumulation", 1) > 1
        ),
        f"ours: prefix_packing_kernel={get('kernel')!r}": get("kernel", "auto") != "auto",
    }
    return common + [text for text, applies in optional.items() if applies]


def train_side(spec: dict) -> dict:
    """Train one side of a point; return its measurements."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    per_step = spec.get("prompts_per_step", 1) * spec.get("accumulation", 1)
    dataset = Dataset.from_dict(
        {"prompt": prompt_texts(tokenizer, spec["prompt_len"], per_step * (spec["steps"] + 2), spec["seed"])}
    )
    trainer = side_trainer(spec, tokenizer, dataset)
    probe = probe_class()(spec, trainer)
    result = train_probed(spec, trainer, probe)
    if spec["side"] == "ours" and probe.first_inputs and spec.get("equivalence"):
        try:
            result["equivalence_check"] = check_equivalence(trainer, probe.first_inputs[0], spec)
        except Exception as err:  # the timings stand; the check reports what broke it
            result["equivalence_check"] = {"equivalent": False, "error": f"{type(err).__name__}: {err}"[-2000:]}
    del trainer, probe
    return result


def side_arguments(spec: dict, tokenizer) -> dict:
    """The training arguments both sides share (TRL's `GRPOConfig` fields)."""
    from transformers import AutoConfig

    common = {"output_dir": spec["output_dir"], "num_generations": spec["generations"], "seed": spec["seed"]}
    common |= {"per_device_train_batch_size": spec["generations"] * spec.get("prompts_per_step", 1)}
    common |= {"gradient_accumulation_steps": spec.get("accumulation", 1), "max_steps": spec["steps"]}
    common |= {"max_completion_length": spec["completion_len"], "logging_steps": 1, "disable_tqdm": True}
    common |= {"report_to": "none", "save_strategy": "no"}
    if spec["device"] != "cuda":
        common.update(use_cpu=True, bf16=False, activation_checkpointing=bool(spec.get("ac")))
    else:
        common["bf16"] = bool(spec["bf16"])
        if spec.get("ac") is False:
            common["activation_checkpointing"] = False
    # the model's path, or (packing_profile.py) the model itself
    vocab = (getattr(spec["model"], "config", None) or AutoConfig.from_pretrained(spec["model"])).vocab_size
    if vocab > len(tokenizer):  # the real vocabulary's LM head; sample only ids the tiny tokenizer can decode
        common["generation_kwargs"] = {"suppress_tokens": list(range(len(tokenizer), vocab))}
    return common | {k: spec[k] for k in ("optim", "learning_rate") if spec.get(k) is not None}


def side_trainer(spec: dict, tokenizer, dataset):
    """The side's trainer: ours (`TrinityTrainer`, GRPO as TRL's default loss) or TRL's `GRPOTrainer`."""
    common = side_arguments(spec, tokenizer)
    extra = {"rollout_func": fixed_rollout(spec, tokenizer) if spec.get("rollout") == "fixed" else None}
    if spec.get("lora"):
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(task_type="CAUSAL_LM", **LORA)
    if spec["side"] in OURS:
        from trinity_trl.trainers import TrinityConfig as Config
        from trinity_trl.trainers import TrinityTrainer as Trainer

        ours = {"algorithm": "grpo", "kl_loss": "none", "loss_agg_mode": "seq-mean-token-mean"}
        ours |= {"prefix_packing": spec["packing"], "prefix_packing_kernel": spec.get("kernel", "auto")}
        if spec["side"] == "ours_compiled":  # compiled decoder layers for packed forwards (issue 53)
            ours["prefix_packing_compile"] = True
        if spec.get("accumulation", 1) > 1:
            ours["prefix_packing_token_budget"] = None  # its default, named: the point is about it
        config = Config(**ours, **common)
    else:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer

        config = Config(loss_type="grpo", **common)
    data = {"train_dataset": dataset, "processing_class": tokenizer}
    return Trainer(model=spec["model"], reward_funcs=char_reward, args=config, **data, **extra)


def probe_class():
    from phases import PhaseTimer

    class Probe(PhaseTimer):
        """`phases.PhaseTimer` on a side's trainer (each step's ``generation``, ``loss`` and ``backward`` phases), and
        beside it what the report reads per step: the training forwards' layouts, whether ``auto`` was still
        deciding at the step's end, the training part's peak memory on CUDA (the allocator's host-side bookkeeping:
        no sync); and the first micro-batch's shape and inputs (the direct check's)."""

        def __init__(self, spec: dict, trainer):
            super().__init__(trainer)
            import torch

            self.torch, self.spec, self.extra, self.layouts, self.peak = torch, spec, [], {}, None
            self.batches, self.first_inputs, self.memory = [], [], {"base": 0, "overall": 0}
            compute_loss = trainer._compute_loss

            def first_batch(model, inputs):
                if not self.batches:  # reading its mask is a host sync: once only
                    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
                    real = int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
                    self.batches.append({"rows": int(prompt.shape[0]), "padded_tokens": int(prompt.numel() +
                                         completion.numel()), "real_tokens": real})  # fmt: skip
                    if spec.get("equivalence"):
                        self.first_inputs.append({k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
                return compute_loss(model, inputs)

            self._replace(trainer, "_compute_loss", first_batch)
            if spec["side"] in OURS:  # which kernel each training forward ran ("padded": TRL's rows)
                packing = trainer.prefix_packing.logps_and_entropies

                def counting(*a, **kw):
                    out = packing(*a, **kw)
                    if torch.is_grad_enabled():
                        name = "padded" if out is None else out.kernel
                        self.layouts[name] = self.layouts.get(name, 0) + 1
                    return out

                self._replace(trainer.prefix_packing, "logps_and_entropies", counting)

        def enter(self, phase: str) -> None:
            if phase == "loss" and self.cuda:
                cuda, memory = self.torch.cuda, self.memory
                memory["overall"] = max(memory["overall"], cuda.max_memory_allocated())
                cuda.reset_peak_memory_stats()
                memory["base"] = cuda.memory_allocated()
            super().enter(phase)

        def exit(self) -> None:
            phase = self._stack[-1]
            super().exit()
            if phase == "backward" and self.cuda:
                peak = (self.torch.cuda.max_memory_allocated() - self.memory["base"]) / 2**20
                self.peak = max(self.peak or 0.0, peak)

        def end_step(self) -> None:
            if self._marks is not None:
                self.extra.append(
                    {"deciding": still_deciding(self.trainer), "layouts": self.layouts, "peak": self.peak}
                )
                self.layouts, self.peak = {}, None
            super().end_step()

    return Probe


class PackingLog(logging.Handler):
    """The ``trinity_trl`` log's prefix-packing lines (``auto``'s verdicts, fall-backs) while it is attached."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if "prefix packing" in (message := record.getMessage()):
            self.lines.append(message)


def train_probed(spec: dict, trainer, probe) -> dict:
    """Train (auto's verdicts and the memory watched); the side's measurements, per step from the phase timer:
    ``step_s`` and ``generation_s`` host seconds, ``train_part_s`` the ``loss`` and ``backward`` phases (on the
    device's clock on CUDA)."""
    torch, verdicts = probe.torch, PackingLog()  # auto's log lines (one per shape class decided, and fall-backs)
    logging.getLogger("trinity_trl").addHandler(verdicts)
    gc.collect()
    bc.malloc_trim()
    rss_before, cuda_before = bc.read_status_kb("VmRSS"), 0
    hwm_reset = (not probe.cuda) and bc.reset_peak_rss()
    if probe.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    if spec["side"] == "ours_compiled":
        from torch._dynamo.utils import counters

        counters.clear()
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    trainer.train()
    wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    logging.getLogger("trinity_trl").removeHandler(verdicts)
    probe.remove()
    steps, logs = probe.steps, trainer.state.log_history
    result = {
        "step_s": [s["step_s"] for s in steps],
        "deciding": [x["deciding"] for x in probe.extra],
        "train_part_s": [(s["device"] or s["host"])["loss"] + (s["device"] or s["host"])["backward"] for s in steps],
        "train_part_peak_mib": [x["peak"] for x in probe.extra],
        "phases_s": [{"host": s["host"], "device": s["device"]} for s in steps],
        "auto_log": verdicts.lines,
        "auto_verdicts": auto_verdicts(trainer) if spec["side"] in OURS else None,  # never raises
        "generation_s": [s["host"]["generation"] for s in steps],
        "warmup": spec["warmup"],
        "train_wall_s": wall,
        "cpu_util": cpu / wall if wall > 0 else None,
        "process_peak_rss_mib": bc.max_rss_mib(),
        "micro_batch": probe.batches[0] if probe.batches else None,
        **{key: [e[name] for e in logs if name in e] for key, name in LOGGED.items()},
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "loadavg_end": bc.loadavg(),
        "first_step_s": steps[0]["step_s"] if steps else None,
        "kernels": _total([x["layouts"] for x in probe.extra]),
        "step_layouts": [x["layouts"] for x in probe.extra],  # the training forwards' layouts, step by step
        "pid": os.getpid(),
        "train_peak_rss_above_start_mib": (
            (bc.read_status_kb("VmHWM") - rss_before) / 1024 if hwm_reset and rss_before is not None else None
        ),
    }
    if probe.cuda:
        overall = max(probe.memory["overall"], torch.cuda.max_memory_allocated())
        result |= {
            "cuda_peak_above_start_mib": (overall - cuda_before) / 2**20,
            "cuda_peak_allocated_mib": overall / 2**20,
        }
    if spec["side"] == "ours_compiled":
        result["compiled"] = compile_counts(trainer)
    return result


def _total(counts: list[dict]) -> dict:
    return dict(sum(map(collections.Counter, counts), collections.Counter()))


def compile_counts(trainer) -> dict:
    """What compiling the decoder layers did in the run (``prefix_packing_compile``): graphs compiled for them, the
    run's compile budget, dynamo's graph breaks and frames (read after ``train()``: never raises)."""
    try:
        from torch._dynamo.utils import counters

        layers, budget = trainer.prefix_packing.compiled, trainer.prefix_packing.compile_budget
        counts = {"layer_graphs": layers.graphs if layers is not None else None, "budget_graphs": budget.graphs}
        counts |= {"graph_breaks": sum(counters["graph_break"].values()), "frames": dict(counters["frames"])}
        return counts | {"unique_graphs": counters["stats"].get("unique_graphs")}
    except Exception as err:  # the timings stand
        return {"error": f"{type(err).__name__}: {err}"}


def still_deciding(trainer) -> bool:
    """Whether ``auto`` has a shape class without a verdict after this step (its calibration still times real passes
    in both layouts); ``False`` for TRL's side and where nothing is measured."""
    verdicts = auto_verdicts(trainer)
    return bool(verdicts) and any(v is None for v in verdicts.values())


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

    device, kernel = trainer.accelerator.device, "sdpa_segments"  # a fused kernel on CUDA
    if device.type == "cuda":
        kernel = next((k for k in ("varlen", "flash_attn", "flex") if KERNELS[k].unavailable(device) is None), None)
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
def timed_steps(result: dict, warmup: int | None = None) -> list[int]:
    """The steps a run's figures are read from: those after its warm-up, less any that ended with ``auto`` still
    deciding (``deciding``: its calibration's passes alternate layouts, so they are not the steady step). Where every
    step after the warm-up was still deciding, those steps (the run is marked by `undecided_steps`)."""
    warmup = result.get("warmup", 0) if warmup is None else warmup
    after = list(range(warmup, len(result["step_s"])))
    deciding = result.get("deciding") or []
    decided = [i for i in after if i >= len(deciding) or not deciding[i]]
    return decided or after


def undecided_steps(result: dict, warmup: int | None = None) -> int:
    """How many of a run's steps after its warm-up ended with ``auto`` still deciding."""
    warmup = result.get("warmup", 0) if warmup is None else warmup
    return sum(1 for d in (result.get("deciding") or [])[warmup:] if d)


def run_summary(result: dict, warmup: int | None = None) -> dict:
    """One run's medians over its timed steps (`timed_steps`)."""
    keep = timed_steps(result, warmup)

    def pick(values):
        return [values[i] for i in keep if i < len(values)]

    steps, gens, split = pick(result["step_s"]), pick(result["generation_s"]), pick(result.get("phases_s", []))
    peaks = [x for x in pick(result.get("train_part_peak_mib", [])) if x is not None]
    deciding = result.get("deciding") or []
    return {
        "step_s": bc.median(steps),
        "generation_s": bc.median(gens),
        "train_s": bc.median([s - g for s, g in zip(steps, gens)]),
        "train_part_s": bc.median(pick(result.get("train_part_s", []))),
        "train_part_peak_mib": max(peaks) if peaks else None,
        "timed_steps": len(keep),
        "undecided_steps": undecided_steps(result, warmup),
        # a run whose timed steps all ended with auto still deciding: its figure mixes layouts (counted apart)
        "decided": not keep or any(i >= len(deciding) or not deciding[i] for i in keep),
        "timed_layouts": pick(result.get("step_layouts", [])),
        # the phase timer's split (on the device's clock where read)
        "phases_s": {p: bc.median([(s["device"] or s["host"])[p] for s in split]) for p in split[0]["host"]}
        if split
        else {},
        "verdicts": result.get("auto_verdicts"),
    }


def side_summary(results: list[dict]) -> dict:
    """Medians over repeats of each run's median (with min-max), the kernels, auto's verdicts. ``train_s`` and its
    spread read the runs that decided before or during their timed steps; the undecided ones are counted apart
    (``undecided_runs``, ``train_s_undecided``)."""
    per_run = [run_summary(r) for r in results]
    numeric = [k for k, v in per_run[0].items() if not isinstance(v, (bool, list, dict))]
    out = {key: bc.median([p[key] for p in per_run]) for key in numeric}
    decided = [p["train_s"] for p in per_run if p["decided"]]
    out |= {"train_s": bc.median(decided), "train_s_spread": harness.spread(decided)}
    out["train_s_undecided"] = harness.spread([p["train_s"] for p in per_run if not p["decided"]])
    out["train_part_peak_mib_spread"] = harness.spread([p["train_part_peak_mib"] for p in per_run])
    out["undecided_runs"] = sum(1 for p in per_run if not p["decided"])
    out["runs_still_deciding_after_warmup"] = sum(1 for p in per_run if p.get("undecided_steps"))
    memory = ("process_peak_rss_mib", "train_peak_rss_above_start_mib", "cuda_peak_above_start_mib")
    for key in (*memory, "cuda_peak_allocated_mib", "cpu_util", "first_step_s"):
        out[key] = bc.median([r.get(key) for r in results])
    for key in ("forwarded_token_ratio", "forwards_per_step"):
        out[key] = bc.median([x for r in results for x in r.get(key, [])])
    out |= {"micro_batch": results[0]["micro_batch"], "kernels": _total([r.get("kernels", {}) for r in results])}
    phases = dict.fromkeys(p for r in per_run for p in r.get("phases_s") or {})
    out["phases_s"] = {p: bc.median([(r.get("phases_s") or {}).get(p) for r in per_run]) for p in phases}
    out["per_run"] = per_run  # each repeat's verdicts and the layouts of its timed steps
    out |= {"auto_verdicts_per_run": [p["verdicts"] for p in per_run], "auto_verdicts": results[0].get("auto_verdicts")}
    out |= {"compiled": [r["compiled"] for r in results if r.get("compiled")], "repeats": len(results)}
    return out | {"auto_log": results[0].get("auto_log", [])}


def calibration_seconds(ours: dict, trl: dict) -> float | None:
    """What ``auto``'s calibration cost one of our runs, in seconds: our warm-up steps' excess over our steady step,
    less TRL's warm-up steps' excess over its steady step (start-up costs both sides pay)."""

    def excess(result):
        warmup = result.get("warmup", 0)
        train = [s - g for s, g in zip(result["step_s"], result["generation_s"])]
        steady = bc.median(train[warmup:])
        return None if steady is None else sum(max(0.0, t - steady) for t in train[:warmup])

    a, b = excess(ours), excess(trl)
    return None if a is None or b is None else max(0.0, a - b)


def compare(ours: list[dict], trl: list[dict], memory_key: str) -> dict:
    """Ours against TRL at one point: ratios of the medians over repeats, and the per-repeat ratios' min-max."""
    so, st = side_summary(ours), side_summary(trl)
    loss, grad = [], []
    for x, y in zip(ours, trl):
        loss += [abs(u - v) for u, v in zip(x["losses"], y["losses"])]
        grad += [abs(u - v) / max(abs(u), abs(v), 1e-12) for u, v in zip(x["grad_norms"], y["grad_norms"])]
    # paired: each repeat's ours / TRL, over the repeats whose run of ours decided (the others apart)
    pairs = [(run_summary(x), run_summary(y)) for x, y in zip(ours, trl)]
    paired = {d: [bc.ratio(x["train_s"], y["train_s"]) for x, y in pairs if x["decided"] == d] for d in (True, False)}
    calibration = [calibration_seconds(x, y) for x, y in zip(ours, trl)]
    checks = [r["equivalence_check"] for r in ours if r.get("equivalence_check")]
    trajectory = bool(grad) and max(grad) < EQUIVALENCE_GRAD_RTOL and max(loss) < EQUIVALENCE_LOSS_ATOL
    bf16 = any(c.get("dtype") in ("bfloat16", "float16") for c in checks)
    # bf16: the two sides' trajectories part by rounding from the first step on, so only the direct check judges
    equivalent = all(c.get("equivalent") for c in checks) and (bf16 or trajectory) if checks else trajectory
    return {
        "ours": so,
        "trl": st,
        "train_ratio": bc.ratio(so["train_s"], st["train_s"]),
        "train_ratio_per_repeat": harness.spread(paired[True]),
        "train_ratio_undecided_runs": harness.spread(paired[False]),
        "step_ratio": bc.ratio(so["step_s"], st["step_s"]),
        "train_part_ratio": bc.ratio(so["train_part_s"], st["train_part_s"]),
        "part_memory_ratio": bc.ratio(so["train_part_peak_mib"], st["train_part_peak_mib"]),
        "memory_ratio": bc.ratio(so[memory_key], st[memory_key]),
        "process_peak_memory_ratio": bc.ratio(so["process_peak_rss_mib"], st["process_peak_rss_mib"]),
        "calibration_s_per_run": harness.spread(calibration),
        "equivalence": {
            "equivalent": bool(equivalent),
            "loss_max_abs_diff": max(loss) if loss else None,
            "grad_norm_max_rel_diff": max(grad) if grad else None,
            "trajectory_within_fp32_tolerances": trajectory,
            "direct": checks[0] if checks else None,
        },
    }


def _cell(stat: dict | None, spec: str = ".3f") -> str:
    return harness.cell(stat, spec)  # median (min-max)


def _counts(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" if isinstance(v, bool) or v is None else f"{k} x{v}" for k, v in counts.items())


def markdown(report: dict) -> str:
    """The points: the setting and protocol, the table (gpu_check.md repeats this Markdown), each point's notes,
    issue 42's targets on CUDA, and what failed, was not measured or was cut short."""
    c, models = report["config"], report.get("models", {})
    mem = "CUDA peak allocated above start" if c["device"] == "cuda" else "peak RSS during train() above start"
    about = "; ".join(
        f"`{n}`: {m.get('about')} ({(m.get('parameters') or 0) / 1e6:.1f}M parameters)" for n, m in models.items()
    )
    lines = [
        "## The points",
        "",
        f"{'**Quick setting** (smoke run, not for conclusions). ' if c['quick'] else ''}Models: {about}. "
        f"{'bf16' if c['bf16'] else 'fp32'}. Ours: `TrinityTrainer(algorithm='grpo', kl_loss='none', "
        f"loss_agg_mode='seq-mean-token-mean')`, `prefix_packing_kernel={c.get('kernel', 'auto')!r}`; TRL: "
        "`GRPOTrainer` at its defaults except the departures below.",
        "",
        "Protocol (benchmarks/README.md): a repeat is a fresh process per side, sides alternating, points "
        f"interleaved; {c['repeats']} repeat(s) asked. `train` = the optimizer step (from its start to the next "
        "step's, split by `phases.PhaseTimer`) minus its generation phase, the median over a run's steps after its "
        f"warm-up (ours: {c['warmup']} steps, `auto`'s calibration; TRL: {c['trl_warmup']}; at accumulation > 1: "
        f"{c['accumulation_warmup']} / {min(c['trl_warmup'], c['accumulation_warmup'])}); figures: median over repeats "
        "(min-max). Ratios ours / TRL (< 1: ours faster / smaller); `per repeat`: each repeat's ours / TRL. "
        f"Memory: {mem}; `part memory`: the peak during the loss's forward and backward above its start. "
        "`calibration`: seconds a run of ours spent in `auto`'s calibration (its warm-up excess over its steady "
        "step, less TRL's). `tokens fwd`: tokens the packed forwards process / tokens of TRL's padded micro-batches.",
        "",
        "| point | repeats | tokens fwd | ours train (s) | TRL train (s) | **train ratio** | per repeat | step ratio "
        "| ours part memory (MiB) | TRL part memory (MiB) | **part memory ratio** | memory ratio | calibration (s/run) "
        "| kernels (training forwards) | equivalent |",
        "|---" * 15 + "|",
    ]
    rows = [(p["name"], p["comparison"]) for p in report["results"]]
    for name, r in rows + [
        (p["name"] + " **compiled**", p["compiled"]) for p in report["results"] if p.get("compiled")
    ]:
        o, t, e = r["ours"], r["trl"], r["equivalence"]
        d = e.get("direct") or {}
        check = ("yes" if e["equivalent"] else "NO") + (
            f" ({bc.fmt(d['logps_rel_l2'], '.1e')} / {bc.fmt(d['grads_rel_l2'], '.1e')})"
            if d.get("logps_rel_l2") is not None
            else ""
        )
        lines.append(
            f"| {name} | {o['repeats']} / {t['repeats']} | {bc.fmt(o['forwarded_token_ratio'], '.2f')} "
            f"| {_cell(o['train_s_spread'])} | {_cell(t['train_s_spread'])} | **{bc.fmt(r['train_ratio'])}** "
            f"| {_cell(r['train_ratio_per_repeat'])} | {bc.fmt(r['step_ratio'])} "
            f"| {_cell(o['train_part_peak_mib_spread'], '.0f')} | {_cell(t['train_part_peak_mib_spread'], '.0f')} "
            f"| **{bc.fmt(r['part_memory_ratio'])}** | {bc.fmt(r['memory_ratio'])} "
            f"| {_cell(r['calibration_s_per_run'], '.2f')} "
            f"| {_counts(dict(sorted(o.get('kernels', {}).items()))) or '-'} | {check} |"
        )
    lines += ["", "Per point: departures from each trainer's defaults, `auto`'s verdicts, the direct check:", ""]
    for point in report["results"]:
        lines += point_notes(point, c)
    return "\n".join(lines + tail_lines(report))


def point_notes(point: dict, c: dict) -> list[str]:
    """A point's departures, `auto`'s verdicts, the direct check and each run of ours."""
    r, o = point["comparison"], point["comparison"]["ours"]
    d = r["equivalence"].get("direct") or {}
    notes = [_counts(o.get("auto_verdicts") or {}) or "-"]
    if o.get("forwards_per_step"):
        notes.append(f"forwards per step {bc.fmt(o['forwards_per_step'], '.1f')}")
    if o.get("undecided_runs"):
        notes.append(
            f"{o['undecided_runs']} of {o['repeats']} runs never decided by their timed steps, counted apart: ours / "
            f"TRL over them {_cell(r.get('train_ratio_undecided_runs'))}"
        )
    check = ""
    if d.get("logps_rel_l2") is not None:
        check = (
            f". Direct check ({d.get('kernel')}, {d.get('dtype')}): log-probs {bc.fmt(d.get('logps_rel_l2'), '.1e')} "
            f"(tol {bc.fmt(d.get('logps_rtol'), '.1e')}), gradient {bc.fmt(d.get('grads_rel_l2'), '.1e')} "
            f"(tol {bc.fmt(d.get('grads_rtol'), '.1e')})"
        )
    elif d:
        check = f". Direct check: {d.get('error') or d.get('reason')}"
    lines = [f"- **{point['name']}**: {'; '.join(point['departures'])}.", f"  `auto`: {'; '.join(notes)}{check}."]
    for side, comparison in (("ours", r), ("ours compiled", point.get("compiled"))):
        for i, run in enumerate((comparison or {}).get("ours", {}).get("per_run", []), start=1):
            layouts = " | ".join(_counts(step) or "-" for step in run["timed_layouts"])
            lines.append(
                f"  - {side}, repeat {i}: verdict {_counts(run.get('verdicts') or {}) or '-'}; timed steps' layouts "
                f"[{layouts}]; train {bc.fmt(run['train_s'])} s"
                + ("" if run["decided"] else " (UNDECIDED: counted apart)")
            )
        lines += [f"  - compiled layers: {counts}" for counts in (comparison or {}).get("ours", {}).get("compiled", [])]
    ours_split, trl_split = o.get("phases_s") or {}, r["trl"].get("phases_s") or {}
    if ours_split:
        split = ", ".join(f"{p} {1e3 * v:.1f} / {1e3 * (trl_split.get(p) or 0):.1f}" for p, v in ours_split.items())
        lines.append(f"  Phases (`phases.PhaseTimer`; median ms, ours / TRL): {split}.")
    if c.get("part_timing"):
        lines.append(
            f"  Training part (the loss and backward phases; on CUDA on the device's clock): ours "
            f"{bc.fmt(o['train_part_s'])} s, TRL {bc.fmt(r['trl']['train_part_s'])} s, "
            f"ratio {bc.fmt(r['train_part_ratio'])}."
        )
    return lines


def tail_lines(report: dict) -> list[str]:
    """Issue 42's targets on CUDA; what was not measured, cut short, failed; the uncounted runs."""
    lines = ["", "Targets (issue 42, one GPU; `train` ratio, part memory ratio):", ""] * (
        report["config"]["device"] == "cuda"
    )
    for t in report["summary"]["cuda_targets"] if lines else []:
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        lines.append(f"- {t['point']} {t['metric']}: {bc.fmt(t['value'])} (target <= {t['bound']}): {met}")
    if report["not_measured"]:
        lines += ["", f"Not measured (no repeat finished): {', '.join(report['not_measured'])}."]
    if report.get("fewer_repeats"):
        cut = ", ".join(f"{k} ({n} finished)" for k, n in report["fewer_repeats"].items())
        lines += ["", f"Fewer repeats than asked (run cut short): {cut}."]
    for run in report.get("uncounted_runs", []):
        lines += [
            "",
            f"Uncounted run ({run['side']}, {run['point']}: warms the compile cache): "
            + (f"ERROR {run['error'][-300:]}" if run.get("error") else f"train {bc.fmt(run.get('train_s'))} s"),
        ]
    for f in report.get("failed_points", []):
        lines += ["", f"FAILED {f['point']}: {f['error'][-400:]}"]
    return lines + [""]


def summarise(results: list[dict]) -> dict:
    """Issue 42's targets (`CUDA_TARGETS`) against the points measured, and whether every point was equivalent."""
    by_key, targets = {r["key"]: r for r in results}, []
    for key, metric, bound in CUDA_TARGETS:
        value = by_key[key]["comparison"].get(metric) if key in by_key else None
        targets.append({"point": parse_point(key).name, "key": key, "metric": metric, "bound": bound, "value": value})
        targets[-1]["met"] = None if value is None else value <= bound
    equivalent = all(r["comparison"]["equivalence"]["equivalent"] for r in results)
    return {"all_equivalent": equivalent, "cuda_targets": targets}


def derive(report: dict) -> None:
    """The figures per point, from the parts' repeats (a repeat counts for a point when each of its sides finished;
    a point measured again in a later part, after ``--resume``, by its latest part): ``results`` (`compare`),
    ``summary`` (issue 42's targets), what failed, was not measured or was cut short, and the uncounted runs that
    warm the compile cache."""
    device = report["config"]["device"]
    memory_key = "cuda_peak_above_start_mib" if device == "cuda" else "train_peak_rss_above_start_mib"
    results, failed, counts, names, uncounted = {}, {}, {}, {}, []
    for part in report["parts"].values():
        for key, name in part.get("points", {}).items():
            samples = [[r["samples"].get(f"{key}/{side}") for side in part["sides"]] for r in part.get("repeats", [])]
            complete = [row for row in samples if all(harness.ok(x) for x in row)]
            error = next((x for row in samples for x in row if x is not None and not harness.ok(x)), None)
            names[key], counts[key] = name, (len(complete), part.get("repeats_asked", report["config"]["repeats"]))
            failed.pop(key, None)
            if error:
                failed[key] = {"point": name, "error": f"{error['error']}: {error['output_tail']}"}
            if complete:
                results[key] = point_entry(report, key, name, dict(zip(part["sides"], zip(*complete))), memory_key)
        for label, run in part.get("uncounted", {}).items():
            if label.startswith("ours_compiled"):
                summary = {"error": run["error"]} if not harness.ok(run) else run_summary(run)
                uncounted.append({"point": label.split(" at ")[-1], "side": "ours_compiled", **summary})
    report.update(
        results=list(results.values()),
        failed_points=list(failed.values()),
        not_measured=[names[k] for k, (n, _) in counts.items() if n == 0],
        fewer_repeats={names[k]: n for k, (n, asked) in counts.items() if 0 < n < asked},
        uncounted_runs=uncounted,
        memory_key=memory_key,
        targets=[list(t) for t in CUDA_TARGETS],
        summary=summarise(list(results.values())),
    )


def point_entry(report: dict, key: str, name: str, runs: dict, memory_key: str) -> dict:
    """A measured point: its figures (ours, and ours compiled where it ran, against TRL) and every run."""
    runs = {side: list(side_runs) for side, side_runs in runs.items()}
    point = parse_point(key)
    report.setdefault("models", {}).setdefault(point.model, {})["parameters"] = runs["ours"][0]["parameters"]
    entry = {"key": key, "name": name, **dataclasses.asdict(point), "repeats": len(runs["ours"])}
    entry |= {"departures": runs["ours"][0].get("departures", [])}
    entry["comparison"] = compare(runs["ours"], runs["trl"], memory_key)
    if "ours_compiled" in runs:
        entry["compiled"] = compare(runs["ours_compiled"], runs["trl"], memory_key)
    return entry | {"runs": runs}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default="cpu")
    add("--point-set", help=f"CUDA: comma-separated point sets of {', '.join(POINT_SETS)} (default target)")
    add("--points", nargs="+", metavar="MODEL:P:C:G[:kN][:gaN][:lora]", help="exactly these points (needed on CPU), "
        "e.g. qwen2.5-1.5b:1024:256:8 qwen2.5-1.5b:2048:512:8:ga4")  # fmt: skip
    add("--kernel", default="auto", choices=["auto", "varlen", "flash_attn", "flex", "sdpa_segments"])
    add("--resume", metavar="JSON", help="an earlier report: keep its points, run the others")
    add("--repeats", type=int, help="fresh-process runs per side per point (default 5 on CUDA, 1 CPU)")
    add("--steps", type=int, help="optimizer steps of ours per run (default: warm-up + timed steps)")
    add("--warmup", type=int, help="our untimed first steps: auto's calibration (default 7 CUDA, 1 CPU)")
    add("--trl-warmup", type=int, help="TRL's untimed first steps (default 2 on CUDA, 1 CPU)")
    add("--accumulation-warmup", type=int, default=3, help="our warm-up at gradient accumulation > 1")
    add("--timed-steps", type=int, help="timed steps per run (default 3 on CUDA, 1 CPU)")
    add("--threads", type=int, default=1, help="torch threads per run (1 on a shared 2-core machine)")
    add("--bf16", action="store_true")
    add("--learning-rate", type=float, help="both sides (default: each trainer's default)")
    add("--seed", type=int, default=0)
    add("--timeout", type=float, default=1800, help="seconds allowed per run")
    add("--quick", action="store_true", help="smoke setting: one tiny point, 2 steps")
    add("--rollout", choices=("generate", "fixed"), help="default: fixed on CUDA, generate on CPU")
    add("--activation-checkpointing", action=argparse.BooleanOptionalAction,
        help="both sides (default: the trainers' default on CUDA, on; off on CPU, our CPU default)")  # fmt: skip
    add("--optim", help="both sides' optimizer (TrainingArguments.optim); default the trainers'")
    add("--sides", help=f"comma-separated sides of {', '.join(SIDES)} (default ours,trl; ours_compiled: "
        "prefix_packing_compile, after one uncounted run that warms the compile cache)")  # fmt: skip
    add("--part-timing", action="store_true", help="also report the training part: the loss and backward phases")
    add("--no-fork", action="store_true", help="spawn each run from scratch (no forkserver)")
    add("--no-equivalence", action="store_true", help="skip the direct packed-vs-padded check")
    add("--break-packed", action="store_true", help=argparse.SUPPRESS)  # self-test of the check
    add("--out", default=os.environ.get("OUT") or "benchmarks/results", help="directory for the report (default "
        "$OUT where set, as on the lent GPU machine, else benchmarks/results)")  # fmt: skip
    return parser


def main(argv=None) -> int:
    args = (parser := build_parser()).parse_args(argv)
    points = settle(args, parser)
    name, config = "prefix_packing" + ("_cuda" if args.device == "cuda" else ""), vars(args).copy()
    options = {"title": "Prefix-shared packed training step vs TRL's `GRPOTrainer`", "render": markdown}
    options |= {"preload": () if args.no_fork else PRELOAD, "update": derive, "resume": args.resume}
    bench = harness.Bench(name, config.pop("out"), config=config, device=args.device, **options)
    done = {r["key"] for r in bench.report["results"]}
    points = [p for p in points if p.key not in done]  # a resumed report's measured points are kept
    label = "points" if args.points else args.point_set or "target"
    label += f" ({len(bench.report['parts']) + 1})" if label in bench.report["parts"] else ""
    about = f"{', '.join(p.name for p in points)}; {args.repeats} repeat(s) asked" if points else "nothing to measure"
    part = bench.part(label, description=about)
    part.record |= {"points": {p.key: p.name for p in points}, "sides": args.sides, "repeats_asked": args.repeats}
    with tempfile.TemporaryDirectory(prefix="prefix_packing_") as tmp:
        paths, sides = {}, []
        for model in dict.fromkeys(p.model for p in points):  # each model saved once, in a worker process
            spec = {"make_model": model, "model_dir": f"{tmp}/model_{model}", "threads": args.threads}
            spec |= {k: getattr(args, k) for k in ("device", "bf16", "seed")}
            made = part.run_once(harness.Side(f"model {model}", WORK, spec), f"model {model}")
            if not harness.ok(made):
                return bench.finish() or 1
            paths[model] = made["path"]
            bench.report.setdefault("models", {}).setdefault(model, {})["about"] = made["about"]
        for point in points:
            spec = point_spec(args, point, paths[point.model], output_dir=f"{tmp}/{point.key}")
            sides += [harness.Side(f"{point.key}/{s}", WORK, {**spec, "side": s}, {}, args.timeout) for s in args.sides]
        if "ours_compiled" in args.sides and points:  # the on-disk compile caches warmed by a first, uncounted run
            warm = next(s for s in sides if s.name.endswith("/ours_compiled"))
            part.run_once(warm, f"ours_compiled, uncounted: warms the compile cache, at {points[0].name}")
        part.run(sides, args.repeats)
    return bench.finish()


def settle(args, parser) -> list[Point]:
    """Fill the defaults that depend on the device and the setting, check the options; the points to measure."""
    cuda = args.device == "cuda"
    if args.quick:
        args.points, args.warmup, args.trl_warmup, args.timed_steps = ["tiny:32:8:4"], 1, 1, 1
    defaults = {"repeats": (5, 1), "warmup": (7, 1), "trl_warmup": (2, 1), "timed_steps": (3, 1)}
    for key in [key for key in defaults if getattr(args, key) is None]:
        setattr(args, key, defaults[key][0 if cuda else 1])
    args.rollout = args.rollout or ("fixed" if cuda else "generate")
    args.sides = [x.strip() for x in (args.sides or "ours,trl").split(",") if x.strip()]
    if set(args.sides) - set(SIDES) or not {"ours", "trl"} <= set(args.sides):
        parser.error(f"--sides takes ours, trl and optionally ours_compiled; got {args.sides}")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch.cuda.is_available() is False")
    elif not args.points:
        parser.error("on CPU give --points (or --quick); the CPU grid is retired (benchmarks/README.md)")
    names = (args.point_set or "target").split(",")
    if not args.points and set(names) - set(POINT_SETS):
        parser.error(f"--point-set takes {', '.join(POINT_SETS)}, got {names}")
    try:
        points = [parse_point(t) for t in args.points] if args.points else [p for n in names for p in POINT_SETS[n]]
    except ValueError as err:
        parser.error(str(err))
    if args.steps is not None and args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    return points


def point_spec(args, point: Point, model_path: str, output_dir: str) -> dict:
    """The worker's spec for ``point`` (steps and warm-up per side: ours until auto's calibration has decided)."""
    warmup = args.accumulation_warmup if point.accumulation > 1 else args.warmup
    spec = {"model": model_path, "steps": args.steps or warmup + args.timed_steps, "warmup": warmup}
    spec |= {k: getattr(args, k) for k in ("device", "threads", "bf16", "learning_rate", "seed", "kernel", "rollout")}
    spec |= {k: getattr(args, k) for k in ("optim", "part_timing", "break_packed")}
    spec |= {"prompt_len": point.prompt_len, "completion_len": point.completion_len, "lora": point.lora}
    spec |= {"generations": point.generations, "prompts_per_step": point.prompts, "accumulation": point.accumulation}
    ac = args.activation_checkpointing if args.device == "cuda" else bool(args.activation_checkpointing)
    spec |= {"point": point.name, "packing": True, "ac": ac, "equivalence": not args.no_equivalence}
    return spec | {"trl_warmup": min(args.trl_warmup, warmup), "output_dir": output_dir}


if __name__ == "__main__":
    raise SystemExit(main())
