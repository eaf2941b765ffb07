"""DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 with 2 CPU processes give the losses of DDP, and resume exactly.

Each engine is launched the way a user launches it: `accelerate launch --config_file recipes/accelerate/<engine>.yaml
--num_processes 2 --mixed_precision no scripts/engine_run.py ...` with the shipped configs (`ddp.yaml`,
`zero2.yaml`, `zero3.yaml`, `fsdp.yaml`), on CPU (`use_cpu=True` in the training config gives gloo). FSDP needs one
more thing on CPU processes (`scripts/cpu_fsdp.py`: Accelerate 1.15 keeps MULTI_CPU there and would silently wrap
the model in DDP; our trainers refuse that run, see test_engine_checks.py).

One launch per engine plays every case (`engine_run.py`): TrinityTrainer full fine-tuning with a k2 KL loss against
TRL's reference model, ChordTrainer with LoRA (expert rows; reference = adapter disabled), on-policy distillation
with a teacher model, CISPOTrainer, SAPOTrainer with LoRA, StepGRPOTrainer (a generation per turn), PPOTrainer full
and with LoRA (the critic in its own engine), and with LoRA and one critic warm-up step (DDP and FSDP; refused
under DeepSpeed, whose engine steps the policy's optimizer at every boundary), TrinitySFTTrainer and
TrinityDPOTrainer (TRL's reference model). The RL cases train 4 steps with TRL's real sampling generation
(`num_iterations=2`: steps 1-2 train on one generation batch, steps 3-4 on a second), SFT and DPO on fixed rows;
every case writes checkpoints at steps 2 and 4. A second launch resumes each case from its
step-2 checkpoint, next to a copy of its step-4 checkpoint without the completion marker, which must be skipped.

What must hold, and the tolerances:

* the engine is the one asked for (DeepSpeed stage 2/3, FSDP version 2), and under ZeRO-3 / FSDP every parameter of
  the policy, the reference model, the teacher and the critic is a shard;
* against DDP, steps 1 and 2: the same sampled completions (generation gathers the ZeRO-3 / FSDP shards; the weights
  are identical before step 1), the same step-1 losses within the rounding bound of the tiny model's reductions
  (`LOSS_ATOL`; observed: identical; 4e-9 before prefix packing, reductions run in another order), the same step-2
  losses within 1e-4 relative (observed: 2e-5 at most, StepGRPO under ZeRO-3 with prefix packing), and after step 2
  the same trained weights within 1e-4 (`WEIGHTS_ATOL`, observed: up to 6e-5 under ZeRO-3, 3e-6 under ZeRO-2 and
  FSDP: Adam divides by the root of tiny second moments at lr 1e-2, which magnifies 1e-9 gradient differences, so
  step 2 starts from slightly different weights);
* the recipes' held-out accuracy (TRL's `unwrap_model_for_generation`, before and after training) scores the same
  greedy completions as DDP before training;
* the resumed run logs steps 3-4 as the uninterrupted run did and ends with the same weights, policy and critic,
  within Adam's rounding bound (`RESUME_ATOL`; observed: identical).

Marked `distributed` (and slow): `make test-distributed` runs them (about 8 minutes on the 2-core CPU machine; the
first DeepSpeed launch on a fresh machine also JIT-builds DeepSpeed's `shm_comm` op, about 2 minutes).
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import accelerate_launch, run_script
from helpers import TINY_MODEL_TERMS, trained_weights_atol
from tolerance import tolerance

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ENGINES = ("zero2", "zero3", "fsdp")
CASES = (
    "trinity_full",
    "chord_lora",
    "distill",
    "cispo",
    "sapo",
    "step_grpo",
    "ppo",
    "ppo_lora",
    "ppo_warmup",
    "sft",
    "dpo",
)
REFUSED_UNDER_DEEPSPEED = "PPOTrainer: critic_warmup_steps > 0 is not supported under DeepSpeed"
STEPS, SAVE_STEPS = 4, 2
# step 1: the weights read from disk, the same batch; each engine reduces the loss (over tokens, ranks and shards) in
# its own order: the tiny model's chain of additions (tests/helpers.py), at the scale of the per-token terms (z-score
# advantages times ratios of 1: 1), tests/tolerance.py's bound
_STEP1 = tolerance(torch.float32, terms=TINY_MODEL_TERMS, scale=1.0)
LOSS_ATOL, LOSS_RTOL = _STEP1["atol"], _STEP1["rtol"]
# step 2 and the trained weights: not a rounding bound. Adam's first update lr * g / (|g| + eps) turns a rounding
# difference of a gradient element near zero (|g| ~ 1e-9) into a difference of up to lr = 1e-2 in the weight, so no
# bound follows from the arithmetic alone; 1e-4 keeps 1.7x margin over the largest difference seen (6e-5, ZeRO-3)
# while a wrong shard, a dropped rank or a missing all-reduce moves weights by O(lr) = 1e-2
STEP2_RTOL = 1e-4
WEIGHTS_ATOL = 1e-4
# the resumed run replays steps 3-4 from the checkpoint: Adam's step bound (tests/helpers.py), lr 1e-2
RESUME_ATOL = trained_weights_atol(steps=STEPS, lr=1e-2)
EXPECTED = {  # what Accelerate must have set up: (distributed type, ZeRO stage, FSDP version)
    "ddp": ("MULTI_CPU", None, None),
    "zero2": ("DEEPSPEED", 2, None),
    "zero3": ("DEEPSPEED", 3, None),
    "fsdp": ("FSDP", None, 2),
}
LOGGED = ("loss", "grad_norm", "actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "critic/grad_norm", "reward")


def require_deepspeed() -> None:
    """A missing deepspeed is a broken set-up, not a reason to skip: the ZeRO tests would pass without running."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("deepspeed is not installed (it comes with the test extra: pip install -e '.[test]')")


