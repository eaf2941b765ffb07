"""Smoke tests of the benchmark scripts: each runs its smallest setting on the tiny model into a temporary
directory and writes its result files with the expected keys. Nothing here looks at timings (they are only
measured, never asserted)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launching import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: int = 600, env: dict | None = None) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(timeout),  # generous when idle, scaled by the load (tests/launching.py)
        env=env,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _load(path: Path) -> dict:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def _check_machine(report: dict) -> None:
    for key in ("cpu", "os_cpu_count", "torch", "trl", "transformers", "torch_threads"):
        assert key in report["machine"], key
    assert "load_average_start" in report and "load_average_end" in report


def test_algorithms_quick(tmp_path):
    _run("algorithms.py", "--quick", "--model-config", "tiny", "--out", str(tmp_path))
    report = _load(tmp_path / "algorithms.json")
    _check_machine(report)
    from trinity_trl.algorithms import ADVANTAGE_FN, KL_FN, POLICY_LOSS_FN

    results, skipped = report["results"], report["skipped"]
    # every registered component is either timed or listed as skipped with a reason
    assert set(results["policy_loss"]) | set(skipped["policy_loss"]) == set(POLICY_LOSS_FN.names())
    assert set(results["kl"]) | set(skipped["kl"]) == set(KL_FN.names())
    timed_advantages = {r["name"] for r in results["advantage"].values()}
    assert timed_advantages | set(skipped["advantage"]) == set(ADVANTAGE_FN.names())
    for name, r in results["policy_loss"].items():
        assert r["forward_backward"]["median_s"] > 0, name
        assert name in report["percent_of_model"]["policy_loss"]
    assert report["model"]["seconds_per_token"] > 0
    assert {"worst_loss", "worst_loss_percent", "target_met"} <= set(report["summary"])
    assert "% of model" in (tmp_path / "algorithms.md").read_text()


def test_seed_stats_match_students_t_and_holm():
    """Reference values of Student's t (tables; t with 1 degree of freedom is Cauchy: p = 1 - 2 atan(t) / pi)."""
    sys.path.insert(0, str(BENCHMARKS))
    import math

    from seed_stats import holm, paired_t, t_quantile, t_two_sided_p

    for probability, df, table in ((0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 7, 2.3646), (0.995, 30, 2.7500)):
        assert t_quantile(probability, df) == pytest.approx(table, abs=1e-4), (probability, df)
    assert t_two_sided_p(50.0, 1) == pytest.approx(1 - 2 * math.atan(50.0) / math.pi, rel=1e-9)
    assert t_two_sided_p(2.0, 5) == pytest.approx(0.101939, abs=1e-6) and t_two_sided_p(0.0, 5) == 1.0
    # the committed 3-seed study: CHORD-mu minus SFT then GRPO per seed
    test = paired_t([-0.025, -0.185, 0.015])
    assert test["p"] == pytest.approx(0.3989, abs=1e-4) and test["df"] == 2
    assert (test["low"], test["high"]) == (pytest.approx(-0.3279, abs=1e-4), pytest.approx(0.1979, abs=1e-4))
    assert paired_t([0.1, 0.1])["p"] is None and paired_t([0.1])["low"] is None  # no spread, one seed: no test
    assert holm({"a": 0.01, "b": 0.04, "c": None}) == {"a": 0.02, "b": 0.04, "c": None}
    assert holm({"a": 0.03, "b": 0.02}) == {"a": 0.04, "b": 0.04}  # step-down: never below an earlier step


def test_prefix_packing_points_parse_with_their_options():
    sys.path.insert(0, str(BENCHMARKS))
    from prefix_packing import POINT_SETS, parse_point

    point = parse_point("qwen2.5-1.5b:2048:512:8:ga4:lora")
    assert (point.prompt_len, point.completion_len, point.accumulation, point.lora, point.prompts) == (
        2048,
        512,
        4,
        True,
        1,
    )
    assert parse_point(point.key) == point
    assert [p.key for p in POINT_SETS["target"]] == ["qwen2.5-1.5b:1024:256:8", "qwen2.5-1.5b:2048:512:8"]
    assert [p.key for p in POINT_SETS["accumulation"]] == ["qwen2.5-1.5b:1024:256:8:ga4", "qwen2.5-1.5b:2048:512:8:ga4"]
    for bad in ("qwen2.5-1.5b:1024:256", "gpt:1:2:3", "qwen2.5-1.5b:1024:256:8:fast"):
        with pytest.raises(ValueError):
            parse_point(bad)


def test_configs_learning_records_a_config_run(tmp_path, tiny_model_dir):
    overrides = ["--model_name_or_path", tiny_model_dir, "--max_steps", "1", "--num_eval_rows", "2"]
    overrides += ["--per_device_train_batch_size", "4", "--max_completion_length", "4", "--eval_max_new_tokens", "4"]
    _run("configs_learning.py", "cispo_cpu", "--label", "tiny", "--results", str(tmp_path), "--", *overrides)
    (record,) = [json.loads(line) for line in (tmp_path / "configs_learning.jsonl").read_text().splitlines()]
    assert record["label"] == "tiny" and record["returncode"] == 0 and record["steps"] == 1
    assert record["metric"] == "held-out accuracy" and 0.0 <= record["before"] <= 1.0 and 0.0 <= record["after"] <= 1.0
    assert len(record["loadavg_before"]) == 3 and record["wall_s"] > 0
    assert (
        "| cispo_cpu | `trinity-trl cispo --config cispo_cpu --model_name_or_path"
        in (tmp_path / "configs_learning.md").read_text()
    )


def test_configs_learning_reward_quarters():
    sys.path.insert(0, str(BENCHMARKS))
    from configs_learning import reward_quarters

    history = [{"reward": r, "reward_std": s} for r, s in [(0.0, 0.0), (0.2, 0.1), (0.4, 0.2), (0.6, 0.0)]]
    assert reward_quarters([*history, {"train_runtime": 1.0}]) == (0.0, 0.6, 0.5)


