#!/usr/bin/env python
"""Where the packed training pass's time goes on a GPU, and what the host's floor is (issue 53): ONE process, the
models built on the device (nothing on disk), a result line written after every measurement, each part skipped (or
cut) once its time mark has passed, at most 90 s in all on an H200 (``make gpu-check``'s ``profile`` part:
docs/prefix-packing.md#the-gpu-check).

Parts, in this order (marks in `MARKS`): ``launch`` (the host's cost of one kernel launch and of one module call),
``passes`` (one training pass per model, point and layout, packed with ``varlen`` or padded: host enqueue time
against event span and GPU busy time, launches, syncs; the profiler's top kernels and host operations at 1.5B
1024/256) and ``steps`` (one trainer step per side split into phases by `phases.PhaseTimer`: ours padded, TRL's,
ours packed). Results: ``packing_profile_cuda.{json,md}`` in ``--out`` (``$OUT`` on the lent machine;
``packing_profile.{json,md}`` on CPU) through `harness.Bench`. On CPU (``--dry-run``, a test) the same code runs tiny
shapes (no CUDA activity: launches and GPU time are not measured)::

    python benchmarks/packing_profile.py --device cuda          # on the GPU machine (make gpu-check's first part)
    python benchmarks/packing_profile.py --dry-run              # here, on CPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports
import harness

#: CUDA runtime/driver calls that launch a kernel
LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
)
#: CUDA runtime calls that make the host wait for the device
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaMemcpy")
#: packages a sync warning's stack is shortened to
PACKAGES = ("trinity_trl", "trl", "transformers", "accelerate", "peft", "torch")
REAL_VOCAB = 151936
G = 8
#: the models of the ``passes`` part (and ``1.5B`` for ``steps``); a dry run's tiny stand-ins
SHAPES = {
    "twin": {"hidden": 128, "layers": 28, "heads": 2, "kv_heads": 1, "intermediate": 256, "vocab": REAL_VOCAB},
    "1.5B": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960, "vocab": REAL_VOCAB},
}
DRY_SHAPES = {
    "twin": {"hidden": 32, "layers": 4, "heads": 2, "kv_heads": 1, "intermediate": 64, "vocab": 512},
    "1.5B": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512},
}
POINTS = ((1024, 256), (2048, 512))
DRY_POINTS = ((32, 8),)
#: each part's time mark (seconds since the start): a part starts nothing after it. 90 s in all on an H200: `launch`
#: takes about 2 s, `passes` about 5 s for the twin and 20-30 s for 1.5B (its model built once), `steps` 10-15 s a side
MARKS = {"launch": 10.0, "passes": 50.0, "steps": 82.0}
#: a dry run's marks are this many times larger (a loaded 2-core machine)
DRY_RUN_SLACK = 20
SIDES = ("ours_padded", "trl", "ours")


# ------------------------------------------------------------------------------------------------ measurements
class Syncs:
    """``torch.cuda.set_sync_debug_mode("warn")``'s warnings while open, each counted with the stack that made it."""

    def __init__(self, cuda: bool):
        self.cuda, self.seen = cuda, collections.Counter()

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record  # catch_warnings puts the previous one back
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None):
        text = str(message).splitlines()[0][:160]
        if "synchroniz" not in text.lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if any(f"/{p}/" in f.filename for p in PACKAGES[:5])]
        stack = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed((ours or frames)[-4:]))
        self.seen[(text, stack)] += 1

    def __exit__(self, *exc):
        if self.cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        return False

    @property
    def count(self) -> int:
        return sum(self.seen.values())


def _short(path: str) -> str:
    for package in PACKAGES:
        marker = f"/{package}/"
        if marker in path:
            return package + "/" + path.split(marker, 1)[1]
    return path.rsplit("/", 2)[-1]