class Runs:
    """Launches each engine's runs once per module, when a test first needs them."""

    def __init__(self, root: Path, model_dir: str, teacher_dir: str):
        self.root, self.model_dir, self.teacher_dir = root, model_dir, teacher_dir
        self._done: dict[tuple[str, str], Path] = {}

    def _launch(self, engine: str, kind: str, *extra: str) -> Path:
        if engine.startswith("zero"):
            require_deepspeed()
        key = (engine, kind)
        if key not in self._done:
            out = self.root / f"{engine}_{kind}"
            out.mkdir(parents=True, exist_ok=True)
            if kind == "resumed":
                self._prepare_resume(engine, out)
            command = accelerate_launch(
                engine,
                "engine_run.py",
                self.model_dir,
                str(out),
                *CASES,
                "--steps",
                str(STEPS),
                "--save_steps",
                str(SAVE_STEPS),
                "--teacher",
                self.teacher_dir,
                *extra,
            )
            proc = run_script(command, f"{engine} ({kind})")
            (out / "launch.stderr").write_text(proc.stderr)
            self._done[key] = out
        return self._done[key]

    def _prepare_resume(self, engine: str, out: Path) -> None:
        """Each case's output folder gets the uninterrupted run's checkpoint-2, and its checkpoint-4 without the
        completion marker (as a run killed while writing it leaves it): resuming must pick checkpoint-2."""
        from trinity_trl.checkpointing.checkpoints import COMPLETE_FILE

        straight = self.straight(engine)
        for case in CASES:
            if refused(engine, case):
                continue
            for step in (SAVE_STEPS, STEPS):
                source = straight / case / f"checkpoint-{step}"
                target = out / case / f"checkpoint-{step}"
                shutil.copytree(source, target)
            (out / case / f"checkpoint-{STEPS}" / COMPLETE_FILE).unlink()

    def straight(self, engine: str) -> Path:
        return self._launch(engine, "straight")

    def bf16(self, engine: str) -> Path:
        """The shipped config's own mixed precision (bf16), 2 steps of TrinityTrainer and PPOTrainer."""
        if engine.startswith("zero"):
            require_deepspeed()
        key = (engine, "bf16")
        if key not in self._done:
            out = self.root / f"{engine}_bf16"
            command = accelerate_launch(
                engine,
                "engine_run.py",
                self.model_dir,
                str(out),
                "trinity_full",
                "ppo",
                "--steps",
                str(SAVE_STEPS),
                "--bf16",
                mixed_precision=None,
            )
            run_script(command, f"{engine} (bf16)")
            self._done[key] = out
        return self._done[key]

    def resumed(self, engine: str) -> Path:
        return self._launch(engine, "resumed", "--resume")

    @staticmethod
    def load(folder: Path, case: str) -> list[dict]:
        return [torch.load(folder / f"{case}_rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def refused(engine: str, case: str) -> bool:
    """PPO's critic warm-up is refused under DeepSpeed (its engine steps the policy's optimizer at every boundary)."""
    return case == "ppo_warmup" and engine.startswith("zero")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, teacher_model_dir, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("engines"), tiny_model_dir, teacher_model_dir)


def _by_step(record: dict) -> dict[int, dict]:
    return {log["step"]: log for log in record["logs"]}


def _assert_logs_close(expected: dict, got: dict, steps, what: str, atol: float, rtol: float) -> None:
    for step in steps:
        for key in LOGGED:
            if key in expected[step] or key in got[step]:
                assert key in expected[step] and key in got[step], (what, step, key)
                assert got[step][key] == pytest.approx(expected[step][key], abs=atol, rel=rtol), (
                    f"{what}, step {step}, {key}: {expected[step][key]} expected, got {got[step][key]}"
                )


def _assert_weights_close(expected: dict, got: dict, atol: float, what: str) -> None:
    assert expected and set(got) == set(expected), (what, sorted(set(got) ^ set(expected))[:5])
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=atol, rtol=0, msg=lambda m, n=name: f"{what} {n}: {m}")