def test_gpu_check_dry_run_runs_every_part_into_out(tmp_path):
    """`make gpu-check DRY_RUN=1`: the parts on CPU into $OUT (no --out), at most 8 files, the summary first; the
    profile summarised both sides' steps, the benchmark ran two repeats (fresh processes) with its direct
    packed-vs-padded check, and the trainers trained 2 steps with packing."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out)}
    parts = "profile,bench,tests,trainers"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "gpu_check.py"),
            "--dry-run",
            "--parts",
            parts,
            "--trainers",
            "trinity",
            "ppo",
            "--test-paths",  # one file of CUDA tests (the part's command and report; collecting all takes longer)
            "tests/packing/test_kernels.py",
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(900),
        env=env,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_check.md", "gpu_check.json", "prefix_packing.json", "packing_profile.md"} <= set(
        files
    ), files
    summary = _load(out / "gpu_check.json")
    assert summary["dry_run"] and list(summary["parts"]) == parts.split(",")
    assert all(part["status"] == "passed" and part["wall_s"] > 0 for part in summary["parts"].values())
    profile = summary["parts"]["profile"]
    assert {p["status"] for p in profile["parts"].values()} == {"done"}, profile["parts"]
    assert profile["launch"]["launch_us"] > 0 and profile["launch"]["module_call_us"] > 0
    assert len(profile["passes"]) == 4 and all(p["aten_ops"] > 0 and p["host_enqueue_s"] > 0 for p in profile["passes"])
    assert [s["side"] for s in profile["steps"]] == ["ours_padded", "trl", "ours"]
    assert all(s["step_s"] > 0 and s["host"]["backward"] > 0 for s in profile["steps"]), profile["steps"]
    tests = summary["parts"]["tests"]["counts"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # the CUDA tests skip on CPU, with the reason
    (point,) = summary["parts"]["bench"]["points"]
    assert point["equivalent"] and point["repeats"] == 2 and point["train_ratio"] > 0 and point["grads_rtol"] > 0
    # the benchmark's own report: each repeat a fresh process per side, medians over repeats with their min-max
    report = _load(out / "prefix_packing.json")
    _check_machine(report)
    (point,) = report["results"]
    assert point["repeats"] == 2 and len({r["pid"] for r in point["runs"]["ours"] + point["runs"]["trl"]}) == 4
    # the direct check runs in the point's first repeat only (the harness hands the child its repeat's index)
    assert [bool(r.get("equivalence_check")) for r in point["runs"]["ours"]] == [True, False]
    comparison = point["comparison"]
    assert all(comparison[key] > 0 for key in ("train_ratio", "step_ratio", "memory_ratio")), comparison
    spread = comparison["ours"]["train_s_spread"]
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert comparison["ours"]["forwarded_token_ratio"] < 1.0  # the packed forward ran
    assert any("loss_type='grpo'" in d for d in point["departures"]) and report["not_measured"] == []
    assert "| tiny P32/C8/G4 K1 | 2 / 2 |" in (out / "prefix_packing.md").read_text()
    # a run's steps are split by phases.PhaseTimer: one layout count, `auto` state and split per step, the training
    # part its loss and backward phases, the generation inside the step; gpu_check.md gives the split per point
    run = point["runs"]["ours"][0]
    assert len(run["step_layouts"]) == len(run["deciding"]) == len(run["phases_s"]) == len(run["step_s"]) >= 2
    split = [p["host"] for p in run["phases_s"]]
    assert run["train_part_s"] == pytest.approx([p["loss"] + p["backward"] for p in split])
    assert all(0 < p["loss"] and 0 < g < s for p, g, s in zip(split, run["generation_s"], run["step_s"]))
    assert sum(run["kernels"].values()) == sum(sum(s.values()) for s in run["step_layouts"]) >= len(run["step_s"])
    assert "Phases (`phases.PhaseTimer`; median ms, ours / TRL): generation" in (out / "gpu_check.md").read_text()
    trainers = summary["parts"]["trainers"]["trainers"]
    assert [t["trainer"] for t in trainers] == ["trinity", "ppo"]
    for t in trainers:
        assert t["ok"] and t["steps"] == 2 and min(t["forwarded_token_ratio"]) < 1.0, t
    assert summary["targets"][0]["point"].startswith("qwen2.5-1.5b P1024/C256")
    assert "| bench | passed |" in (out / "gpu_check.md").read_text()
    assert "Trainers, 2 steps with packing auto" in proc.stdout  # the one-screen summary


def test_gpu_check_runs_the_profile_and_the_target_points_by_default():
    """Without --parts: the profile (at most 90 s), then the benchmark's target points (1.5B at one prompt per
    micro-batch) with ours, ours compiled and TRL, 5 repeats; the other parts are named by PARTS, each command within
    the 8 minutes of the GPU check's bound."""
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_check
    from prefix_packing import POINT_SETS

    assert gpu_check.DEFAULT_PARTS == ("profile", "bench") and gpu_check.BENCH_SETS["bench"] == "target"
    assert gpu_check.BENCH_SIDES["bench"] == "ours,ours_compiled,trl" and gpu_check.BUDGETS["profile"] <= 90
    assert all(p.accumulation == 1 and p.model == "qwen2.5-1.5b" for p in POINT_SETS["target"])
    # a command runs at most 8 minutes; run.sh's installs and the parts' start-up took 41 s on an H200
    assert sum(gpu_check.BUDGETS[p] for p in gpu_check.DEFAULT_PARTS) <= 480 - 60
    for command in (("accumulation", "small"), ("tests", "trainers", "lora")):  # the further commands
        assert sum(gpu_check.BUDGETS[p] for p in command) <= 480 - 60, command


