"""The benchmarks' harness (`benchmarks/harness.py`): fresh processes, alternation, time marks, result files written
after every sample, paired ratios. The sides here are tiny functions of a module written to a temporary folder."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

SIDES = '''
import json, os, subprocess, sys, time
from pathlib import Path


def value(spec):
    time.sleep(spec.get("sleep", 0))
    group = {"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0)}
    return {"step_s": spec["value"], "phases": {"generation": spec["value"] * 2}, **group}


def files_so_far(spec):
    """The samples the bench's JSON file held when this side started (it is rewritten after every sample)."""
    report = json.loads(Path(spec["json"]).read_text())
    repeats = report["parts"]["p"].get("repeats", [])
    return {"step_s": 1.0, "seen": sum(len(r["samples"]) for r in repeats)}


def hang(spec):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(spec["pid_file"]).write_text(str(child.pid))
    time.sleep(120)


def fail(spec):
    raise ValueError("this side fails")
'''


@pytest.fixture
def sides_env(tmp_path):
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "toy_sides.py").write_text(SIDES)
    return {"PYTHONPATH": str(tmp_path / "mod")}


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within 5 s."""
    for _ in range(50):
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            return True
        time.sleep(0.1)
    return False


def _side(name, function, env, **spec):
    return harness.Side(name, f"toy_sides:{function}", spec, env)


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["spawned", "forked"])
def test_sides_alternate_in_fresh_processes_with_paired_ratios(tmp_path, sides_env, preload):
    bench = harness.Bench("toy", tmp_path / "out", config={"k": 1}, preload=preload)
    part = bench.part("p", description="three sides")
    sides = [
        _side("a", "value", sides_env, value=1.0),
        _side("b", "files_so_far", sides_env, json=str(tmp_path / "out" / "toy.json")),
        _side("c", "value", sides_env, value=4.0),
    ]
    part.run(sides, repeats=3, reference="c", ratios=("step_s", "phases.generation"))
    assert bench.finish() == 0
    report = json.loads((tmp_path / "out" / "toy.json").read_text())
    record = report["parts"]["p"]
    assert record["status"] == "done" and record["why"] is None
    assert [r["order"] for r in record["repeats"]] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    # the file is rewritten after every sample: side b saw every sample that finished before it
    assert [r["samples"]["b"]["seen"] for r in record["repeats"]] == [1, 4, 7]
    pids = [r["samples"][s]["pid"] for r in record["repeats"] for s in ("a", "c")]
    assert len(set(pids)) == 6 and os.getpid() not in pids  # a fresh process per sample
    # each leads its own process group (stopped whole at a timeout) in this session: a new session would be a new
    # scheduler autogroup, weighted as nice 0 however niced the study that started it
    samples = [r["samples"][s] for r in record["repeats"] for s in ("a", "c")]
    assert all(s["pgid"] == s["pid"] and s["sid"] == os.getsid(0) for s in samples)
    assert all(r["samples"][s]["process_wall_s"] > 0 for r in record["repeats"] for s in "abc")
    summary = record["summary"]
    assert summary["sides"]["a"]["phases.generation"] == {"median": 2.0, "min": 2.0, "max": 2.0, "n": 3}
    assert summary["ratios"]["a"]["step_s"]["median"] == pytest.approx(0.25)
    assert summary["ratios"]["b"]["step_s"]["median"] == pytest.approx(0.25)
    assert all(isinstance(r["samples"]["a"]["loadavg_before"], list) for r in record["repeats"])
    assert {"cpu", "os_cpu_count", "torch", "trl", "transformers", "torch_threads"} <= set(report["machine"])
    assert report["load_average_start"] and report["load_average_end"]
    text = (tmp_path / "out" / "toy.md").read_text()
    assert "| a | 1 (1-1) | 0.25 (0.25-0.25) |" in text and "| 2 | c b a |" in text


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["spawned", "forked"])
def test_a_part_past_its_time_mark_skips_itself_and_a_hung_side_is_stopped(tmp_path, sides_env, preload):
    bench = harness.Bench("toy", tmp_path, config={}, budget_s=60, preload=preload)
    late = bench.part("late", mark_s=0.0)
    assert late.skipped
    late.run([_side("a", "value", sides_env, value=1.0)], repeats=2)  # runs nothing
    pid_file = tmp_path / "grandchild.pid"
    hung = bench.part("hung", mark_s=60)
    side = harness.Side("h", "toy_sides:hang", {"pid_file": str(pid_file)}, sides_env, timeout_s=3)
    start = time.monotonic()
    hung.run([side, _side("f", "fail", sides_env)], repeats=2)
    assert time.monotonic() - start < 30
    assert bench.finish() == 1
    parts = json.loads((tmp_path / "toy.json").read_text())["parts"]
    assert parts["late"]["status"] == "skipped"
    assert "time mark (0 s) had passed before it started" in parts["late"]["why"]
    assert "repeats" not in parts["late"] or parts["late"]["repeats"] == []
    assert parts["hung"]["status"] == "cut" and parts["hung"]["why"] == "h timed out"
    (repeat,) = parts["hung"]["repeats"]
    assert repeat["samples"]["h"]["timed_out"] and list(repeat["samples"]) == ["h"]
    assert _stopped(int(pid_file.read_text())), "the side's child process survived its timeout"  # the whole group


def test_a_part_reaching_its_mark_between_repeats_keeps_what_finished(tmp_path, sides_env):
    bench = harness.Bench("toy", tmp_path, config={})
    part = bench.part("p", mark_s=bench.elapsed() + 1.0)
    part.run([_side("a", "value", sides_env, value=1.0, sleep=1.5), _side("f", "fail", sides_env)], repeats=3)
    record = json.loads((tmp_path / "toy.json").read_text())["parts"]["p"]
    assert record["status"] == "cut" and "before repeat 2" in record["why"]
    (repeat,) = record["repeats"]
    assert repeat["samples"]["a"]["step_s"] == 1.0
    assert "this side fails" in repeat["samples"]["f"]["output_tail"]  # a failing side's own output is kept
    assert record["summary"]["sides"]["a"]["step_s"]["n"] == 1 and record["summary"]["sides"]["f"] == {}


# ------------------------------------------------------------------------------------------------- phase timer
import phases  # noqa: E402


class FakeEvent:
    """`torch.cuda.Event` on CPU: records the host clock; ``query`` is False until the test says the device
    passed it; ``synchronize`` is counted (the timer may call it only at the end of training)."""

    passed = False
    synchronized = 0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def query(self):
        return FakeEvent.passed

    def synchronize(self):
        FakeEvent.synchronized += 1

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _train(trainer, **timer_kwargs):
    timer = phases.PhaseTimer(trainer, **timer_kwargs)
    trainer.train()
    return timer


def _trl_trainer(tmp_path, model, dataset, **config):
    from helpers import length_reward, tiny_grpo_kwargs
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path), **{"max_steps": 2, **config}))
    return GRPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=dataset)


def _assert_partition(step):
    """Every phase is there (0 when it did not run) and the phases add up to the step."""
    assert set(step["host"]) == set(phases.PHASES)
    assert all(v >= 0 for v in step["host"].values())
    resolution = max(time.get_clock_info("perf_counter").resolution, 1e-9)
    assert sum(step["host"].values()) == pytest.approx(step["step_s"], abs=20 * resolution)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_phase_timer_splits_trls_steps_and_ours(tmp_path, tiny_model_dir, tiny_dataset):
    """TRL's GRPOTrainer at its defaults (no old or reference log-probs: logprob 0), with a reference model (beta:
    logprob runs) and our TrinityTrainer: every step split, the phases add up to the step, the seams checked
    (check=True). TRL's run also takes the CUDA path with a stand-in event: nothing is waited on during training, a
    step's device split is read at a later step's start once the device passed its events (else at the end)."""
    from helpers import length_reward, tiny_grpo_kwargs
    from transformers import TrainerCallback

    from trinity_trl.trainers import TrinityConfig, TrinityTrainer

    FakeEvent.passed, FakeEvent.synchronized, seen = False, 0, []

    class Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # after the timer's own callback
            seen.append((FakeEvent.synchronized, [s["device"] is not None for s in plain.steps]))

        def on_step_end(self, args, state, control, **kwargs):
            FakeEvent.passed = state.global_step == 2  # the device passed steps 0 and 1 after step 1's end

    trainer = _trl_trainer(tmp_path / "a", tiny_model_dir, tiny_dataset, max_steps=3)
    plain = phases.PhaseTimer(trainer, cuda=True, event_class=FakeEvent, check=True)
    trainer.add_callback(Watch())
    trainer.train()
    assert seen == [(0, []), (0, [False]), (0, [True, True])]
    assert FakeEvent.synchronized == 1  # the end of training waits for the last step's events
    with_ref = _train(_trl_trainer(tmp_path / "b", tiny_model_dir, tiny_dataset, beta=0.1), check=True)
    ours_trainer = TrinityTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=tiny_dataset,
        args=TrinityConfig(**tiny_grpo_kwargs(output_dir=str(tmp_path / "c"), algorithm="grpo")),
    )
    ours = _train(ours_trainer, check=True)
    for timer in (plain, with_ref, ours):
        assert [s["global_step"] for s in timer.steps] == list(range(len(timer.steps))) and len(timer.steps) >= 2
        for step in timer.steps:
            _assert_partition(step)
            for phase in ("generation", "reward", "loss", "backward", "optimizer", "rest"):
                assert step["host"][phase] > 0, (phase, step)
            assert step["calls"]["generation"] == 1 and step["calls"]["backward"] >= 1
    for step in plain.steps:
        assert set(step["device"]) == set(phases.PHASES) and step["host"]["logprob"] == step["calls"]["logprob"] == 0
        # the stand-in events read the host clock just after the timer's own reading of each boundary
        assert step["device_step_s"] == pytest.approx(step["step_s"], abs=1e-3)
        assert step["device"]["generation"] == pytest.approx(step["host"]["generation"], abs=1e-3)
    assert all(s["host"]["logprob"] > 0 and s["calls"]["logprob"] >= 1 for s in with_ref.steps)
    assert all(s["device"] is None for s in ours.steps)  # no CUDA here
    summary = phases.summarise_steps(plain.steps, skip=1)
    assert summary["step_s"] > 0 and set(summary["host"]) == set(summary["device"]) == set(phases.PHASES)
    ours.remove()
    assert not {"compute_loss", "_generate_single_turn", "_calculate_rewards"} & set(vars(ours_trainer))
    assert "backward" not in vars(ours_trainer.accelerator)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_phase_timer_fails_when_a_seam_is_not_wrapped(tmp_path, tiny_model_dir, tiny_dataset, monkeypatch):
    """With check=True a forward or a gradient outside the wrapped seams raises instead of landing in `rest`; a
    trainer without a seam is refused when the timer is made."""
    trainer = _trl_trainer(tmp_path / "a", tiny_model_dir, tiny_dataset, max_steps=1)
    monkeypatch.setattr(phases, "SEAMS", {k: v for k, v in phases.SEAMS.items() if k != "compute_loss"})
    with pytest.raises(phases.PhaseError, match="forward of the policy ran in no phase"):
        _train(trainer, check=True)
    monkeypatch.undo()
    trainer = _trl_trainer(tmp_path / "b", tiny_model_dir, tiny_dataset, max_steps=1)
    monkeypatch.setattr(trainer.accelerator, "backward", trainer.accelerator.backward)  # left unwrapped below
    original_wrap, unwrapped = phases.PhaseTimer._wrap, ("backward", "_get_per_token_logps_and_entropies")
    monkeypatch.setattr(
        phases.PhaseTimer,
        "_wrap",
        lambda self, obj, attr, *a, **kw: None if attr in unwrapped else original_wrap(self, obj, attr, *a, **kw),
    )
    with pytest.raises(phases.PhaseError, match="gradient was accumulated outside"):
        _train(trainer, check=True)
    monkeypatch.undo()

    class NoGeneration:
        accelerator = trainer.accelerator

    with pytest.raises(phases.PhaseError, match="no method '_generate_single_turn'"):
        phases.PhaseTimer(NoGeneration())


def test_a_stopped_bench_stops_the_sample_it_runs(tmp_path, sides_env):
    """SIGTERM to the driver (a device command at its limit, `kill`): the running sample's whole group stops too."""
    import signal
    import subprocess

    pid_file = tmp_path / "grandchild.pid"
    driver = (
        "import sys; sys.path.insert(0, sys.argv[1]); import harness\n"
        "bench = harness.Bench('toy', sys.argv[2], config={})\n"
        "side = harness.Side('h', 'toy_sides:hang', {'pid_file': sys.argv[3]}, {'PYTHONPATH': sys.argv[4]})\n"
        "bench.part('p').run([side], repeats=1)\n"
    )
    args = [str(ROOT / "benchmarks"), str(tmp_path), str(pid_file), sides_env["PYTHONPATH"]]
    proc = subprocess.Popen([sys.executable, "-c", driver, *args])
    for _ in range(300):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert _stopped(int(pid_file.read_text())), "the running sample survived its stopped bench"


AUTOGROUP_PROBE = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import harness
if sys.argv[2] == "leader":
    os.setsid()
os.nice(7)
before = Path("/proc/self/autogroup").read_text().strip()
harness.autogroup_as_niced()
print(json.dumps([before, Path("/proc/self/autogroup").read_text().strip()]))
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").is_file(), reason="the kernel has no scheduler autogroups")
@pytest.mark.parametrize("role", ["leader", "member"])
def test_a_study_leading_its_session_gives_its_autogroup_its_nice(role):
    """`setsid nohup nice -n 19 python benchmarks/<study>.py run`: the new session's autogroup takes the study's nice;
    a process inside someone else's session (a terminal's) leaves that session's autogroup as it was. That session
    may be init's, which sits in no autogroup of its own: the kernel then shows an empty file (as in CI's container)."""
    import subprocess

    probe = [sys.executable, "-c", AUTOGROUP_PROBE, str(ROOT / "benchmarks"), role]
    done = subprocess.run(probe, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout)
    if role == "member":
        assert after == before
    else:
        group = re.fullmatch(r"(/autogroup-\d+) nice 0", before)
        assert group, before
        assert after == f"{group[1]} nice 7"