# every engine with every case it runs (the refused pairs are checked by test_the_launch_sets_up_the_engine_asked_for)
COMPARED = [(engine, case) for engine in ENGINES for case in CASES if not refused(engine, case)]


@pytest.mark.parametrize("engine", ("ddp", *ENGINES))
def test_the_launch_sets_up_the_engine_asked_for(runs, engine):
    for case in CASES:
        ranks = Runs.load(runs.straight(engine), case)
        if refused(engine, case):
            assert all(REFUSED_UNDER_DEEPSPEED in r["refused"] for r in ranks)
            continue
        info = ranks[0]["engine"]
        assert (info["distributed_type"], info["zero_stage"], info["fsdp_version"]) == EXPECTED[engine], (case, info)
        assert info["world"] == 2 and ranks[1]["engine"]["world"] == 2
        if engine in ("zero3", "fsdp"):
            sharded = {name: value for name, value in info["sharded"].items() if value is not None}
            assert sharded and all(sharded.values()), (case, info["sharded"])  # policy, ref, teacher, critic
        assert {f"checkpoint-{SAVE_STEPS}", f"checkpoint-{STEPS}"} <= set(ranks[0]["checkpoints"])


@pytest.mark.parametrize(("engine", "case"), COMPARED)
def test_same_losses_and_weights_as_ddp(runs, engine, case):
    ddp, other = Runs.load(runs.straight("ddp"), case), Runs.load(runs.straight(engine), case)
    for rank in (0, 1):
        # the same first generation batch: sampling from the (gathered) weights read from disk (SFT/DPO: fixed rows)
        assert (other[rank]["completions"] or [None])[0] == (ddp[rank]["completions"] or [None])[0], (
            f"rank {rank}: completions differ"
        )
        assert other[rank]["eval_completions"]["before"] == ddp[rank]["eval_completions"]["before"]
    assert other[0]["accuracy"]["before"] == ddp[0]["accuracy"]["before"]
    assert isinstance(other[0]["accuracy"]["after"], float)
    _assert_logs_close(_by_step(ddp[0]), _by_step(other[0]), (1,), f"{engine} vs ddp, {case}", LOSS_ATOL, LOSS_RTOL)
    _assert_logs_close(_by_step(ddp[0]), _by_step(other[0]), (2,), f"{engine} vs ddp, {case}", LOSS_ATOL, STEP2_RTOL)
    assert ddp[0]["logs"][1]["loss"] != ddp[0]["logs"][0]["loss"]  # step 2 trained on updated weights
    _assert_weights_close(ddp[0]["weights_step_2"], other[0]["weights_step_2"], WEIGHTS_ATOL, f"{engine} {case}")
    if case.startswith("ppo"):
        _assert_weights_close(
            ddp[0]["critic_step_2"], other[0]["critic_step_2"], WEIGHTS_ATOL, f"{engine} {case} critic"
        )