def profile_summary(prof, layers: int, top: int = 0) -> dict:
    """What one profiled pass did: GPU busy time, kernels run, launches (per layer), aten operations, host reads,
    synchronising runtime calls; with ``top``, the top kernels, host operations and runtime calls."""
    from torch.autograd import DeviceType

    host, runtime, kernels = [], [], []
    for e in prof.key_averages():
        if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CUDA:
            kernels.append({"name": e.key[:120], "count": e.count, "ms": getattr(e, "self_device_time_total", 0) / 1e3})
        elif e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
            runtime.append({"name": e.key, "count": e.count, "ms": e.self_cpu_time_total / 1e3})
        else:
            host.append({"name": e.key[:120], "count": e.count, "self_ms": e.self_cpu_time_total / 1e3})
    for rows, key in ((host, "self_ms"), (runtime, "ms"), (kernels, "ms")):
        rows.sort(key=lambda x: -x[key])
    launches = sum(r["count"] for r in runtime if r["name"] in LAUNCHES)
    aten = [h for h in host if h["name"].startswith("aten::")]
    out = {
        "gpu_busy_ms": sum(k["ms"] for k in kernels) if kernels else None,
        "kernels_run": sum(k["count"] for k in kernels),
        "launches": launches,
        "launches_per_layer": launches / max(layers, 1),
        "aten_ops": sum(h["count"] for h in aten),
        "host_reads": sum(h["count"] for h in aten if h["name"] == "aten::_local_scalar_dense"),
        "sync_calls": sum(r["count"] for r in runtime if r["name"] in SYNCS or "Synchronize" in r["name"]),
    }
    if top:
        out.update(top_kernels=kernels[:top], top_host_ops=host[:top], runtime_calls=runtime[:top])
    return out