def test_packing_profile_writes_after_every_measurement_and_skips_parts_past_their_marks(tmp_path, monkeypatch):
    """The profile is one process that rewrites its report after every measurement: on the H200 (2026-11-28) the
    part was stopped by its budget and reported nothing. Here the process is stopped during its third pass: the
    report on disk holds the launch costs and the first two passes. And a part whose time mark has passed is skipped,
    recorded as such."""
    sys.path.insert(0, str(BENCHMARKS))
    import packing_profile
    import torch

    passes = []

    def measure_pass(*args, **kwargs):
        passes.append(args[1])
        if len(passes) == 3:
            raise SystemExit("stopped by its budget")
        return {"host_enqueue_s": 0.1, "event_span_s": 0.2, "gpu_busy_s": None, "launches": 0, "aten_ops": 9}

    monkeypatch.setattr(packing_profile, "launch_costs", lambda device, n: {"launches": n, "launch_us": 2.0})
    monkeypatch.setattr(packing_profile, "build_model", lambda *a: object())
    monkeypatch.setattr(packing_profile, "batch", lambda p, c, vocab, device: (torch.zeros(8, p + c), None, c))
    monkeypatch.setattr(packing_profile, "measure_pass", measure_pass)
    with pytest.raises(SystemExit, match="stopped"):
        packing_profile.main(["--dry-run", "--out", str(tmp_path)])
    parts = _load(tmp_path / "packing_profile.json")["parts"]
    assert parts["launch"]["status"] == "done" and parts["launch"]["measurements"][0]["launch_us"] == 2.0
    assert [m["layout"] for m in parts["passes"]["measurements"]] == ["packed", "padded"]
    assert "| twin | P32/C8 | padded |" in (tmp_path / "packing_profile.md").read_text()

    monkeypatch.setattr(packing_profile, "MARKS", {"launch": 1e6, "passes": -1.0, "steps": -1.0})
    assert packing_profile.main(["--dry-run", "--out", str(tmp_path / "marks")]) == 0
    parts = _load(tmp_path / "marks" / "packing_profile.json")["parts"]
    assert parts["launch"]["status"] == "done"
    assert parts["passes"]["status"] == parts["steps"]["status"] == "skipped" and "time mark" in parts["steps"]["why"]