@pytest.mark.parametrize(("engine", "case"), COMPARED)
def test_resume_skips_the_incomplete_checkpoint_and_reproduces_the_run(runs, engine, case):
    from trinity_trl.checkpointing.checkpoints import COMPLETE_FILE

    straight, resumed = Runs.load(runs.straight(engine), case), Runs.load(runs.resumed(engine), case)
    partial = runs.resumed(engine) / case / f"checkpoint-{STEPS}"
    assert (
        f"Skipping checkpoint {partial} for resuming: it has no {COMPLETE_FILE}"
        in (runs.resumed(engine) / "launch.stderr").read_text()
    )
    expected, got = _by_step(straight[0]), _by_step(resumed[0])
    # the log history: checkpoint-2's steps (its trainer_state.json), then steps 3 and 4 trained after resuming
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_logs_close(expected, got, range(SAVE_STEPS + 1, STEPS + 1), f"{engine} resumed, {case}", RESUME_ATOL, 0)
    for rank in (0, 1):
        # one generation after resuming (from checkpoint-2, not the partial checkpoint-4, after which nothing would
        # be left to train), sampling what the uninterrupted run sampled (SFT/DPO: no generation)
        if straight[rank]["completions"]:
            assert len(resumed[rank]["completions"]) == 1
            assert resumed[rank]["completions"][0] == straight[rank]["completions"][-1]
    _assert_weights_close(straight[0]["weights"], resumed[0]["weights"], RESUME_ATOL, f"{engine} resumed {case}")
    if case.startswith("ppo"):
        _assert_weights_close(
            straight[0]["critic"], resumed[0]["critic"], RESUME_ATOL, f"{engine} resumed {case} critic"
        )


def test_fsdp_on_cpu_processes_without_fsdp_is_refused(tmp_path, tiny_model_dir):
    """Left to itself, Accelerate 1.15 runs `fsdp.yaml` on CPU processes as MULTI_CPU (DDP) and ignores the FSDP
    plugin, while transformers would save checkpoints as if sharded: the trainer refuses the run and says why."""
    command = accelerate_launch(
        "fsdp", "engine_run.py", tiny_model_dir, str(tmp_path), "trinity_full", "--steps", "1", "--no_cpu_fsdp"
    )
    proc = run_script(command, "fsdp.yaml without the CPU switch", expect_rc=None)
    assert proc.returncode != 0
    assert (
        "FSDP was requested (accelerate config or fsdp=...), but Accelerate set up MULTI_CPU instead: Accelerate "
        "1.15 never uses FSDP for CPU processes"
    ) in proc.stderr


