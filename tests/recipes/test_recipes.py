"""Every recipe (recipes/*.py) end to end: each trains 2 steps on the tiny model from its YAML config plus
command-line overrides, writes what it promises, pushes to a (local, fake) Hub, logs to trackio, and runs on two
processes with `accelerate launch`. Parsing, data and rewards: test_common.py; the command: tests/test_cli.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from launching import free_port, run_launch
from safetensors.torch import load_file

from trinity_trl.cli import run as cli
from trinity_trl.recipes.plot import curves

REPO = Path(__file__).resolve().parent.parent.parent

# what makes a bundled CPU config tiny enough for the tiny model and 2 steps
RL_TINY = [
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
]
RUNS = {
    "chord": ("chord_cpu", RL_TINY + ["--expert_batch_size", "2", "--num_expert_rows", "8", "--mu_decay_steps", "2"]),
    "cispo": ("cispo_cpu", RL_TINY),
    "sapo": ("sapo_cpu", RL_TINY),
    "train": ("train_cpu", RL_TINY + ["--algorithm", "reinforceplusplus"]),
    "train-sft": (
        "sft_cpu",
        [
            "--max_steps",
            "2",
            "--num_expert_rows",
            "8",
            "--num_eval_rows",
            "4",
            "--eval_max_new_tokens",
            "8",
            "--eval_batch_size",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
        ],
    ),
    "train-dpo": (
        "dpo_cpu",
        [
            "--max_steps",
            "2",
            "--num_expert_rows",
            "8",
            "--num_eval_rows",
            "4",
            "--eval_max_new_tokens",
            "8",
            "--eval_batch_size",
            "4",
            "--per_device_train_batch_size",
            "2",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
        ],
    ),
    "step_grpo": (
        "step_grpo_cpu",
        ["--max_steps", "2", "--num_tasks", "8", "--max_completion_length", "8", "--max_env_steps", "2"],
    ),
}
RUNS["ppo"] = ("ppo_cpu", RL_TINY + ["--critic_warmup_steps", "1"])


def run_recipe(name: str, tiny_model_dir: str, output_dir: Path, *extra: str):
    config, tiny = RUNS[name]
    command = name.split("-")[0]
    return cli(
        [
            command,
            "--config",
            config,
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(output_dir),
            *tiny,
            *extra,
        ]
    )


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "training_log.json").read_text())["summary"]


@pytest.mark.parametrize("name", list(RUNS))
def test_recipe_trains_two_steps_and_writes_its_outputs(name, tmp_path, tiny_model_dir, capsys):
    trainer = run_recipe(name, tiny_model_dir, tmp_path)
    assert trainer.state.global_step == 2
    files = set(os.listdir(tmp_path))
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "README.md",
        "training_log.json",
        "training_curves.png",
    } <= files, files
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["summary"]["global_step"] == 2
    assert [e["step"] for e in log["log_history"] if "loss" in e and "train_runtime" not in e] == [1, 2]
    card = (tmp_path / "README.md").read_text()
    assert "## Algorithm:" in card and "## Training set-up" in card
    assert "huggingface.co/None" not in card and "(a local model)" in card  # the base model is a local folder
    assert os.path.basename(tiny_model_dir) in card and tiny_model_dir not in card  # its name, not its path
    if name != "step_grpo":  # the arithmetic recipes measure accuracy before and after
        before, after = log["summary"]["accuracy_before"], log["summary"]["accuracy_after"]
        assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
        assert f"**{before:.3f}** before training, **{after:.3f}** after" in card
        printed = capsys.readouterr().out
        assert "held-out accuracy before training" in printed and "held-out accuracy after training" in printed
        assert f"accuracy {before:.3f} -> {after:.3f}; model, card, training_log.json and plot in {tmp_path}" in printed


def test_chord_recipe_logs_mu_and_both_losses_and_plots_them(tmp_path, tiny_model_dir):
    trainer = run_recipe("chord", tiny_model_dir, tmp_path, "--eval_accuracy", "false")
    panels = curves(trainer.state.log_history)
    assert set(panels) == {"reward", "μ (SFT weight)", "losses"}
    assert {"SFT loss", "RL loss", "total loss"} <= set(panels["losses"])
    steps, mu = panels["μ (SFT weight)"]["mu"]
    assert steps == [1, 2] and mu[0] > mu[1]  # mu decays from 0.9 over mu_decay_steps=2
    assert summary(tmp_path)["accuracy_before"] is None and summary(tmp_path)["accuracy_after"] is None


@pytest.mark.parametrize("variant", ["chord_mu", "chord_phi"])
def test_paper_configs_from_yaml_and_the_command_line(variant, tmp_path):
    """Issue 45: the paper's CHORD variants as bundled configs and as one option on the command line."""
    from trinity_trl.recipes.common import RecipeArguments, UsageError, parse
    from trinity_trl.trainers import ChordConfig

    on_cpu = ["--use_cpu", "true", "--bf16", "false", "--use_vllm", "false", "--output_dir", str(tmp_path)]
    for config in (f"{variant}_paper_gpu", f"{variant}_paper_cpu"):
        _, parsed = parse((RecipeArguments, ChordConfig), ["--config", config, *on_cpu], "chord")
        policy_loss = parsed.resolved_algorithm().policy_loss.args
        assert parsed.paper_config == variant and parsed.num_generations == 8 and parsed.kl_loss.name == "none"
        assert policy_loss["enable_phi_function"] is (variant == "chord_phi")
        assert policy_loss["mu_decay_steps"] == (parsed.max_steps if variant == "chord_mu" else 0)
        rows = parsed.local_expert_rows()
        assert rows / (rows + parsed.per_device_train_batch_size * parsed.steps_per_generation) == 0.2
    other = "chord_phi" if variant == "chord_mu" else "chord_mu"
    _, parsed = parse(
        (RecipeArguments, ChordConfig), ["--config", f"{other}_paper_cpu", "--paper_config", variant, *on_cpu], "chord"
    )
    assert parsed.paper_config == variant and parsed.mu_peak == (0.9 if variant == "chord_mu" else 0.1)
    # a config that sets its own rollouts and mu schedule: the conflict is named, nothing is overridden
    with pytest.raises((ValueError, UsageError), match=f"paper_config='{variant}' samples 8 rollouts per prompt"):
        parse((RecipeArguments, ChordConfig), ["--config", "chord_cpu", "--paper_config", variant, *on_cpu], "chord")
    with pytest.raises((ValueError, UsageError), match=rf"paper_config='{variant}' sets \w+=.*, got"):
        parse(
            (RecipeArguments, ChordConfig),
            ["--config", "chord_cpu", "--paper_config", variant, "--num_generations", "8", "--expert_batch_size", "2"]
            + ["--enable_phi_function", str(variant == "chord_mu"), *on_cpu],
            "chord",
        )