def test_gpu_check_stops_a_part_over_budget_and_runs_the_rest(tmp_path):
    """A part that overruns its budget is stopped (its process group killed) and reported; the next part runs."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "gpu_check.py"),
            "--dry-run",
            "--parts",
            "bench,accumulation",  # run in this order; a dry run's `accumulation` passes at once
            "--budget-bench",
            "0.5",
            "--out",
            str(out),
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(300),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1, proc.stdout[-3000:]  # a part did not pass
    parts = _load(out / "gpu_check.json")["parts"]
    assert parts["bench"]["status"] == "timeout" and parts["bench"]["wall_s"] < 30
    assert parts["accumulation"]["status"] == "passed"


def test_prefix_packing_resume_keeps_the_measured_points_and_measures_the_rest(tmp_path, monkeypatch):
    """`--resume` (gpu_check's later benchmark parts): the earlier report's parts and commands are kept, its measured
    points are not run again, a point it could not measure is, and the figures per point read every part."""
    sys.path.insert(0, str(BENCHMARKS))
    import harness
    import prefix_packing

    ran = []

    def run(self, side, timeout_s, log=None):  # no processes: the samples a run of each side would give
        ran.append(side.name)
        if side.spec.get("make_model"):
            return {"path": "unused", "about": "a stand-in"}
        if side.name.startswith("tiny:32:8:2"):
            return {"error": "exit status 1", "output_tail": "broken"}
        steps = [0.5, 0.2, 0.2] if side.spec["side"] == "ours" else [0.5, 0.4, 0.4]
        sample = {"step_s": steps, "generation_s": [0.1] * 3, "warmup": 1, "losses": [1.0], "grad_norms": [1.0]}
        return sample | {"forwarded_token_ratio": [0.5], "parameters": 10, "micro_batch": None, "departures": []}

    monkeypatch.setattr(harness.Launcher, "run", run)
    args = ["--out", str(tmp_path), "--no-equivalence", "--points"]
    first = ["--repeats", "1", "--sides", "ours,ours_compiled,trl", *args, "tiny:32:8:4", "tiny:32:8:2"]
    assert prefix_packing.main(first) == 1  # a point failed
    assert ran[:3] == ["model tiny", "tiny:32:8:4/ours_compiled", "tiny:32:8:4/ours"]  # the cache warmed first
    report = _load(tmp_path / "prefix_packing.json")
    assert report["uncounted_runs"][0]["point"] == "tiny P32/C8/G4 K1" and "compiled" in report["results"][0]
    assert [r["key"] for r in report["results"]] == ["tiny:32:8:4"] and report["not_measured"] == ["tiny P32/C8/G2 K1"]
    assert report["results"][0]["comparison"]["train_ratio"] == pytest.approx(0.1 / 0.3)
    ran.clear()
    resume = ["--resume", str(tmp_path / "prefix_packing.json")]
    prefix_packing.main(["--repeats", "2", *args, "tiny:32:8:4", "tiny:32:8:2", *resume])
    ours, trl = "tiny:32:8:2/ours", "tiny:32:8:2/trl"
    assert ran == ["model tiny", ours, trl, trl, ours]  # only the point not measured, its sides alternating
    report = _load(tmp_path / "prefix_packing.json")
    assert report["fewer_repeats"] == {}  # each part against the repeats it asked
    assert list(report["parts"]) == ["points", "points (2)"] and len(report["commands"]) == 2
    assert [r["key"] for r in report["results"]] == ["tiny:32:8:4"] and len(report["failed_points"]) == 1


def test_prefix_packing_direct_check_fails_on_a_wrong_packed_forward(tiny_model_dir, tmp_path):
    """The benchmark's packed-vs-padded check passes on the real packed forward and fails when the packed side
    sees a different sequence (two completion tokens swapped): it can fail."""
    sys.path.insert(0, str(BENCHMARKS))
    import prefix_packing
    from helpers import first_batch, length_reward, tiny_conversational_dataset, tiny_grpo_kwargs

    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), algorithm="grpo")),
        train_dataset=tiny_conversational_dataset(8),
    )
    batch = first_batch(trainer)
    good = prefix_packing.check_equivalence(trainer, batch, {})
    assert good["equivalent"] and good["packed_forwards"] == ["sdpa_segments", "sdpa_segments"], good
    bad = prefix_packing.check_equivalence(trainer, batch, {"break_packed": True})
    assert not bad["equivalent"] and bad["grads_rel_l2"] > bad["grads_rtol"], bad


def test_prefix_packing_reads_only_steps_after_autos_verdict():
    """A run's figure reads its steps after the warm-up that ended with every `auto` verdict taken: on the H200
    (2026-11-28) the verdict at gradient accumulation 4 came at step 3 to 5, after a 3-step warm-up, so the old
    reading mixed calibration steps (both layouts in turn) into the medians. Where no step after the warm-up was
    decided, all of them are read, and the run is counted apart from the decided ones."""
    sys.path.insert(0, str(BENCHMARKS))
    import prefix_packing as pp

    run = {
        "warmup": 3,
        "step_s": [3.0, 1.5, 1.5, 1.5, 1.4, 0.9, 0.8, 0.85],
        "generation_s": [0.1] * 8,
        "deciding": [True, True, True, True, True, False, False, False],
        "train_part_peak_mib": [9.0, 9.0, 9.0, 9.0, 9.0, 5.0, 5.0, 5.0],
    }
    summary = pp.run_summary(run)
    assert summary["timed_steps"] == 3 and summary["undecided_steps"] == 2
    assert summary["train_s"] == pytest.approx(0.75)  # median of 0.8, 0.7, 0.75: no calibration step
    assert summary["train_part_peak_mib"] == 5.0
    never = dict(run, deciding=[True] * 8)
    assert pp.timed_steps(never) == [3, 4, 5, 6, 7] and pp.run_summary(never)["undecided_steps"] == 5
    old = {k: v for k, v in run.items() if k != "deciding"}  # runs recorded before `deciding` existed
    assert pp.timed_steps(old) == [3, 4, 5, 6, 7]
    side = pp.side_summary(
        [dict(run, micro_batch=None, forwarded_token_ratio=[]), dict(never, micro_batch=None, forwarded_token_ratio=[])]
    )
    # the run that never decided is counted apart: the side's figure is the decided run's (issue 53)
    assert side["undecided_runs"] == 1 and side["runs_still_deciding_after_warmup"] == 2
    assert side["train_s"] == pytest.approx(0.75) and side["train_s_spread"]["max"] == pytest.approx(0.75)
    assert side["train_s_undecided"]["median"] == pp.run_summary(never)["train_s"]
    assert [r["decided"] for r in side["per_run"]] == [True, False]

    class Calibration:
        def __init__(self, verdicts):
            self.classes = {(0, True, 8, w): type("C", (), {"verdict": v})() for w, v in verdicts.items()}

    def trainer(verdicts):
        return type("T", (), {"prefix_packing": type("P", (), {"calibration": Calibration(verdicts)})()})()

    assert pp.still_deciding(trainer({2048: None, 4096: True}))
    assert not pp.still_deciding(trainer({2048: False, 4096: True}))
    assert not pp.still_deciding(object())  # TRL's side: nothing measured


def test_prefix_packing_bf16_tolerances_come_from_the_dtype():
    """bf16 runs are judged with bf16 tolerances (one rounding per op on a value's path through the layers), not
    the float32 ones the CPU run uses."""
    import torch
    from tolerance import tolerance
    from transformers import Qwen2Config

    sys.path.insert(0, str(BENCHMARKS))
    import prefix_packing

    shape = prefix_packing.MODEL_SHAPES["qwen2.5-1.5b"]
    config = Qwen2Config(
        vocab_size=prefix_packing.REAL_VOCAB,
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"],
    )
    bf16 = prefix_packing.equivalence_tolerances(torch.bfloat16, config, rows=8, width=2560)
    fp32 = prefix_packing.equivalence_tolerances(torch.float32, config, rows=8, width=2560)
    roundings = prefix_packing.BF16_ROUNDINGS_PER_LAYER * 28 + prefix_packing.BF16_HEAD_ROUNDINGS
    assert bf16["logps_rtol"] == tolerance(torch.bfloat16, terms=roundings, ulps=1)["rtol"]
    assert bf16["grads_rtol"] == tolerance(torch.bfloat16, terms=2 * roundings, ulps=1)["rtol"]
    assert bf16["logps_rtol"] > 100 * fp32["logps_rtol"]  # bf16's eps is 2**16 times float32's


class InProcess:
    """A study's launcher that runs each run in this process (the fresh-process launcher, forked or spawned, is tested
    with the harness: tests/test_bench_harness.py): seconds instead of a process start each. The sample goes through
    JSON, as it does from a fresh process."""

    def run(self, side, timeout_s, log=None):
        import transformers

        module, function = side.run.split(":")
        verbosity = transformers.logging.get_verbosity()
        try:
            return json.loads(json.dumps(getattr(importlib.import_module(module), function)(side.spec)))
        finally:
            transformers.logging.set_verbosity(verbosity)


def test_learning_study_tuning_extends_an_edge_and_stops():
    """The pre-registered tuning: the grid in order, a best value on an edge extends the grid past it (at most
    max_extensions times), a tie goes to the lower rate."""
    sys.path.insert(0, str(BENCHMARKS))
    from learning_study import PLAN, tuning

    plan = {**PLAN, "grid": [1e-4, 3e-4, 1e-3], "max_extensions": 2, "tune_seed": 0}

    def runs(vals: dict) -> list[dict]:
        return [{"arm": "chord_phi", "seed": 0, "lr": lr, "val": v} for lr, v in vals.items()]

    assert tuning(runs({1e-4: 0.5}), plan, "chord_phi")["next"] == 3e-4  # the grid in order
    inside = tuning(runs({1e-4: 0.2, 3e-4: 0.5, 1e-3: 0.4}), plan, "chord_phi")
    assert (inside["lr"], inside["next"], inside["at_edge"]) == (3e-4, None, None)
    tie = tuning(runs({1e-4: 0.5, 3e-4: 0.5, 1e-3: 0.4}), plan, "chord_phi")  # the lower rate, an edge: extended
    assert tie["next"] == pytest.approx(1e-4 / 3, rel=1e-5)
    high = {1e-4: 0.2, 3e-4: 0.3, 1e-3: 0.5}
    assert tuning(runs(high), plan, "chord_phi")["next"] == 3e-3
    assert tuning(runs({**high, 3e-3: 0.6}), plan, "chord_phi")["next"] == 9e-3
    done = tuning(runs({**high, 3e-3: 0.6, 9e-3: 0.7}), plan, "chord_phi")  # still on the edge after 2: used, said
    assert (done["lr"], done["next"], done["at_edge"]) == (9e-3, None, "high")
    back = tuning(runs({**high, 3e-3: 0.4}), plan, "chord_phi")  # the extension lost: the old edge is interior now
    assert (back["lr"], back["next"], back["at_edge"]) == (1e-3, None, None)


def test_learning_study_runs_resumes_and_summarises_on_the_tiny_model(tmp_path):
    """The study end to end on a random tiny model and a miniature plan: the tuning seed first, then whole seeds;
    a restart runs nothing finished; the summary's tests are paired t over the complete seeds, Holm-corrected, and a
    study with seeds missing says it is partial."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_common
    import learning_study as ls

    model = bench_common.save_random_qwen2(tmp_path / "model", hidden=64, layers=2, intermediate=128)
    plan = {
        **ls.PLAN,
        **{"steps": 4, "eval_rows": 10, "probe_rows": 5, "val_rows": 5, "train_rows": 16, "expert_pool": 8},
        **{"scored_seeds": [1, 2], "grid": [1e-3], "max_extensions": 0, "completion_len": 8},
        "eval_max_new_tokens": 8,
    }
    out = tmp_path / "study"
    ls.run_study(out, plan, str(model), InProcess())
    records = [json.loads(line) for line in (out / ls.RUNS_FILE).read_text().splitlines()]
    order = [(r["arm"], r["seed"], r["role"]) for r in records]
    assert order == [("base", None, "base")] + [(a, 0, "tune") for a in plan["arms"]] + [
        (a, s, "scored") for s in (1, 2) for a in plan["arms"]
    ]
    sft_grpo = records[3]
    assert [p["step"] for p in sft_grpo["points"]] == [1, 3, 5] and sft_grpo["optimizer_steps"] == 5
    assert (sft_grpo["demonstrations"], sft_grpo["rollouts"]) == (8, 32) == (records[1]["demonstrations"], 32)
    final = records[-1]["points"][-1]
    assert len(final["completions"]) == len(final["outcomes"]) == 10 and records[-1]["val"] is None
    assert [p["n"] for p in records[1]["points"]] == [5, 5, 10] and 0.0 <= records[1]["val"] <= 1.0
    ls.run_study(out, plan, str(model), InProcess())  # a restart: nothing left to run
    assert len((out / ls.RUNS_FILE).read_text().splitlines()) == len(records)
    summary = ls.write_summary(out / ls.RUNS_FILE, tmp_path / "results", plan)
    assert not summary["partial"] and summary["complete_seeds"] == [1, 2]
    primary = summary["tests"]["primary"]
    scored = {(r["arm"], r["seed"]): r["points"][-1]["all"] for r in records if r["role"] == "scored"}
    assert primary["diffs"] == [scored[("chord_phi", s)] - scored[("sft_grpo", s)] for s in (1, 2)]
    assert (tmp_path / "results" / "learning_study_runs.jsonl").read_text() == (out / ls.RUNS_FILE).read_text()
    assert "## Pre-registered tests" in (tmp_path / "results" / "learning_study.md").read_text()
    # the last seed unfinished: partial, and said so
    (out / ls.RUNS_FILE).write_text("\n".join(json.dumps(r) for r in records[:-1]) + "\n")
    partial = ls.write_summary(out / ls.RUNS_FILE, tmp_path / "partial", plan)
    assert partial["partial"] and partial["complete_seeds"] == [1]
    assert "**PARTIAL: 1 of 2 scored seeds complete**" in (tmp_path / "partial" / "learning_study.md").read_text()
    # another plan's runs are not read
    assert ls.load_runs(out / ls.RUNS_FILE, ls.plan_key({**plan, "steps": 8})) == []


def test_the_committed_study_summary_is_that_of_the_committed_runs():
    """benchmarks/results/learning_study.md is what `summarise` makes of learning_study_runs.jsonl (no hand edits),
    while the study is partial the docs say it is running and quote no result, and once it is finished README and
    docs quote each pre-registered test exactly."""
    sys.path.insert(0, str(BENCHMARKS))
    from learning_study import PLAN, load_runs, markdown, plan_key, summarise

    results = BENCHMARKS / "results"
    summary = summarise(load_runs(results / "learning_study_runs.jsonl", plan_key(PLAN)), PLAN)
    assert (results / "learning_study.md").read_text() == markdown(summary)
    assert summary["runs_done"] >= 1  # the committed runs are of this plan
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("{ #learning-study }") :]
    readme = (ROOT / "README.md").read_text()
    if summary["partial"]:
        assert "**Running; no result yet.**" in section[:400]
        assert "running**; no result yet" in readme
        return
    # finished: README and docs quote each pre-registered test exactly as the summary has it
    assert "no result yet" not in section[:400] and "no result yet" not in readme
    for t in summary["tests"].values():
        assert _quoted(t) in section and _quoted(t) in readme, _quoted(t)


