#!/usr/bin/env python
"""Benchmark: the host work of the packed training forward on CPU, the GPU path's call sites included (issue 42).

On a GPU at TRL's default micro-batch (one group of 8 rows) the packed step is bound by the host: what Python and
the dispatcher do per layer (hooks, gathers, key/value copies, plan copies) rather than what the GPU computes. This
benchmark measures that host work where it can be measured every day, on CPU: a random model of the
Qwen2.5-1.5B LAYER STRUCTURE (28 layers, 12 query / 2 key-value heads) with tiny hidden sizes (hidden 48, head dim
4, intermediate 96, vocabulary 512), so that the arithmetic is small and the time is almost all per-op host work.

Sides, timed in the same process, one step of each in turn (the order alternating), after warm-up:

* ``packed``: `PrefixPacking` with the ``varlen`` kernel forced, exactly the call sites of the CUDA path (gathered
  keys, the GQA expansion of torch 2.11, which has no ``enable_gqa``; the plan's offsets; the routing hooks), with
  ``torch.nn.attention.varlen.varlen_attn`` replaced by a CPU stand-in with torch 2.11's signature, built as torch's
  (custom operators forward and backward, so the host pays their dispatch), which does no attention arithmetic (a
  GPU runs one kernel there; its time is the GPU's);
* ``packed_sdpa``: the CPU kernel (``sdpa_segments``, one SDPA per tree node), for reference;
* ``padded``: TRL's padded forward (the model's own ``sdpa`` over left-padded prompt + right-padded completion).

A step is the log-prob forward through TRL's fused LM head (activation checkpointing on, non-reentrant, as TRL's
default on a GPU), a sum of the completion log-probs as the loss, and its backward. Each worker also counts, on one
untimed packed step, the hooks installed, the host reads (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``) and
the aten operations dispatched (forward and backward): what the GPU would launch and the host would pay for.

``--code DIR`` imports ``trinity_trl`` from DIR instead of this checkout (e.g. an export of an older commit): a
before/after comparison runs both in fresh worker processes, alternating (``--code`` given twice, as ``NAME=DIR``);
each worker prints the ``trinity_trl`` it loaded, so an arm that did not take effect shows.

Run it niced from the repository root::

    nice -n 5 .venv/bin/python benchmarks/packing_host.py --out benchmarks/results
    git archive main trinity_trl | tar -x -C /tmp/before && \\
        nice -n 5 .venv/bin/python benchmarks/packing_host.py --code before=/tmp/before --code after=. \\
        --name packing_host_before_after --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports

#: the Qwen2.5-1.5B layer structure with tiny hidden sizes
SHAPE = {"layers": 28, "heads": 12, "kv_heads": 2, "hidden": 48, "intermediate": 96, "vocab": 512}
SIDES = ("packed", "packed_sdpa", "padded")


# ------------------------------------------------------------------------------------------ the stand-in
def _define_stand_in():
    """Register the stand-in's custom operators, built as torch's ``varlen_attn`` is (torch 2.11 and 2.13 alike): a
    Python function calling a ``torch.library.custom_op`` (``_varlen_attn``: output, log-sum-exp, RNG state) whose
    autograd formula calls a second one (``_varlen_attn_backward``), so that the host pays the custom operators'
    dispatch as on the GPU; their bodies do no attention arithmetic (a copy of the queries forward; the output
    gradient and zero key/value gradients backward, so that the gathers' backward runs)."""
    import torch

    @torch.library.custom_op(
        "trinity_bench::varlen_stand_in",
        mutates_args=(),
        schema="(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k, "
        "bool is_causal=False, float? scale=None, SymInt[]? window_size=None) -> (Tensor, Tensor, Tensor)",
    )
    def forward(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seq_q: torch.Tensor,
        cu_seq_k: torch.Tensor,
        max_q: int,
        max_k: int,
        is_causal: bool = False,
        scale: float | None = None,
        window_size: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse = torch.empty((query.shape[1], query.shape[0]), dtype=torch.float32, device=query.device)
        return query.clone(), lse, torch.zeros((2,), dtype=torch.uint64, device=query.device)

    @forward.register_fake
    def _(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None):
        lse = torch.empty((query.shape[1], query.shape[0]), dtype=torch.float32, device=query.device)
        return torch.empty_like(query), lse, torch.empty((2,), dtype=torch.uint64, device=query.device)

    @torch.library.custom_op(
        "trinity_bench::varlen_stand_in_backward",
        mutates_args=(),
        schema="(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor out) -> (Tensor, Tensor, Tensor)",
    )
    def backward_op(
        grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return grad.clone(), torch.zeros_like(key), torch.zeros_like(value)

    @backward_op.register_fake
    def _(grad, query, key, value, out):
        return torch.empty_like(grad), torch.empty_like(key), torch.empty_like(value)

    def setup_context(ctx, inputs, output):
        query, key, value = inputs[:3]
        ctx.save_for_backward(query, key, value, output[0])

    def backward(ctx, grad, grad_lse, grad_rng):
        query, key, value, out = ctx.saved_tensors
        dq, dk, dv = backward_op(grad, query, key, value, out)
        return dq, dk, dv, None, None, None, None, None, None, None

    forward.register_autograd(backward, setup_context=setup_context)
    return forward


def varlen_attn_2_11(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    k_cache=None,
    v_cache=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    page_table=None,
    seqused_k=None,
):
    """A CPU stand-in for torch 2.11's ``varlen_attn`` (its signature: no ``enable_gqa``), called exactly as the GPU
    path calls it; it checks what the GPU kernel needs (heads expanded, causal window, int32 offsets, Python-int
    maxima) and costs the host what the real one costs (the same custom-operator structure, see
    `_define_stand_in`), with no attention arithmetic: the time left is the packing code's host work and the model's
    (exactness is the tests' business: tests/packing/test_kernel_paths.py runs these call sites through an exact
    reference)."""
    import torch

    assert window_size == (-1, 0) and key.shape[1] == query.shape[1], "torch 2.11: causal, heads expanded"
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and type(max_q) is int and type(max_k) is int
    out, _, _ = STAND_IN(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, True, scale, list(window_size))
    return out


STAND_IN = None


# ---------------------------------------------------------------------------------------------- worker
def worker(spec: dict) -> dict:
    """Measure the sides of ``spec`` in this process; return the per-step times and the counts."""
    if spec.get("code"):
        sys.path.insert(0, str(Path(spec["code"]).resolve()))
    import contextlib
    import inspect

    import torch
    import torch.nn.attention.varlen as varlen_module
    import transformers
    from prefix_packing import qwen2_config
    from transformers import Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    import trinity_trl
    from trinity_trl.packing import KERNELS, PrefixPacking
    from trinity_trl.packing import kernels as kernels_module

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    global STAND_IN
    STAND_IN = _define_stand_in()
    varlen_attn_2_11.__signature__ = inspect.signature(varlen_attn_2_11)
    varlen_module.varlen_attn = varlen_attn_2_11  # the kernel reads its signature: torch 2.11's, no enable_gqa
    kernels_module._varlen_api.cache_clear()
    KERNELS["varlen"].unavailable = lambda device: None  # a CPU stands in for the CUDA device
    KERNELS["varlen"].dtypes = None  # and float32 for bf16 (the stand-in takes any dtype)

    s = spec["shape"]
    config = qwen2_config(s, s["vocab"], 8192, head_dim=s["hidden"] // s["heads"], attn_implementation="sdpa")
    torch.manual_seed(spec["seed"])
    model = Qwen2ForCausalLM(config)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs",))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    g, p, c, k = spec["generations"], spec["prompt_len"], spec["completion_len"], spec["prompts"]
    gen = torch.Generator().manual_seed(spec["seed"])
    rows = []
    for _ in range(k):
        prompt = torch.randint(3, s["vocab"], (p,), generator=gen)
        rows += [(prompt, torch.randint(3, s["vocab"], (c,), generator=gen)) for _ in range(g)]
    ids = torch.cat([torch.stack([pr for pr, _ in rows]), torch.stack([co for _, co in rows])], 1)
    mask = torch.ones_like(ids)

    packers = {
        side: PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, kernel=kernel)
        for side, kernel in (("packed", "varlen"), ("packed_sdpa", "sdpa_segments"))
    }

    def padded_logps():
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-c] = -100
        return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -c:]

    def step(side: str) -> None:
        model.zero_grad(set_to_none=True)
        if side == "padded":
            logps = padded_logps()
        else:
            out = packers[side].logps_and_entropies(model, ids, mask, c, None, False, False, {})
            if out is None:
                raise RuntimeError(f"{side}: the packed forward fell back to padded rows")
            logps = out.logps
        logps.sum().backward()

    sides = spec["sides"]
    for _ in range(spec["warmup"]):
        for side in sides:
            step(side)
    counts = {side: count_host_work(lambda side=side: step(side)) for side in sides}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(spec["steps"]):
        for side in sides if r % 2 == 0 else tuple(reversed(sides)):
            start = time.perf_counter()
            step(side)
            times[side].append(time.perf_counter() - start)
    packed_tokens = None
    with torch.no_grad():
        out = packers["packed"].logps_and_entropies(model, ids, mask, c, None, False, False, {}) if sides else None
        packed_tokens = out.forwarded if out is not None else None
    return {
        "trinity_trl": trinity_trl.__file__,
        "times": times,
        "counts": counts,
        "padded_tokens": int(ids.numel()),
        "packed_tokens": packed_tokens,
        "torch": torch.__version__,
    }


def count_host_work(run) -> dict:
    """What one call of ``run`` does that a CPU can see: hooks installed on modules, host reads of tensors
    (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``int()``/``float()``/``bool()`` of a tensor: each a device
    synchronisation on a GPU) and aten operations dispatched (forward and backward: each a launch or more on a
    GPU)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"hook_installs": 0, "host_reads": 0, "host_tensors": 0, "aten_ops": 0}
    originals = {}

    def wrap(owner, name, count):
        original = getattr(owner, name)
        originals[(owner, name)] = original

        def counted(self, *a, **kw):
            out = original(self, *a, **kw)
            count(self, out, name)
            return out

        setattr(owner, name, counted)

    def hook(module, out, name):
        counts["hook_installs"] += 1

    def read(tensor, out, name):  # .numpy() of what a counted .cpu() returned is the same read (tests/packing)
        if name == "numpy" and getattr(tensor, "_counted_read", False):
            return
        counts["host_reads"] += 1
        if name == "cpu":
            out._counted_read = True

    for name in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook"):
        wrap(torch.nn.Module, name, hook)
    for name in ("tolist", "numpy", "cpu"):  # not dispatched: seen at the Python level
        wrap(torch.Tensor, name, read)
    aten = torch.ops.aten
    reads = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["aten_ops"] += 1
            if func in reads or (
                func is aten.index.Tensor
                and any(getattr(i, "dtype", None) == torch.bool for i in args[1] if i is not None)
            ):
                counts["host_reads"] += 1  # a value or a data-dependent shape read on the host
            elif func is aten.lift_fresh.default:
                counts["host_tensors"] += 1  # a tensor made from host data: a host-to-device copy on a GPU
            return func(*args, **(kwargs or {}))

    try:
        with Ops():
            run()
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    return counts


# ---------------------------------------------------------------------------------------------- driver
def run_worker(spec: dict, tmp: Path, index: int, timeout: float) -> dict:
    path, result = tmp / f"spec{index}.json", tmp / f"result{index}.json"
    path.write_text(json.dumps(dict(spec, result=str(result))))
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"])},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {index} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def summarise(runs: list[dict], sides: tuple[str, ...]) -> dict:
    """Per side: the median over workers of each worker's median step, its min and max; the ratios to padded."""
    out = {}
    for side in sides:
        medians = [bc.median(r["times"][side]) for r in runs]
        out[side] = {
            "median_s": bc.median(medians),
            "min_s": min(medians),
            "max_s": max(medians),
            "per_worker_s": medians,
            "counts": runs[0]["counts"][side],
        }
    if "padded" in out:
        for side in sides:
            ratios = [bc.ratio(bc.median(r["times"][side]), bc.median(r["times"]["padded"])) for r in runs]
            out[side]["ratio_to_padded"] = bc.median(ratios)
            out[side]["ratio_to_padded_min_max"] = [min(ratios), max(ratios)]
    out["packed_tokens"] = runs[0]["packed_tokens"]
    out["padded_tokens"] = runs[0]["padded_tokens"]
    out["trinity_trl"] = sorted({r["trinity_trl"] for r in runs})
    return out


def markdown(report: dict) -> str:
    c, m = report["config"], report["machine"]
    arms = list(report["arms"])
    lines = [
        "# Host work of the packed training forward (CPU stand-in for the GPU path)",
        "",
        f"Command: `{report['command']}`",
        "",
        bc.machine_line(m),
        f"Load average (1/5/15 min): {report['load_average_start']} at start, {report['load_average_end']} at end.",
        "",
        f"Model: random Qwen2, {c['shape']['layers']} layers, {c['shape']['heads']} query / {c['shape']['kv_heads']} "
        f"key-value heads (the Qwen2.5-1.5B layer structure), hidden {c['shape']['hidden']}, intermediate "
        f"{c['shape']['intermediate']}, vocabulary {c['shape']['vocab']}, float32, activation checkpointing on "
        f"(non-reentrant), TRL's fused LM head. Micro-batch: {c['prompts']} prompt(s) of {c['prompt_len']} tokens x "
        f"{c['generations']} completions of {c['completion_len']} tokens. A step: the log-prob forward, a sum as the "
        "loss, its backward. `packed`: the `varlen` kernel's call sites (torch 2.11's signature, no `enable_gqa`) "
        "with a CPU stand-in for `varlen_attn` built as torch's (custom operators forward and backward) that does no "
        "attention arithmetic; `packed_sdpa`: the CPU kernel; `padded`: TRL's "
        f"padded rows. {c['repeats']} worker process(es) per arm, arms alternating; per worker {c['warmup']} warm-up "
        f"steps per side, then {c['steps']} timed steps per side, sides alternating. Figures: median over workers of "
        "each worker's median step (min-max over workers).",
        "",
        "| arm | side | step (s), median (min-max) | / padded, median (min-max) | aten ops per step | host reads "
        "per step | tensors from host data per step | hooks installed per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        a = report["arms"][arm]
        for side in c["sides"]:
            x = a[side]
            ratio = x.get("ratio_to_padded")
            lo_hi = x.get("ratio_to_padded_min_max") or [None, None]
            lines.append(
                f"| {arm} | {side} | {bc.fmt(x['median_s'], '.4f')} ({bc.fmt(x['min_s'], '.4f')}-"
                f"{bc.fmt(x['max_s'], '.4f')}) | {bc.fmt(ratio)} ({bc.fmt(lo_hi[0])}-{bc.fmt(lo_hi[1])}) "
                f"| {x['counts']['aten_ops']} | {x['counts']['host_reads']} | {x['counts']['host_tensors']} "
                f"| {x['counts']['hook_installs']} |"
            )
    first = report["arms"][arms[0]]
    lines += [
        "",
        f"Tokens: packed {first['packed_tokens']}, padded {first['padded_tokens']}.",
        "",
        "Code of each arm (the `trinity_trl` its workers imported): "
        + "; ".join(f"{arm}: `{', '.join(report['arms'][arm]['trinity_trl'])}`" for arm in arms),
    ]
    if len(arms) == 2 and "packed" in c["sides"]:
        a, b = (report["arms"][x]["packed"]["median_s"] for x in arms)
        ra, rb = (report["arms"][x]["packed"].get("ratio_to_padded") for x in arms)
        lines += [
            "",
            f"Packed step, {arms[1]} / {arms[0]}: {bc.fmt(bc.ratio(b, a))} (medians of separate processes); packed / "
            f"padded within a process: {bc.fmt(ra)} ({arms[0]}) and {bc.fmt(rb)} ({arms[1]}), the comparison a "
            "changing load affects least (both sides of it ran interleaved in one process). With the load average "
            "above the core count, as here when it is, single steps vary by several times: the counts (exact, the "
            "same in every run) are what compares the versions.",
        ]
    lines += ["", f"Total wall time {report['total_wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--code", action="append", metavar="[NAME=]DIR", help="import trinity_trl from DIR")
    parser.add_argument("--repeats", type=int, default=5, help="worker processes per arm (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side per worker (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=1, help="prompts (groups) per micro-batch")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--name", default="packing_host", help="report name (default packing_host)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["result"]).write_text(json.dumps(worker(spec)))
        return 0
    arms = {}
    for text in args.code or [""]:
        name, _, path = text.rpartition("=") if "=" in text else ("", "", text)
        arms[name or (Path(path).name if path else "this checkout")] = path or None
    started, load_start = time.perf_counter(), bc.loadavg()
    base = {
        "shape": SHAPE,
        "sides": args.sides,
        "steps": args.steps,
        "warmup": args.warmup,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "generations": args.generations,
        "prompts": args.prompts,
        "threads": args.threads,
        "seed": args.seed,
    }
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="packing_host_") as tmp:
        index = 0
        for rep in range(args.repeats):
            order = list(arms) if rep % 2 == 0 else list(reversed(arms))
            for arm in order:
                index += 1
                result = run_worker(dict(base, code=arms[arm]), Path(tmp), index, args.timeout)
                runs[arm].append(result)
                medians = {side: bc.fmt(bc.median(t), ".4f") for side, t in result["times"].items()}
                print(f"[rep {rep + 1}/{args.repeats}] {arm}: {medians} ({result['trinity_trl']})", flush=True)
    command = " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])])
    report = {
        "benchmark": args.name,
        "command": command,
        "machine": bc.machine_description("cpu") | {"torch_threads": args.threads},
        "load_average_start": load_start,
        "load_average_end": bc.loadavg(),
        "config": {**base, "repeats": args.repeats, "arms": arms},
        "arms": {arm: summarise(r, tuple(args.sides)) for arm, r in runs.items()},
        "runs": runs,
        "total_wall_s": time.perf_counter() - started,
    }
    bc.write_report(args.out, args.name, report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