@pytest.mark.parametrize("engine", ("zero3", "fsdp"))
def test_two_machines_on_loopback_train_as_one(runs, tmp_path, tiny_model_dir, engine):
    """Multi-node `accelerate launch` (`--num_machines 2 --machine_rank R --main_process_ip ...`), simulated by two
    launchers of one process each on this machine, joined over loopback: the same losses and weights as the
    one-machine, two-process run."""
    import subprocess

    from engine_helpers import REPO_ROOT, script_env
    from launching import LAUNCH_ATTEMPTS, free_port, port_was_taken, scaled_timeout

    def node_command(rank: int, port: int) -> list[str]:
        # the one-machine run's schedule (learning rate decays over 4 steps); its weights after step 2 are compared
        command = accelerate_launch(
            engine, "engine_run.py", tiny_model_dir, str(tmp_path), "trinity_full", "ppo", "--steps", str(STEPS)
        )
        # both launchers must meet on one port, found free by the OS once for both
        at = command.index("--main_process_port")
        command[at : at + 2] = [
            "--num_machines",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
        ]
        return command

    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        port, timeout = free_port(), scaled_timeout(900)
        nodes = [
            subprocess.Popen(
                node_command(rank, port),
                cwd=REPO_ROOT,
                env=script_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        try:
            outputs = [node.communicate(timeout=timeout) for node in nodes]
        except subprocess.TimeoutExpired:
            for node in nodes:
                node.kill()
            pytest.fail(f"the two launchers did not finish in {timeout}s")
        failed = any(node.returncode != 0 for node in nodes)
        # a retry only when the rendezvous port was taken by another process between free_port() and the bind
        if not (failed and attempt < LAUNCH_ATTEMPTS and any(port_was_taken(out + err) for out, err in outputs)):
            break
    for rank, (node, (_, err)) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"machine {rank}:\n{err[-6000:]}"
    for case in ("trinity_full", "ppo"):
        two_machines, one_machine = Runs.load(tmp_path, case), Runs.load(runs.straight(engine), case)
        assert two_machines[0]["engine"]["world"] == 2
        assert two_machines[0]["engine"]["distributed_type"] == EXPECTED[engine][0]
        _assert_logs_close(
            _by_step(one_machine[0]),
            _by_step(two_machines[0]),
            (1, 2),
            f"{engine} 2 machines {case}",
            LOSS_ATOL,
            STEP2_RTOL,
        )
        _assert_weights_close(one_machine[0]["weights_step_2"], two_machines[0]["weights_step_2"], WEIGHTS_ATOL, case)
        _assert_weights_close(
            one_machine[0]["critic_step_2"] if case == "ppo" else {"-": torch.zeros(1)},
            two_machines[0]["critic_step_2"] if case == "ppo" else {"-": torch.zeros(1)},
            WEIGHTS_ATOL,
            f"{case} critic",
        )


#: bf16 against float32 losses. bf16 rounds each op's inputs and outputs to u = 2**-8 relative (matmuls accumulate in
#: float32), so a log-prob of the tiny model (2 layers, about 13 rounded ops each: norms, q/k/v/o, the MLP's three
#: projections, the residual adds, plus the embedding and the head) carries sqrt(28) * u = 2.1e-2 of relative error,
#: independent errors adding in quadrature. The GRPO/PPO loss is a mean of advantage-weighted ratios whose advantages
#: cancel (the loss is ~0.07 while its terms are ~1), so the error is absolute, at the terms' scale of 1. Step 2 adds
#: the first update made from bf16 gradients. The earlier 2e-3 was read off an Intel CPU with native bf16 kernels; an
#: AMD EPYC differs by 2.7e-3 at step 2.
BF16_LOSS_ATOL = math.sqrt(28) * 2**-8


@pytest.mark.parametrize("engine", ("ddp", *ENGINES))
def test_the_shipped_configs_bf16_trains(runs, engine):
    """`mixed_precision: bf16` as shipped (DeepSpeed: bf16 weights with float32 masters in the ZeRO optimizer; DDP and
    FSDP: autocast): 2 steps of TrinityTrainer and PPOTrainer train, with the float32 losses within
    :data:`BF16_LOSS_ATOL` (+2e-2 relative). Sampling reads bf16 logits, so the batches equal the float32 run's only
    as long as no sampled token flips (the losses are compared only then)."""
    for case in ("trinity_full", "ppo"):
        bf16, fp32 = Runs.load(runs.bf16(engine), case), Runs.load(runs.straight(engine), case)
        losses = [log["loss"] for log in bf16[0]["logs"]]
        assert len(losses) == SAVE_STEPS and all(map(math.isfinite, losses)), (case, losses)
        if engine.startswith("zero"):
            assert bf16[0]["engine"]["bf16"] is True  # DeepSpeed's bf16 section is on
        if all(bf16[r]["completions"][0] == fp32[r]["completions"][0] for r in (0, 1)):
            for step in (1, 2):
                expected = _by_step(fp32[0])[step]["loss"]
                assert losses[step - 1] == pytest.approx(expected, rel=2e-2, abs=BF16_LOSS_ATOL), (case, step)


def test_the_chord_recipe_under_zero3_with_held_out_accuracy(tmp_path, tiny_model_dir):
    """What the DeepSpeed command of docs/distributed.md#accelerate does, on 2 CPU processes: the CHORD recipe under the
    shipped `zero3.yaml` (its bundled `chord_cpu` config sets `use_cpu`), with the held-out accuracy measured before and
    after training through TRL's `unwrap_model_for_generation` (ZeRO-3 parameters gathered), and the adapter saved."""
    import json

    from engine_helpers import REPO_ROOT

    require_deepspeed()
    options = [
        "--config",
        "chord_cpu",
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path),
        "--max_steps",
        "2",
        "--num_train_rows",
        "8",
        "--num_eval_rows",
        "4",
        "--eval_max_new_tokens",
        "8",
        "--eval_batch_size",
        "4",
        "--max_completion_length",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--expert_batch_size",
        "2",
        "--num_expert_rows",
        "8",
        "--mu_decay_steps",
        "2",
        "--eval_accuracy",
        "true",
    ]
    command = accelerate_launch("zero3", REPO_ROOT / "recipes" / "chord.py", *options)
    proc = run_script(command, "chord recipe under zero3")
    assert "held-out accuracy before training" in proc.stdout and "held-out accuracy after training" in proc.stdout
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["summary"]["global_step"] == 2 and log["summary"]["accuracy_after"] is not None
    assert (tmp_path / "adapter_model.safetensors").is_file()