def _quoted(test: dict) -> str:
    """How README and docs quote a pre-registered test of a finished study: its mean, interval and p, as `summarise`
    computed them."""
    quote = f"{test['mean']:+.3f}, 95 % interval [{test['low']:+.3f}, {test['high']:+.3f}], p {test['p']:.3f}"
    return quote + f" (Holm {test['p_holm']:.3f})"


def test_async_vs_sync_dry_run(tmp_path):
    """`make gpu-check-async DRY_RUN=1`: one round of both sides on the tiny model (on `harness.Bench`), each a fresh
    process; the report re-renders from its JSON alike."""
    sys.path.insert(0, str(BENCHMARKS))
    import async_vs_sync

    _run("async_vs_sync.py", "--dry-run", "--out", str(tmp_path))
    report = _load(tmp_path / "async_vs_sync_dry.json")
    _check_machine(report)
    (part,) = report["parts"].values()
    (round_,) = part["repeats"]
    assert part["status"] == "done" and round_["order"] == ["sync", "async"]
    for side, sample in round_["samples"].items():
        assert sample["steps"] == 2 and sample["trained_tokens"] > 0 and len(sample["rewards"]) == 2, (side, sample)
    assert round_["samples"]["sync"]["staleness_mean"] == 0.0 and round_["samples"]["async"]["staleness_mean"] >= 0
    assert part["summary"]["ratios"]["async"]["train_s"]["median"] > 0
    text = (tmp_path / "async_vs_sync_dry.md").read_text()
    assert "| async |" in text and "Reward per step (median over rounds): sync " in text
    (tmp_path / "async_vs_sync_dry.md").unlink()
    assert async_vs_sync.main(["--report-only", str(tmp_path / "async_vs_sync_dry.json")]) == 0
    assert (tmp_path / "async_vs_sync_dry.md").read_text() == text


