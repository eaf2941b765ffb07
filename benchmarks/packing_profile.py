#!/usr/bin/env python
"""One profiled training step of ours (packed, and with packing off) and of TRL's (padded) at Qwen2.5-1.5B, prompt
1024, completion 256, G 8 (issue 42 item 1): where the packed step's host time goes on a GPU.

Each side (``ours``, ``ours_padded``: packing off, the layout ``auto`` keeps where packing does not pay; ``trl``)
trains in its own fresh process (`prefix_packing.py`'s worker, the benchmark's exact setting: random model
of the 1.5B shape with the real vocabulary, bf16, activation checkpointing on, TRL's defaults, completions of
exactly C tokens). After its warm-up (ours: ``prefix_packing_kernel="varlen"`` forced, so that the profiled step is
packed whatever ``auto`` would decide), one step runs under ``torch.profiler`` (CPU and CUDA activities) with
``torch.cuda.set_sync_debug_mode("warn")`` (every synchronising CUDA call warns; each warning is recorded with the
Python stack that made it), and the next step under ``cProfile`` (where the Python time goes, by function and by
package). The summary, per side:

* the step's host wall time against the GPU's busy time (the sum of its kernels' durations);
* aten operations and host reads of device data (``aten::_local_scalar_dense``) in the step;
* the top host operations by self CPU time, the CUDA runtime calls (launches, copies, syncs) with counts and times;
* every device synchronisation: the runtime's synchronising calls and the sync-debug warnings, each with its stack;
* kernel launches per decoder layer (all launches of the step / layers), and the top GPU kernels;
* the Python functions and packages that took the host's time.

Results: ``packing_profile_cuda.{json,md}`` in ``--out`` (``$OUT`` on the lent machine; ``packing_profile.{json,md}``
in a dry run on CPU, where only CPU activities and cProfile run), rewritten after each side (ours, TRL, ours padded),
so that a run stopped by its time budget keeps the sides that finished. ``make gpu-check`` runs it as its first part
(``PARTS=profile``)::

    python benchmarks/packing_profile.py --device cuda          # on the GPU machine
    python benchmarks/packing_profile.py --quick                # here, on CPU: the same code on a tiny model
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # sets the offline environment before torch/trl imports

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
#: the profiled processes: ours packed (the forced kernel), ours with packing off (the padded layout: what `auto`
#: runs where it keeps padded rows, to set against TRL's own padded step), TRL's
SIDES = ("ours", "trl", "ours_padded")
#: packages the cProfile summary groups the host's Python time by
PACKAGES = ("trinity_trl", "trl", "transformers", "accelerate", "peft", "torch", "datasets")


# ------------------------------------------------------------------------------------- in the worker
class _Syncs:
    """``torch.cuda.set_sync_debug_mode("warn")``'s warnings, each with the Python stack that made it."""

    def __init__(self):
        self.seen: collections.Counter = collections.Counter()
        self._previous = None

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._previous = warnings.showwarning
        warnings.showwarning = self._record
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None):
        text = str(message).splitlines()[0][:160]
        if "synchroniz" not in text.lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if any(f"/{p}/" in f.filename for p in PACKAGES[:5]) or "benchmarks/" in f.filename]
        stack = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed((ours or frames)[-4:]))
        self.seen[(text, stack)] += 1

    def __exit__(self, *exc):
        warnings.showwarning = self._previous
        self._catch.__exit__(*exc)
        return False


def _short(path: str) -> str:
    for package in PACKAGES:
        marker = f"/{package}/"
        if marker in path:
            return package + "/" + path.split(marker, 1)[1]
    return path.rsplit("/", 2)[-1] if "benchmarks/" not in path else "benchmarks/" + path.split("benchmarks/", 1)[1]


def start(torch_profile: bool, cuda: bool):
    """At a step's beginning: the profiler (``torch_profile``) or cProfile; returns the state `stop` takes."""
    import torch

    if not torch_profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        return {"kind": "cprofile", "prof": prof, "start": time.perf_counter()}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, record_shapes=False, with_stack=False)
    prof.__enter__()
    syncs = _Syncs().__enter__()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    return {"kind": "torch", "prof": prof, "syncs": syncs, "cuda": cuda, "start": time.perf_counter()}


def stop(state: dict, spec: dict) -> dict:
    """At the step's end: the summary of what ``state`` recorded."""
    import torch

    wall = time.perf_counter() - state["start"]
    if state["kind"] == "cprofile":
        state["prof"].disable()
        return {"kind": "cprofile", "wall_s": wall, **_cprofile_summary(state["prof"])}
    if state["cuda"]:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    state["syncs"].__exit__(None, None, None)
    state["prof"].__exit__(None, None, None)
    return {"kind": "torch", "wall_s": wall, **_torch_summary(state["prof"], state["syncs"], spec)}


