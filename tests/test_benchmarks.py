"""Smoke tests of the benchmark scripts: each runs its smallest setting on the tiny model into a temporary
directory and writes its result files with the expected keys. Nothing here looks at timings (they are only
measured, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launching import scaled_timeout

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _run(script: str, *args: str, timeout: int = 600) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
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


def test_trl_overhead_quick_one_pair(tmp_path):
    _run("trl_overhead.py", "--quick", "--pairs", "cispo", "--out", str(tmp_path))
    report = _load(tmp_path / "trl_overhead.json")
    _check_machine(report)
    pair = report["results"]["cispo"]
    for side in ("ours", "trl"):
        assert {"step_s", "train_s", "generation_s", "process_peak_rss_mib", "micro_batch"} <= set(pair[side])
        assert pair[side]["step_s"] > 0
    assert {"step", "train", "step_paired", "memory"} <= set(pair["ratio"])
    # the pair is equivalent: both sides log the same loss and gradient norm at every step
    assert pair["equivalence"]["loss_max_abs_diff"] < 1e-3
    assert pair["equivalence"]["grad_norm_max_rel_diff"] < 1e-2
    text = (tmp_path / "trl_overhead.md").read_text()
    assert "| cispo | " in text and "| cispo | ours |" in text  # the comparison row and its time breakdown


@pytest.mark.slow
def test_trl_overhead_quick_all(tmp_path):
    _run("trl_overhead.py", "--quick", "--out", str(tmp_path))
    report = _load(tmp_path / "trl_overhead.json")
    assert set(report["results"]) == {"cispo", "sapo", "gspo", "grpo", "chord"}
    for name in ("cispo", "sapo", "gspo", "grpo"):
        assert report["results"][name]["equivalence"]["grad_norm_max_rel_diff"] < 1e-2, name
    chord = report["results"]["chord"]
    assert chord["ours"]["micro_batch"]["rows"] == chord["trl_same_rows"]["micro_batch"]["rows"]
    assert {"train_vs_same_rows", "added_train_over_extra_rows_cost"} <= set(chord["ratio"])


def test_learning_quick_tiny_tunes_each_method_resumes_and_pairs(tmp_path):
    tiny = [
        "--model",
        "tiny",
        "--quick",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--eval-rows",
        "5",
        "--val-rows",
        "5",
        "--eval-max-new-tokens",
        "8",
        "--completion-len",
        "8",
        "--seeds",
        "0",
        "1",
        "--learning-rates",
        "1e-3",
        "2e-4",
        "--out",
        str(tmp_path),
        "--resume-from",  # nothing: the committed runs file is not copied in
    ]
    _run("learning.py", *tiny, "--methods", "grpo", "sft_grpo")
    runs = [json.loads(line) for line in (tmp_path / "learning_runs.jsonl").read_text().splitlines()]
    # the grid on the tuning seed (every method at one rate, then the next), then seed 1 at each chosen rate
    assert [(r["method"], r["seed"], r.get("lr")) for r in runs[:5]] == [
        ("base", None, None),
        ("grpo", 0, 1e-3),
        ("sft_grpo", 0, 1e-3),
        ("grpo", 0, 2e-4),
        ("sft_grpo", 0, 2e-4),
    ]
    for method in ("grpo", "sft_grpo"):
        tuned = {r["lr"]: r["val"] for r in runs if r["method"] == method and r["seed"] == 0}
        best = max(tuned, key=lambda lr: (tuned[lr], lr == 1e-3))  # a tie goes to the rate listed first
        assert [(r["seed"], r["lr"]) for r in runs if r["method"] == method and r["seed"] == 1] == [(1, best)]
    sft_grpo = runs[2]
    assert sft_grpo["sft_steps"] == 1 and [p["step"] for p in sft_grpo["curve"]] == [1, 2]  # SFT, then GRPO
    assert len(sft_grpo["train_reward"]) == 1 and sft_grpo["mu"] == []  # rewards of the GRPO stage only
    assert len(sft_grpo["curve"][-1]["outcomes"]) == 5 and "outcomes" not in sft_grpo["curve"][0]
    assert runs[1]["generation_cpu_s"] > 0 and runs[1]["generation_cpu_s"] < runs[1]["train_cpu_s"]
    assert len(runs[1]["frac_reward_zero_std"]) == 2 and 0.0 <= runs[1]["val"] <= 1.0
    # a second invocation with one more method runs only that one's grid and seed (the others are read back)
    _run("learning.py", *tiny, "--methods", "grpo", "sft_grpo", "chord_mu")
    runs = [json.loads(line) for line in (tmp_path / "learning_runs.jsonl").read_text().splitlines()]
    assert [r["method"] for r in runs[7:]] == ["chord_mu"] * 3 and len(runs) == 10
    chord = runs[7]
    assert len(chord["mu"]) == 2 and chord["mu"][0] > chord["mu"][1]  # CHORD-mu's mu decays over the run
    report = _load(tmp_path / "learning.json")
    _check_machine(report)
    assert report["num_runs"] == report["planned_runs"] == 9
    assert set(report["summary"]) == set(report["rates"]) == {"grpo", "sft_grpo", "chord_mu"}
    for method, summary in report["summary"].items():
        assert summary["lr"] == report["rates"][method]["lr"] and summary["seeds"] == [0, 1]
        for group in ("all", "covered", "uncovered"):
            assert set(summary["accuracy"][group]) == {"0", "1", "2"}, (method, group)
            assert summary["accuracy"][group]["2"]["n"] == 2
        assert 0.0 <= summary["final"]["all"]["mean"] <= 1.0
        assert 0.0 < summary["generation_share"] < 1.0 and summary["train_cpu_s_per_step"] > 0
    pair = report["paired"]
    assert pair["methods"] == ["chord_mu", "sft_grpo"] and pair["seeds"] == [0, 1]
    finals = {
        m: [
            max(r["curve"], key=lambda p: p["step"])
            for r in runs
            if r["method"] == m and r.get("lr") == report["rates"][m]["lr"]
        ]
        for m in ("chord_mu", "sft_grpo")
    }
    diffs = [a["all"] - b["all"] for a, b in zip(finals["chord_mu"], finals["sft_grpo"])]
    assert pair["all"]["diffs"] == diffs  # the same subtraction of the same values
    only_a = sum(
        x > y for a, b in zip(finals["chord_mu"], finals["sft_grpo"]) for x, y in zip(a["outcomes"], b["outcomes"])
    )
    assert pair["problems"]["only_a"] == only_a and 0.0 <= pair["problems"]["sign_test_p"] <= 1.0
    assert report["config"]["covered"] == ["add", "sub", "mul"]
    text = (tmp_path / "learning.md").read_text()
    assert "uncovered templates (div, two_step)" in text and f"Settings fingerprint `{report['settings']}`" in text
    assert "## Tuning" in text and "## Paired comparison: CHORD-mu minus SFT then GRPO" in text
    png = tmp_path / "learning.png"
    if png.exists():  # matplotlib is optional
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # re-rendering trains nothing, adds the notes and keeps what the training process recorded
    report["machine"]["cpu"] = "the machine that trained"
    (tmp_path / "learning.json").write_text(json.dumps(report))
    _run("learning.py", *tiny, "--methods", "grpo", "sft_grpo", "chord_mu", "--report-only", "--note", "a reading")
    assert len((tmp_path / "learning_runs.jsonl").read_text().splitlines()) == 10
    rendered = _load(tmp_path / "learning.json")
    assert rendered["machine"]["cpu"] == "the machine that trained"
    assert rendered["command"] == report["command"] and rendered["summary"] == report["summary"]
    assert "- a reading" in (tmp_path / "learning.md").read_text()


def test_sign_test_matches_the_binomial_distribution():
    sys.path.insert(0, str(BENCHMARKS))
    from learning import _sign_test

    assert _sign_test(0, 0) == 1.0
    assert _sign_test(5, 0) == 2 / 32  # one-sided 1/32, doubled
    assert _sign_test(1, 4) == _sign_test(4, 1) == 2 * 6 / 32  # P(X <= 1) = 6/32
    assert _sign_test(3, 3) == 1.0


def test_prefix_packing_quick(tmp_path):
    _run("prefix_packing.py", "--quick", "--out", str(tmp_path))
    report = _load(tmp_path / "prefix_packing.json")
    _check_machine(report)
    (point,) = report["results"]
    comparison = point["comparison"]
    for key in ("train_time_ratio", "step_time_ratio", "memory_ratio"):
        assert comparison[key] > 0, key
    assert comparison["ours"]["forwarded_token_ratio"] < 1.0  # the packed forward ran
    assert comparison["equivalence"]["equivalent"], comparison["equivalence"]
    assert report["not_measured"] == [] and "headline_met" in report["summary"]
    assert "| tiny | 32 | 8 | 4 |" in (tmp_path / "prefix_packing.md").read_text()


def test_demo_profile_on_the_tiny_model(tmp_path, tiny_model_dir):
    """The demo's own trainer, built from its config with overrides; each phase is timed and the shares add up."""
    small = ["num_train_rows=8", "num_eval_rows=4", "eval_batch_size=4", "eval_max_new_tokens=4"]
    small += ["max_completion_length=4", "num_expert_rows=8", "lora_r=4", "lora_alpha=8"]
    sets = [arg for pair in zip(["--set"] * 9, [f"model_name_or_path={tiny_model_dir}", *small]) for arg in pair]
    _run("demo_profile.py", *sets, "--warmup", "0", "--steps", "1", "--label", "t", "--out", str(tmp_path))
    report = _load(tmp_path / "demo_profile-t.json")
    _check_machine(report)
    assert report["eval"]["rows"] == 4 and report["gradient_checkpointing"] is False  # the CPU default
    for part in ("eval", "step"):
        phases = {row["phase"]: row for row in report[part]["phases"]}
        assert abs(sum(row["share"] for row in phases.values()) - 1.0) < 1e-6, part
    assert {"backward", "optimizer step", "loss/log-prob helper/forward"} <= set(phases)
    assert set(report["lora"]) == {"train shape (4 x prompt+40)", "decode shape (20 x 1 token)"}  # 4 held-out rows
    assert all(v["lora_cpu_s"] > 0 and v["plain_cpu_s"] > 0 for v in report["lora"].values())
    assert "## One training step" in (tmp_path / "demo_profile-t.md").read_text()