def test_whole_step_gpu_command_dry_run(tmp_path):
    """`make gpu-check-step DRY_RUN=1`: the GPU run's parts and sides on CPU with the tiny model, into $OUT (no --out):
    per part its model, the cache-warming run, then ours, TRL and TRL with continuous batching, each a fresh process
    whose steps are split by the phase timer (seams checked); the results hold every sample, the dtypes, the
    compilation counts and the split table."""
    sys.path.insert(0, str(BENCHMARKS))
    import phases
    import whole_step

    out = tmp_path / "out"
    _run("whole_step.py", "--gpu", "--dry-run", env={"OUT": str(out)})
    assert sorted(p.name for p in out.iterdir()) == [f"whole_step_cuda_dry.{x}" for x in ("json", "log", "md")]
    report = _load(out / "whole_step_cuda_dry.json")
    _check_machine(report)
    assert report["config"]["sides"] == list(whole_step.GPU_SIDES) == ["ours", "trl", "trl_cb"]
    assert len(report["parts"]) == len(whole_step.GPU_PARTS)
    for index, part in enumerate(report["parts"].values()):
        assert part["status"] == "done", part["why"]
        # the first part's uncounted run warms the compile caches; the later parts spend their time on repeats
        assert list(part["uncounted"]) == ["model", "ours, cold caches"][: 2 if index == 0 else 1]
        (repeat,) = part["repeats"]
        assert repeat["order"] == ["ours", "trl", "trl_cb"]
        for name, sample in repeat["samples"].items():
            assert len(sample["steps"]) == 2 and sample["step_s"] > 0, name  # 1 warm-up + 1 timed step
            assert set(sample["phases"]) == set(phases.PHASES) and sample["phases"]["generation"] > 0
            assert sample["dtype"]["parameters"] == "torch.float32" and sample["dtype"]["autocast"] is None
            assert set(sample["compile"]) == {"dynamo_compiles", "cudagraph_recordings", "cudagraph_replays"}
            assert len(sample["compile_per_step"]) == 2 and len(sample["completion_tokens"]) == 2
        assert repeat["samples"]["ours"]["trainer"] == "TrinityTrainer"
        assert any("continuous batching cache" in d for d in repeat["samples"]["trl_cb"]["departures"])
        assert [s["generation"]["continuous_batching"] for s in repeat["samples"].values()] == [False, False, True]
        for sample in repeat["samples"].values():  # the training part: the timed step less its generation
            timed = sample["steps"][1]
            assert sample["train_s"] == pytest.approx(timed["step_s"] - timed["host"]["generation"])
        assert {"step_s", "train_s", "phases.generation"} <= set(part["summary"]["ratios"]["ours"])
        assert part["summary"]["ratios"]["ours"]["train_s"]["median"] > 0
        assert "compiled" in part["compilation"]
    text = (out / "whole_step_cuda_dry.md").read_text()
    assert "## The split, per side" in text and "| ours | float32 |" in text and "| trl_cb | float32 |" in text
    (out / "whole_step_cuda_dry.md").unlink()
    assert whole_step.main(["--report-only", str(out / "whole_step_cuda_dry.json")]) == 0  # re-rendered alike
    assert (out / "whole_step_cuda_dry.md").read_text() == text


def test_whole_step_charges_compilation_per_run_and_counts_compilations():
    """The compilation charge: ours' first-step excess beyond TRL's, cold (the cache-warming run) and warm, repaid by
    the gain per step over the eager side (ours_off where it ran); and the counter sees dynamo compile a frame."""
    sys.path.insert(0, str(BENCHMARKS))
    import torch
    import whole_step

    def run(side, step, excess, compiles=1):
        return {"step_s": step, "first_step_excess_s": excess, "compile": {"dynamo_compiles": compiles}}

    part = {
        "uncounted": {"ours, cold caches": run("ours", 1.0, 21.0)},
        "repeats": [
            {"samples": {"ours": run("ours", 1.0, 6.0), "trl": run("trl", 3.0, 1.0), "ours_off": run("o", 2.0, 1.0)}},
            {"samples": {"ours": run("ours", 1.2, 5.0), "trl": run("trl", 3.2, 1.0), "ours_off": run("o", 2.2, 1.2)}},
        ],
    }
    c = whole_step.compilation(part)
    assert c["eager_side"] == "ours_off" and c["warm_s"] == pytest.approx(4.5) and c["cold_s"] == pytest.approx(20.0)
    assert c["gain_per_step_s"] == pytest.approx(1.0)
    assert c["repaid_after_steps"] == {"cold": pytest.approx(20.0), "warm": pytest.approx(4.5)}
    without_warming = {"repeats": part["repeats"]}  # ours' counted runs compiled cold
    assert whole_step.compilation(without_warming)["warm_s"] is None
    assert whole_step.compilation(without_warming)["cold_s"] == pytest.approx(4.5)
    for repeat in part["repeats"]:
        del repeat["samples"]["ours_off"]
    c = whole_step.compilation(part)
    assert c["eager_side"] == "trl" and c["gain_per_step_s"] == pytest.approx(2.0)
    assert c["repaid_after_steps"]["warm"] == pytest.approx(2.25)
    for repeat in part["repeats"]:
        repeat["samples"]["ours"]["compile"]["dynamo_compiles"] = 0
    assert whole_step.compilation(part) == {"compiled": False}

    torch._dynamo.reset()  # (clears the compilation callbacks too: the counter registers after it)
    counters = whole_step.CompileCounters()
    torch.compile(lambda x: torch.sin(x) + 1, backend="eager")(torch.ones(3))
    assert counters.totals()["dynamo_compiles"] >= 1 and counters.totals()["cudagraph_recordings"] == 0


def test_the_readme_and_docs_quote_the_committed_whole_step():
    """The README's first performance figure and docs/benchmarks.md#whole-step are the committed results' paired
    medians (benchmarks/results/whole_step.json), not a number typed once and left behind."""
    report = _load(BENCHMARKS / "results" / "whole_step.json")
    (part,) = [p for p in report["parts"].values() if p.get("repeats")]
    step, train = (part["summary"]["ratios"]["ours"][k] for k in ("step_s", "train_s"))
    readme = (ROOT / "README.md").read_text()
    assert f"takes {step['median']:.2f}x TRL's\n  time, its training part {train['median']:.2f}x" in readme
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    spread = f"{step['min']:.2f}-{step['max']:.2f}"
    quote = f"**{step['median']:.2f}x TRL's time for the whole step** (paired ratios {spread})"
    assert quote in docs and f"{train['median']:.2f}x for its training part" in docs