def _torch_summary(prof, syncs: _Syncs, spec: dict) -> dict:
    from torch.autograd import DeviceType

    events = prof.key_averages()
    host, runtime, kernels = [], [], []
    for e in events:
        device = getattr(e, "device_type", DeviceType.CPU)
        self_cpu = e.self_cpu_time_total / 1e3
        if device == DeviceType.CUDA:
            kernels.append({"name": e.key[:120], "count": e.count, "ms": getattr(e, "self_device_time_total", 0) / 1e3})
        elif e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
            runtime.append({"name": e.key, "count": e.count, "ms": self_cpu})
        else:
            host.append(
                {"name": e.key[:120], "count": e.count, "self_ms": self_cpu, "total_ms": e.cpu_time_total / 1e3}
            )
    host.sort(key=lambda x: -x["self_ms"])
    runtime.sort(key=lambda x: -x["ms"])
    kernels.sort(key=lambda x: -x["ms"])
    layers = spec.get("layers") or 1
    launches = sum(r["count"] for r in runtime if r["name"] in LAUNCHES)
    sync_calls = [r for r in runtime if r["name"] in SYNCS or "Synchronize" in r["name"]]
    aten = [h for h in host if h["name"].startswith("aten::")]
    return {
        "aten_ops": sum(h["count"] for h in aten),
        "host_reads": sum(h["count"] for h in aten if h["name"] == "aten::_local_scalar_dense"),
        "host_ops_self_ms": sum(h["self_ms"] for h in host),
        "gpu_busy_ms": sum(k["ms"] for k in kernels),
        "kernels_run": sum(k["count"] for k in kernels),
        "launches": launches,
        "layers": layers,
        "launches_per_layer": launches / layers,
        "top_host_ops": host[:25],
        "host_op_counts": {h["name"]: h["count"] for h in host},
        "runtime_calls": runtime[:25],
        "sync_calls": sync_calls,
        "sync_warnings": [{"message": m, "stack": s, "count": n} for (m, s), n in syncs.seen.most_common()],
        "top_kernels": kernels[:15],
    }


def _cprofile_summary(prof) -> dict:
    import pstats

    stats = pstats.Stats(prof)
    rows, packages = [], collections.Counter()
    for (path, line, name), (calls, _, tottime, cumtime, _) in stats.stats.items():
        package = next((p for p in PACKAGES if f"/{p}/" in path), "other" if not path.startswith("~") else "builtin")
        packages[package] += tottime
        rows.append(
            {
                "function": f"{_short(path)}:{line} {name}",
                "calls": calls,
                "tottime_ms": tottime * 1e3,
                "cumtime_ms": cumtime * 1e3,
            }
        )
    ours = [r for r in rows if r["function"].startswith("trinity_trl/")]
    return {
        "by_package_ms": {k: v * 1e3 for k, v in packages.most_common()},
        "top_tottime": sorted(rows, key=lambda r: -r["tottime_ms"])[:25],
        "top_cumtime_trinity_trl": sorted(ours, key=lambda r: -r["cumtime_ms"])[:20],
    }


