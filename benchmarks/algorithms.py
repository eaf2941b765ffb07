#!/usr/bin/env python
"""Benchmark: cost of every registered algorithm component against the model's own forward + backward.

Times, on synthetic tensors of realistic size, every key of ``POLICY_LOSS_FN``, ``KL_FN``, ``ENTROPY_LOSS_FN`` (the
call as the trainers make it, + ``backward()``) and ``ADVANTAGE_FN`` (no grad) in ``trinity_trl.algorithms``, built
with its ``default_args()``, against one forward + backward of SmolLM2-135M measured on a slice and scaled linearly
per token (the percentages are upper bounds). What it builds, the options and the latest figures:
benchmarks/README.md (`algorithms.py`); components whose inputs it cannot build are skipped and listed with why.

    nice -n 5 .venv/bin/python benchmarks/algorithms.py --out benchmarks/results
    nice -n 5 .venv/bin/python benchmarks/algorithms.py --quick --out /tmp/bench
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports
import torch

TARGET_PERCENT = 2.0

# SmolLM2-135M-Instruct (LlamaForCausalLM), used when the bundled checkpoint is not installed
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9}
SMOLLM2_135M |= {"num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192}
SMOLLM2_135M |= {"tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu"}
TINY_LLAMA = {**SMOLLM2_135M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
TINY_LLAMA |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}


# ------------------------------------------------------------------------------------- timing
def time_call(fn, reps: int, warmup: int, setup=tuple) -> dict:
    """Median / min / max wall seconds of ``fn(*setup())`` over ``reps`` calls after ``warmup`` calls (``setup``
    untimed)."""
    samples = []
    for rep in range(warmup + reps):
        args = setup()
        start = time.perf_counter()
        fn(*args)
        if rep >= warmup:
            samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples)}


# ----------------------------------------------------------------------------------- inputs
def token_batch(batch: int, length: int, seed: int) -> dict:
    """Per-token inputs of a training micro-batch: ragged masks (each row keeps 50-100 % of ``length``),
    log-probs in (-3, 0), an off-policy behaviour policy, a reference, a teacher, per-row advantages,
    a quarter of the rows expert (CHORD / MIX), entropies."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    logprob = -3.0 * torch.rand(batch, length, generator=g)
    advantages = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    return {
        "logprob": logprob,
        "old_logprob": logprob + 0.1 * torch.randn(batch, length, generator=g),
        "ref_logprob": logprob + 0.2 * torch.randn(batch, length, generator=g),
        "teacher_logprobs": logprob + 0.3 * torch.randn(batch, length, generator=g),
        "action_mask": mask,
        "advantages": advantages,
        "expert_mask": torch.arange(batch) < max(1, batch // 4),
        "step": torch.ones(batch, dtype=torch.long),
        "entropy": 3.0 * torch.rand(batch, length, generator=g),
    }


def loss_inputs(base: dict) -> dict:
    """Fresh leaf tensors requiring grad for what gets a gradient in training (log-probs, entropies)."""
    inputs = dict(base)
    inputs["logprob"] = base["logprob"].clone().requires_grad_(True)
    inputs["entropy"] = base["entropy"].clone().requires_grad_(True)
    return inputs


def experiences(num: int, groups: int, response_len: int, seed: int):
    """``num`` experiences in ``groups`` tasks (``num // groups`` runs each), rewards in {0, 0.5, 1} + noise.
    Run ``r`` of a task is step ``r % 2`` of run ``r // 2`` so step-wise GRPO sees two-step runs."""
    from trinity_trl.algorithms import EID, Experience

    g = torch.Generator().manual_seed(seed)
    rewards = (torch.randint(0, 3, (num,), generator=g).float() / 2 + 0.01 * torch.randn(num, generator=g)).tolist()
    logprobs = -torch.rand(num, response_len, generator=g)
    tokens = torch.zeros(16 + response_len, dtype=torch.long)
    per_group = num // groups
    out = []
    for i in range(num):
        task, k = divmod(i, per_group)
        out.append(
            Experience(
                eid=EID(batch=0, task=task, run=k // 2, step=k % 2),
                tokens=tokens,
                prompt_length=16,
                reward=rewards[i],
                logprobs=logprobs[i],
                teacher_logprobs=logprobs[i] - 0.1,
            )
        )
    return out


def batch_inputs(batch: int, length: int, group_size: int, seed: int) -> dict:
    """A trainer-side advantage batch: token-level rewards (score at each row's last token), masks,
    group ids, critic values, behaviour / reference / teacher log-probs, greedy baselines (ReMax)."""
    from trinity_trl.algorithms.advantage import scalar_rewards_to_token_level

    base = token_batch(batch, length, seed)
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.randint(0, 2, (batch,), generator=g).float()
    return {
        "token_level_rewards": scalar_rewards_to_token_level(scores, base["action_mask"]),
        "response_mask": base["action_mask"],
        "uid": torch.arange(batch) // group_size,
        "values": 0.1 * torch.randn(batch, length, generator=g),
        "old_log_probs": base["old_logprob"],
        "ref_log_prob": base["ref_logprob"],
        "teacher_logprobs": base["teacher_logprobs"],
        "reward_baselines": torch.rand(batch, generator=g),
    }


# ----------------------------------------------------------------------------- components
def bench_components(label: str, registry, call, base: dict, reps: int, warmup: int, **fixed):
    """Every component of ``registry``, built with its default arguments (and ``fixed``): ``call(fn, inputs)``
    (its loss) timed without gradients, and with its backward on fresh inputs. A policy loss (``label``
    ``"policy loss"``) is timed on fresh inputs both ways and must give a loss to differentiate. A component whose
    inputs do not fit is listed in ``skipped`` with why."""
    policy = label == "policy loss"
    results, skipped = {}, {}
    for name in registry.names():
        cls = registry.get(name)
        args = {**cls.default_args(), **fixed}
        try:
            fn = cls(**args)

            def forward(fn=fn):
                with torch.no_grad():
                    call(fn, loss_inputs(base) if policy else base)

            def forward_backward(fn=fn):
                loss = call(fn, loss_inputs(base))
                if policy or (isinstance(loss, torch.Tensor) and loss.requires_grad):
                    loss.backward()

            forward_backward()  # fails here (and is skipped) if the inputs do not fit
            results[name] = {
                "forward": time_call(forward, reps, warmup),
                "forward_backward": time_call(forward_backward, reps, warmup),
                "args": args,
            }
        except Exception as err:  # noqa: BLE001 (reported, not hidden)
            skipped[name] = f"{type(err).__name__}: {err}"
        print(f"{label} {name}: {_short(results.get(name), skipped.get(name))}", flush=True)
    return results, skipped


def policy_loss_of(fn, inputs: dict):
    return fn.evaluate(**inputs)[0]


def kl_loss_of(fn, inputs: dict):
    keys = ("logprob", "ref_logprob", "action_mask")
    return fn.calculate_kl_loss(*(inputs[k] for k in keys), "token-mean", old_logprob=inputs["old_logprob"])[0]


def entropy_loss_of(fn, inputs: dict):
    keys = ("entropy", "action_mask", "expert_mask")
    return fn(**{k: inputs[k] for k in keys}, loss_agg_mode="token-mean")[0]


def bench_advantages(args, token_shape: tuple[int, int]) -> tuple[dict, dict]:
    from trinity_trl.algorithms import ADVANTAGE_FN

    results, skipped = {}, {}
    group_size = args.experiences // args.groups
    exp_shape = (args.experiences, args.groups, args.experience_len)
    batches = {"tokens": (token_shape, batch_inputs(*token_shape, args.token_group_size, args.seed))}
    exp_tokens = (args.experiences, args.experience_len)
    batches["experiences"] = (exp_tokens, batch_inputs(*exp_tokens, group_size, args.seed))
    for name in ADVANTAGE_FN.names():
        cls = ADVANTAGE_FN.get(name)
        try:
            fn = cls(**cls.default_args())
            if cls.compute_in_trainer():
                for label, (shape, batch) in batches.items():

                    def call(fn=fn, batch=batch):
                        with torch.no_grad():
                            fn(dict(batch))

                    call()
                    size = args.token_group_size if label == "tokens" else group_size
                    entry = {"kind": "batch", "name": name, "shape": list(shape), "tokens": shape[0] * shape[1]}
                    entry |= {"group_size": size, "time": time_call(call, args.reps, args.warmup)}
                    results[f"{name} [{label}]"] = entry | {"args": cls.default_args()}
            else:  # each call on fresh experiences, made before it is timed
                seeds = iter(range(args.seed, args.seed + args.warmup + args.reps))
                with torch.no_grad():
                    timed = time_call(fn, args.reps, args.warmup, lambda s=seeds: (experiences(*exp_shape, next(s)),))
                shape = [args.experiences, args.experience_len]
                results[name] = {"kind": "group", "name": name, "shape": shape, "tokens": shape[0] * shape[1]}
                results[name] |= {"group_size": group_size, "time": timed, "args": cls.default_args()}
        except Exception as err:  # noqa: BLE001
            skipped[name] = f"{type(err).__name__}: {err}"
        for key in [k for k in results if results[k]["name"] == name]:
            print(f"advantage {key}: {results[key]['time']['median_s'] * 1e3:.2f} ms", flush=True)
        if name in skipped:
            print(f"advantage {name}: skipped ({skipped[name]})", flush=True)
    return results, skipped


def _short(result, error) -> str:
    if result is None:
        return f"skipped ({error})"
    return (
        f"forward {result['forward']['median_s'] * 1e3:.2f} ms, "
        f"forward+backward {result['forward_backward']['median_s'] * 1e3:.2f} ms"
    )


# ---------------------------------------------------------------------------------- model
def model_config(which: str):
    from transformers import LlamaConfig

    if which == "tiny":
        return LlamaConfig(**TINY_LLAMA), "tiny Llama (hidden 64, 2 layers, vocab 512; smoke runs only)"
    try:
        from transformers import AutoConfig

        from trinity_trl.data import bundled_model_dir

        return AutoConfig.from_pretrained(bundled_model_dir()), "SmolLM2-135M-Instruct config (bundled), random weights"
    except Exception:  # noqa: BLE001 (the bundled model is optional here: its config is known)
        return LlamaConfig(**SMOLLM2_135M), "SmolLM2-135M-Instruct config (built in), random weights"


def bench_model(args) -> dict:
    """Forward + backward (next-token cross-entropy) of the reference model on a ``batch x length`` slice."""
    from transformers import AutoModelForCausalLM

    config, description = model_config(args.model_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.model_batch, args.model_len), generator=g)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    print(f"model: {description}, {args.model_batch} x {args.model_len} tokens ...", flush=True)
    timing = time_call(forward_backward, args.model_reps, args.model_warmup)
    tokens = args.model_batch * args.model_len
    seconds = timing["median_s"]
    print(f"model forward+backward: {seconds:.2f} s ({seconds / tokens * 1e3:.3f} ms/token)", flush=True)
    parameters = sum(p.numel() for p in model.parameters())
    out = {"description": description, "parameters": parameters, "batch": args.model_batch, "length": args.model_len}
    return out | {"tokens": tokens, "forward_backward": timing, "seconds_per_token": seconds / tokens}


# ------------------------------------------------------------------------------- reporting
def percent(seconds: float, tokens: int, model: dict) -> float:
    return 100.0 * seconds / (model["seconds_per_token"] * tokens)


def markdown(report: dict) -> str:
    c, m, model = report["config"], report["machine"], report["model"]
    tokens = c["batch"] * c["length"]
    model_on_batch = model["seconds_per_token"] * tokens
    lines = [
        "# Cost of the algorithm components against the model's forward + backward",
        "",
        f"{'**Quick setting** (smoke run, not for conclusions). ' if c['quick'] else ''}Command: `{report['command']}`",
        "",
        bc.machine_line(m),
        f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end "
        f"(on {m['os_cpu_count']} cores).",
        "",
        f"Reference: {model['description']} ({model['parameters'] / 1e6:.1f}M parameters, fp32), forward + "
        f"backward with a next-token cross-entropy, measured on {model['batch']} x {model['length']} tokens: "
        f"{model['forward_backward']['median_s']:.2f} s (median of {c['model_reps']}), "
        f"i.e. {model['seconds_per_token'] * 1e3:.3f} ms per token, **scaled linearly** to each component's "
        f"tokens (for {c['batch']} x {c['length']} = {tokens} tokens: {model_on_batch:.0f} s). Attention grows "
        "faster than linearly with length, so at 4096 tokens the real model costs more than this and the "
        f"percentages below are upper bounds. Target: every loss below {TARGET_PERCENT:g} % of the model.",
        "",
        f"Losses, KL and entropy terms on {c['batch']} x {c['length']} tokens (ragged masks, a quarter of the rows "
        f"expert), default arguments; `forward` = the call under no_grad, `fwd+bwd` = the call + "
        f"`loss.backward()` (median of {c['reps']} after {c['warmup']} warm-up):",
        "",
        "| component | key | forward (ms) | fwd+bwd (ms) | % of model fwd+bwd | < 2 % |",
        "|---|---|---|---|---|---|",
    ]
    for family, label in (("policy_loss", "policy loss"), ("kl", "KL"), ("entropy", "entropy")):
        for name, r in report["results"][family].items():
            fb = r["forward_backward"]["median_s"]
            share = percent(fb, tokens, model)
            lines.append(
                f"| {label} | `{name}` | {r['forward']['median_s'] * 1e3:.2f} | {fb * 1e3:.2f} "
                f"| {share:.4f} | {'yes' if share < TARGET_PERCENT else '**no**'} |"
            )
    lines += [
        "",
        f"Advantage functions (no grad; once per generation batch): group operators on {c['experiences']} "
        f"experiences in {c['groups']} groups ({c['experience_len']}-token responses); batch functions on the "
        f"{c['batch']} x {c['length']} token batch (groups of {c['token_group_size']} rows) and on the experiences' "
        f"shape ({c['experiences']} x {c['experience_len']}, {c['groups']} groups):",
        "",
        "| key | kind | shape | time (ms) | % of model fwd+bwd on those tokens |",
        "|---|---|---|---|---|",
    ]
    for key, r in report["results"]["advantage"].items():
        t = r["time"]["median_s"]
        lines.append(
            f"| `{key}` | {r['kind']} | {r['shape'][0]} x {r['shape'][1]} | {t * 1e3:.2f} "
            f"| {percent(t, r['tokens'], model):.4f} |"
        )
    skipped = report["skipped"]
    lines += [
        "",
        "Skipped (inputs this script cannot build with default arguments): "
        + ("; ".join(f"`{k}` ({v})" for fam in skipped.values() for k, v in fam.items()) or "none")
        + ".",
        "",
    ]
    worst = report["summary"]
    lines += [
        f"Largest loss share: `{worst['worst_loss']}` at {worst['worst_loss_percent']:.4f} % of the model "
        f"(target < {TARGET_PERCENT:g} %: {'met' if worst['target_met'] else 'NOT met'}).",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="rows of the loss / KL / token-advantage batch")
    parser.add_argument("--length", type=int, default=4096, help="tokens per row of that batch")
    parser.add_argument("--token-group-size", type=int, default=8, help="group size of the token batch (uid)")
    parser.add_argument("--experiences", type=int, default=10000)
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--experience-len", type=int, default=128, help="response tokens per experience")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model-config", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--model-batch", type=int, default=1)
    parser.add_argument("--model-len", type=int, default=1024)
    parser.add_argument("--model-reps", type=int, default=3)
    parser.add_argument("--model-warmup", type=int, default=1)
    threads = "torch.set_num_threads (1: steadier on shared cores; the same for every measurement)"
    parser.add_argument("--threads", type=int, default=1, help=threads)
    parser.add_argument("--seed", type=int, default=0)
    quick = "small setting: 8 x 512 tokens, 1000 experiences in 100 groups, model on 1 x 128, 2 reps"
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", default="benchmarks/results", help="directory for algorithms.json / .md")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.length, args.experiences, args.groups = 8, 512, 1000, 100
        args.reps, args.model_len, args.model_reps = 2, 128, 1
    if args.experiences % args.groups or args.experiences // args.groups < 2:
        parser.error("--experiences must be a multiple of --groups with at least 2 per group")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    started, load_start = time.perf_counter(), bc.loadavg()

    base = token_batch(args.batch, args.length, args.seed)
    results, skipped = {}, {}
    from trinity_trl.algorithms import ENTROPY_LOSS_FN, KL_FN, POLICY_LOSS_FN

    for key, label, registry, call, fixed in (
        ("policy_loss", "policy loss", POLICY_LOSS_FN, policy_loss_of, {}),
        ("kl", "KL", KL_FN, kl_loss_of, {}),
        ("entropy", "entropy", ENTROPY_LOSS_FN, entropy_loss_of, {"entropy_coef": 0.001}),
    ):
        results[key], skipped[key] = bench_components(label, registry, call, base, args.reps, args.warmup, **fixed)
    results["advantage"], skipped["advantage"] = bench_advantages(args, (args.batch, args.length))
    model = bench_model(args)

    tokens = args.batch * args.length
    shares = {
        family: {name: percent(r["forward_backward"]["median_s"], tokens, model) for name, r in results[family].items()}
        for family in ("policy_loss", "kl", "entropy")
    }
    shares["advantage"] = {
        k: percent(r["time"]["median_s"], r["tokens"], model) for k, r in results["advantage"].items()
    }
    worst = max(shares["policy_loss"], key=shares["policy_loss"].get)
    report = {
        "benchmark": "algorithms",
        "command": " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])]),
        "machine": bc.machine_description("cpu"),
        "load_average_start": load_start,
        "load_average_end": bc.loadavg(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "model": model,
        "results": results,
        "skipped": skipped,
        "percent_of_model": shares,
        "summary": {"worst_loss": worst, "worst_loss_percent": shares["policy_loss"][worst]},
        "total_wall_s": time.perf_counter() - started,
    }
    report["summary"] |= {"target_percent": TARGET_PERCENT, "target_met": shares["policy_loss"][worst] < TARGET_PERCENT}
    bc.write_report(args.out, "algorithms", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