def test_generation_speed_sides_decode_the_job_they_name():
    """benchmarks/generation_speed.py's sides, in this process on the tiny model: each decodes the G copies of one
    prompt to the full completion length (the side asserts the output's shape) in float32, and the reading names
    the paired ratio."""
    sys.path.insert(0, str(BENCHMARKS))
    import generation_speed

    spec = {"model": "tiny", "prompt": 12, "completion": 3, "group": 4, "calls": 1}
    plain = generation_speed.run_side({**spec, "side": "plain"})
    grouped = generation_speed.run_side({**spec, "side": "grouped"})
    for sample in (plain, grouped):
        assert sample["dtype"] == "torch.float32" and len(sample["timed_s"]) == 1 and sample["generate_s"] > 0
        assert sample["compilations"] == 0
    report = {
        "parts": {"p": {"summary": {"ratios": {"grouped": {"generate_s": {"median": 0.5, "min": 0.4, "max": 0.6}}}}}}
    }
    assert "`grouped` generation took 0.50x `plain`'s (paired per repeat, 0.40-0.60)" in generation_speed.render(report)


def test_gigpo_study_runs_resumes_and_summarises_on_the_tiny_model(tmp_path):
    """The GiGPO study end to end on a random tiny model and a miniature plan: a base record, the tuning seed, then
    whole seeds; a restart runs nothing finished; the summary's tests are the per-seed differences of the evaluation
    games' success; a missing run makes it partial; a spent CPU budget stops the study and says so."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_common
    import gigpo_study as gs

    model = bench_common.save_random_qwen2(tmp_path / "model", hidden=64, layers=2, intermediate=128)
    plan = {
        **gs.PLAN,
        **{"steps": 2, "probe_steps": [1], "scored_seeds": [1], "grid": [1e-3], "max_extensions": 0},
        **{"high": 3, "max_env_steps": 2, "completion_len": 4, "num_generations": 4, "train_tasks": 8},
        **{"eval_plays": 2, "val_plays": 1},
    }
    out = tmp_path / "study"
    gs.run_study(out, plan, str(model), InProcess())
    records = [json.loads(line) for line in (out / gs.RUNS_FILE).read_text().splitlines()]
    order = [(r["arm"], r["seed"], r["role"]) for r in records]
    assert order == [("base", None, "base")] + [(a, 0, "tune") for a in plan["arms"]] + [
        (a, 1, "scored") for a in plan["arms"]
    ]
    gigpo, step_grpo = records[-3], records[-2]
    assert [p["step"] for p in gigpo["points"]] == [1, 2] and gigpo["points"][-1]["n"] == 6  # 3 targets x 2 plays
    assert gigpo["optimizer_steps"] == 2 and gigpo["runs_played"] == 8 and records[1]["val"] is not None
    assert all(0.0 <= h <= 1.0 for h in gigpo["anchor_hit_ratio"] if h is not None)
    assert step_grpo["anchor_hit_ratio"] == [None, None]  # step-wise GRPO logs no anchor hits
    gs.run_study(out, plan, str(model), InProcess())  # a restart: nothing left to run
    assert len((out / gs.RUNS_FILE).read_text().splitlines()) == len(records)
    summary = gs.write_summary(out / gs.RUNS_FILE, tmp_path / "results", plan)
    assert not summary["partial"] and summary["complete_seeds"] == [1]
    success = {r["arm"]: r["points"][-1]["success"] for r in records if r["role"] == "scored"}
    assert summary["tests"]["primary"]["diffs"] == [success["gigpo"] - success["step_grpo"]]
    assert summary["tests"]["secondary 1"]["diffs"] == [success["gigpo"] - success["gigpo_omega0"]]
    assert "## Pre-registered tests" in (tmp_path / "results" / "gigpo_study.md").read_text()
    (out / gs.RUNS_FILE).write_text("\n".join(json.dumps(r) for r in records[:-1]) + "\n")
    partial = gs.write_summary(out / gs.RUNS_FILE, tmp_path / "partial", plan)
    assert partial["partial"] and "**PARTIAL: 0 of 1 scored seeds complete**" in gs.markdown(partial)
    spent = {**plan, "cpu_budget_h": 0.0}  # another plan: its own runs, stopped after the base model
    gs.run_study(tmp_path / "spent", spent, str(model), InProcess())
    stopped = gs.summarise(gs.load_runs(tmp_path / "spent" / gs.RUNS_FILE, gs.plan_key(spent)), spent)
    assert stopped["runs_done"] == 0 and "The CPU budget (0.0 h of one core) is spent" in gs.markdown(stopped)
    assert "of the 0.0 h budget" in gs.status(tmp_path / "spent", spent)


def test_the_gigpo_plan_is_committed_under_its_fingerprint_and_the_chord_plan_is_unchanged():
    """The GiGPO study's plan file names the fingerprint of the PLAN its script runs (changing a value of the plan
    changes it), and the finished CHORD study keeps its own."""
    sys.path.insert(0, str(BENCHMARKS))
    import gigpo_study
    import learning_study

    assert learning_study.plan_key() == "cb3f9c6bfb3b"
    plan_file = (BENCHMARKS / "results" / "gigpo_study_plan.md").read_text()
    assert f"**`{gigpo_study.plan_key()}`**" in plan_file
    assert gigpo_study.plan_key({**gigpo_study.PLAN, "steps": 41}) != gigpo_study.plan_key()


def test_the_committed_gigpo_study_summary_is_that_of_the_committed_runs():
    """benchmarks/results/gigpo_study.md is what `summarise` makes of gigpo_study_runs.jsonl (no hand edits), and the
    docs say what the study has come to (`_check_study_section`)."""
    sys.path.insert(0, str(BENCHMARKS))
    from gigpo_study import PLAN, load_runs, markdown, plan_key, summarise

    results = BENCHMARKS / "results"
    summary = summarise(load_runs(results / "gigpo_study_runs.jsonl", plan_key(PLAN)), PLAN)
    assert (results / "gigpo_study.md").read_text() == markdown(summary)
    assert any(r["arm"] == "base" for r in load_runs(results / "gigpo_study_runs.jsonl", plan_key(PLAN)))
    _check_study_section(summary, "gigpo-study")


def test_m2po_study_runs_resumes_and_summarises_on_the_tiny_model(tmp_path):
    """The M2PO study end to end on a random tiny model and a miniature plan: a base record, the tuning seed, then a
    whole scored seed, each run in AsyncTrinityTrainer whose worker samples with lagged weights (its staleness logged
    per step); a restart runs nothing finished; the summary's test is the per-seed difference of the held-out
    accuracy; a missing run makes it partial; a spent CPU budget stops the study and says so."""
    sys.path.insert(0, str(BENCHMARKS))
    import bench_common
    import m2po_study as ms

    model = bench_common.save_random_qwen2(tmp_path / "model", hidden=64, layers=2, intermediate=128)
    plan = {
        **ms.PLAN,
        **{"steps": 3, "weight_lag": 1, "max_staleness": 4, "scored_seeds": [1], "grid": [1e-3], "max_extensions": 0},
        **{"num_generations": 4, "micro_batch": 2, "completion_len": 4, "train_rows": 8},
        **{"eval_rows": 10, "val_rows": 5, "eval_max_new_tokens": 4, "lora_r": 4},
    }
    out = tmp_path / "study"
    ms.run_study(out, plan, str(model), InProcess())
    records = [json.loads(line) for line in (out / ms.RUNS_FILE).read_text().splitlines()]
    order = [(r["arm"], r["seed"], r["role"]) for r in records]
    assert order == [("base", None, "base"), ("m2po", 0, "tune"), ("cispo", 0, "tune"), ("m2po", 1, "scored")] + [
        ("cispo", 1, "scored")
    ]
    m2po, cispo = records[-2], records[-1]
    for run in (m2po, cispo):
        assert run["optimizer_steps"] == 3 and len(run["staleness"]) == 3 and run["points"][-1]["n"] == 10
        assert all(s is not None and 0 <= s <= 4 for s in run["staleness"])  # logged at every step
    assert all(f is not None for f in m2po["masked_fraction"]) and set(cispo["masked_fraction"]) == {None}
    assert all(0 <= f <= 1 for f in cispo["cispo_capped"]) and set(m2po["cispo_capped"]) == {None}  # the cap's share
    assert records[1]["val"] is not None and records[3]["val"] is None  # validation on the tuning seed only
    ms.run_study(out, plan, str(model), InProcess())  # a restart: nothing left to run
    assert len((out / ms.RUNS_FILE).read_text().splitlines()) == len(records)
    summary = ms.write_summary(out / ms.RUNS_FILE, tmp_path / "results", plan)
    assert not summary["partial"] and summary["complete_seeds"] == [1]
    assert summary["tests"]["primary"]["diffs"] == [m2po["points"][-1]["all"] - cispo["points"][-1]["all"]]
    text = (tmp_path / "results" / "m2po_study.md").read_text()
    assert "## Pre-registered test" in text and "weight_lag=1" in text
    assert "CISPO capped" in text and ms.NOT_RECORDED not in text  # recorded, so not said to be missing
    (out / ms.RUNS_FILE).write_text("\n".join(json.dumps(r) for r in records[:-1]) + "\n")
    partial = ms.write_summary(out / ms.RUNS_FILE, tmp_path / "partial", plan)
    assert partial["partial"] and "**PARTIAL: 0 of 1 scored seeds complete** (both arms)" in ms.markdown(partial)
    spent = {**plan, "cpu_budget_h": 0.0}  # another plan: its own runs, stopped after the base model
    ms.run_study(tmp_path / "spent", spent, str(model), InProcess())
    stopped = ms.summarise(ms.load_runs(tmp_path / "spent" / ms.RUNS_FILE, ms.plan_key(spent)), spent)
    assert stopped["runs_done"] == 0 and "The CPU budget (0.0 h of one core) is spent" in ms.markdown(stopped)
    assert "of the 0.0 h budget" in ms.status(tmp_path / "spent", spent)


def test_the_m2po_plan_is_committed_under_its_fingerprint():
    """The M2PO study's plan file names the fingerprint of the PLAN its script runs (changing a value of the plan
    changes it); the other studies keep theirs."""
    sys.path.insert(0, str(BENCHMARKS))
    import gigpo_study
    import learning_study
    import m2po_study

    assert learning_study.plan_key() == "cb3f9c6bfb3b" and gigpo_study.plan_key() == "8359d859c68f"
    plan_file = (BENCHMARKS / "results" / "m2po_study_plan.md").read_text()
    assert f"**`{m2po_study.plan_key()}`**" in plan_file
    assert m2po_study.plan_key({**m2po_study.PLAN, "weight_lag": 3}) != m2po_study.plan_key()


def test_the_committed_m2po_study_summary_is_that_of_the_committed_runs():
    """benchmarks/results/m2po_study.md is what `summarise` makes of m2po_study_runs.jsonl (no hand edits), and the
    docs say what the study has come to (`_check_study_section`)."""
    sys.path.insert(0, str(BENCHMARKS))
    from m2po_study import PLAN, load_runs, markdown, plan_key, summarise

    results = BENCHMARKS / "results"
    summary = summarise(load_runs(results / "m2po_study_runs.jsonl", plan_key(PLAN)), PLAN)
    assert (results / "m2po_study.md").read_text() == markdown(summary)
    assert any(r["arm"] == "base" for r in load_runs(results / "m2po_study_runs.jsonl", plan_key(PLAN)))
    _check_study_section(summary, "m2po-study")


def _check_study_section(summary: dict, anchor: str) -> None:
    """While a study is partial its section of docs/benchmarks.md says it is running and quotes no result; once it is
    finished the section and README quote each of its pre-registered tests exactly."""
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index(f"{{ #{anchor} }}") :]
    section = section[: section.index("\n## ")]
    if summary["partial"]:
        assert "**Running; no result yet.**" in section[:200]
        return
    readme = (ROOT / "README.md").read_text()
    assert "no result yet" not in section
    for t in summary["tests"].values():
        assert _quoted(t) in section and _quoted(t) in readme, _quoted(t)