# ------------------------------------------------------------------------------------------ driver
def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"# One profiled training step, ours (packed, and padded) and TRL's{' (DRY RUN on CPU)' if c['quick'] else ''}",
        "",
        f"Command: `{report['command']}`",
        "",
        bc.machine_line(report["machine"]),
        f"Date: {report['date']}. Point: {report['point']}; ours with `prefix_packing_kernel={c['kernel']!r}` (so the "
        f"profiled step is packed), `ours_padded` with `prefix_packing=False`; each side in its own process, "
        f"{c['warmup']} warm-up steps, then one step under torch.profiler (CPU + CUDA activities, "
        "`torch.cuda.set_sync_debug_mode('warn')`) and one under cProfile.",
        "",
        "| side | step wall (s) | GPU busy (s) | host ops self (s) | aten ops | host reads | kernels run | launches "
        "| launches per layer | sync calls | sync warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side, s in report["sides"].items():
        t = s.get("torch") or {}
        lines.append(
            f"| {side} | {bc.fmt(t.get('wall_s'))} | {bc.fmt((t.get('gpu_busy_ms') or 0) / 1e3)} "
            f"| {bc.fmt((t.get('host_ops_self_ms') or 0) / 1e3)} | {t.get('aten_ops', 'n/a')} "
            f"| {t.get('host_reads', 'n/a')} | {t.get('kernels_run', 'n/a')} "
            f"| {t.get('launches', 'n/a')} | {bc.fmt(t.get('launches_per_layer'), '.0f')} "
            f"| {sum(x['count'] for x in t.get('sync_calls', []))} "
            f"| {sum(x['count'] for x in t.get('sync_warnings', []))} |"
        )
    for side, s in report["sides"].items():
        t, p = s.get("torch") or {}, s.get("cprofile") or {}
        lines += [
            "",
            f"## {side}",
            "",
            "Every device synchronisation (sync-debug warnings, with the stack that made it):",
            "",
        ]
        lines += [f"- x{w['count']} {w['message']}: {w['stack']}" for w in t.get("sync_warnings", [])] or ["- none"]
        lines += ["", "CUDA runtime calls (count, host ms):", ""]
        lines += [f"- {r['name']}: {r['count']}, {r['ms']:.1f} ms" for r in t.get("runtime_calls", [])[:12]]
        lines += ["", "Top host operations by self CPU time (count, self ms, total ms):", ""]
        lines += [
            f"- {h['name']}: {h['count']}, {h['self_ms']:.1f}, {h['total_ms']:.1f}"
            for h in t.get("top_host_ops", [])[:15]
        ]
        lines += ["", "Top GPU kernels (count, ms):", ""]
        lines += [f"- {k['name']}: {k['count']}, {k['ms']:.1f}" for k in t.get("top_kernels", [])[:10]] or [
            "- none (CPU)"
        ]
        lines += ["", "Python time by package (cProfile, the next step; ms):", ""]
        lines.append(", ".join(f"{k} {v:.0f}" for k, v in (p.get("by_package_ms") or {}).items()) or "n/a")
        lines += ["", "trinity_trl's functions by cumulative time (calls, ms):", ""]
        lines += [
            f"- {r['function']}: {r['calls']}, {r['cumtime_ms']:.1f}" for r in p.get("top_cumtime_trinity_trl", [])[:12]
        ]
    lines += ["", f"Total wall time {report['total_wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    import prefix_packing as pp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--point", default="qwen2.5-1.5b:1024:256:8", help="MODEL:P:C:G (default 1.5B 1024/256)")
    parser.add_argument("--kernel", help="ours' prefix_packing_kernel (default varlen on CUDA, sdpa_segments on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--quick", action="store_true", help="on CPU: a tiny model, the same code")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if args.quick:
        args.point = "tiny:32:8:4"
    point = pp.parse_point(args.point)
    args.kernel = args.kernel or ("varlen" if cuda else "sdpa_segments")
    started = time.perf_counter()
    layers = pp.MODEL_SHAPES[point.model]["layers"] if point.model in pp.MODEL_SHAPES else 2
    shape = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128}
    sides = {}
    with tempfile.TemporaryDirectory(prefix="packing_profile_") as tmp:
        runner = pp.Runner(Path(tmp), args.timeout, fork=False)
        made = runner.run(
            {
                "make_model": point.model,
                "model_dir": str(Path(tmp) / "model"),
                "device": args.device,
                "threads": 1,
                "bf16": cuda,
                "seed": 0,
                "shape": shape,
            }
        )
        base = {
            "model": made["path"],
            "device": args.device,
            "threads": 1,
            "bf16": cuda,
            "steps": args.warmup + 2,
            "warmup": args.warmup,
            "trl_warmup": args.warmup,
            "prompt_len": point.prompt_len,
            "completion_len": point.completion_len,
            "generations": point.generations,
            "prompts_per_step": 1,
            "accumulation": 1,
            "lora": False,
            "learning_rate": None,
            "seed": 0,
            "point": point.name,
            "packing": True,
            "kernel": args.kernel,
            "rollout": "fixed",
            "ac": None if cuda else False,
            "optim": None,
            "part_timing": False,
            "equivalence": False,
            "break_packed": False,
            "profile": {"step": args.warmup},
            "layers": layers,
        }
        name = "packing_profile_cuda" if cuda else "packing_profile"
        for side in SIDES:  # the report is rewritten after each side: a part stopped by its budget keeps what finished
            trainer, padded = side.removesuffix("_padded"), side == "ours_padded"
            result = runner.run(
                dict(base, sides=[trainer], **({"packing": False, "kernel": "auto"} if padded else {}))
            )[trainer]
            profiles = {p["kind"]: p for p in result.get("profile", [])}
            sides[side] = {"step_s": result["step_s"], "kernels": result.get("kernels"), **profiles}
            print(f"[profile] {side}: steps {[round(x, 3) for x in result['step_s']]}", flush=True)
            report = {
                "benchmark": name,
                "command": " ".join([bc.interpreter(), *(sys.argv if argv is None else [__file__, *argv])]),
                "date": time.strftime("%Y-%m-%d"),
                "machine": bc.machine_description(args.device),
                "config": vars(args),
                "point": point.name,
                "sides": sides,
                "total_wall_s": time.perf_counter() - started,
            }
            bc.write_report(args.out, name, report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