def launch_costs(device: str, n: int) -> dict:
    """Host microseconds per kernel launch and per module call (see the module docs)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    x = torch.zeros(1, device=device)
    for _ in range(100):  # warm: the allocator, the kernel's first load
        x.add_(1)
    sync()
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    enqueued = time.perf_counter() - start
    sync()
    drained = time.perf_counter() - start
    empty, hooked = torch.nn.Identity(), torch.nn.Identity()
    hooked.register_forward_hook(lambda module, args, output: None)
    calls = {}
    for name, module in (("module_call_us", empty), ("hooked_module_call_us", hooked)):
        start = time.perf_counter()
        for _ in range(n):
            module(x)
        calls[name] = (time.perf_counter() - start) / n * 1e6
    # launch_drained_us: enqueue, then the device's queue emptied: per launch
    return {"launches": n, "launch_us": enqueued / n * 1e6, "launch_drained_us": drained / n * 1e6, **calls}


def build_model(shape: dict, device: str, dtype):
    """A random Qwen2 of ``shape``, initialised on ``device`` (nothing on disk), with TRL's fused LM head, activation
    checkpointing on (non-reentrant, TRL's setting) and in training mode."""
    import torch
    from transformers import Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    config = bc.qwen2_config(shape, shape["vocab"])
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    add_fused_lm_head(model, outputs=("log_probs",))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batch(prompt: int, completion: int, vocab: int, device: str, seed: int = 0):
    """One prompt x `G` completions, TRL's layout (no padding: every completion exactly ``completion`` tokens)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (1, prompt), generator=generator).expand(G, prompt)
    ids = torch.cat([shared, torch.randint(3, vocab, (G, completion), generator=generator)], 1).to(device)
    return ids, torch.ones_like(ids), completion


def one_pass(model, layout: str, packing, ids, mask, keep) -> None:
    """The training pass: log-probs of the completion tokens, packed or padded, and the backward of their sum."""
    if layout == "packed":
        out = packing.logps_and_entropies(model, ids, mask, keep, None, False, False, {})
        if out is None:
            raise RuntimeError("the packed pass fell back to padded rows")
        logps = out.logps
    else:
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-keep] = -100
        logps = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]
    logps.float().sum().backward()
    model.zero_grad(set_to_none=True)


def measure_pass(model, layout: str, packing, ids, mask, keep, device: str, layers: int, top: int = 0) -> dict:
    """One warm-up pass, 3 timed (host enqueue, event span), then one profiled (GPU busy, launches, syncs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    one_pass(model, layout, packing, ids, mask, keep)
    sync()
    hosts, spans = [], []
    for _ in range(3):
        begin, end = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else (None, None)
        if cuda:
            begin.record()
        start = time.perf_counter()
        one_pass(model, layout, packing, ids, mask, keep)
        hosts.append(time.perf_counter() - start)
        if cuda:
            end.record()
        sync()
        spans.append(begin.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with Syncs(cuda) as syncs, profile(activities=activities) as prof:
        one_pass(model, layout, packing, ids, mask, keep)
        sync()
    summary = profile_summary(prof, layers, top)
    host, busy = statistics.median(hosts), summary["gpu_busy_ms"]
    out = {"host_enqueue_s": host, "event_span_s": statistics.median(spans), "sync_warnings": syncs.count}
    out["gpu_busy_s"] = busy / 1e3 if busy is not None else None
    out["host_us_per_launch"] = host / summary["launches"] * 1e6 if summary["launches"] else None
    out["sync_stacks"] = [{"message": m, "stack": s, "count": n} for (m, s), n in syncs.seen.most_common(5)]
    return out | summary


def trainer_step(side: str, shape: dict, prompt: int, completion: int, device: str, warmup: int) -> dict:
    """One side's trainer on a model built on ``device``: ``warmup`` steps, then one timed step split by the phase
    timer."""
    import torch
    from datasets import Dataset
    from phases import PhaseTimer
    from prefix_packing import prompt_texts, side_trainer

    sys.path.insert(0, str(bc.ROOT / "tests"))
    from helpers import build_tiny_tokenizer

    cuda = device == "cuda"
    tokenizer = build_tiny_tokenizer()
    model = build_model(shape, device, torch.bfloat16 if cuda else torch.float32)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    steps = warmup + 1
    dataset = Dataset.from_dict({"prompt": prompt_texts(tokenizer, prompt, steps + 2, 0)})
    spec = {"side": "trl" if side == "trl" else "ours", "packing": side != "ours_padded", "rollout": "fixed"}
    spec |= {"kernel": packed_kernel(cuda) if side == "ours" else "auto", "model": model, "generations": G}
    spec["completion_len"] = completion
    spec |= {"steps": steps, "seed": 0, "device": device, "bf16": cuda, "ac": True}  # checkpointing on CPU too
    trainer = side_trainer(spec | {"output_dir": tempfile.mkdtemp(prefix="packing_profile_")}, tokenizer, dataset)
    timer = PhaseTimer(trainer)
    trainer.train()
    timer.remove()
    result = {k: timer.steps[-1][k] for k in ("step_s", "host", "device", "calls")}
    result["steps_s"] = [round(s["step_s"], 4) for s in timer.steps]
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def packed_kernel(cuda: bool) -> str:
    return "varlen" if cuda else "sdpa_segments"


# ------------------------------------------------------------------------------------------------------ driver
class Profile:
    """The run: a `harness.Bench` whose parts this one process fills, one measurement at a time."""

    def __init__(self, args):
        self.args, self.cuda = args, args.device == "cuda"
        self.name = "packing_profile_cuda" if self.cuda else "packing_profile"
        slack = DRY_RUN_SLACK if args.dry_run else 1
        self.marks = {k: v * slack for k, v in MARKS.items()}
        self.shapes = DRY_SHAPES if args.dry_run else SHAPES
        self.points = DRY_POINTS if args.dry_run else POINTS
        config = {k: v for k, v in vars(args).items() if k != "out"} | {"marks_s": self.marks, "shapes": self.shapes}
        title = "Packed training pass on the host: launches, passes, trainer steps" + (" (DRY RUN)" * args.dry_run)
        self.bench = harness.Bench(self.name, args.out, config=config, device=args.device, title=title, render=markdown)

    def part(self, name: str, description: str):
        part = self.bench.part(name, mark_s=self.marks[name], description=description)
        part.record["measurements"] = []
        return part

    def add(self, part, about: dict, call, *args) -> None:
        """``call(*args)``'s measurement (or its error: the next one runs) with ``about``, written at once."""
        try:
            measurement = {**about, **call(*args)}
        except Exception as err:
            measurement = {**about, "error": f"{type(err).__name__}: {err}"[-1500:]}
        part.record["measurements"].append(measurement)
        line = ", ".join(f"{k} {v:.4g}" for k, v in measurement.items() if isinstance(v, float))
        print(f"[profile/{part.name}] {measurement.get('label', '')}: {line}", flush=True)
        self.bench.write()

    def done(self, part) -> None:
        if part.record["status"] == "running":
            part.record["status"] = "done"
        self.bench.write()

    def run(self) -> int:
        import torch

        torch.set_num_threads(1)
        device = self.args.device
        part = self.part("launch", "host µs per kernel launch and per module call")
        if not part.skipped:
            self.add(part, {"label": "launch"}, launch_costs, device, 5000)
            self.done(part)
        part = self.part("passes", "one training pass per model, point and layout (see the script's docs)")
        if not part.skipped:
            self.passes(part, device)
        part = self.part("steps", "one trainer step per side, split by the phase timer")
        if not part.skipped:
            prompt, completion = self.points[0]
            for side in SIDES:
                if part.check_mark(f"before {side}"):
                    break
                about = {"label": side, "side": side, "point": f"P{prompt}/C{completion}"}
                self.add(
                    part, about, trainer_step, side, self.shapes["1.5B"], prompt, completion, device, self.args.warmup
                )
            self.done(part)
        self.bench.finish()
        errors = [m for p in self.bench.report["parts"].values() for m in p.get("measurements", []) if "error" in m]
        return 1 if errors else 0

    def passes(self, part, device: str) -> None:
        import torch

        from trinity_trl.packing import PrefixPacking

        dtype = torch.bfloat16 if self.cuda else torch.float32
        packing = PrefixPacking(True, 1.0, lambda m: m, contextlib.nullcontext, packed_kernel(self.cuda), device)
        for model_name in ("twin", "1.5B"):
            if part.check_mark(f"before the {model_name} model"):
                return
            shape = self.shapes[model_name]
            model = build_model(shape, device, dtype)
            for prompt, completion in self.points:
                ids, mask, keep = batch(prompt, completion, shape["vocab"], device)
                for layout in ("packed", "padded"):
                    label = f"{model_name} P{prompt}/C{completion} {layout}"
                    if part.check_mark(f"before {label}"):
                        return
                    top = 12 if model_name == "1.5B" and (prompt, completion) == self.points[0] else 0
                    about = {"label": label, "model": model_name, "point": f"P{prompt}/C{completion}", "layout": layout}
                    about["tokens"] = int(ids.numel())
                    self.add(
                        part, about, measure_pass, model, layout, packing, ids, mask, keep, device, shape["layers"], top
                    )
            del model
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        self.done(part)


# ---------------------------------------------------------------------------------------------------- markdown
def _ms(value) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def markdown(report: dict) -> str:
    measured = {name: part.get("measurements") or [] for name, part in report["parts"].items()}
    launch, passes, steps, lines = measured.get("launch"), measured.get("passes"), measured.get("steps"), []
    if launch:
        m = launch[0]
        lines += [
            "### Launch and call costs (host)",
            "",
            f"{bc.fmt(m.get('launch_us'), '.1f')} µs per launch queued ({bc.fmt(m.get('launch_drained_us'), '.1f')} "
            f"µs with the queue drained), {bc.fmt(m.get('module_call_us'), '.1f')} µs per call of an empty module, "
            f"{bc.fmt(m.get('hooked_module_call_us'), '.1f')} µs with one forward hook ({m.get('launches')} each).",
            "",
        ]
    if passes:
        lines += [
            "### Training passes (one prompt x 8, forward and backward, activation checkpointing on)",
            "",
            "| model | point | layout | tokens | host enqueue (ms) | event span (ms) | GPU busy (ms) | launches "
            "| host µs per launch | aten ops | syncs (calls / warnings) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in passes:
            row = f"| {m['model']} | {m['point']} | {m['layout']} | {m['tokens']} "
            if "error" in m:
                lines.append(f"{row}| ERROR {m['error'][:200]} |")
                continue
            lines.append(
                f"{row}| {_ms(m.get('host_enqueue_s'))} | {_ms(m.get('event_span_s'))} | {_ms(m.get('gpu_busy_s'))} "
                f"| {m.get('launches')} | {bc.fmt(m.get('host_us_per_launch'), '.1f')} | {m.get('aten_ops')} "
                f"| {m.get('sync_calls')} / {m.get('sync_warnings')} |"
            )
        for m in passes:
            if m.get("top_kernels") or m.get("top_host_ops"):
                lines += ["", f"Profile of {m['label']}: top GPU kernels (count, ms):", ""]
                lines += [f"- {k['name']}: {k['count']}, {k['ms']:.1f}" for k in m.get("top_kernels", [])] or ["- none"]
                lines += ["", "top host operations (count, self ms):", ""]
                lines += [f"- {h['name']}: {h['count']}, {h['self_ms']:.1f}" for h in m.get("top_host_ops", [])]
        lines.append("")
    if steps:
        from phases import PHASES

        lines += [
            "### Trainer steps, split by the phase timer (host s; device s where read)",
            "",
            "| side | point | step | " + " | ".join(PHASES) + " | steps (all, s) |",
            "|---|---|---|" + "---|" * len(PHASES) + "---|",
        ]
        for m in steps:
            if "error" in m:
                lines.append(f"| {m['side']} | {m['point']} | ERROR {m['error'][:300]} |")
                continue
            device = m.get("device") or {}
            cells = [
                f"{m['host'][p]:.3f}" + (f" / {device[p]:.3f}" if p in device else "") for p in PHASES
            ]  # fmt: skip
            lines.append(
                f"| {m['side']} | {m['point']} | {m['step_s']:.3f} | " + " | ".join(cells) + f" | {m['steps_s']} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dry-run", action="store_true", help="on CPU: tiny shapes, the same code")
    parser.add_argument("--warmup", type=int, default=None, help="trainer steps before the timed one (2; 1 dry run)")
    parser.add_argument("--out", default=None, help="results folder (default $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.dry_run else 2
    args.out = args.out or harness.out_dir(argparse.Namespace(out=None, dry_run=False))
    return Profile(args).run()


if __name__ == "__main__":
    raise SystemExit(main())