def test_paper_config_recipe_trains_from_the_command_line(tmp_path, tiny_model_dir):
    trainer = cli(
        [
            "chord",
            "--config",
            "chord_phi_paper_cpu",
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            *RL_TINY,
            "--num_generations",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--num_expert_rows",
            "8",
            "--eval_accuracy",
            "false",
        ]
    )
    log = [e for e in trainer.state.log_history if "actor/mu" in e]
    assert [e["actor/mu"] for e in log] == [0.1, 0.1] and all("actor/expert/sft_phi_loss" in e for e in log)
    assert [e["chord/expert_rows"] for e in log] == [2.0, 2.0] and trainer.ref_model is None


@pytest.mark.parametrize("name", list(RUNS))
def test_recipe_pushes_adapter_tokenizer_and_card_to_the_hub(name, tmp_path, tiny_model_dir, fake_hub):
    repo = f"tester/{name}-recipe"
    no_eval = [] if name == "step_grpo" else ["--eval_accuracy", "false"]
    run_recipe(name, tiny_model_dir, tmp_path, "--push_to_hub", "--hub_model_id", repo, *no_eval)
    pushed = fake_hub.files(repo)
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= set(pushed), sorted(pushed)
    assert "## Algorithm:" in pushed["README.md"].decode()
    local = load_file(tmp_path / "adapter_model.safetensors")
    (tmp_path / "pushed.safetensors").write_bytes(pushed["adapter_model.safetensors"])
    remote = load_file(tmp_path / "pushed.safetensors")
    assert local.keys() == remote.keys() and all(torch.equal(local[k], remote[k]) for k in local)


def test_pushed_recipe_adapter_loads_with_from_pretrained(tmp_path, tiny_model_dir, fake_hub):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = run_recipe(
        "chord",
        tiny_model_dir,
        tmp_path,
        "--push_to_hub",
        "--hub_model_id",
        "tester/chord-load",
        "--eval_accuracy",
        "false",
    )
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), "tester/chord-load")
    trained = {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}
    pulled = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert trained.keys() == pulled.keys() and any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)
    assert all(torch.equal(trained[k], pulled[k]) for k in trained)