# what benchmarks/README.md states of the study's default (paired) setting and of its full setting (--full)
PAIR_STATES = {
    "methods": ["chord_mu", "sft_grpo"],
    "seeds": [0, 1, 2],
    "steps": 60,
    "eval_every": 0,
    "eval_rows": 200,
    "val_rows": 100,
    "learning_rates": [1e-4, 3e-4],
    "rows": 8,
    "expert_rows": 4,
    "num_generations": 4,
    "completion_len": 40,
    "temperature": 0.8,
    "covered": ["add", "sub", "mul"],
}
FULL_STATES = {
    **PAIR_STATES,
    "methods": ["grpo", "sft", "sft_grpo", "chord_mu", "chord_phi", "mix"],
    "steps": 100,
    "eval_every": 25,
    "learning_rates": [3e-4, 1e-4, 1e-3],
}


def test_learning_settings_are_what_the_readme_states():
    sys.path.insert(0, str(BENCHMARKS))
    from learning import parse_args

    for argv, states in (([], PAIR_STATES), (["--full"], FULL_STATES)):
        args = parse_args(argv)
        assert {key: getattr(args, key) for key in states} == states, argv
    text = (BENCHMARKS / "README.md").read_text()
    section = text[text.index("## `learning.py`") :]
    for stated in (
        "60 optimizer steps of 8 training rows each, seeds 0, 1, 2",
        "200 held-out problems",
        "the learning rates 1e-4 and 3e-4",
        "100 **validation** problems",
        "2 x (2 + 2) = 8 runs",
        "(`--full`): 100 optimizer steps",
        "the learning rates 3e-4, 1e-4 and 1e-3",
        "6 x (3 + 2) = 30 runs",
    ):
        assert stated in section, stated