def test_recipe_logs_to_trackio_offline(tmp_path, tiny_model_dir, monkeypatch):
    import sqlite3

    trackio_dir = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    for name, module in list(sys.modules.items()):  # trackio copies its storage path at import
        if name.startswith("trackio"):
            for attr, sub in (("TRACKIO_DIR", ""), ("MEDIA_DIR", "media"), ("ARTIFACTS_DIR", "artifacts")):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, trackio_dir / sub if sub else trackio_dir)
    run_recipe(
        "chord",
        tiny_model_dir,
        tmp_path / "out",
        "--eval_accuracy",
        "false",
        "--report_to",
        "trackio",
        "--project",
        "recipe-tracking",
        "--trackio_static_space_id",
        "false",
    )
    database = trackio_dir / "recipe-tracking.db"
    assert database.exists()
    rows = [json.loads(r[0]) for r in sqlite3.connect(database).execute("SELECT metrics FROM metrics")]
    assert any("train/actor/mu" in row for row in rows)


def test_accelerate_configs_load():
    from accelerate.commands.config.config_args import ClusterConfig

    kinds = {}
    for path in sorted((REPO / "recipes" / "accelerate").glob("*.yaml")):
        config = ClusterConfig.from_yaml_file(str(path))
        kinds[path.stem] = (config.distributed_type.value, (config.deepspeed_config or {}).get("zero_stage"))
    assert kinds == {
        "ddp": ("MULTI_GPU", None),
        "fsdp": ("FSDP", None),
        "zero2": ("DEEPSPEED", 2),
        "zero3": ("DEEPSPEED", 3),
    }


def test_recipe_runs_on_two_processes_with_accelerate_launch(tmp_path, tiny_model_dir):
    """What the multi-GPU command of docs/distributed.md#accelerate does, on CPU: `accelerate launch` starts 2 processes
    of the recipe."""
    config, tiny = RUNS["chord"]
    command = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--cpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(REPO / "recipes" / "chord.py"),
        "--config",
        config,
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(tmp_path),
        *tiny,
        "--num_eval_rows",
        "6",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a port found by the OS (accelerate's simple launcher would hand out the fixed 29500), a fresh one per attempt
    at = command.index("--num_processes")
    result = run_launch(
        lambda: [*command[:at], "--main_process_port", str(free_port()), *command[at:]],
        "accelerate launch of the chord recipe",
        timeout_s=600,
        env=env,
        expect_rc=None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["summary"]["global_step"] == 2
    # the expert rows of both processes were trained: 2 per process per step
    assert [e["chord/expert_rows"] for e in log["log_history"] if "chord/expert_rows" in e] == [2.0, 2.0]
    assert (tmp_path / "adapter_model.safetensors").exists()
    # each process scored its half of the held-out rows; the printed accuracy counts all 6
    assert "held-out accuracy before training" in result.stdout and "(6 problems; " in result.stdout
    before = log["summary"]["accuracy_before"]
    assert before is not None and abs(before * 6 - round(before * 6)) < 1e-9


def test_a_run_whose_reward_never_varied_ends_saying_so(tmp_path, tiny_model_dir, capsys):
    """The tiny random model never answers an arithmetic problem: reward 0 for every rollout of every step."""
    trainer = run_recipe("cispo", tiny_model_dir, tmp_path, "--eval_accuracy", "false")
    assert all(e["frac_reward_zero_std"] == 1.0 for e in trainer.state.log_history if "frac_reward_zero_std" in e)
    lines = [line for line in capsys.readouterr().out.splitlines() if "no learning signal" in line]
    assert lines == [
        "[trinity-trl] no learning signal: the reward never varied within a group of rollouts (every rollout got "
        "reward 0 at every logged step), so the policy learned nothing from its rewards; use prompts the model "
        "sometimes solves, more rollouts per prompt (num_generations), a higher temperature or a reward with "
        "partial credit"
    ]


def test_a_run_with_varying_rewards_says_nothing_of_the_kind(tmp_path, tiny_model_dir, capsys):
    run_recipe("cispo", tiny_model_dir, tmp_path, "--eval_accuracy", "false", "--reward_funcs", "helpers:length_reward")
    assert "no learning signal" not in capsys.readouterr().out