def test_learning_fingerprint_changes_with_what_a_run_measures():
    sys.path.insert(0, str(BENCHMARKS))
    from learning import RUN_KEYS, parse_args, settings_key

    base = settings_key(parse_args([]))
    assert base == settings_key(parse_args([]))  # deterministic
    assert base != settings_key(parse_args(["--full"]))  # 100 steps, an evaluation every 25
    for option in (["--steps", "61"], ["--eval-rows", "199"], ["--eval-every", "20"], ["--completion-len", "32"]):
        assert settings_key(parse_args(option)) != base, option
    for option in (["--covered", "add", "sub"], ["--rows", "12"], ["--sft-steps", "20"], ["--val-rows", "50"]):
        assert settings_key(parse_args(option)) != base, option
    # options that do not change a run's measurement keep it: which runs to do, threads, where to write
    for option in (["--seeds", "0", "1", "2", "3"], ["--threads", "2"], ["--out", "/elsewhere"], ["--note", "x"]):
        assert settings_key(parse_args(option)) == base, option
    assert {"steps", "eval_every", "eval_rows", "val_rows", "completion_len", "rows"} <= set(RUN_KEYS)


def _records(key: str, ids: list[tuple]) -> list[dict]:
    return [{"settings": key, "method": m, "seed": seed, "lr": lr, "val": 0.5} for m, seed, lr in ids]


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_learning_resumes_from_the_committed_runs_without_counting_a_run_twice(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    from learning import load_runs, merge_runs, run_id

    committed, out = tmp_path / "committed.jsonl", tmp_path / "out" / "learning_runs.jsonl"
    ours = [("base", None, None), ("chord_mu", 0, 1e-4), ("sft_grpo", 0, 1e-4)]
    other = _records("bbb", [("chord_mu", 0, 1e-4)])  # the same run under other settings: another run
    _write(committed, _records("aaa", ours) + other)
    # a fresh output folder gets every recorded run; the current settings read only their own
    assert merge_runs(out, [committed]) == 4
    assert [run_id(r)[1:] for r in load_runs(out, "aaa")] == ours and load_runs(out, "bbb") == other
    assert merge_runs(out, [committed]) == 0  # nothing twice
    # the output folder ran on: its own runs stay, the committed file's new ones are added once
    with out.open("a") as f:
        f.write(json.dumps(_records("aaa", [("chord_mu", 0, 3e-4)])[0]) + "\n")
    _write(committed, _records("aaa", ours + [("sft_grpo", 0, 3e-4), ("chord_mu", 0, 3e-4)]) + other)
    assert merge_runs(out, [committed]) == 1
    ids = [run_id(r)[1:] for r in load_runs(out, "aaa")]
    assert ids == ours + [("chord_mu", 0, 3e-4), ("sft_grpo", 0, 3e-4)] and len(set(ids)) == len(ids)
    # a missing source and the output file itself are left alone
    assert merge_runs(out, [tmp_path / "missing.jsonl", out]) == 0
    assert len(out.read_text().splitlines()) == 6


def test_learning_sign_test_per_template_group():
    sys.path.insert(0, str(BENCHMARKS))
    from learning import _sign_test, paired

    kinds = ["add", "div", "mul", "two_step", "sub", "div"]

    def run(method, seed, outcomes):
        point = {"step": 60, "all": sum(outcomes) / 6, "covered": 0.0, "uncovered": 0.0}
        return {"method": method, "seed": seed, "lr": 1e-4, "curve": [{**point, "outcomes": outcomes, "kinds": kinds}]}

    records = [
        run("chord_mu", 0, [1, 1, 0, 1, 1, 0]),
        run("sft_grpo", 0, [0, 0, 1, 0, 1, 0]),
        run("chord_mu", 1, [1, 0, 1, 1, 0, 0]),
        run("sft_grpo", 1, [0, 1, 1, 0, 1, 1]),
    ]
    rates = {m: {"lr": 1e-4} for m in ("chord_mu", "sft_grpo")}
    pair = paired(records, rates, "chord_mu", "sft_grpo", covered=["add", "sub", "mul"])
    groups = pair["problems_by_group"]
    # covered: seed 0 add +1, mul -1; seed 1 add +1, sub -1. uncovered: seed 0 div +1, two_step +1; seed 1
    # div -1 (index 1), two_step +1, div -1 (index 5)
    assert (groups["covered"]["only_a"], groups["covered"]["only_b"]) == (2, 2)
    assert (groups["uncovered"]["only_a"], groups["uncovered"]["only_b"]) == (3, 2)
    assert groups["all"] == pair["problems"] == {"only_a": 5, "only_b": 4, "sign_test_p": _sign_test(5, 4)}
    assert groups["uncovered"]["sign_test_p"] == _sign_test(3, 2)
    assert "problems_by_group" not in paired(records, rates, "chord_mu", "sft_grpo")  # no groups without covered


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


def test_threads_quick_on_the_tiny_model(tmp_path, tiny_model_dir):
    output = tmp_path / "threads.json"
    _run(
        "threads.py", "--threads", "1", "--steps", "1", "--no-busy", "--model", tiny_model_dir, "--output", str(output)
    )
    (run,) = _load(output)["runs"]
    assert run["threads"] == 1 and run["threads_used"] == 1 and len(run["step_times"]) == 1


def test_gpu_check_dry_run_runs_every_part_into_out(tmp_path):
    """`make gpu-check DRY_RUN=1`: every part on CPU into $OUT (no --out), at most 8 files, the summary first; the
    benchmark's direct packed-vs-padded check ran and every trainer trained 2 steps with packing."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out)}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--dry-run"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled_timeout(600),
        env=env,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_check.md", "gpu_check.json", "prefix_packing.json"} <= set(files), files
    summary = _load(out / "gpu_check.json")
    assert summary["dry_run"] and list(summary["parts"]) == ["tests", "bench", "trainers"]
    assert all(part["status"] == "passed" and part["wall_s"] > 0 for part in summary["parts"].values())
    tests = summary["parts"]["tests"]["counts"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # the CUDA tests skip on CPU, with the reason
    (point,) = summary["parts"]["bench"]["points"]
    assert point["equivalent"] and point["train_part_ratio"] > 0 and point["grads_rtol"] > 0
    trainers = summary["parts"]["trainers"]["trainers"]
    assert [t["trainer"] for t in trainers] == ["trinity", "chord", "cispo", "sapo", "ppo", "step_grpo"]
    for t in trainers:
        assert t["ok"] and t["steps"] == 2 and min(t["forwarded_token_ratio"]) < 1.0, t
    assert [t["target"] for t in summary["targets"]][0].startswith("training part, 1.5B")
    assert "| bench | passed |" in (out / "gpu_check.md").read_text()
    assert "Trainers, 2 steps with packing auto" in proc.stdout  # the one-screen summary


def test_gpu_check_stops_a_part_over_budget_and_runs_the_rest(tmp_path):
    """A part that overruns its budget is stopped (its process group killed) and reported; the next part runs."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "gpu_check.py"),
            "--dry-run",
            "--parts",
            "tests,trainers",
            "--budget-tests",
            "0.5",
            "--trainers",
            "trinity",
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
    assert parts["tests"]["status"] == "timeout" and parts["tests"]["wall_s"] < 30
    assert parts["trainers"]["status"] == "passed" and parts["trainers"]["trainers"][0]["ok"]


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


def test_async_vs_sync_dry_run(tmp_path):
    """`make gpu-check-async DRY_RUN=1`: one round of both sides on the tiny model, each a fresh process."""
    _run("async_vs_sync.py", "--dry-run", "--out", str(tmp_path))
    report = _load(tmp_path / "async_vs_sync_dry.json")
    _check_machine(report)
    (round_,) = report["rounds"]
    for side in ("sync", "async"):
        assert round_[side]["steps"] == 2 and round_[side]["trained_tokens"] > 0, round_[side]
        assert len(round_[side]["rewards"]) == 2
    assert round_["sync"]["staleness_mean"] == 0.0 and round_["async"]["staleness_mean"] >= 0.0
    assert report["summary"]["ratio_time_to_steps"]["median"] > 0
    assert "| time to 2 steps (s) |" in (tmp_path / "async_vs_sync_dry.md").read_text()
